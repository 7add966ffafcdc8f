package simreplica

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// agentic is fast with the words tokenizer and its chat template, where
// the order of a prompt's messages shows in its tokens.
var agentic = func() Options { o := fast; o.Tokenizer = TokenizerWords; o.OutputTokens = 4; return o }()

// postJSON posts body (marshalled) to path and decodes the answer into out;
// it returns the status.
func postJSON(t *testing.T, r *Running, path string, body, out any) int {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	code, _, raw := call(t, r, path, string(b))
	if out != nil {
		if err := json.Unmarshal(raw, out); err != nil {
			t.Fatalf("%s: %v: %s", path, err, raw)
		}
	}
	return code
}

// chatTokens returns the token ids /tokenize gives the chat of msgs (a
// list of messages) and tools: the prompt the same conversation makes on
// /v1/chat/completions.
func chatTokens(t *testing.T, r *Running, msgs any, tools []any) []int32 {
	t.Helper()
	body := map[string]any{"messages": msgs}
	if tools != nil {
		body["tools"] = tools
	}
	var out struct {
		Tokens []int32 `json:"tokens"`
	}
	if code := postJSON(t, r, "/tokenize", body, &out); code != http.StatusOK {
		t.Fatalf("tokenize: %d", code)
	}
	return out.Tokens
}

// cachedFor is what the prefix cache gives prompt after earlier prompts
// were computed: its longest prefix in full blocks that one of them
// shares (blocks are chained), never its last token.
func cachedFor(prompt []int32, earlier [][]int32, bs int) int {
	best := 0
	for _, e := range earlier {
		n := 0
		for n < len(prompt) && n < len(e) && prompt[n] == e[n] {
			n++
		}
		best = max(best, n/bs*bs)
	}
	return min(best, (len(prompt)-1)/bs*bs)
}

// responseJSON is the part of a Responses API answer the tests read.
type responseJSON struct {
	ID     string `json:"id"`
	Output []struct {
		Type    string `json:"type"`
		ID      string `json:"id"`
		CallID  string `json:"call_id"`
		Name    string `json:"name"`
		Args    string `json:"arguments"`
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
	} `json:"output"`
	Usage struct {
		Input   int `json:"input_tokens"`
		Output  int `json:"output_tokens"`
		Details struct {
			Cached int `json:"cached_tokens"`
		} `json:"input_tokens_details"`
	} `json:"usage"`
}

// text is the response's output text.
func (r responseJSON) text() string {
	var sb strings.Builder
	for _, o := range r.Output {
		for _, c := range o.Content {
			sb.WriteString(c.Text)
		}
	}
	return sb.String()
}

// A chain of Responses requests is rendered as vLLM renders it: the
// request's tools (its own only), its instructions, the messages of the
// response it continues (instructions included, so a chain that repeats
// its instructions gathers them at the front), that response's output
// text, its input; and the prefix cache sees that prompt.
func TestResponsesContinuationAsVLLM(t *testing.T) {
	tools := []any{map[string]any{"type": "function", "name": "lookup", "description": "Looks a word up.",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"word": map[string]any{"type": "string"}}}}}
	chatTools := []any{map[string]any{"type": "function", "function": map[string]any{"name": "lookup", "description": "Looks a word up.",
		"parameters": map[string]any{"type": "object", "properties": map[string]any{"word": map[string]any{"type": "string"}}}}}}
	const instr = "You answer questions about the harbour's opening hours, briefly and politely, in English."
	questions := []string{"When does the harbour open on weekdays?", "And on Sundays in winter?", "Is there a ferry at night?"}
	for _, withInstr := range []bool{true, false} {
		r := start(t, agentic)
		bs := r.Options().BlockSize
		var prev string
		var msgs []map[string]any // the stored messages of the last response
		var prompts [][]int32
		for turn, q := range questions {
			body := map[string]any{"model": "sim-model", "input": q, "tools": tools, "tool_choice": "none"}
			want := []map[string]any{}
			if withInstr {
				body["instructions"] = instr
				want = append(want, map[string]any{"role": "system", "content": instr})
			}
			if prev != "" {
				body["previous_response_id"] = prev
			}
			want = append(append(want, msgs...), map[string]any{"role": "user", "content": q})
			var resp responseJSON
			if code := postJSON(t, r, "/v1/responses", body, &resp); code != http.StatusOK {
				t.Fatalf("instructions %v, turn %d: %d", withInstr, turn, code)
			}
			prompt := chatTokens(t, r, want, chatTools)
			if resp.Usage.Input != len(prompt) {
				t.Fatalf("instructions %v, turn %d: %d input tokens, want %d (the chat of %v)", withInstr, turn, resp.Usage.Input, len(prompt), want)
			}
			if c := cachedFor(prompt, prompts, bs); resp.Usage.Details.Cached != c {
				t.Fatalf("instructions %v, turn %d: %d cached tokens, want %d", withInstr, turn, resp.Usage.Details.Cached, c)
			}
			if !withInstr && turn == 2 {
				if last := len(prompts[1]) / bs * bs; resp.Usage.Details.Cached != last {
					t.Fatalf("turn 3 has %d tokens cached, want its turn-2 prompt's %d", resp.Usage.Details.Cached, last)
				}
			}
			if withInstr && turn == 2 && len(want) != 8 {
				t.Fatalf("turn 3 rendered %d messages, want 3 system, 3 user and 2 assistant", len(want))
			}
			prompts = append(prompts, prompt)
			msgs = append(want, map[string]any{"role": "assistant", "content": resp.text()})
			prev = resp.ID
		}
	}
}

// A request's tools are its own: those of the response it continues are
// not rendered; store: false stores nothing, and a continuation of it is
// vLLM's 404.
func TestResponsesToolsAndStore(t *testing.T) {
	r := start(t, agentic)
	tools := []any{map[string]any{"type": "function", "name": "lookup", "parameters": map[string]any{"type": "object"}}}
	var first responseJSON
	postJSON(t, r, "/v1/responses", map[string]any{"model": "sim-model", "input": "hello there", "tools": tools, "tool_choice": "none"}, &first)
	var second responseJSON
	postJSON(t, r, "/v1/responses", map[string]any{"model": "sim-model", "input": "again", "previous_response_id": first.ID}, &second)
	want := chatTokens(t, r, []map[string]any{{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.text()},
		{"role": "user", "content": "again"}}, nil)
	if second.Usage.Input != len(want) {
		t.Fatalf("a continuation without tools: %d input tokens, want %d (no tools rendered)", second.Usage.Input, len(want))
	}

	var unstored responseJSON
	postJSON(t, r, "/v1/responses", map[string]any{"model": "sim-model", "input": "forget me", "store": false}, &unstored)
	var e openAIError
	code := postJSON(t, r, "/v1/responses", map[string]any{"model": "sim-model", "input": "x", "previous_response_id": unstored.ID}, &e)
	if code != http.StatusNotFound || e.Error.Message != "Response with id '"+unstored.ID+"' not found." || e.Error.Type != "invalid_request_error" || e.Error.Code != 404 {
		t.Fatalf("continuing an unstored response: %d %+v", code, e)
	}
	resp, err := http.Get(r.URL + "/v1/responses/" + unstored.ID)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("GET an unstored response: %d", resp.StatusCode)
	}
}

// Every error /v1/messages answers is in Anthropic's shape, {"type":
// "error", "error": {"type", "message"}}, with vLLM's error type as its
// Anthropic router gives it; chat's and the Responses API's stay OpenAI's.
func TestMessagesErrorsInAnthropicShape(t *testing.T) {
	o := agentic
	o.MaxModelLen, o.MaxBodyBytes = 64, 1<<10
	r := start(t, o)
	msg := func(extra string) string {
		return `{"model":"sim-model","max_tokens":2,"messages":[{"role":"user","content":"hi"}]` + extra + `}`
	}
	cases := []struct {
		name, path, body string
		status           int
		typ              string
	}{
		{"bad JSON", "/v1/messages", `{"model":`, 400, "BadRequestError"},
		{"bad role", "/v1/messages", `{"model":"sim-model","max_tokens":2,"messages":[{"role":"wizard","content":"x"}]}`, 400, "BadRequestError"},
		{"unknown model", "/v1/messages", `{"model":"nope","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`, 404, "NotFoundError"},
		{"max_tokens over the model's", "/v1/messages", `{"model":"sim-model","max_tokens":99999,"messages":[{"role":"user","content":"hi"}]}`, 400, "BadRequestError"},
		{"maximum context length", "/v1/messages", `{"model":"sim-model","max_tokens":60,"messages":[{"role":"user","content":"` + strings.Repeat("word ", 20) + `"}]}`, 400, "BadRequestError"},
		{"body too large", "/v1/messages", msg(`,"pad":"` + strings.Repeat("x", 2<<10) + `"`), 413, "BadRequestError"},
		{"chat stays OpenAI's", "/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"hi"}]}`, 404, ""},
		{"Responses stay OpenAI's", "/v1/responses", `{"model":"nope","input":"hi"}`, 404, ""},
	}
	check := func(name, path string, code int, raw []byte, status int, typ string) {
		t.Helper()
		var e struct {
			Type  string `json:"type"`
			Error struct {
				Type    string `json:"type"`
				Message string `json:"message"`
				Code    *int   `json:"code"`
			} `json:"error"`
		}
		if err := json.Unmarshal(raw, &e); err != nil || code != status || e.Error.Message == "" ||
			name == "maximum context length" && !strings.Contains(e.Error.Message, name) {
			t.Fatalf("%s: %d %s", name, code, raw)
		}
		anthropic := path == "/v1/messages"
		if anthropic && (e.Type != "error" || e.Error.Type != typ || e.Error.Code != nil) {
			t.Fatalf("%s: %s, want Anthropic's shape with type %q", name, raw, typ)
		}
		if !anthropic && (e.Type != "" || e.Error.Code == nil || *e.Error.Code != status) {
			t.Fatalf("%s: %s, want OpenAI's shape", name, raw)
		}
	}
	for _, tc := range cases {
		code, _, raw := call(t, r, tc.path, tc.body)
		check(tc.name, tc.path, code, raw, tc.status, tc.typ)
	}
	r.Fault(529)
	code, _, raw := call(t, r, "/v1/messages", msg(""))
	check("a fault", "/v1/messages", code, raw, 529, "InternalServerError")
	code, _, raw = call(t, r, "/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}`)
	check("a fault on chat", "/v1/chat/completions", code, raw, 529, "")
}
