package blockhash

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// A document sent as a content part is a segment of its own: its blocks
// have the same Seg keys after any system prompt and in any order, while
// their prefix Hashes differ; and a document that is not the message's
// last part is retrieved context to its last block.
func TestSegmentKeysArePositionIndependent(t *testing.T) {
	docA := strings.Repeat("alpha document about rivers and their deltas. ", 40) // ~1,900 bytes
	docB := strings.Repeat("bravo document on the history of printing. ", 40)
	body := func(system string, docs ...string) []byte {
		var parts []map[string]string
		for _, d := range docs {
			parts = append(parts, map[string]string{"type": "text", "text": d})
		}
		parts = append(parts, map[string]string{"type": "text", "text": "What do they say?"})
		b, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]any{
			{"role": "system", "content": system}, {"role": "user", "content": parts}}})
		return b
	}
	s, _ := NewSplitter(Options{Segments: true})
	blocks := func(b []byte) []Block {
		r, err := Parse(Chat, b, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Recycle()
		return s.Split(nil, r)
	}
	// segKeys maps each retrieved-context block's Seg to its Hash.
	segKeys := func(bl []Block) map[uint64]uint64 {
		m := map[uint64]uint64{}
		for _, b := range bl {
			if b.Seg == 0 {
				t.Fatal("a block without a segment key")
			}
			if b.Kind == KindRetrievedContext {
				m[b.Seg] = b.Hash
			}
		}
		return m
	}
	one := segKeys(blocks(body("You are terse.", docA, docB)))
	two := segKeys(blocks(body("You are a helpful assistant for a library.", docB, docA)))
	docBlocks := (len(docA)+255)/256 + (len(docB)+255)/256
	if len(one) != docBlocks || len(two) != docBlocks {
		t.Fatalf("retrieved-context blocks: %d and %d, want %d (both documents whole)", len(one), len(two), docBlocks)
	}
	for seg, h := range one {
		h2, ok := two[seg]
		if !ok {
			t.Fatal("a document block's segment key changed with its position")
		}
		if h2 == h {
			t.Fatal("a prefix hash did not change with what precedes the block")
		}
	}
	// Off, no segment keys; the prefix hashes are the same either way.
	plain, _ := NewSplitter(Options{})
	r, _ := Parse(Chat, body("You are terse.", docA, docB), Limits{})
	defer r.Recycle()
	a, b := plain.Split(nil, r), s.Split(nil, r)
	for i := range a {
		if a[i].Seg != 0 || a[i].Hash != b[i].Hash || a[i].Kind != b[i].Kind {
			t.Fatalf("block %d: %+v without segments, %+v with", i, a[i], b[i])
		}
	}
}

// In precise mode the engine's token blocks of a document get mostly the
// same segment keys after another system prompt, at another offset and
// in another order; the instruction and the question get none; and it
// does not allocate.
func TestTokenSegmentKeys(t *testing.T) {
	words := func(tag string, n int) string {
		var b strings.Builder
		for i := range n {
			fmt.Fprintf(&b, "%s%d ", tag, i*7%1000)
		}
		return b.String()
	}
	docA, docB := words("a", 300), words("b", 200)
	type prompt struct {
		r    *Request
		ids  []int32
		docs map[string][2]int // a document's first and last id
	}
	build := func(system string, docs ...string) prompt {
		var parts []map[string]string
		parts = append(parts, map[string]string{"type": "text", "text": "Answer from these. "})
		for _, d := range docs {
			parts = append(parts, map[string]string{"type": "text", "text": d})
		}
		parts = append(parts, map[string]string{"type": "text", "text": "What do they say?"})
		body, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]any{
			{"role": "system", "content": system}, {"role": "user", "content": parts}}})
		r, err := Parse(Chat, body, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Recycle)
		// A template of 4 ids per message, then one id per word.
		p := prompt{r: r, docs: map[string][2]int{}}
		for i := range r.Parts {
			p.ids = append(p.ids, 1, 2, 3, 4)
			part := &r.Parts[i]
			part.EachSeg(func(from, to int) {
				first := len(p.ids)
				for _, w := range strings.Fields(string(part.Text[from:to])) {
					p.ids = append(p.ids, int32(xxhash.Sum64String(w)%50000))
				}
				p.docs[string(part.Text[from:to])] = [2]int{first, len(p.ids)}
			})
		}
		return p
	}
	keys := func(p prompt, doc string) (segs map[uint64]bool, others int) {
		bl, _ := AppendTokenBlocks(nil, 1, p.ids, 16, p.r)
		SetTokenSegments(bl, len(p.ids), 16, p.r)
		span := p.docs[doc]
		segs = map[uint64]bool{}
		for i, b := range bl {
			mid := i*16 + 8
			inDoc := mid >= span[0] && mid < span[1]
			switch {
			case inDoc && (b.Seg == 0 || b.Kind != KindRetrievedContext):
				t.Fatalf("block %d of the document: seg %x, kind %v", i, b.Seg, b.Kind)
			case inDoc:
				segs[b.Seg] = true
			case b.Seg != 0:
				others++
			}
		}
		return segs, others
	}
	one := build("You are terse.", docA, docB)
	two := build("You are a helpful assistant for a library, and you answer in full sentences.", docB, docA)
	a1, o1 := keys(one, docA)
	a2, _ := keys(two, docA)
	shared := 0
	for k := range a1 {
		if a2[k] {
			shared++
		}
	}
	if shared < len(a1)*8/10 {
		t.Fatalf("document A: %d of %d block keys shared between the prompts", shared, len(a1))
	}
	b1, _ := keys(one, docB)
	// Keyed blocks outside A are B's, and at most a block at each end of
	// the documents (the estimate's error), never the instruction's or the
	// question's.
	if o1 < len(b1) || o1 > len(b1)+2 {
		t.Fatalf("%d keyed blocks outside document A, document B has %d", o1, len(b1))
	}
	bl, _ := AppendTokenBlocks(nil, 1, one.ids, 16, one.r)
	if n := testing.AllocsPerRun(50, func() { SetTokenSegments(bl, len(one.ids), 16, one.r) }); n != 0 {
		t.Fatalf("%v allocations", n)
	}
}
