package blockhash

import (
	"encoding/json"
	"strings"
	"testing"
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
		defer r.Release()
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
	defer r.Release()
	a, b := plain.Split(nil, r), s.Split(nil, r)
	for i := range a {
		if a[i].Seg != 0 || a[i].Hash != b[i].Hash || a[i].Kind != b[i].Kind {
			t.Fatalf("block %d: %+v without segments, %+v with", i, a[i], b[i])
		}
	}
}
