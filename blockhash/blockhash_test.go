package blockhash

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

func mustSplitter(t testing.TB, o Options) *Splitter {
	t.Helper()
	s, err := NewSplitter(o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func chatBodyJSON(t testing.TB, msgs ...map[string]any) []byte {
	t.Helper()
	b, err := json.Marshal(map[string]any{"model": "m", "messages": msgs})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func msg(role, content string) map[string]any {
	return map[string]any{"role": role, "content": content}
}

func TestParseErrors(t *testing.T) {
	lim := Limits{MaxMessages: 3}
	cases := []struct {
		name, body string
		ep         Endpoint
		field      string
	}{
		{"empty", ``, Chat, ""},
		{"not json", `{"model":`, Chat, ""},
		{"no model", `{"messages":[{"role":"user","content":"x"}]}`, Chat, "model"},
		{"no messages", `{"model":"m"}`, Chat, "messages"},
		{"empty messages", `{"model":"m","messages":[]}`, Chat, "messages"},
		{"too many", `{"model":"m","messages":[{"role":"user","content":"x"},{"role":"user","content":"x"},{"role":"user","content":"x"},{"role":"user","content":"x"}]}`, Chat, "messages"},
		{"bad role", `{"model":"m","messages":[{"role":"wizard","content":"x"}]}`, Chat, "messages[0].role"},
		{"missing role", `{"model":"m","messages":[{"content":"x"}]}`, Chat, "messages[0].role"},
		{"bad content", `{"model":"m","messages":[{"role":"user","content":5}]}`, Chat, "messages[0].content"},
		{"bad part", `{"model":"m","messages":[{"role":"user","content":[5]}]}`, Chat, "messages[0].content[0]"},
		{"tools object", `{"model":"m","tools":{},"messages":[{"role":"user","content":"x"}]}`, Chat, "tools"},
		{"negative max", `{"model":"m","max_tokens":-1,"messages":[{"role":"user","content":"x"}]}`, Chat, "max_tokens"},
		{"no prompt", `{"model":"m"}`, Completion, "prompt"},
		{"prompt number", `{"model":"m","prompt":5}`, Completion, "prompt"},
		{"prompt empty array", `{"model":"m","prompt":[]}`, Completion, "prompt"},
		{"prompt mixed", `{"model":"m","prompt":[1,"a"]}`, Completion, "prompt"},
		{"prompt bad item", `{"model":"m","prompt":["a",1]}`, Completion, "prompt[1]"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(tc.ep, []byte(tc.body), lim)
			var ie *InputError
			if !errors.As(err, &ie) {
				t.Fatalf("err = %v, want *InputError", err)
			}
			if ie.Field != tc.field {
				t.Fatalf("field = %q, want %q (%v)", ie.Field, tc.field, err)
			}
		})
	}
}

func TestParseChatOrderAndKinds(t *testing.T) {
	body := `{"model":"m","user":"alice","stream":true,"max_tokens":7,
	  "tools":[{"type":"function","function":{"name":"f"}}],
	  "messages":[
	    {"role":"system","content":"be nice"},
	    {"role":"user","content":[{"type":"text","text":"hello "},{"type":"text","text":"there"}]},
	    {"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]},
	    {"role":"tool","content":"42","tool_call_id":"1"},
	    {"role":"user","name":"bob","content":"and now?"}]}`
	r, err := ParseChat([]byte(body), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if r.Model != "m" || r.User != "alice" || !r.Stream || r.MaxTokens != 7 {
		t.Fatalf("header fields: %+v", r)
	}
	want := []struct {
		role byte
		kind Kind
		text string
	}{
		{RoleTools, KindTools, `[{"type":"function","function":{"name":"f"}}]`},
		{RoleSystem, KindSystem, "be nice"},
		{RoleUser, KindUserHistory, "hello there"},
		{RoleAssistant, KindAssistantHistory, "\x00f\x00{}"},
		{RoleTool, KindToolOutput, "42"},
		{RoleUser, KindUserQuery, "bob\x00and now?"},
	}
	if len(r.Parts) != len(want) {
		t.Fatalf("got %d parts, want %d", len(r.Parts), len(want))
	}
	for i, w := range want {
		p := r.Parts[i]
		if p.Role != w.role || p.Base != w.kind || string(p.Text) != w.text {
			t.Errorf("part %d = {%c %v %q}, want {%c %v %q}", i, p.Role, p.Base, p.Text, w.role, w.kind, w.text)
		}
	}
	if got := AssistantText("", [][2]string{{"f", "{}"}}); string(got) != string(r.Parts[3].Text) {
		t.Errorf("AssistantText = %q, want %q", got, r.Parts[3].Text)
	}
}

func TestParseCompletionForms(t *testing.T) {
	s := mustSplitter(t, Options{BlockTokens: 2})
	cases := []struct {
		body   string
		parts  int
		blocks int
	}{
		{`{"model":"m","prompt":"abcdefghij"}`, 1, 2},    // 10 bytes / 8-byte blocks
		{`{"model":"m","prompt":["abcd","efgh"]}`, 2, 2}, // one block each
		{`{"model":"m","prompt":[1,2,3,4,5]}`, 1, 3},     // 2 tokens a block
		{`{"model":"m","prompt":[[1,2,3],[4]]}`, 2, 3},   // 2 + 1
		{`{"model":"m","prompt":["x"],"max_tokens":3}`, 1, 1},
	}
	for _, tc := range cases {
		r, err := ParseCompletion([]byte(tc.body), Limits{})
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		if len(r.Parts) != tc.parts {
			t.Errorf("%s: %d parts, want %d", tc.body, len(r.Parts), tc.parts)
		}
		if got := len(s.Split(nil, r)); got != tc.blocks {
			t.Errorf("%s: %d blocks, want %d", tc.body, got, tc.blocks)
		}
	}
}

func TestTokenBlocksCountTokens(t *testing.T) {
	s := mustSplitter(t, Options{BlockTokens: 4, BytesPerToken: 3})
	r := &Request{Model: "m", Parts: []Part{TokenPart([]int32{1, 2, 3, 4, 5, 6})}}
	bl := s.Split(nil, r)
	if len(bl) != 2 || bl[0].Tokens != 4 || bl[1].Tokens != 2 {
		t.Fatalf("blocks = %+v, want tokens 4 and 2", bl)
	}
}

func TestChainProperties(t *testing.T) {
	s := mustSplitter(t, Options{BlockTokens: 4}) // 16-byte blocks
	base := []map[string]any{
		msg("system", strings.Repeat("S", 40)),
		msg("user", strings.Repeat("a", 33)),
		msg("assistant", strings.Repeat("b", 20)),
		msg("user", "question?"),
	}
	split := func(msgs []map[string]any, model string) []Block {
		b := chatBodyJSON(t, msgs...)
		if model != "m" {
			b = []byte(strings.Replace(string(b), `"model":"m"`, `"model":"`+model+`"`, 1))
		}
		r, err := ParseChat(b, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		return s.Split(nil, r)
	}
	ref := split(base, "m")
	// 40 bytes → 3 blocks, 33 → 3, 20 → 2, 9 → 1.
	if len(ref) != 9 {
		t.Fatalf("got %d blocks, want 9", len(ref))
	}
	again := split(base, "m")
	for i := range ref {
		if ref[i] != again[i] {
			t.Fatalf("block %d not deterministic", i)
		}
	}
	if other := split(base, "m2"); other[0].Hash == ref[0].Hash {
		t.Fatal("model name does not seed the chain")
	}
	// Changing message 2 (the assistant, blocks 6..7) keeps blocks 0..5.
	changed := append([]map[string]any{}, base...)
	changed[2] = msg("assistant", strings.Repeat("b", 19)+"c")
	got := split(changed, "m")
	for i := range ref {
		same := got[i].Hash == ref[i].Hash
		if same != (i < 7) { // the assistant's first 16 bytes are unchanged
			t.Errorf("block %d: same=%v", i, same)
		}
	}
	// The same text under another role is another block.
	roleSwap := append([]map[string]any{}, base...)
	roleSwap[1] = msg("system", strings.Repeat("a", 33))
	if got := split(roleSwap, "m"); got[3].Hash == ref[3].Hash {
		t.Error("role marker not part of the hash")
	}
}

func TestKindsHeuristics(t *testing.T) {
	s := mustSplitter(t, Options{}) // 256-byte blocks
	doc := "<document>" + strings.Repeat("Paris is the capital of France. ", 40) + "</document>\n"
	code := "```go\n" + strings.Repeat("func f(x int) int { return x*2; }\n", 20) + "```\n"
	r, err := ParseChat(chatBodyJSON(t,
		msg("system", "You are helpful."),
		msg("user", code+"why does this fail?"),
		msg("assistant", "Because."),
		msg("tool", "result"),
		msg("user", doc+"What is the capital of France?"),
	), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	bl := s.Split(nil, r)
	count := map[Kind]int{}
	for _, b := range bl {
		count[b.Kind]++
	}
	if count[KindSystem] != 1 || count[KindAssistantHistory] != 1 || count[KindToolOutput] != 1 {
		t.Errorf("role kinds: %v", count)
	}
	if count[KindCode] < 3 {
		t.Errorf("code blocks = %d, want ≥3 (%v)", count[KindCode], count)
	}
	if count[KindRetrievedContext] < 4 {
		t.Errorf("retrieved blocks = %d, want ≥4 (%v)", count[KindRetrievedContext], count)
	}
	if last := bl[len(bl)-1]; last.Kind != KindUserQuery {
		t.Errorf("last block kind = %v, want user_query", last.Kind)
	}
}

// TestLooksLikeCodeCounts checks the table-driven symbol count against the
// heuristic's definition (≥ 3 line breaks and ≥ 1 in 12 bytes one of
// {};=<>()[]), on blocks around the threshold.
func TestLooksLikeCodeCounts(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []byte("{};=<>()[]\nab c")
	for range 20000 {
		b := make([]byte, rng.IntN(300))
		for i := range b {
			if rng.IntN(8) == 0 {
				b[i] = alphabet[rng.IntN(len(alphabet))]
			} else {
				b[i] = 'a' + byte(rng.IntN(26))
			}
		}
		sym, nl := 0, 0
		for _, c := range b {
			if strings.IndexByte("{};=<>()[]", c) >= 0 {
				sym++
			}
			if c == '\n' {
				nl++
			}
		}
		want := nl >= 3 && sym*12 >= len(b)
		if got := looksLikeCode(b, false); got != want {
			t.Fatalf("looksLikeCode(%q) = %v, want %v (%d symbols, %d newlines)", b, got, want, sym, nl)
		}
	}
}

func TestKindNames(t *testing.T) {
	for k := Kind(0); k < NumKinds; k++ {
		got, err := ParseKind(k.String())
		if err != nil || got != k {
			t.Errorf("ParseKind(%q) = %v, %v", k.String(), got, err)
		}
	}
	if _, err := ParseKind("nope"); err == nil {
		t.Error("ParseKind accepted an unknown name")
	}
}

func TestNewSplitterValidates(t *testing.T) {
	for _, o := range []Options{{BlockTokens: -1}, {BytesPerToken: 100}} {
		if _, err := NewSplitter(o); err == nil {
			t.Errorf("NewSplitter(%+v) accepted", o)
		}
	}
}

func TestSplitDoesNotAllocate(t *testing.T) {
	s := mustSplitter(t, Options{})
	r, err := ParseChat(chatBodyJSON(t, msg("system", strings.Repeat("x", 10000)), msg("user", "q")), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	dst := make([]Block, 0, 1024)
	if n := testing.AllocsPerRun(50, func() { dst = s.Split(dst[:0], r) }); n != 0 {
		t.Fatalf("Split allocates %v times per call", n)
	}
}

// FuzzParseSplit: any input parses or returns an *InputError; a parsed
// request splits deterministically; and changing the last part's text changes
// only blocks from that part on.
func FuzzParseSplit(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"system","content":"hi"},{"role":"user","content":"q"}]}`), true)
	f.Add([]byte(`{"model":"m","tools":[{"a":1}],"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url","image_url":{"url":"u"}}]}]}`), true)
	f.Add([]byte(`{"model":"m","prompt":["a","b"]}`), false)
	f.Add([]byte(`{"model":"m","prompt":[[1,2],[3]]}`), false)
	f.Add([]byte(`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}]}`), true)
	s := mustSplitter(f, Options{BlockTokens: 2, BytesPerToken: 2})
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		ep := Completion
		if chat {
			ep = Chat
		}
		r, err := Parse(ep, body, Limits{MaxMessages: 64})
		if err != nil {
			var ie *InputError
			if !errors.As(err, &ie) {
				t.Fatalf("error of type %T: %v", err, err)
			}
			return
		}
		a := s.Split(nil, r)
		b := s.Split(nil, r)
		if len(a) == 0 || len(a) != len(b) {
			t.Fatalf("split lengths %d, %d", len(a), len(b))
		}
		if n := s.Count(r); n != len(a) {
			t.Fatalf("Count = %d, Split made %d blocks", n, len(a))
		}
		tokens := 0
		for i := range a {
			if a[i] != b[i] {
				t.Fatalf("block %d not deterministic", i)
			}
			tokens += int(a[i].Tokens)
		}
		estimate := 0
		for i := range r.Parts {
			p, n := &r.Parts[i], 0
			p.EachSeg(func(from, to int) { n += s.segTokens(p, to-from) })
			estimate += max(n, 1)
		}
		if tokens != estimate {
			t.Fatalf("blocks hold %d tokens, the parts' estimate is %d", tokens, estimate)
		}
		// Change the last part: blocks of earlier parts keep their hashes.
		last := len(r.Parts) - 1
		before := 0
		for i := 0; i < last; i++ {
			before += len(s.AppendPart(nil, 0, &r.Parts[i]))
		}
		r.Parts[last].Text = append(append([]byte{}, r.Parts[last].Text...), 'Z')
		if r.Parts[last].Role == RoleTokens {
			r.Parts[last].Tokens++
			r.Parts[last].Text = append(r.Parts[last].Text, 0, 0, 0)
		}
		c := s.Split(nil, r)
		for i := range c {
			if i < before && c[i].Hash != a[i].Hash {
				t.Fatalf("block %d of an unchanged part changed", i)
			}
		}
		if c[len(c)-1].Hash == a[len(a)-1].Hash {
			t.Fatal("changing the last part left its last hash unchanged")
		}
	})
}

// BenchmarkChainHash measures hashing one 64-token (256-byte) block.
func BenchmarkChainHash(b *testing.B) {
	block := []byte(strings.Repeat("x", 256))
	b.SetBytes(int64(len(block)))
	b.ReportAllocs()
	var h uint64
	for i := 0; i < b.N; i++ {
		h = ChainHash(h, RoleUser, block)
	}
}

// BenchmarkParseConversation parses a 100-message conversation: the cost
// per message, which field names for errors must not add to.
func BenchmarkParseConversation(b *testing.B) {
	var msgs []map[string]any
	for i := range 100 {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, map[string]any{"role": role, "content": fmt.Sprintf("turn %d says a few words.\nAnd a second line.", i)})
	}
	body := chatBodyJSON(b, msgs...)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		r, err := ParseChat(body, Limits{})
		if err != nil {
			b.Fatal(err)
		}
		r.Recycle()
	}
}
