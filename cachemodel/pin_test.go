package cachemodel

import (
	"fmt"
	"math/rand/v2"
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
	_, pa := m.Commit(0, a, 1)
	if pa.Blocks() != 4 {
		t.Fatalf("pinned %d of 4", pa.Blocks())
	}
	_, pb := m.Commit(0, b, 2)
	if got := held(m, a); got != 4 {
		t.Fatalf("the running prompt a holds %d of 4 blocks after b: evicted while running", got)
	}
	if st, _ := m.Stats(0); st.Tokens != 8 || st.Evictions != 0 {
		t.Fatalf("stats %+v, want 8 tokens over the budget of 6 and no eviction", st)
	}
	m.Done(0, a, pa, 3)
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
	if _, n := m.Commit(0, p, 1); n.Blocks() != 2 {
		t.Fatalf("pinned %d, want the 2 blocks admitted", n.Blocks())
	}
}

// refuseAfter admits the first n blocks a replica holds, then none.
type refuseAfter struct {
	eviction.Policy
	n int64
}

func (r refuseAfter) Admit(_ eviction.Info, used, _ int64) bool { return used < r.n }

// tracked wraps a policy and remembers its candidate set.
type tracked struct {
	eviction.Policy
	set map[uint64]bool
}

func (p *tracked) Evictable(k uint64, i eviction.Info) { p.set[k] = true; p.Policy.Evictable(k, i) }
func (p *tracked) Removed(k uint64)                    { delete(p.set, k); p.Policy.Removed(k) }
func (p *tracked) Victim() (uint64, bool) {
	k, ok := p.Policy.Victim()
	if ok {
		delete(p.set, k)
	}
	return k, ok
}

type trackedFO struct{ *tracked }

func (p trackedFO) Freed(k uint64, i eviction.Info) { p.Policy.(eviction.FreeObserver).Freed(k, i) }

func trackedFactory(inner eviction.Factory) eviction.Factory {
	return func() eviction.Policy {
		t := &tracked{Policy: inner(), set: map[uint64]bool{}}
		if _, ok := t.Policy.(eviction.FreeObserver); ok {
			return trackedFO{t}
		}
		return t
	}
}

func setOf(p eviction.Policy) map[uint64]bool {
	switch x := p.(type) {
	case *tracked:
		return x.set
	case trackedFO:
		return x.set
	case trackedAdmit:
		return x.set
	}
	panic("untracked policy")
}

// checkCandidates: the policy's keys are exactly the held, childless,
// unpinned slots; returns total pins left.
func (m *Model) checkCandidates(t *testing.T, step int) (pins int) {
	t.Helper()
	for id, st := range m.replicas {
		if st == nil {
			continue
		}
		want := map[uint64]bool{}
		m.nodes.each(func(n *node) {
			if i, ok := m.find(n, int32(id)); ok {
				s := m.at(n, i)
				pins += int(s.pins)
				if s.flags != 0 && s.children == 0 && s.pins == 0 {
					want[n.hash] = true
				}
			}
		})
		got := setOf(st.policy)
		for k := range want {
			if !got[k] {
				t.Fatalf("step %d replica %d: unpinned leaf %x is not a candidate (never evictable)", step, id, k)
			}
		}
		for k := range got {
			if !want[k] {
				t.Fatalf("step %d replica %d: key %x is a candidate but not an unpinned held leaf", step, id, k)
			}
		}
		if st.policy.Len() != len(got) {
			t.Fatalf("step %d: policy Len %d, tracked %d", step, st.policy.Len(), len(got))
		}
	}
	return pins
}

// TestPinInvariantRandom: over random commits, dones, records, replies,
// releases, engine events, shrinks, budget changes and clears, under LRU,
// vLLM's order, the adaptive policy and an admitter that refuses blocks,
// the policy's candidates are exactly the held, childless, unpinned slots
// after every step; once every request is done no pin is left and the
// picture evicts down to its budget. (Written by a helper attacking the
// pins.)
func TestPinInvariantRandom(t *testing.T) {
	for _, pol := range []struct {
		name string
		f    eviction.Factory
	}{
		{"lru", trackedFactory(func() eviction.Policy { return eviction.NewLRU() })},
		{"vllm", trackedFactory(eviction.NewVLLM)},
		{"adaptive", trackedFactory(func() eviction.Policy { return eviction.NewAdaptiveKind(eviction.AdaptiveParams{}) })},
		{"admit", func() eviction.Policy {
			return trackedAdmit{&tracked{Policy: eviction.NewLRU(), set: map[uint64]bool{}}}
		}},
	} {
		for seed := uint64(1); seed <= 6; seed++ {
			t.Run(fmt.Sprint(pol.name, seed), func(t *testing.T) {
				m := New(Options{Policy: pol.f, PendingTTL: 50})
				m.noShortcut = seed%5 == 0
				m.AddReplica("a", 400)
				m.AddReplica("b", 300)
				rng := rand.New(rand.NewPCG(seed, 7))
				base := chain("sys", 20, 0)
				var prompts [][]blockhash.Block
				type run struct {
					id int
					n  Pins
					p  []blockhash.Block
				}
				var running []run
				for step := 0; step < 3000/raceSteps; step++ {
					id := rng.IntN(2)
					now := int64(step * 10)
					switch op := rng.IntN(100); {
					case op < 30 || len(prompts) == 0:
						p := extend(base, 1+rng.IntN(len(base)), 1+rng.IntN(20), fmt.Sprint("p", step))
						prompts = append(prompts, p)
						_, n := m.Commit(id, p, now)
						running = append(running, run{id, n, p})
					case op < 40:
						p := prompts[rng.IntN(len(prompts))]
						_, n := m.Commit(id, p, now)
						running = append(running, run{id, n, p})
					case op < 55 && len(running) > 0:
						k := rng.IntN(len(running))
						r := running[k]
						running = append(running[:k], running[k+1:]...)
						m.Done(r.id, r.p, r.n, now)
						if rng.IntN(2) == 0 {
							m.Extend(r.id, extend(r.p, len(r.p), 1+rng.IntN(5), fmt.Sprint("r", step)), len(r.p), now)
						}
					case op < 62:
						m.Record(id, prompts[rng.IntN(len(prompts))], now)
					case op < 66:
						m.Free(id, prompts[rng.IntN(len(prompts))], now)
					case op < 72:
						p := prompts[rng.IntN(len(prompts))]
						j := rng.IntN(len(p))
						if j == 0 {
							m.Store(id, 0, false, p[j:j+1+rng.IntN(len(p)-j)], rng.IntN(4) == 0, now)
						} else {
							m.Store(id, p[j-1].Hash, true, p[j:j+1+rng.IntN(len(p)-j)], rng.IntN(4) == 0, now)
						}
					case op < 80:
						p := prompts[rng.IntN(len(prompts))]
						m.Remove(id, p[rng.IntN(len(p))].Hash, rng.IntN(3) == 0)
					case op < 84:
						m.Shrink(id, int64(1+rng.IntN(100)))
					case op < 88:
						m.SetEventDriven(id, rng.IntN(2) == 0)
					case op < 92:
						m.ExpirePending(now)
					case op < 94:
						m.SetBudget(id, int64(50+rng.IntN(500)))
					case op < 95:
						m.Clear(id)
					}
					m.checkCandidates(t, step)
				}
				for _, r := range running {
					m.Done(r.id, r.p, r.n, 1e9)
				}
				if pins := m.checkCandidates(t, -1); pins != 0 {
					t.Fatalf("%d pins left after every request was done", pins)
				}
				for id := 0; id < 2; id++ {
					m.SetBudget(id, 10)
					m.Record(id, chain("last", 1, 0), 2e9)
					if st, _ := m.Stats(id); st.Tokens > 10 {
						t.Fatalf("replica %d holds %d tokens over a budget of 10 after every request was done", id, st.Tokens)
					}
				}
			})
		}
	}
}

type trackedAdmit struct{ *tracked }

func (p trackedAdmit) Admit(i eviction.Info, used, budget int64) bool {
	return used < budget*3/4 || i.Depth < 22
}

// 65,536 running requests of one prompt: the count saturates rather than
// wrapping to 0 (which left the leaf out of the policy for good), and once
// all are done the block is evicted. (Found by a helper's review.)
func TestPinCountSaturates(t *testing.T) {
	m := New(Options{Policy: eviction.NewVLLM})
	m.AddReplica("r", 4)
	p := chain("hot", 1, 0)
	const running = 1 << 16
	ns := make([]Pins, running)
	for i := range ns {
		_, ns[i] = m.Commit(0, p, int64(i))
	}
	n := m.nodes.get(p[0].Hash)
	if s := m.at(n, 0); s.pins != maxPins {
		t.Fatalf("%d running requests: pins = %d, want saturated at %d", running, s.pins, maxPins)
	}
	for i := range ns {
		m.Done(0, p, ns[i], int64(running+i))
	}
	m.Record(0, chain("other", 8, 0), 1<<20)
	if got := held(m, p); got != 0 {
		t.Fatalf("the prompt, done by every request, holds %d block: never evicted", got)
	}
}

// A request running across a Clear (a replica restart, kvsync's reset on
// AllBlocksCleared or an event gap) unpins nothing when it ends: its pins
// went with the clear, and the pins now there are a later request's.
// (Found by a helper's review.)
func TestDoneAfterClearUnpinsNothing(t *testing.T) {
	m := New(Options{Policy: eviction.NewVLLM})
	m.AddReplica("r", 6)
	p := chain("p", 4, 0)
	_, n1 := m.Commit(0, p, 1) // request 1 running
	m.Clear(0)                 // the engine restarted
	_, n2 := m.Commit(0, p, 2) // request 2, same prompt, running
	m.Done(0, p, n1, 3)        // request 1 ends
	m.Record(0, chain("q", 4, 0), 4)
	if got := held(m, p); got != 4 {
		t.Fatalf("request 2 still runs, yet its prompt holds %d of 4 blocks: request 1's Done took its pins", got)
	}
	m.Done(0, p, n2, 5)
}

// Active counts the tokens of the leading blocks a replica holds pinned
// by running requests, stopping at the first it holds unpinned or not at
// all.
func TestActiveCountsPinnedPrefix(t *testing.T) {
	m := New(Options{Policy: eviction.NewVLLM})
	m.AddReplica("r", 100)
	m.AddReplica("s", 100)
	blocks := chain("a", 4, 0)
	_, pins := m.Commit(0, blocks[:2], 1)
	m.Record(0, blocks, 2)
	want := int(blocks[0].Tokens + blocks[1].Tokens)
	if got := m.Active(0, blocks); got != want {
		t.Fatalf("pinned 2 of 4 blocks: Active %d, want %d", got, want)
	}
	if got := m.Active(1, blocks); got != 0 {
		t.Fatalf("another replica: Active %d", got)
	}
	m.Done(0, blocks[:2], pins, 3)
	if got := m.Active(0, blocks); got != 0 {
		t.Fatalf("after Done: Active %d", got)
	}
}
