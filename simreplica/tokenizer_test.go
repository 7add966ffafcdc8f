package simreplica

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
)

func mustTokenizer(t testing.TB, name string) *Tokenizer {
	t.Helper()
	tok, err := NewTokenizer(name, 0)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// routerProse is the prose cmd/router's end-to-end tests send (its text
// function): about tokens×4 bytes that differ with seed.
func routerProse(seed string, tokens int) string {
	var sb strings.Builder
	for i := 0; sb.Len() < tokens*4; i++ {
		fmt.Fprintf(&sb, "%s sentence %d of the document. ", seed, i)
	}
	return sb.String()[:tokens*4]
}

// englishProse is ordinary English text.
const englishProse = `The old lighthouse stood at the edge of the harbour, its white paint
peeling after decades of salt and wind. Every evening the keeper climbed the
spiral stairs, checked the lamp, and wrote a short note in the logbook: the
weather, the ships that passed, and anything unusual he had seen on the water.
Most nights were quiet. Fishing boats returned before dark, the ferry crossed
twice, and the gulls settled on the rocks below. But in the autumn storms the
sea changed completely; waves broke over the pier, the windows rattled, and the
light became the only thing that sailors could trust. Years later, when the
lighthouse was automated, the logbooks were given to the town library, where
children still read them and imagine the long nights of the keeper's watch.`

func TestTokenizerDeterministic(t *testing.T) {
	texts := []string{
		"", "Hello, world!", englishProse, routerProse("tenant 3", 500),
		"naïve café — ünïcödé", strings.Repeat("x", 1000), "a\n\n\tb  c   d",
		`{"model":"m","messages":[{"role":"user","content":"hi"}]}`,
	}
	a, b := mustTokenizer(t, TokenizerWords), mustTokenizer(t, TokenizerWords)
	for _, text := range texts {
		x, y := a.Encode(nil, []byte(text), true), b.Encode(nil, []byte(text), true)
		if !slices.Equal(x, y) {
			t.Fatalf("%.40q: two tokenizers disagree", text)
		}
		if x[0] != TokenBOS {
			t.Fatalf("%.40q: first id %d, want BOS", text, x[0])
		}
		for _, id := range x[1:] {
			if id < firstPieceID || id >= WordVocabSize {
				t.Fatalf("%.40q: id %d outside [%d, %d)", text, id, firstPieceID, WordVocabSize)
			}
		}
		if got := a.Encode(nil, []byte(text), false); !slices.Equal(got, x[1:]) {
			t.Fatalf("%.40q: without special tokens %v, want %v", text, got, x[1:])
		}
	}
	// The ids are a pure function of the text, in every process and
	// version: a change here changes every cached block and KV event.
	got := a.Encode(nil, []byte("Hello, world! It's doc-0."), false)
	want := []int32{pieceID([]byte("Hello,"), WordVocabSize), pieceID([]byte(" world!"), WordVocabSize),
		pieceID([]byte(" It's"), WordVocabSize), pieceID([]byte(" doc-0."), WordVocabSize)}
	if !slices.Equal(got, want) {
		t.Fatalf("ids %v, want %v", got, want)
	}
	if pinned := []int32{41404, 16388, 579, 49567}; !slices.Equal(got, pinned) {
		t.Fatalf("ids %v, pinned %v: the piece hash changed", got, pinned)
	}
}

func TestTokenizerPieces(t *testing.T) {
	cases := []struct {
		text string
		want []string
	}{
		{"Hello, world!", []string{"Hello,", " world!"}},
		{"It's doc-0's 3.14 test.", []string{"It's", " doc-0's", " 3.14", " test."}},
		{"a\n\n  b", []string{"a", "\n\n ", " b"}},
		{"(see [1]) x", []string{"(", "see", " [", "1])", " x"}},
		{"---- ====", []string{"----", " ===="}},
		{"abcdefghijklmnopqrstuvwxyz", []string{"abcdefghijkl", "mnopqrstuvwx", "yz"}},
		{" <|eot_id|>x<|begin_of_text|>", []string{" ", "<|eot_id|>", "x", "<|begin_of_text|>"}},
		{"<<|eot_id|>", []string{"<", "<|eot_id|>"}},
		{"<|nope|>", []string{"<", "|", "nope", "|", ">"}},
		{"tab\there", []string{"tab", "\t", "here"}},
	}
	tok := mustTokenizer(t, TokenizerWords)
	for _, tc := range cases {
		ids, strs := tok.EncodePieces([]byte(tc.text), false)
		if !slices.Equal(strs, tc.want) || len(ids) != len(strs) {
			t.Errorf("%q: pieces %q, want %q", tc.text, strs, tc.want)
		}
		if strings.Join(strs, "") != tc.text {
			t.Errorf("%q: pieces do not join to the text: %q", tc.text, strs)
		}
	}
	if ids := tok.Encode(nil, []byte("<|eot_id|><|start_header_id|>"), false); !slices.Equal(ids, []int32{TokenEOT, TokenStartHeader}) {
		t.Errorf("special tokens: %v", ids)
	}
}

// TestBytesPerToken: the words tokenizer makes clearly more than the 4
// bytes per token a router estimates, on the prose cmd/router's tests send
// and on ordinary English; the bytes tokenizer makes exactly BytesPerToken.
func TestBytesPerToken(t *testing.T) {
	words, bytes4 := mustTokenizer(t, TokenizerWords), mustTokenizer(t, TokenizerBytes)
	var totalBytes, totalTokens int
	for _, tc := range []struct {
		name, text string
		lo, hi     float64
	}{
		{"english", strings.Repeat(englishProse+"\n\n", 4), 5.0, 6.5},
		{"router prose: tenant 3", routerProse("tenant 3", 1000), 5.0, 6.5},
		{"router prose: system-0", routerProse("system-0", 300), 5.0, 6.5},
		{"router prose: doc-0", routerProse("doc-0", 1700), 5.0, 6.5},
		{"router prose: global system prompt", routerProse("global system prompt", 1000), 5.0, 6.5},
		{"router prose: unique request 7", routerProse("unique request 7", 200), 5.0, 6.5},
		{"router prose: question 3 4", routerProse("question 3 4", 30), 4.8, 6.5},
	} {
		n := len(words.Encode(nil, []byte(tc.text), false))
		bpt := float64(len(tc.text)) / float64(n)
		t.Logf("%-36s %6d bytes %5d tokens: %.2f bytes per token", tc.name, len(tc.text), n, bpt)
		if bpt < tc.lo || bpt > tc.hi {
			t.Errorf("%s: %.2f bytes per token, want in [%.1f, %.1f]", tc.name, bpt, tc.lo, tc.hi)
		}
		if m := len(bytes4.Encode(nil, []byte(tc.text), false)); m != (len(tc.text)+3)/4 {
			t.Errorf("%s: bytes tokenizer %d tokens for %d bytes", tc.name, m, len(tc.text))
		}
		if tc.name != "english" {
			totalBytes += len(tc.text)
			totalTokens += n
		}
	}
	t.Logf("router prose overall: %.2f bytes per token", float64(totalBytes)/float64(totalTokens))
}

func TestDecode(t *testing.T) {
	tok := mustTokenizer(t, TokenizerWords)
	for _, text := range []string{"Hello, world!", englishProse, "a\n\n  b <|eot_id|> c"} {
		ids := tok.Encode(nil, []byte(text), true)
		got, err := tok.Decode(ids)
		if err != nil || got != "<|begin_of_text|>"+text {
			t.Errorf("Decode(Encode(%.30q)) = %.60q, %v", text, got, err)
		}
	}
	if got, err := tok.Decode([]int32{pieceID([]byte(" never-encoded-piece"), WordVocabSize)}); err != nil || !strings.HasPrefix(got, "<unk_") {
		t.Errorf("unseen id: %q %v", got, err)
	}
	for _, ids := range [][]int32{{0}, {-1}, {WordVocabSize}} {
		if _, err := tok.Decode(ids); err == nil {
			t.Errorf("Decode(%v): no error", ids)
		}
	}
	if _, err := mustTokenizer(t, TokenizerBytes).Decode([]int32{9}); err == nil {
		t.Error("the bytes tokenizer decoded")
	}
	if _, err := NewTokenizer("bpe", 0); err == nil {
		t.Error("NewTokenizer accepted an unknown name")
	}
}

func TestChatTemplate(t *testing.T) {
	body := `{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[
		{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"Bye"}]}`
	req, err := blockhash.ParseChat([]byte(body), blockhash.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	defer req.Recycle()
	const (
		head = `<|begin_of_text|>` +
			`<|start_header_id|>system<|end_header_id|>` + "\n\n" + `Available tools: [{"type":"function","function":{"name":"f"}}]<|eot_id|>` +
			`<|start_header_id|>system<|end_header_id|>` + "\n\nBe brief.<|eot_id|>" +
			`<|start_header_id|>user<|end_header_id|>` + "\n\nHi<|eot_id|>" +
			`<|start_header_id|>assistant<|end_header_id|>` + "\n\nHello<|eot_id|>" +
			`<|start_header_id|>user<|end_header_id|>` + "\n\nBye"
		gen = `<|start_header_id|>assistant<|end_header_id|>` + "\n\n"
	)
	words := mustTokenizer(t, TokenizerWords)
	for _, tc := range []struct {
		name      string
		gen, cont bool
		want      string
	}{
		{"generation prompt", true, false, head + "<|eot_id|>" + gen},
		{"no generation prompt", false, false, head + "<|eot_id|>"},
		{"continue final message", false, true, head},
	} {
		if got := string(words.RenderChat(nil, req.Parts, tc.gen, tc.cont)); got != tc.want {
			t.Errorf("%s:\n got %q\nwant %q", tc.name, got, tc.want)
		}
	}
	// The template's markers are single special tokens.
	ids := words.Encode(nil, words.RenderChat(nil, req.Parts, true, false), false)
	if ids[0] != TokenBOS || ids[1] != TokenStartHeader || ids[len(ids)-1] == TokenEOT {
		t.Errorf("template ids %v", ids)
	}
	if n := strings.Count(head+"<|eot_id|>"+gen, "<|"); countSpecial(ids) != n {
		t.Errorf("%d special tokens, want %d", countSpecial(ids), n)
	}
	// The bytes tokenizer keeps the old markers.
	if got := string(mustTokenizer(t, TokenizerBytes).RenderChat(nil, req.Parts[1:3], true, false)); got != "<|s|>Be brief.<|u|>Hi" {
		t.Errorf("bytes template %q", got)
	}
}

func countSpecial(ids []int32) (n int) {
	for _, id := range ids {
		if id < firstPieceID {
			n++
		}
	}
	return n
}

func BenchmarkWordsEncode(b *testing.B) {
	tok := mustTokenizer(b, TokenizerWords)
	text := []byte(routerProse("tenant 3", 2000))
	var ids []int32
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	for b.Loop() {
		ids = tok.Encode(ids[:0], text, true)
	}
}

func BenchmarkBytesPromptAndLookup(b *testing.B) {
	s, err := New(fast)
	if err != nil {
		b.Fatal(err)
	}
	req, err := blockhash.ParseChat([]byte(chatBody(routerProse("tenant 3", 2000), "question")), blockhash.Limits{})
	if err != nil {
		b.Fatal(err)
	}
	m, _ := s.model("sim-model")
	var (
		ids  []int32
		buf  []byte
		keys []uint64
	)
	b.ReportAllocs()
	for b.Loop() {
		ids, buf = s.tok.promptIDs(ids, buf, req, blockhash.Chat, chatOptions{})
		keys, _, _ = s.lookup(ids, m, keys)
	}
}
