package tokenizer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
)

// bytesOf is the query's body in one buffer.
func (q *query) bytesOf() []byte { return bytes.Join(q.parts, nil) }

// TestBodyQuery: the /tokenize body holds the fields the engine reads from
// the request body, found as the engine finds them (exact keys, unescaped),
// their values as the body gives them; a field given twice is refused.
func TestBodyQuery(t *testing.T) {
	const a = `[{"role":"user","content":"A"}]`
	const b = `[{"role":"user","content":"B planted"}]`
	cases := []struct {
		name  string
		ep    blockhash.Endpoint
		model string
		body  string
		want  string // the query, or "" when refused
		dup   string // the field refused as given twice
	}{
		{"chat", blockhash.Chat, "m", `{"model":"m","messages":` + a + `}`,
			`{"model":"m","messages":` + a + `,"add_generation_prompt":true}`, ""},
		{"other spellings are other keys", blockhash.Chat, "m",
			`{"messages":` + a + `,"MESSAGES":` + b + `,"Messages":` + b + `,"model":"m","Model":"evil-model","Tools":[1],"Add_generation_prompt":false}`,
			`{"model":"m","messages":` + a + `,"add_generation_prompt":true}`, ""},
		{"escaped keys are the key", blockhash.Chat, "m", `{"m\u0065ssages":` + a + `,"model":"m","add_generation_prompt":false}`,
			`{"model":"m","messages":` + a + `,"add_generation_prompt":false}`, ""},
		{"values as given", blockhash.Chat, "m",
			"{ \"model\" : \"m\" ,\n\"tools\" : [ {\"x\": \"}]\\\"\"} ] , \"messages\"\t:\t" + a + " , \"chat_template_kwargs\":{\"k\":[1,{}]},\"continue_final_message\":true,\"add_generation_prompt\":false,\"chat_template\":null,\"add_special_tokens\":true,\"n\":2}",
			`{"model":"m","messages":` + a + `,"tools":[ {"x": "}]\""} ],"add_generation_prompt":false,"continue_final_message":true,"chat_template":null,"chat_template_kwargs":{"k":[1,{}]},"add_special_tokens":true}`, ""},
		{"model as parsed", blockhash.Chat, "m\"ü<", `{"model":"m\"\u00fc<","messages":` + a + `}`,
			`{"model":"m\"ü\u003c","messages":` + a + `,"add_generation_prompt":true}`, ""},
		{"messages twice", blockhash.Chat, "m", `{"model":"m","messages":` + a + `,"messages":` + b + `}`, "", "messages"},
		{"a template option twice", blockhash.Chat, "m", `{"model":"m","messages":` + a + `,"add_generation_prompt":true,"add_generation_prompt":false}`, "", "add_generation_prompt"},
		{"an escaped spelling twice", blockhash.Chat, "m", `{"model":"m","messages":` + a + `,"tools":[],"\u0074ools":[]}`, "", "tools"},
		{"no messages", blockhash.Chat, "m", `{"model":"m","MESSAGES":` + a + `}`, "", ""},
		{"a chat body's prompt is not its prompt", blockhash.Chat, "m", `{"model":"m","prompt":"x"}`, "", ""},
		{"completion", blockhash.Completion, "m", `{"model":"m","prompt":"say \"hi\"","PROMPT":"planted","messages":` + a + `,"add_special_tokens":false}`,
			`{"model":"m","prompt":"say \"hi\"","add_special_tokens":false}`, ""},
		{"completion of several prompts", blockhash.Completion, "m", `{"model":"m","prompt":["a","b"]}`, "", ""},
		{"completion of token ids", blockhash.Completion, "m", `{"model":"m","prompt":[1,2]}`, "", ""},
		{"not an object", blockhash.Chat, "m", `[1]`, "", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			q, err := bodyQuery(c.ep, c.model, []byte(c.body))
			var dup *dupError
			switch {
			case c.want == "" && err == nil:
				t.Fatalf("query %s, want it refused", q.bytesOf())
			case c.want == "" && c.dup != "" && (!errors.As(err, &dup) || dup.Field != c.dup):
				t.Fatalf("error %v, want %s given twice", err, c.dup)
			case c.want != "" && err != nil:
				t.Fatal(err)
			case c.want != "":
				got := q.bytesOf()
				if string(got) != c.want || q.n != len(got) || !json.Valid(got) {
					t.Fatalf("query\n%s (%d bytes counted)\nwant\n%s", got, q.n, c.want)
				}
				if q.model != c.model {
					t.Fatalf("asks for model %q, want %q", q.model, c.model)
				}
			}
		})
	}
}

// TestBodyQueryCopiesNothing: building the query of a large body allocates
// a few hundred bytes whatever the body's size: its values are slices of
// the body, not copies.
func TestBodyQueryCopiesNothing(t *testing.T) {
	content := strings.Repeat("a sentence of prose {with} \\\"brackets\\\" and quotes. ", 300_000) // 15 MiB
	body := []byte(`{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"user","content":"` + content + `"}]}`)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const runs = 10
	for range runs {
		q, err := bodyQuery(blockhash.Chat, "m", body)
		if err != nil {
			t.Fatal(err)
		}
		if q.n < len(content) {
			t.Fatalf("query of %d bytes", q.n)
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / runs; per > 4<<10 {
		t.Fatalf("%d bytes allocated per query of a %d-byte body", per, len(body))
	}
}

// keepBody is a transport that answers at once and keeps the request, whose
// body it reads only later, as a transport may.
type keepBody struct{ req *http.Request }

func (k *keepBody) RoundTrip(r *http.Request) (*http.Response, error) {
	k.req = r
	return &http.Response{StatusCode: 200, Body: io.NopCloser(strings.NewReader(`{"count":1,"tokens":[7]}`)), Request: r}, nil
}

// TestBodyReadAfterTheCall: the body of a /tokenize call is not read after
// the call returns (the router's buffer it aliases may serve another
// request by then): a transport's late read fails.
func TestBodyReadAfterTheCall(t *testing.T) {
	k := &keepBody{}
	c, _ := New(Options{URL: "http://127.0.0.1:1", Timeout: time.Second, Client: &http.Client{Transport: k}})
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if ids, err := c.Body(context.Background(), blockhash.Chat, "m", body); err != nil || len(ids) != 1 {
		t.Fatalf("%v %v", ids, err)
	}
	if n, err := k.req.Body.Read(make([]byte, 64)); n != 0 || !errors.Is(err, errLeaseEnded) {
		t.Fatalf("late read: %d bytes, %v", n, err)
	}
	if again, err := k.req.GetBody(); err != nil {
		t.Fatal(err)
	} else if _, err := io.ReadAll(again); !errors.Is(err, errLeaseEnded) {
		t.Fatalf("late read of GetBody's reader: %v", err)
	}
}

// TestBodyQueryReads: the reader yields the query's bytes, through reads
// of any size, and as often as GetBody asks.
func TestBodyQueryReads(t *testing.T) {
	q, err := bodyQuery(blockhash.Chat, "m", []byte(`{"model":"m","messages":[{"role":"user","content":"hello there"}],"tools":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	l := &lease{}
	for _, size := range []int{1, 3, 7, 64, 4096} {
		r := q.reader(l)
		var got []byte
		p := make([]byte, size)
		for {
			n, err := r.Read(p)
			got = append(got, p[:n]...)
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(got, q.bytesOf()) {
			t.Fatalf("reads of %d: %s", size, got)
		}
	}
}

// TestBodyTokenizesTheEnginesMessages: over a socket to a simulated
// replica, a body with "messages" and "MESSAGES" is tokenized as its
// "messages", the ones the engine serves: the ids are as many as the
// engine counts for the body.
func TestBodyTokenizesTheEnginesMessages(t *testing.T) {
	r := sim(t)
	c, _ := New(Options{URL: r.URL, Timeout: 5 * time.Second})
	body := `{"model":"sim-model","max_tokens":1,"messages":[{"role":"user","content":"short"}],` +
		`"MESSAGES":[{"role":"user","content":"` + strings.Repeat("planted words ", 200) + `"}],"Model":"evil-model"}`
	ids, err := c.Body(context.Background(), blockhash.Chat, "sim-model", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post(r.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Usage struct {
			Prompt int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %v", resp.StatusCode, err)
	}
	if out.Usage.Prompt != len(ids) {
		t.Fatalf("/tokenize gave %d ids, the engine counted %d prompt tokens", len(ids), out.Usage.Prompt)
	}
}

// TestJSONString: a model's name is written as encoding/json writes it
// (the query's bytes, and so its cache key, are as before).
func TestJSONString(t *testing.T) {
	for _, s := range []string{"", "sim-model", "Qwen/Qwen3-8B", `a"b`, `a\b`, "a<b>&c", "tab\there", "é", "\u2028", "\xff", "del\x7f", "x:y@z"} {
		want, _ := json.Marshal(s)
		if got := jsonString(s); !bytes.Equal(got, want) {
			t.Errorf("%q: %s, want %s", s, got, want)
		}
	}
}
