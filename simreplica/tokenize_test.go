package simreplica

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
)

var words = func() Options { o := fast; o.Tokenizer = TokenizerWords; o.LoRAs = []string{"sql-lora"}; return o }()

type tokenized struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []int32  `json:"tokens"`
	TokenStrs   []string `json:"token_strs"`
}

func tokenizeCall(t *testing.T, r *Running, body string) (int, tokenized, []byte) {
	t.Helper()
	code, _, b := call(t, r, "/tokenize", body)
	var out tokenized
	if code == http.StatusOK {
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatalf("%s: %v", b, err)
		}
	}
	return code, out, b
}

func mustTokenize(t *testing.T, r *Running, body string) tokenized {
	t.Helper()
	code, out, b := tokenizeCall(t, r, body)
	if code != http.StatusOK {
		t.Fatalf("/tokenize %s: %d %s", body, code, b)
	}
	return out
}

func TestTokenize(t *testing.T) {
	r := start(t, words)
	tok := r.Tokenizer()
	msgs := `[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello there, friend."}]`
	tmpl := func(gen bool) []int32 {
		text := "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" +
			"<|start_header_id|>user<|end_header_id|>\n\nHello there, friend.<|eot_id|>"
		if gen {
			text += "<|start_header_id|>assistant<|end_header_id|>\n\n"
		}
		return tok.Encode(nil, []byte(text), false)
	}
	prompt := []byte("The quick brown fox jumps over the lazy dog.")
	for _, tc := range []struct {
		name, body string
		want       []int32
	}{
		{"completion", `{"model":"sim-model","prompt":"The quick brown fox jumps over the lazy dog."}`, tok.Encode(nil, prompt, true)},
		{"completion, no model", `{"prompt":"The quick brown fox jumps over the lazy dog."}`, tok.Encode(nil, prompt, true)},
		{"completion, null model", `{"model":null,"prompt":"The quick brown fox jumps over the lazy dog."}`, tok.Encode(nil, prompt, true)},
		{"completion, LoRA", `{"model":"sql-lora","prompt":"The quick brown fox jumps over the lazy dog."}`, tok.Encode(nil, prompt, true)},
		{"completion, no special tokens", `{"prompt":"The quick brown fox jumps over the lazy dog.","add_special_tokens":false}`, tok.Encode(nil, prompt, false)},
		{"completion, empty", `{"prompt":""}`, []int32{TokenBOS}},
		{"chat", `{"model":"sim-model","messages":` + msgs + `}`, tmpl(true)},
		{"chat, no generation prompt", `{"messages":` + msgs + `,"add_generation_prompt":false}`, tmpl(false)},
		{"chat, special tokens", `{"messages":` + msgs + `,"add_special_tokens":true}`, append([]int32{TokenBOS}, tmpl(true)...)},
		{"chat, continue final", `{"messages":` + msgs + `,"continue_final_message":true,"add_generation_prompt":false}`, tmpl(false)[:len(tmpl(false))-1]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := mustTokenize(t, r, tc.body)
			if !slices.Equal(out.Tokens, tc.want) || out.Count != len(tc.want) || out.MaxModelLen != 1<<20 || out.TokenStrs != nil {
				t.Fatalf("got %+v\nwant tokens %v", out, tc.want)
			}
		})
	}
	// token_strs are the pieces, joining to the prompt.
	out := mustTokenize(t, r, `{"prompt":"Hello, world!","return_token_strs":true,"add_special_tokens":false}`)
	if !slices.Equal(out.TokenStrs, []string{"Hello,", " world!"}) || len(out.Tokens) != 2 {
		t.Fatalf("token_strs: %+v", out)
	}
	// The raw body keeps token_strs: null when not asked for, as vLLM's does.
	if _, _, b := tokenizeCall(t, r, `{"prompt":"x"}`); !strings.Contains(string(b), `"token_strs":null`) {
		t.Fatalf("body %s", b)
	}
}

func TestTokenizeErrors(t *testing.T) {
	r := start(t, words)
	for _, tc := range []struct {
		body   string
		status int
	}{
		{`{"model":"other","prompt":"x"}`, 404},
		{`{"model":"other","messages":[{"role":"user","content":"x"}]}`, 404},
		{`{"model":5,"prompt":"x"}`, 400},
		{`{}`, 400},
		{`{"model":"sim-model"}`, 400},
		{`{"prompt":["a","b"]}`, 400},
		{`{"prompt":[1,2,3]}`, 400},
		{`{"prompt":"x","add_special_tokens":"yes"}`, 400},
		{`{"prompt":"x","return_token_strs":1}`, 400},
		{`{"messages":"hi"}`, 400},
		{`{"messages":[]}`, 400},
		{`{"messages":[{"content":"no role"}]}`, 400},
		{`{"messages":[{"role":"wizard","content":"x"}]}`, 400},
		{`{"messages":[{"role":"user","content":"x"}],"continue_final_message":true,"add_generation_prompt":true}`, 400},
		{`[]`, 400},
		{`nope`, 400},
	} {
		code, _, b := tokenizeCall(t, r, tc.body)
		var e openAIError
		if code != tc.status || json.Unmarshal(b, &e) != nil || e.Error.Code != tc.status || e.Error.Message == "" {
			t.Errorf("%s: %d %s, want %d with an error body", tc.body, code, b, tc.status)
		}
	}
}

// TestTokenizeCountsWhatCompletionsCount: for the same prompt /tokenize
// gives usage.prompt_tokens, with either tokenizer and either endpoint.
func TestTokenizeCountsWhatCompletionsCount(t *testing.T) {
	sys := englishProse
	for _, o := range []Options{fast, words} {
		r := start(t, o)
		t.Run(r.Tokenizer().Name(), func(t *testing.T) {
			chat := chatBody(sys, "What happened to the logbooks?")
			var m map[string]any
			_ = json.Unmarshal([]byte(chat), &m)
			delete(m, "model")
			tb, _ := json.Marshal(m)
			_, u, body := call(t, r, "/v1/chat/completions", chat)
			if n := mustTokenize(t, r, string(tb)).Count; n != u.Prompt || n == 0 {
				t.Fatalf("chat: /tokenize counts %d, usage %d (%s)", n, u.Prompt, body)
			}
			pb, _ := json.Marshal(map[string]any{"model": "sim-model", "prompt": sys})
			_, u, body = call(t, r, "/v1/completions", string(pb))
			tb, _ = json.Marshal(map[string]any{"prompt": sys})
			if n := mustTokenize(t, r, string(tb)).Count; n != u.Prompt || n == 0 {
				t.Fatalf("completion: /tokenize counts %d, usage %d (%s)", n, u.Prompt, body)
			}
			t.Logf("%d bytes of prose: %d prompt tokens", len(sys), u.Prompt)
		})
	}
}

func TestDetokenize(t *testing.T) {
	r := start(t, words)
	text := "Hello there, friend. <|eot_id|> How are you?"
	ids := mustTokenize(t, r, fmt.Sprintf(`{"prompt":%q}`, text)).Tokens
	b, _ := json.Marshal(map[string]any{"model": "sim-model", "tokens": ids})
	code, _, body := call(t, r, "/detokenize", string(b))
	var out struct {
		Prompt string `json:"prompt"`
	}
	if code != 200 || json.Unmarshal(body, &out) != nil || out.Prompt != "<|begin_of_text|>"+text {
		t.Fatalf("detokenize: %d %s", code, body)
	}
	for _, tc := range []struct {
		body   string
		status int
	}{
		{`{"tokens":[0]}`, 400},
		{`{"tokens":[-1]}`, 400},
		{`{"tokens":[50000]}`, 400},
		{`{"tokens":[1.5]}`, 400},
		{`{"tokens":"abc"}`, 400},
		{`{}`, 400},
		{`{"model":"other","tokens":[1]}`, 404},
	} {
		if code, _, body := call(t, r, "/detokenize", tc.body); code != tc.status {
			t.Errorf("%s: %d %s, want %d", tc.body, code, body, tc.status)
		}
	}
	if code, _, body := call(t, start(t, fast), "/detokenize", `{"tokens":[9]}`); code != 400 {
		t.Errorf("bytes tokenizer detokenized: %d %s", code, body)
	}
}

// TestWordsCachedTokens: with the words tokenizer, cached_tokens is the
// full blocks of token ids two prompts share, never the last token, and
// prompt_tokens the count /tokenize gives.
func TestWordsCachedTokens(t *testing.T) {
	r := start(t, words)
	sys := strings.Repeat(englishProse+"\n\n", 3)
	ids := func(user string) []int32 {
		b, _ := json.Marshal(map[string]any{"messages": []map[string]string{{"role": "system", "content": sys}, {"role": "user", "content": user}}})
		return mustTokenize(t, r, string(b)).Tokens
	}
	one, two := ids("What did the keeper write?"), ids("Who reads the logbooks now?")
	shared := 0
	for shared < min(len(one), len(two)) && one[shared] == two[shared] {
		shared++
	}
	_, u1, body := call(t, r, "/v1/chat/completions", chatBody(sys, "What did the keeper write?"))
	if u1.Prompt != len(one) || u1.Details.Cached != 0 {
		t.Fatalf("first: %+v, want %d prompt tokens (%s)", u1, len(one), body)
	}
	_, u2, _ := call(t, r, "/v1/chat/completions", chatBody(sys, "Who reads the logbooks now?"))
	if u2.Prompt != len(two) || u2.Details.Cached != shared/16*16 || shared < 400 {
		t.Fatalf("second: %+v, want %d prompt tokens and %d cached (%d shared)", u2, len(two), shared/16*16, shared)
	}
	_, u3, _ := call(t, r, "/v1/chat/completions", chatBody(sys, "Who reads the logbooks now?"))
	if u3.Details.Cached != (len(two)-1)/16*16 {
		t.Fatalf("repeat: %+v, want %d cached", u3, (len(two)-1)/16*16)
	}
	// The router's 4-bytes-per-token estimate of the same prompt is far off.
	t.Logf("prompt: %d bytes, %d tokens (%.2f bytes per token); an estimate of 4 bytes per token says %d",
		len(sys), u1.Prompt, float64(len(sys))/float64(u1.Prompt), len(sys)/4)
	// The same prompt under a LoRA adapter shares no blocks with the base model.
	b, _ := json.Marshal(map[string]any{"model": "sql-lora", "messages": []map[string]string{{"role": "system", "content": sys}, {"role": "user", "content": "Who reads the logbooks now?"}}})
	code, u4, body := call(t, r, "/v1/chat/completions", string(b))
	if code != 200 || u4.Details.Cached != 0 || u4.Prompt != u3.Prompt || !strings.Contains(string(body), `"model":"sql-lora"`) {
		t.Fatalf("LoRA: %d %+v %s", code, u4, body)
	}
}

func TestMaxModelLen(t *testing.T) {
	o := words
	o.MaxModelLen = 100
	r := start(t, o)
	body := func(n, maxTokens int) string {
		b, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": maxTokens, "prompt": strings.Repeat(" word", n-1)})
		return string(b)
	}
	if code, u, b := call(t, r, "/v1/completions", body(90, 10)); code != 200 || u.Prompt != 90 {
		t.Fatalf("90 + 10 tokens: %d %+v %s", code, u, b)
	}
	if code, _, b := call(t, r, "/v1/completions", body(90, 11)); code != 400 || !strings.Contains(string(b), "maximum context length is 100 tokens") {
		t.Fatalf("90 + 11 tokens: %d %s", code, b)
	}
	if out := mustTokenize(t, r, `{"prompt":"x"}`); out.MaxModelLen != 100 {
		t.Fatalf("/tokenize max_model_len %d", out.MaxModelLen)
	}
	resp, err := http.Get(r.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var models struct {
		Data []struct {
			ID          string  `json:"id"`
			Parent      *string `json:"parent"`
			MaxModelLen int     `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&models); err != nil || len(models.Data) != 2 ||
		models.Data[1].ID != "sql-lora" || models.Data[1].Parent == nil || *models.Data[1].Parent != "sim-model" || models.Data[0].MaxModelLen != 100 {
		t.Fatalf("models %+v %v", models, err)
	}
}

// TestWordsRequestSwitches: the switches a chat or completions body gives
// change the prompt as they change /tokenize's, and a prompt of token ids
// is taken as it is.
func TestWordsRequestSwitches(t *testing.T) {
	r := start(t, words)
	msgs := `[{"role":"user","content":"Tell me about lighthouses."}]`
	for _, tc := range []struct {
		path, body, tokenize string
	}{
		{"/v1/chat/completions", `{"model":"sim-model","messages":` + msgs + `}`, `{"messages":` + msgs + `}`},
		{"/v1/chat/completions", `{"model":"sim-model","messages":` + msgs + `,"add_generation_prompt":false}`, `{"messages":` + msgs + `,"add_generation_prompt":false}`},
		{"/v1/chat/completions", `{"model":"sim-model","messages":` + msgs + `,"continue_final_message":true}`, `{"messages":` + msgs + `,"continue_final_message":true}`},
		{"/v1/chat/completions", `{"model":"sim-model","messages":` + msgs + `,"add_special_tokens":true}`, `{"messages":` + msgs + `,"add_special_tokens":true}`},
		{"/v1/completions", `{"model":"sim-model","prompt":"Tell me."}`, `{"prompt":"Tell me."}`},
		{"/v1/completions", `{"model":"sim-model","prompt":"Tell me.","add_special_tokens":false}`, `{"prompt":"Tell me.","add_special_tokens":false}`},
	} {
		code, u, b := call(t, r, tc.path, tc.body)
		if n := mustTokenize(t, r, tc.tokenize).Count; code != 200 || u.Prompt != n {
			t.Errorf("%s: %d, %d prompt tokens, /tokenize %d (%s)", tc.body, code, u.Prompt, n, b)
		}
	}
	if code, _, b := call(t, r, "/v1/chat/completions", `{"model":"sim-model","messages":`+msgs+`,"continue_final_message":true,"add_generation_prompt":true}`); code != 400 {
		t.Errorf("both switches: %d %s", code, b)
	}
	ids := make([]string, 40)
	for i := range ids {
		ids[i] = fmt.Sprint(1000 + i)
	}
	body := `{"model":"sim-model","prompt":[` + strings.Join(ids, ",") + `]}`
	call(t, r, "/v1/completions", body)
	if _, u, b := call(t, r, "/v1/completions", body); u.Prompt != 40 || u.Details.Cached != 32 {
		t.Errorf("token ids: %+v %s", u, b)
	}
}

// openAIError is an error body in OpenAI's shape, as vLLM answers it.
type openAIError struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}
