package cachemodel

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/eviction"
)

// matchOf returns replica id's match of blocks.
func matchOf(m *Model, blocks []blockhash.Block, id int) Match {
	return m.Match(blocks, nil, nil)[id]
}

func stats(t *testing.T, m *Model, id int) Stats {
	t.Helper()
	s, ok := m.Stats(id)
	if !ok {
		t.Fatalf("no replica %d", id)
	}
	return s
}

func TestStoreChainsAfterParent(t *testing.T) {
	m := newModel(t, 0, 0)
	c := chain("p", 6, 0)
	if ok, _ := m.Store(0, 0, false, c[:2], false, 1); !ok {
		t.Fatal("a chain from the start was refused")
	}
	if ok, _ := m.Store(0, c[1].Hash, true, c[2:4], false, 2); !ok {
		t.Fatal("a chain after a held parent was refused")
	}
	if ok, _ := m.Store(0, c[4].Hash, true, c[5:], false, 3); ok {
		t.Fatal("a chain after a parent the replica does not hold was stored")
	}
	if ok, _ := m.Store(1, c[1].Hash, true, c[2:4], false, 3); ok {
		t.Fatal("a chain after another replica's parent was stored")
	}
	if got := matchOf(m, c, 0); got.Blocks != 4 || got.Tokens != 4 {
		t.Fatalf("match %+v, want the 4 stored blocks", got)
	}
	if s := stats(t, m, 0); s.Blocks != 4 || s.Tokens != 4 {
		t.Fatalf("stats %+v", s)
	}
}

// The engine may drop a block and keep its children: its own prefix lookup
// stops at the hole, so Match must too, and the children stay counted
// until the engine drops them, then the dead block goes with the last.
func TestRemoveInsideAChainStopsTheMatch(t *testing.T) {
	m := newModel(t, 0, 0)
	c := chain("p", 5, 0)
	m.Store(0, 0, false, c, false, 1)
	m.Store(1, 0, false, c[:3], false, 1)
	if removed, left := m.Remove(0, c[1].Hash, false); !removed || left {
		t.Fatal("remove of a held block reported", removed, left)
	}
	if removed, _ := m.Remove(0, c[1].Hash, false); removed {
		t.Fatal("second remove reported true")
	}
	out := m.Match(c, nil, nil)
	if out[0].Blocks != 1 || out[1].Blocks != 3 {
		t.Fatalf("matches %+v: want 1 (stops at the hole) and 3", out)
	}
	if s := stats(t, m, 0); s.Blocks != 4 {
		t.Fatalf("blocks %d, want 4 held (the dead one not counted)", s.Blocks)
	}
	for _, i := range []int{4, 3, 2} {
		m.Remove(0, c[i].Hash, false)
	}
	m.mu.RLock()
	n := m.nodes.get(c[1].Hash)
	_, held := m.find(n, 0)
	m.mu.RUnlock()
	if held {
		t.Fatal("the dead block outlived its last child")
	}
	if s := stats(t, m, 0); s.Blocks != 1 || s.Tokens != 1 {
		t.Fatalf("stats %+v, want the first block only", s)
	}
	// Stored again, the hole closes.
	m.Store(0, c[0].Hash, true, c[1:], false, 2)
	if got := matchOf(m, c, 0); got.Blocks != 5 {
		t.Fatalf("match %+v after storing again", got)
	}
}

func TestDeadBlockRevivedByStore(t *testing.T) {
	m := newModel(t, 0)
	c := chain("p", 3, 0)
	m.Store(0, 0, false, c, false, 1)
	m.Remove(0, c[1].Hash, false)
	m.Store(0, c[0].Hash, true, c[1:2], false, 2)
	if got := matchOf(m, c, 0); got.Blocks != 3 {
		t.Fatalf("match %+v, want 3 after the hole was stored again", got)
	}
	if s := stats(t, m, 0); s.Blocks != 3 {
		t.Fatalf("blocks %d, want 3", s.Blocks)
	}
}

func TestPendingExpiresUnlessConfirmed(t *testing.T) {
	m := New(Options{PendingTTL: 100})
	m.AddReplica("a", 0)
	m.SetEventDriven(0, true)
	a, b := chain("a", 3, 0), chain("b", 3, 0)
	m.Record(0, a, 10)
	m.Record(0, b, 10)
	if got := matchOf(m, a, 0); got.Blocks != 3 {
		t.Fatalf("pending blocks not counted: %+v", got)
	}
	m.Store(0, 0, false, a[:2], false, 50) // the engine confirms two of a's
	m.ExpirePending(109)
	if got := matchOf(m, b, 0); got.Blocks != 3 {
		t.Fatalf("expired early: %+v", got)
	}
	m.ExpirePending(110)
	if got := matchOf(m, b, 0); got.Blocks != 0 {
		t.Fatalf("unconfirmed chain outlived its TTL: %+v", got)
	}
	if got := matchOf(m, a, 0); got.Blocks != 2 {
		t.Fatalf("confirmed blocks: %+v, want 2", got)
	}
	if s := stats(t, m, 0); s.Blocks != 2 || s.Tokens != 2 {
		t.Fatalf("stats %+v", s)
	}
	// Routed again and then the events stop: pending blocks become cached.
	m.Record(0, b, 200)
	m.SetEventDriven(0, false)
	m.ExpirePending(1000)
	if got := matchOf(m, b, 0); got.Blocks != 3 {
		t.Fatalf("after falling back, routed blocks expired: %+v", got)
	}
}

func TestCPUOnlyBlocksCreditedLess(t *testing.T) {
	m := New(Options{CPUCredit: 0.25})
	m.AddReplica("a", 0)
	c := chain("p", 4, 0)
	m.Store(0, 0, false, c, false, 1)
	m.Store(0, 0, false, c, true, 2) // offloaded copies
	m.Remove(0, c[2].Hash, false)    // block 2 left the GPU
	m.Remove(0, c[3].Hash, false)
	got := matchOf(m, c, 0)
	if got.Blocks != 4 || got.Tokens != 4 || got.Weighted != 2.5 {
		t.Fatalf("match %+v, want 4 blocks, 4 tokens, weighted 1+1+0.25+0.25", got)
	}
	m.Remove(0, c[3].Hash, true)
	if got := matchOf(m, c, 0); got.Blocks != 3 {
		t.Fatalf("match %+v after the CPU copy went", got)
	}
}

func TestMatchWeighsTheRequestsKinds(t *testing.T) {
	m := newModel(t, 0)
	c := chain("p", 2, blockhash.KindOther)
	m.Store(0, 0, false, c, false, 1)
	req := append([]blockhash.Block{}, c...)
	req[0].Kind = blockhash.KindSystem
	w := UnitWeights()
	w[blockhash.KindSystem] = 3
	if got := m.Match(req, w, nil)[0]; got.Weighted != 4 {
		t.Fatalf("weighted %v, want 3+1 from the request's kinds", got.Weighted)
	}
}

// Removal events arriving for blocks never stored, or after Clear, are
// ignored, and eviction keeps working on a picture with dead blocks.
func TestBudgetEvictionWithDeadBlocks(t *testing.T) {
	m := newModel(t, 6)
	a := chain("a", 4, 0)
	m.Store(0, 0, false, a, false, 1)
	m.Remove(0, a[1].Hash, false) // a[1] dead, a[2:] held
	if removed, _ := m.Remove(0, 12345, false); removed {
		t.Fatal("unknown block removed")
	}
	b := chain("b", 4, 0)
	m.Record(0, b, 2) // 3 + 4 held > 6: evicts the oldest leaves
	s := stats(t, m, 0)
	if s.Tokens > 6 {
		t.Fatalf("tokens %d over the budget", s.Tokens)
	}
	m.Clear(0)
	if s := stats(t, m, 0); s.Blocks != 0 || s.Tokens != 0 {
		t.Fatalf("after clear %+v", s)
	}
	m.mu.RLock()
	left := m.nodes.len()
	m.mu.RUnlock()
	if left != 0 {
		t.Fatalf("%d nodes left after clear", left)
	}
}

// TestMatchPathsAgree: on a picture of routing records only, the nested
// fast path and the path that handles holes give the same matches, and
// the count of irregular slots returns to 0 once events' blocks are gone.
func TestMatchPathsAgree(t *testing.T) {
	m := New(Options{})
	for r := 0; r < 5; r++ {
		m.AddReplica("r", 200)
	}
	base := chain("p", 40, blockhash.KindSystem)
	for i := 0; i < 300; i++ {
		m.Record(i%5, extend(base, 1+(i*7)%40, i%4, fmt.Sprint(i)), int64(i))
	}
	for i := 0; i < 50; i++ {
		req := extend(base, 1+(i*11)%40, 2, fmt.Sprint(i*3))
		m.mu.RLock()
		a := m.matchNested(req, UnitWeights(), make([]Match, 5))
		b := m.matchHoles(req, UnitWeights(), make([]Match, 5))
		m.mu.RUnlock()
		for r := range a {
			if a[r] != b[r] {
				t.Fatalf("request %d replica %d: nested %+v, holes %+v", i, r, a[r], b[r])
			}
		}
	}
	c := chain("ev", 6, 0)
	m.Store(0, 0, false, c, false, 1000)
	m.Store(0, 0, false, c, true, 1000)
	m.Remove(0, c[2].Hash, false)
	if m.irregular == 0 {
		t.Fatal("CPU copies and holes not counted")
	}
	m.Clear(0)
	if m.irregular != 0 {
		t.Fatalf("%d irregular slots left after clear", m.irregular)
	}
}

// The engine reports a block after one it had cached already (so sent no
// event for it) more than PendingTTL after the router marked that parent
// pending: expiring pending blocks drops the parent, which Store must see
// before it chains to it, not after (it indexed a slot that was gone, and
// the router crashed). (Found by a helper's review.)
func TestStoreAfterItsPendingParentExpired(t *testing.T) {
	m := New(Options{PendingTTL: time.Second})
	m.AddReplica("a", 0)
	m.AddReplica("b", 0)
	m.SetEventDriven(1, true)
	z := chain("z", 2, 0)
	m.Record(0, z[:1], 0) // another replica holds z[0], so its node stays
	m.Record(1, z[:1], 0) // routed to b: pending there
	ok, _ := m.Store(1, z[0].Hash, true, z[1:], false, int64(2*time.Second))
	if ok {
		t.Fatal("stored after a parent b no longer holds")
	}
	if got := matchOf(m, z, 1).Blocks; got != 0 {
		t.Fatalf("b matches %d blocks, want 0", got)
	}
}

// A block the engine drops (a KV event) and the blocks of a cleared
// replica are given to OnEvict, as evictions are (the donor index forgets
// by them); a block kept in CPU memory is not.
func TestRemoveAndClearTellOnEvict(t *testing.T) {
	var gone []uint64
	m := New(Options{Policy: eviction.NewVLLM, OnEvict: func(_ int, k uint64) { gone = append(gone, k) }})
	m.AddReplica("r", 0)
	c := chain("p", 3, 0)
	m.Store(0, 0, false, c, false, 1)
	m.Store(0, 0, false, c[:1], true, 2) // the first block in CPU memory too
	m.Remove(0, c[2].Hash, false)
	m.Remove(0, c[0].Hash, false) // still in CPU memory
	if fmt.Sprint(gone) != fmt.Sprint([]uint64{c[2].Hash}) {
		t.Fatalf("OnEvict saw %v, want only %v", gone, c[2].Hash)
	}
	gone = nil
	m.Clear(0)
	slices.Sort(gone)
	want := []uint64{c[0].Hash, c[1].Hash}
	slices.Sort(want)
	if fmt.Sprint(gone) != fmt.Sprint(want) {
		t.Fatalf("Clear told %v, want %v", gone, want)
	}
}

// An engine that evicts a chain's middle keeps the blocks past the hole:
// Past counts them, per event-driven replica, after each one's own match,
// and nothing for a replica whose picture is the router's simulation.
func TestPastCountsHeldBlocksBeyondAHole(t *testing.T) {
	m := newModel(t, 0, 0, 0)
	m.SetEventDriven(0, true)
	m.SetEventDriven(1, true)
	c := chain("p", 6, 0)
	m.Store(0, 0, false, c, false, 1)
	m.Store(1, 0, false, c[:4], false, 1)
	m.Record(2, c[:2], 1)
	m.Remove(0, c[1].Hash, false) // replica 0: held 0, hole, held 2..5
	m.Remove(1, c[2].Hash, false) // replica 1: held 0 1, hole, held 3
	m.Remove(0, c[4].Hash, false) // and a second hole on replica 0
	out := m.Match(c, nil, nil)
	m.Past(c, out)
	for r, want := range []struct{ blocks, past int }{{1, 3}, {2, 1}, {2, 0}} {
		if out[r].Blocks != want.blocks || out[r].Past != want.past {
			t.Errorf("replica %d: match %d blocks, past %d tokens; want %d, %d", r, out[r].Blocks, out[r].Past, want.blocks, want.past)
		}
	}
}
