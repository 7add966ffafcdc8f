package blockhash

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/valyala/fastjson"
)

// nest is n levels of open around inner, closed again.
func nest(n int, open, close, inner string) string {
	return strings.Repeat(open, n) + inner + strings.Repeat(close, n)
}

// withExtra is a valid chat body (depth 3) with v under an unread key.
func withExtra(v string) string {
	return `{"model":"m","messages":[{"role":"user","content":"x"}],"extra":` + v + `}`
}

// parseErr parses body as ep and returns its *InputError, failing the test
// on success, on another error type, or on a long message.
func parseErr(t *testing.T, ep Endpoint, body string, lim Limits) *InputError {
	t.Helper()
	r, err := Parse(ep, []byte(body), lim)
	if err == nil {
		r.Recycle()
		t.Fatalf("accepted %.80q", body)
	}
	var ie *InputError
	if !errors.As(err, &ie) {
		t.Fatalf("err = %v (%T), want *InputError", err, err)
	}
	if n := len(err.Error()); n > maxErrorLen {
		t.Fatalf("error message of %d bytes: %.100q…", n, err.Error())
	}
	return ie
}

func TestNestingLimit(t *testing.T) {
	const depthMsg = "JSON nesting is deeper than the limit of "
	cases := []struct {
		name string
		body string
		lim  Limits
		ok   bool // else refused for nesting past limit
	}{
		{"20000 [", strings.Repeat("[", 20000), Limits{}, false},
		{`20000 {"a":`, strings.Repeat(`{"a":`, 20000), Limits{}, false},
		{"20000 [ closed", nest(20000, "[", "]", ""), Limits{}, false},
		{"1 MiB [", strings.Repeat("[", 1<<20), Limits{}, false},
		{"at the limit, arrays", withExtra(nest(DefaultMaxDepth-1, "[", "]", "1")), Limits{}, true},
		{"past the limit, arrays", withExtra(nest(DefaultMaxDepth, "[", "]", "1")), Limits{}, false},
		{"at the limit, objects", withExtra(nest(DefaultMaxDepth-1, `{"a":`, "}", "null")), Limits{}, true},
		{"past the limit, objects", withExtra(nest(DefaultMaxDepth, `{"a":`, "}", "null")), Limits{}, false},
		{"past the limit, mixed", withExtra(nest(DefaultMaxDepth/2, `[{"a":`, "}]", "[]")), Limits{}, false},
		{"many allowed nests", withExtra("[" + strings.Repeat(nest(DefaultMaxDepth-2, "[", "]", "")+",", 1000) + "1]"), Limits{}, true},
		{"set limit, at", withExtra(nest(4, "[", "]", "")), Limits{MaxDepth: 5}, true},
		{"set limit, past", withExtra(nest(5, "[", "]", "")), Limits{MaxDepth: 5}, false},
		{"set limit 2", withExtra("[[]]"), Limits{MaxDepth: 2}, false},
		{"negative limit is the default", withExtra(nest(DefaultMaxDepth-1, "[", "]", "")), Limits{MaxDepth: -1}, true},
		{"negative limit is the default, past", withExtra(nest(DefaultMaxDepth, "[", "]", "")), Limits{MaxDepth: -1}, false},
		{"limit above the ceiling, at", withExtra(nest(maxDepthCeiling-1, "[", "]", "1")), Limits{MaxDepth: 1000}, true},
		{"limit above the ceiling, past", withExtra(nest(maxDepthCeiling, "[", "]", "1")), Limits{MaxDepth: 1000}, false},
		{"brackets inside strings", withExtra(`"` + strings.Repeat("[{", 20000) + `"`), Limits{}, true},
		{"brackets inside keys", withExtra(`{"` + strings.Repeat("[{", 20000) + `":1}`), Limits{}, true},
		{"escaped quotes inside strings", withExtra(`["\"` + strings.Repeat("[{", 20000) + `\"", "\\\"[[[\\\\\"{{"]`), Limits{}, true},
		{"escaped backslash ends a string", withExtra(`["\\", ` + nest(DefaultMaxDepth, "[", "]", "") + `]`), Limits{}, false},
		{"three backslashes and a quote", withExtra(`["\\\"` + strings.Repeat("[", 100) + `\\\\", ` + nest(DefaultMaxDepth-1, "[", "]", "") + `]`), Limits{}, false},
		{"escapes of other kinds", withExtra(`["\u005b\n\t\/\b\f\r\"` + strings.Repeat("[", 100) + `"]`), Limits{}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for _, ep := range []Endpoint{Chat, Completion} {
				body := tc.body
				if ep == Completion {
					body = strings.Replace(body, `"messages":[{"role":"user","content":"x"}]`, `"prompt":"p"`, 1)
				}
				if tc.ok {
					r, err := Parse(ep, []byte(body), tc.lim)
					if err != nil {
						t.Fatalf("endpoint %d: %.200v", ep, err)
					}
					r.Recycle()
					continue
				}
				ie := parseErr(t, ep, body, tc.lim)
				want := fmt.Sprint(depthMsg, tc.lim.maxDepth())
				if ie.Field != "" || !strings.HasPrefix(ie.Msg, want) {
					t.Fatalf("endpoint %d: err = %v, want %q…", ep, ie, want)
				}
			}
		})
	}
}

// TestStrictJSON: prescan and fastjson's parser accept the JSON that the
// replica's json.loads does, and no more: no raw control characters in
// strings (which fastjson's validator let through before an escape), no
// NaN or Infinity, no malformed numbers or escapes.
func TestStrictJSON(t *testing.T) {
	for _, tc := range []struct {
		extra string
		ok    bool
	}{
		{`"a\u00e9\/\"\\\b\f\n\r\t"`, true},
		{`[-0, 0.5, 1E+2, 1e-2, -12.5e3, 123]`, true},
		{"\t[\r\n1 , 2 ]\n", true},
		{`"\ud800"`, true}, // an unpaired surrogate: json.loads takes it too
		{"\"a\tb\\n\"", false},
		{"\"a\x00\"", false},
		{"\"\x1f\"", false},
		{`"\x"`, false},
		{`"\u12"`, false},
		{`"\u12G4"`, false},
		{`NaN`, false},
		{`Infinity`, false},
		{`-Infinity`, false},
		{`nan`, false},
		{`[01]`, false},
		{`[1.]`, false},
		{`[.5]`, false},
		{`[+1]`, false},
		{`[1e]`, false},
		{`[1-2]`, false},
		{`[0x10]`, false},
		{`[1,]`, false},
		{`{"a":1,}`, false},
		{`[truex]`, false},
		{`'a'`, false},
		{"\"\xff\"", true}, // not UTF-8, but JSON's lexical rules do not say
	} {
		for _, ep := range []Endpoint{Chat, Completion} {
			body := withExtra(tc.extra)
			if ep == Completion {
				body = `{"model":"m","prompt":"p","extra":` + tc.extra + `}`
			}
			if valid := json.Valid([]byte(body)); valid != tc.ok {
				t.Fatalf("json.Valid(%q) = %v: the table is wrong", body, valid)
			}
			r, err := Parse(ep, []byte(body), Limits{})
			if (err == nil) != tc.ok {
				t.Errorf("%q: err = %v, want ok = %v", body, err, tc.ok)
			}
			if err == nil {
				r.Recycle()
			}
		}
	}
}

// TestHostileErrorsShort feeds bodies whose errors once quoted the input, or
// cost more than linear time: every error is short.
func TestHostileErrorsShort(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	garbage := make([]byte, 1<<20)
	for i := range garbage {
		garbage[i] = byte(rng.Uint32())
	}
	mb := strings.Repeat("\x01é", 1<<19)
	cases := map[string]string{
		"random bytes":             string(garbage),
		"random after a key":       `{"model":` + string(garbage),
		"bad literal, deep":        strings.Repeat("[", DefaultMaxDepth-1) + "t" + mb,
		"bad literal in an object": strings.Repeat(`{"a":`, DefaultMaxDepth-1) + "nul" + mb,
		"nan":                      withExtra("nan" + mb),
		"bad number":               withExtra("-" + mb),
		"long number":              withExtra(strings.Repeat("9", 1<<20) + "x"),
		"unterminated string":      `{"model":"` + mb,
		"control char in a string": `{"model":"` + mb + `"}`,
		"bad escape":               `{"model":"` + strings.Repeat("a", 1<<20) + `\x"}`,
		"long unknown role":        `{"model":"m","messages":[{"role":"` + strings.Repeat("é", 1<<19) + `","content":"x"}]}`,
		"long tail":                `{}` + mb,
		"structure, deep":          strings.Repeat("[", DefaultMaxDepth-1) + "1 2" + strings.Repeat(` "é\u00e9"`, 1<<17),
		"structure, deep objects":  strings.Repeat(`{"a":`, DefaultMaxDepth-1) + `{"b" 1}` + strings.Repeat(`,"é"`, 1<<17),
		"token ids overflow":       `{"model":"m","prompt":[` + strings.Repeat("1,", 1<<19) + `99999999999]}`,
		"1 MiB of quotes":          strings.Repeat(`"`, 1<<20),
		"1 MiB of backslashes":     `"` + strings.Repeat(`\`, 1<<20),
	}
	for name, body := range cases {
		t.Run(name, func(t *testing.T) {
			for _, ep := range []Endpoint{Chat, Completion} {
				parseErr(t, ep, body, Limits{})
			}
		})
	}
}

func TestKeysMatchExactly(t *testing.T) {
	cases := []struct {
		name, body string
		ep         Endpoint
		field      string // refused with an error on this field, if set
		check      func(t *testing.T, r *Request)
	}{
		{"MAX_TOKENS is not max_tokens", `{"max_tokens":99999999,"MAX_TOKENS":5,"model":"m","messages":[{"role":"user","content":"x"}]}`, Chat, "",
			func(t *testing.T, r *Request) {
				if r.MaxTokens != 99999999 {
					t.Errorf("MaxTokens = %d, want 99999999", r.MaxTokens)
				}
			}},
		{"Max_Completion_Tokens ignored", `{"max_tokens":7,"Max_Completion_Tokens":5,"model":"m","prompt":"p"}`, Completion, "",
			func(t *testing.T, r *Request) {
				if r.MaxTokens != 7 {
					t.Errorf("MaxTokens = %d, want 7", r.MaxTokens)
				}
			}},
		{"Model alone", `{"Model":"m","messages":[{"role":"user","content":"x"}]}`, Chat, "model", nil},
		{"MODEL beside model", `{"MODEL":"decoy","model":"m","Model":"decoy","messages":[{"role":"user","content":"x"}]}`, Chat, "",
			func(t *testing.T, r *Request) {
				if r.Model != "m" {
					t.Errorf("Model = %q, want m", r.Model)
				}
			}},
		{"MESSAGES alone", `{"model":"m","MESSAGES":[{"role":"user","content":"x"}]}`, Chat, "messages", nil},
		{"MESSAGES decoy", `{"model":"m","MESSAGES":[{"role":"user","content":"decoy"}],"messages":[{"role":"user","content":"real"}]}`, Chat, "",
			func(t *testing.T, r *Request) {
				if len(r.Parts) != 1 || string(r.Parts[0].Text) != "real" {
					t.Errorf("parts = %+v, want the one real message", r.Parts)
				}
			}},
		{"Prompt alone", `{"model":"m","Prompt":"p"}`, Completion, "prompt", nil},
		{"Stream ignored", `{"model":"m","Stream":true,"prompt":"p"}`, Completion, "",
			func(t *testing.T, r *Request) {
				if r.Stream {
					t.Error("Stream read from \"Stream\"")
				}
			}},
		{"User ignored", `{"model":"m","USER":"u","prompt":"p"}`, Completion, "",
			func(t *testing.T, r *Request) {
				if r.User != "" {
					t.Errorf("User = %q from \"USER\"", r.User)
				}
			}},
		{"Tools ignored", `{"model":"m","Tools":[{"a":1}],"messages":[{"role":"user","content":"x"}]}`, Chat, "",
			func(t *testing.T, r *Request) {
				if len(r.Parts) != 1 {
					t.Errorf("%d parts, want 1 (no tools part)", len(r.Parts))
				}
			}},
		{"Role alone", `{"model":"m","messages":[{"Role":"user","content":"x"}]}`, Chat, "messages[0].role", nil},
		{"Content ignored", `{"model":"m","messages":[{"role":"user","Content":"decoy","content":"x","NAME":"n"}]}`, Chat, "",
			func(t *testing.T, r *Request) {
				if string(r.Parts[0].Text) != "x" {
					t.Errorf("text = %q, want x", r.Parts[0].Text)
				}
			}},
		{"Tool_Calls ignored", `{"model":"m","messages":[{"role":"assistant","content":"x","Tool_Calls":[{"function":{"name":"f"}}]}]}`, Chat, "",
			func(t *testing.T, r *Request) {
				if string(r.Parts[0].Text) != "x" {
					t.Errorf("text = %q, want x", r.Parts[0].Text)
				}
			}},
		{"Function and Name ignored", `{"model":"m","messages":[{"role":"assistant","tool_calls":[{"Function":{"name":"g"}},{"function":{"Name":"g","name":"f","ARGUMENTS":"{}"}}]}]}`, Chat, "",
			func(t *testing.T, r *Request) {
				if want := "\x00\x00\x00f\x00"; string(r.Parts[0].Text) != want {
					t.Errorf("text = %q, want %q", r.Parts[0].Text, want)
				}
			}},
		{"Type is not type", `{"model":"m","messages":[{"role":"user","content":[{"Type":"text","text":"x"}]}]}`, Chat, "",
			func(t *testing.T, r *Request) {
				if want := `{"Type":"text","text":"x"}`; string(r.Parts[0].Text) != want {
					t.Errorf("text = %q, want %q", r.Parts[0].Text, want)
				}
			}},
		{"Kelvin sign is not k", "{\"model\":\"m\",\"max_to\u212aens\":5,\"prompt\":\"p\"}", Completion, "",
			func(t *testing.T, r *Request) {
				if r.MaxTokens != 0 {
					t.Errorf("MaxTokens = %d, want 0", r.MaxTokens)
				}
			}},
		{"escaped key is the key", `{"mod\u0065l":"m","prompt":"p"}`, Completion, "",
			func(t *testing.T, r *Request) {
				if r.Model != "m" {
					t.Errorf("Model = %q, want m", r.Model)
				}
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.field != "" {
				ie := parseErr(t, tc.ep, tc.body, Limits{})
				if ie.Field != tc.field || !strings.Contains(ie.Msg, "required") {
					t.Fatalf("err = %v, want %s: …required…", ie, tc.field)
				}
				return
			}
			r, err := Parse(tc.ep, []byte(tc.body), Limits{})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Recycle()
			tc.check(t, r)
		})
	}
}

// TestDuplicateKeys refuses every key the router reads given twice in each
// object the router reads, whatever the values, and lets others repeat.
func TestDuplicateKeys(t *testing.T) {
	type level struct {
		ep     Endpoint
		keys   []string
		before string // the body up to the object, which comes next
		object string // the object's required members, without braces
		after  string
		field  string // the path prefix of its keys
	}
	levels := []level{
		{Chat, []string{"model", "messages", "tools", "user", "stream", "max_tokens", "max_completion_tokens"},
			``, `"model":"m","messages":[{"role":"user","content":"x"}]`, ``, ""},
		{Completion, []string{"model", "prompt", "user", "stream", "max_tokens", "max_completion_tokens"},
			``, `"model":"m","prompt":"p"`, ``, ""},
		{Chat, []string{"role", "content", "name", "tool_calls"},
			`{"model":"m","messages":[{"role":"user","content":"x"},`, `"role":"user"`, `]}`, "messages[1]."},
		{Chat, []string{"id", "function"},
			`{"model":"m","messages":[{"role":"assistant","tool_calls":[null,`, `"id":"1"`, `]}]}`, "messages[0].tool_calls[1]."},
		{Chat, []string{"name", "arguments"},
			`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"1","function":`, `"name":"f"`, `}]}]}`, "messages[0].tool_calls[0].function."},
		{Chat, []string{"type", "text"},
			`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},`, `"type":"text"`, `]}]}`, "messages[0].content[1]."},
	}
	values := []string{`null`, `"s"`, `1`, `[]`, `{}`, `true`}
	for _, lv := range levels {
		for _, key := range lv.keys {
			for _, v := range values {
				for _, order := range []string{"apart", "adjacent"} {
					members := `"` + key + `":` + v + `,` + lv.object + `,"` + key + `":` + v
					if order == "adjacent" {
						members = lv.object + `,"` + key + `":null,"` + key + `":` + v
					}
					body := lv.before + "{" + members + "}" + lv.after
					t.Run(fmt.Sprintf("%s%s/%s/%s", lv.field, key, v, order), func(t *testing.T) {
						ie := parseErr(t, lv.ep, body, Limits{})
						if ie.Field != lv.field+key || ie.Msg != "is given more than once" {
							t.Fatalf("err = %v, want %s%s: is given more than once", ie, lv.field, key)
						}
					})
				}
			}
		}
	}
	// The key written with an escape is the same key.
	ie := parseErr(t, Chat, `{"model":"a","mod\u0065l":"b","messages":[{"role":"user","content":"x"}]}`, Limits{})
	if ie.Field != "model" || ie.Msg != "is given more than once" {
		t.Fatalf("escaped duplicate: err = %v", ie)
	}

	accepted := []struct {
		ep   Endpoint
		body string
	}{
		{Chat, `{"model":"m","x":1,"x":{"y":2},"temperature":1,"temperature":0,"messages":[{"role":"user","content":"x"}]}`},
		{Chat, `{"model":"m","prompt":"a","prompt":"b","messages":[{"role":"user","content":"x"}]}`},
		{Completion, `{"model":"m","messages":1,"messages":2,"tools":[],"tools":{},"prompt":"p"}`},
		{Chat, `{"model":"m","messages":[{"role":"tool","tool_call_id":"a","tool_call_id":"b","content":"x"}]}`},
		{Chat, `{"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"1","type":"function","type":"x","function":{"name":"f","strict":true,"strict":false}}]}]}`},
		{Chat, `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a","url":"b"},"detail":1,"detail":2}]}]}`},
		{Chat, `{"model":"m","tools":[{"type":"function","type":"function","function":{"name":"f","name":"g"}}],"messages":[{"role":"user","content":"x"}]}`},
		{Chat, `{"model":"m","MODEL":"x","Model":"y","messages":[{"role":"user","content":"x","Content":"y","CONTENT":"z"}]}`},
	}
	for _, a := range accepted {
		r, err := Parse(a.ep, []byte(a.body), Limits{})
		if err != nil {
			t.Errorf("%s: %v", a.body, err)
			continue
		}
		r.Recycle()
	}
	// An unread duplicate inside an image part is read as the replica
	// reads it: the last.
	r, err := ParseChat([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a","url":"b"}}]}]}`), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"image_url":{"url":"b"},"type":"image_url"}`; string(r.Parts[0].Text) != want {
		t.Errorf("image part = %q, want %q", r.Parts[0].Text, want)
	}
	r.Recycle()
}

func TestClip(t *testing.T) {
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"abc", 3, "abc"},
		{"abcdef", 5, "ab…"},
		{"ééé", 6, "ééé"},
		{"éééé", 7, "éé…"},
		{"ééé", 6 + 1, "ééé"},
		{"a€€", 6, "a…"},
		{"\xff\xff\xff\xff\xff\xff\xff", 6, "\xff\xff\xff…"},
	} {
		if got := clip(tc.in, tc.n); got != tc.want || len(got) > max(tc.n, len(tc.in)) {
			t.Errorf("clip(%q, %d) = %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
	for _, tc := range []struct {
		in   string
		n    int
		want string
	}{
		{"abc", 3, "abc"},
		{"abcdefghijkl", 9, "ab…ijkl"},
		{"éééééé", 9, "é…éé"},
		{"ééééééé", 10, "é…éé"},
		{"a€b€c€d", 9, "a…c€d"},
	} {
		got := clipMiddle(tc.in, tc.n)
		if got != tc.want || len(got) > max(tc.n, len(tc.in)) || !utf8.ValidString(got) {
			t.Errorf("clipMiddle(%q, %d) = %q, want %q", tc.in, tc.n, got, tc.want)
		}
	}
}

// TestPrescanDoesNotAllocate: the scan runs on every body.
func TestPrescanDoesNotAllocate(t *testing.T) {
	body := []byte(withExtra(`["` + strings.Repeat(`a\"[{`, 1000) + `", ` + nest(60, "[", "]", "true,false,null") + `]`))
	if n := testing.AllocsPerRun(100, func() {
		if err := prescan(body, DefaultMaxDepth); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Fatalf("prescan allocates %v times per call", n)
	}
}

// depthNaive is the nesting check written the obvious way, a byte at a
// time with an in-string state and nothing else: the offset of the first
// bracket or brace past maxDepth, or -1.
func depthNaive(data []byte, maxDepth int) int {
	depth, inString, escaped := 0, false, false
	for i, c := range data {
		switch {
		case inString && escaped:
			escaped = false
		case inString && c == '\\':
			escaped = true
		case inString && c == '"':
			inString = false
		case inString:
		case c == '"':
			inString = true
		case c == '[' || c == '{':
			depth++
			if depth > maxDepth {
				return i
			}
		case c == ']' || c == '}':
			depth--
		}
	}
	return -1
}

// checkPrescan holds prescan(body, maxDepth) to slow references, on any
// input:
//
//   - a refusal for nesting is depthNaive's, at the same byte, and a body
//     it passes depthNaive passes (it may refuse a lexical error first);
//   - on valid JSON, it refuses exactly the bodies nested deeper than
//     maxDepth, as counted on encoding/json's tokens (refDepth);
//   - where it does not refuse for nesting, it and fastjson's parser after
//     it accept exactly the bodies that encoding/json's json.Valid does;
//   - its errors are short *InputErrors, and so are fastjson's parse errors
//     on a body it passes: at most two wrappings a level of about 50 bytes,
//     around a bounded innermost error and a tail of at most 83 bytes
//     quoted (4 bytes each when escaped): no quadratic growth, no quoted
//     rest of the body.
func checkPrescan(t *testing.T, body []byte, maxDepth int) {
	t.Helper()
	err := prescan(body, maxDepth)
	var ie *InputError
	if err != nil {
		if !errors.As(err, &ie) {
			t.Fatalf("error of type %T", err)
		}
		if len(err.Error()) > maxErrorLen {
			t.Fatalf("error of %d bytes", len(err.Error()))
		}
	}
	naive := depthNaive(body, maxDepth)
	switch {
	case err == nil && naive >= 0:
		t.Fatalf("prescan(%q, %d) passes; depthNaive refuses at byte %d", body, maxDepth, naive)
	case err != nil && isDepth(ie):
		if want := fmt.Sprintf("JSON nesting is deeper than the limit of %d (at byte %d)", maxDepth, naive); ie.Msg != want {
			t.Fatalf("prescan(%q, %d) = %v, want %q", body, maxDepth, err, want)
		}
	}
	valid := json.Valid(body)
	if valid && (err == nil) != (refDepth(body) <= maxDepth) {
		t.Fatalf("prescan(%q, %d) = %v at depth %d", body, maxDepth, err, refDepth(body))
	}
	if err != nil && isDepth(ie) {
		return
	}
	var p fastjson.Parser
	_, perr := p.ParseBytes(body)
	if accepted := err == nil && perr == nil; accepted != valid {
		t.Fatalf("json.Valid(%q) = %v, but prescan says %v and fastjson's parser %v", body, valid, err, perr)
	}
	if err == nil && perr != nil && len(perr.Error()) > 50*(maxDepth+2)+600 {
		t.Fatalf("limit %d: fastjson's parse error is %d bytes", maxDepth, len(perr.Error()))
	}
}

// TestPrescanRandom checks prescan on random bodies over an alphabet of
// what matters to it, of lengths around its 8-byte steps.
func TestPrescanRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	alphabet := []string{"[", "]", "{", "}", `"`, `\`, `\"`, `\\`, `\/`, `\u00e9`, `\u12`, `\uZZZZ`, `\x`, "\x00", "\x01", "\x1f", "\t", "\x7f",
		"t", "true", "false", "null", "nul", "f", "n", "nan", "Infinity", "truex",
		"0", "1", "-", "+", ".", "e", "E", "-0", "01", "1.", ".5", "1e", "1e+5", "1.5E-3", "12345678",
		",", ":", " ", "\n", "\r", "a", "@", "\xc3\xa9", "\xff", `"ab[c"`, `{"a":1}`, `"abcdefghijklmnop"`}
	for range 300000 {
		var b []byte
		for n := rng.IntN(20); n > 0; n-- {
			b = append(b, alphabet[rng.IntN(len(alphabet))]...)
		}
		checkPrescan(t, b, 1+rng.IntN(4))
	}
}

// FuzzNestingLimit holds prescan to checkPrescan's slow references under
// limits from 1 to 255 (0 meaning DefaultMaxDepth), and Parse to short
// errors.
func FuzzNestingLimit(f *testing.F) {
	for _, s := range []string{
		`[]`, `[[[]]]`, `{"a":{"a":{}}}`, `[{"a":[{}]}]`, `"x"`, `1`, `null`, ``,
		`["[[[["]`, `{"[[":"{{"}`, `["\"[[[", "\\"]`, `["\\", [[[]]]]`, `["\\\"[[", [[1]]]`,
		`[tru]`, `[[[nul`, `[fals, [[[]]]]`, `[[[[[[[[[[[[[[[[[[[`, `]]]][[[[`, `"[[[[`,
		`[1e5, -0.5E+3, true, false, null, "\u005b"]`, `[01]`, `[1.]`, `[-]`, `[1e+]`, `[1-2]`, `[NaN, Infinity]`,
		`["\ud800"]`, `["\u12"]`, `["\x"]`, "[\"\t\"]", "[\"\\n\t\"]", "[\"a\x00\"]", `{"a" 1}`, `[1,]`, `{"a":1,}`,
		withExtra(nest(10, "[", "]", "")), withExtra(nest(10, `{"a":`, "}", "1")),
		strings.Repeat("[", 300),
	} {
		for _, lim := range []uint8{0, 1, 2, 3, 5, 64} {
			f.Add([]byte(s), lim)
		}
	}
	f.Fuzz(func(t *testing.T, body []byte, limit uint8) {
		lim := Limits{MaxDepth: int(limit)}
		checkPrescan(t, body, lim.maxDepth())
		for _, ep := range []Endpoint{Chat, Completion} {
			r, err := Parse(ep, body, lim)
			if err == nil {
				r.Recycle()
				continue
			}
			if len(err.Error()) > maxErrorLen {
				t.Fatalf("parse error of %d bytes", len(err.Error()))
			}
		}
	})
}

// hostileBodies are the bodies BenchmarkNestingRejected sweeps, of about
// size bytes: runs of "[" and of `{"a":` (refused after 65 levels), an
// allowed body of many nests 60 deep (parsed), and that body with one nest
// too deep at its end (refused after scanning it all).
func hostileBodies(size int) []struct {
	name string
	body []byte
	ok   bool
} {
	var allowed strings.Builder
	allowed.WriteString(`{"model":"m","messages":[{"role":"user","content":"x"}],"extra":[`)
	unit := nest(DefaultMaxDepth-4, "[", "]", `{"a":"[[["}`) + ","
	for allowed.Len() < size-len(unit) {
		allowed.WriteString(unit)
	}
	late := allowed.String() + nest(DefaultMaxDepth, "[", "]", "") + "]}"
	allowed.WriteString("1]}")
	return []struct {
		name string
		body []byte
		ok   bool
	}{
		{"brackets", bytes.Repeat([]byte("["), size), false},
		{"objects", bytes.Repeat([]byte(`{"a":`), size/5), false},
		{"allowed", []byte(allowed.String()), true},
		{"deep_at_end", []byte(late), false},
	}
}

// BenchmarkNestingRejected parses hostile bodies of 10 KB, 100 KB and 1 MB.
// Time per body must grow at most linearly with its size (MB/s flat or
// rising); bodies refused early cost the same at every size. The value
// limit is lifted, so that nesting alone is measured.
func BenchmarkNestingRejected(b *testing.B) {
	lim := Limits{MaxValues: 1 << 30}
	for _, size := range []int{10 << 10, 100 << 10, 1 << 20} {
		for _, h := range hostileBodies(size) {
			b.Run(fmt.Sprintf("%s/%dKB", h.name, size>>10), func(b *testing.B) {
				b.SetBytes(int64(len(h.body)))
				b.ReportAllocs()
				for b.Loop() {
					r, err := ParseChat(h.body, lim)
					if (err == nil) != h.ok {
						b.Fatalf("err = %.200v", err)
					}
					if r != nil {
						r.Recycle()
					}
				}
			})
		}
	}
}

// benchBodies are realistic bodies for the scan and parse benchmarks.
func benchBodies(tb testing.TB) map[string][]byte {
	var ids strings.Builder
	ids.WriteString(`{"model":"m","prompt":[`)
	for i := range 100000 {
		if i > 0 {
			ids.WriteByte(',')
		}
		ids.WriteString(fmt.Sprint(i * 7919 % 151936))
	}
	ids.WriteString("]}")
	var code strings.Builder
	for i := range 20000 {
		fmt.Fprintf(&code, "func f%d(x []int) map[string]int { return map[string]int{\"a\": x[%d]} }\n", i, i)
	}
	var turns []map[string]any
	for i := range 100 {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		turns = append(turns, map[string]any{"role": role, "content": fmt.Sprintf("turn %d says a few words.\nAnd a second line.", i)})
	}
	return map[string][]byte{
		"conversation": chatBodyJSON(tb, turns...), // BenchmarkParseConversation's
		"content_1MB":  chatBodyJSON(tb, msg("system", strings.Repeat("You are a helpful assistant. ", 36000)), msg("user", "q")),
		"code_1MB":     chatBodyJSON(tb, msg("user", code.String())),
		"token_ids":    []byte(ids.String()),
	}
}

// BenchmarkPrescan measures the nesting scan alone on realistic bodies.
func BenchmarkPrescan(b *testing.B) {
	for name, body := range benchBodies(b) {
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if err := prescan(body, DefaultMaxDepth); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkParseLarge parses the same realistic bodies whole.
func BenchmarkParseLarge(b *testing.B) {
	for name, body := range benchBodies(b) {
		b.Run(name, func(b *testing.B) {
			ep := Chat
			if name == "token_ids" {
				ep = Completion
			}
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				r, err := Parse(ep, body, Limits{})
				if err != nil {
					b.Fatal(err)
				}
				r.Recycle()
			}
		})
	}
}

// TestValuesBounded: a body's values are counted in the pre-scan and
// refused past Limits.MaxValues; large bodies take their values from a
// shared Budget until Recycle; a token-id prompt is one prompt, however
// long, for MaxMessages.
func TestValuesBounded(t *testing.T) {
	ids := func(n int) []byte {
		return []byte(`{"model":"m","prompt":[` + strings.Repeat("7,", n-1) + `7]}`)
	}
	lim := Limits{MaxMessages: 4, MaxValues: 10000, Budget: NewBudget(15000)}
	// {"model":"m","prompt":[...]}: the object, two keys, "m", the array.
	full, err := ParseCompletion(ids(10000-5), lim)
	if err != nil {
		t.Fatalf("10,000 values with a limit of 10,000: %v", err)
	}
	full.Recycle()
	if _, err := ParseCompletion(ids(10000-4), lim); err == nil || !strings.Contains(err.Error(), "more values than the limit of 10000") {
		t.Fatalf("10,001 values: %v", err)
	}
	a, err := ParseCompletion(ids(8000), lim)
	if err != nil || lim.Budget.Used() != 8005 {
		t.Fatalf("first large body: %v, budget used %d", err, lim.Budget.Used())
	}
	if _, err := ParseCompletion(ids(8000), lim); err != ErrBusy {
		t.Fatalf("second large body over the budget: %v", err)
	}
	small, err := ParseCompletion(ids(BudgetFloor-5), lim)
	if err != nil || lim.Budget.Used() != 8005 {
		t.Fatalf("a body under the floor takes from the budget: %v, used %d", err, lim.Budget.Used())
	}
	small.Recycle()
	a.Recycle()
	a.Recycle()
	if lim.Budget.Used() != 0 {
		t.Fatalf("budget used %d after release", lim.Budget.Used())
	}
	b, err := ParseCompletion(ids(8000), lim)
	if err != nil || len(b.Parts) != 1 || b.Parts[0].Tokens != 8000 {
		t.Fatalf("after release: %v", err)
	}
	b.Recycle()
}

// BenchmarkManyValues parses bodies of small values ("1,") of 10 KB to
// 16 MB under the default limits: up to DefaultMaxValues they are parsed,
// past it refused after a scan of the first DefaultMaxValues values, so no
// body costs more than the largest allowed one.
func BenchmarkManyValues(b *testing.B) {
	for _, size := range []int{10 << 10, 100 << 10, 1 << 20, 16 << 20} {
		body := []byte(`{"model":"m","prompt":[` + strings.Repeat("1,", size/2) + `1]}`)
		b.Run(fmt.Sprintf("%dKB", size>>10), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				r, err := ParseCompletion(body, Limits{})
				if (err == nil) != (size/2 < DefaultMaxValues) {
					b.Fatalf("err = %.200v", err)
				}
				if r != nil {
					r.Recycle()
				}
			}
		})
	}
}

// Admit holds what the router reads from replicas to a client body's
// bounds: values, nesting, and the shared budget, given back once.
func TestAdmitBoundsOtherJSON(t *testing.T) {
	million := []byte(`{"kv_transfer_params":{"remote_block_ids":[` + strings.Repeat("1,", 999_999) + `1]}}`)
	if _, err := Admit(million, Limits{}); err == nil {
		t.Fatal("an answer of a million values was admitted")
	}
	if _, err := Admit([]byte(strings.Repeat("[", 100)+strings.Repeat("]", 100)), Limits{}); err == nil {
		t.Fatal("an answer nested 100 deep was admitted")
	}
	b := NewBudget(3 * BudgetFloor)
	large := []byte(`[` + strings.Repeat("1,", 2*BudgetFloor) + `1]`)
	release, err := Admit(large, Limits{Budget: b})
	if err != nil || b.Used() == 0 {
		t.Fatalf("a large answer: %v, %d values held", err, b.Used())
	}
	if _, err := Admit(large, Limits{Budget: b}); !errors.Is(err, ErrBusy) {
		t.Fatalf("a second large answer past the budget: %v, want ErrBusy", err)
	}
	release()
	release()
	if b.Used() != 0 {
		t.Fatalf("%d values held after release", b.Used())
	}
	small, err := Admit([]byte(`{"usage":{"prompt_tokens":3}}`), Limits{Budget: b})
	if err != nil || b.Used() != 0 {
		t.Fatalf("a small answer: %v, %d held", err, b.Used())
	}
	small()
}
