package cachemodel

import (
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/eviction"
)

// held returns how many of the first blocks of c replica 0 holds.
func held(m *Model, c []blockhash.Block) int { return m.Match(c, nil, nil)[0].Blocks }

// A running request's prompt (Commit to Done) is not evicted, as vLLM
// keeps a running request's blocks off its free queue: a second prompt
// that does not fit leaves the picture over its budget rather than evict
// the first. Once the first is done, the next record evicts it, tail
// first, and a done request is evicted in vLLM's free order.
func TestCommitPinsUntilDone(t *testing.T) {
	m := New(Options{Policy: eviction.NewVLLM})
	m.AddReplica("r", 6)
	a, b, c := chain("a", 4, 0), chain("b", 4, 0), chain("c", 2, 0)
	if _, pinned := m.Commit(0, a, 1); pinned != 4 {
		t.Fatalf("pinned %d of 4", pinned)
	}
	_, pb := m.Commit(0, b, 2)
	if got := held(m, a); got != 4 {
		t.Fatalf("the running prompt a holds %d of 4 blocks after b: evicted while running", got)
	}
	if st, _ := m.Stats(0); st.Tokens != 8 || st.Evictions != 0 {
		t.Fatalf("stats %+v, want 8 tokens over the budget of 6 and no eviction", st)
	}
	m.Done(0, a, 4, 3)
	m.Record(0, c, 4) // 10 tokens: 4 to evict, all of done a, tail first
	if got := held(m, a); got != 0 {
		t.Fatalf("done a holds %d blocks, want 0", got)
	}
	if got := held(m, b); got != 4 {
		t.Fatalf("running b holds %d of 4 blocks", got)
	}
	m.Done(0, b, pb, 5)
	m.Record(0, chain("d", 4, 0), 6) // 10 tokens: c, last used at 4, goes before b, freed at 5
	if got, gotC := held(m, b), held(m, c); got != 2 || gotC != 0 {
		t.Fatalf("done b holds %d blocks and c %d, want 2 and 0", got, gotC)
	}
}

// Two running requests share a prefix: it stays pinned until both are
// done, and a failover (Done on one replica, Commit on the next) moves
// the pins.
func TestPinsCountRequests(t *testing.T) {
	m := New(Options{Policy: eviction.NewLRU})
	m.AddReplica("r0", 4)
	m.AddReplica("r1", 4)
	p := chain("p", 4, 0)
	_, n1 := m.Commit(0, p, 1)
	_, n2 := m.Commit(0, p, 2)
	m.Done(0, p, n1, 3)
	m.Record(0, chain("q", 4, 0), 4)
	if got := held(m, p); got != 4 {
		t.Fatalf("p, still used by one request, holds %d of 4", got)
	}
	m.Done(0, p, n2, 5)
	m.Record(0, chain("s", 4, 0), 6)
	if got := held(m, p); got != 0 {
		t.Fatalf("p, done by both, holds %d", got)
	}
	// Failover: r0 → r1.
	f := chain("f", 4, 0)
	_, n := m.Commit(0, f, 7)
	m.Done(0, f, n, 8)
	_, n = m.Commit(1, f, 9)
	m.Record(0, chain("g", 4, 0), 10)
	m.Record(1, chain("h", 4, 0), 11)
	if got := m.Match(f, nil, nil); got[0].Blocks != 0 || got[1].Blocks != 4 {
		t.Fatalf("after failover f holds %d on r0 (done) and %d on r1 (running), want 0 and 4", got[0].Blocks, got[1].Blocks)
	}
	m.Done(1, f, n, 12)
}

// Done unpins every pinned block the replica still holds when the engine
// dropped one in the middle of the prompt (a dead slot: the picture is no
// longer plainly on the GPU, so Done walks down from the first block): no
// pin outlives its request.
func TestDoneUnpinsAroundADroppedBlock(t *testing.T) {
	m := New(Options{Policy: eviction.NewVLLM})
	m.AddReplica("r", 100)
	p := chain("p", 5, 0)
	_, n := m.Commit(0, p, 1)
	if removed, _ := m.Remove(0, p[2].Hash, false); !removed {
		t.Fatal("remove")
	}
	m.Done(0, p, n, 2)
	m.SetBudget(0, 1)
	m.Record(0, chain("x", 1, 0), 3)
	if st, _ := m.Stats(0); st.Tokens > 1 {
		t.Fatalf("%d tokens held over a budget of 1 after every request was done: a pin outlived its request", st.Tokens)
	}
}

// An Admitter's refusal ends the chain: Commit pins only what it cached,
// and says so.
func TestCommitPinsWhatItCaches(t *testing.T) {
	m := New(Options{Policy: func() eviction.Policy { return refuseAfter{eviction.NewLRU(), 2} }})
	m.AddReplica("r", 100)
	p := chain("p", 5, 0)
	if _, n := m.Commit(0, p, 1); n != 2 {
		t.Fatalf("pinned %d, want the 2 blocks admitted", n)
	}
}

// refuseAfter admits the first n blocks a replica holds, then none.
type refuseAfter struct {
	eviction.Policy
	n int64
}

func (r refuseAfter) Admit(_ eviction.Info, used, _ int64) bool { return used < r.n }
