package cachemodel

import (
	"testing"

	"github.com/semroute/semroute/blockhash"
)

func segBlocks(kind blockhash.Kind, segs ...uint64) []blockhash.Block {
	out := make([]blockhash.Block, len(segs))
	for i, s := range segs {
		out[i] = blockhash.Block{Hash: 1000 + s, Seg: s, Tokens: 64, Kind: kind}
	}
	return out
}

// A replica's reusable blocks are found wherever they sit in a later
// prompt, past its exact prefix only, of the kept kinds only; the budget
// evicts the least recently used; Clear forgets them.
func TestSegmentsBeyondThePrefix(t *testing.T) {
	s := NewSegments(nil, []blockhash.Kind{blockhash.KindRetrievedContext})
	s.AddReplica(0, 4*64)
	s.AddReplica(1, 0)
	s.Record(0, segBlocks(blockhash.KindRetrievedContext, 1, 2, 3), 1)
	s.Record(1, segBlocks(blockhash.KindUserQuery, 1, 2, 3), 1) // not a kept kind
	req := append(segBlocks(blockhash.KindSystem, 0), segBlocks(blockhash.KindRetrievedContext, 3, 1, 9)...)
	out := make([]float64, 2)
	s.Beyond(req, make([]Match, 2), out)
	if out[0] != 128 || out[1] != 0 {
		t.Fatalf("beyond = %v, want [128 0] (blocks 3 and 1 on replica 0)", out)
	}
	// Replica 0 matched the first two blocks exactly: block 3 is in its prefix.
	out = make([]float64, 2)
	s.Beyond(req, []Match{{Blocks: 2}, {}}, out)
	if out[0] != 64 {
		t.Fatalf("beyond a 2-block prefix = %v, want 64 (block 1 only)", out[0])
	}
	// Over budget (4 blocks): block 2, the least recently used, goes.
	s.Record(0, segBlocks(blockhash.KindRetrievedContext, 1, 3), 2)
	if n := s.Record(0, segBlocks(blockhash.KindRetrievedContext, 4, 5), 3); n != 1 {
		t.Fatalf("evicted %d, want 1", n)
	}
	out = make([]float64, 2)
	s.Beyond(segBlocks(blockhash.KindRetrievedContext, 2, 1), make([]Match, 2), out)
	if out[0] != 64 {
		t.Fatalf("after eviction: %v, want only block 1 (64)", out[0])
	}
	if st, _ := s.Stats(0); st.Blocks != 4 || st.Tokens != 256 || st.Evictions != 1 {
		t.Fatalf("stats %+v", st)
	}
	s.Clear(0)
	out = make([]float64, 2)
	s.Beyond(segBlocks(blockhash.KindRetrievedContext, 1, 3, 4, 5), make([]Match, 2), out)
	if out[0] != 0 || len(s.holders) != 0 {
		t.Fatalf("after Clear: %v, %d keys held", out, len(s.holders))
	}
	if n := testing.AllocsPerRun(100, func() { s.Beyond(req, make([]Match, 2)[:2], out) }); n > 1 {
		t.Fatalf("Beyond allocates %v times", n)
	}
}
