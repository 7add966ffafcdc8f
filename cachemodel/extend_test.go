package cachemodel

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/eviction"
)

// Extend's and Done's shortcuts (start at the held prompt's last block
// instead of walking the prompt again) change nothing: two models fed the
// same random records, running requests (Commit to Done), replies,
// releases, shrinks, clears and engine events — one taking the shortcuts
// where it may, one always walking — evict the same blocks in the same
// order and hold the same picture, under LRU and vLLM's eviction.
func TestExtendShortcutChangesNothing(t *testing.T) {
	for _, pol := range []struct {
		name string
		f    eviction.Factory
	}{{"lru", func() eviction.Policy { return eviction.NewLRU() }}, {"vllm", eviction.NewVLLM}} {
		t.Run(pol.name, func(t *testing.T) {
			var evA, evB []string
			a := New(Options{Policy: pol.f, OnEvict: func(r int, k uint64) { evA = append(evA, fmt.Sprint(r, k)) }})
			b := New(Options{Policy: pol.f, OnEvict: func(r int, k uint64) { evB = append(evB, fmt.Sprint(r, k)) }})
			b.noShortcut = true
			for _, m := range []*Model{a, b} {
				m.AddReplica("r0", 300)
				m.AddReplica("r1", 200)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			base := chain("system", 40, 0)
			var prompts [][]blockhash.Block
			type run struct {
				id int
				p  []blockhash.Block
				n  Pins
			}
			var running []run
			shortcuts := 0
			for step := 0; step < 4000/raceSteps; step++ {
				id := rng.IntN(2)
				now := int64(step)
				var p []blockhash.Block
				switch op := rng.IntN(100); {
				case op < 40 || len(prompts) == 0: // a new prompt, half of them running until done
					p = extend(base, 1+rng.IntN(len(base)), 1+rng.IntN(30), fmt.Sprint("p", step))
					prompts = append(prompts, p)
					if rng.IntN(2) == 0 {
						_, na := a.Commit(id, p, now)
						_, nb := b.Commit(id, p, now)
						if na != nb {
							t.Fatalf("step %d: pinned %d and %d", step, na, nb)
						}
						running = append(running, run{id, p, na})
						break
					}
					a.Record(id, p, now)
					b.Record(id, p, now)
				case op < 80: // a reply learned after a prompt: mostly the last one
					p = prompts[len(prompts)-1]
					if rng.IntN(4) == 0 {
						p = prompts[rng.IntN(len(prompts))]
					}
					full := extend(p, len(p), 1+rng.IntN(20), fmt.Sprint("r", step))
					if a.heldPrefix(id, full, len(p), fGPU) != nil {
						shortcuts++
					}
					a.Extend(id, full, len(p), now)
					b.Extend(id, full, len(p), now)
					prompts = append(prompts, full)
				case op < 88 && len(running) > 0 && rng.IntN(2) == 0: // a running request is done
					k := rng.IntN(len(running))
					r := running[k]
					running = append(running[:k], running[k+1:]...)
					a.Done(r.id, r.p, r.n, now)
					b.Done(r.id, r.p, r.n, now)
					p = r.p
				case op < 88:
					p = prompts[rng.IntN(len(prompts))]
					a.Free(id, p, now)
					b.Free(id, p, now)
				case op < 95:
					n := int64(1 + rng.IntN(60))
					a.Shrink(id, n)
					b.Shrink(id, n)
				case op < 96 && step > 3000: // the engine drops a block, maybe with children: a dead slot
					p = prompts[rng.IntN(len(prompts))]
					k := p[rng.IntN(len(p))].Hash
					a.Remove(id, k, false)
					b.Remove(id, k, false)
				case op >= 98:
					a.Clear(id)
					b.Clear(id)
				}
				if !slices.Equal(evA, evB) {
					t.Fatalf("step %d: evictions differ:\n%v\n%v", step, evA[max(0, len(evA)-5):], evB[max(0, len(evB)-5):])
				}
				for r := 0; r < 2; r++ {
					sa, _ := a.Stats(r)
					sb, _ := b.Stats(r)
					if sa != sb {
						t.Fatalf("step %d: replica %d stats %+v and %+v", step, r, sa, sb)
					}
				}
				if p != nil {
					ma, mb := a.Match(p, nil, nil), b.Match(p, nil, nil)
					if fmt.Sprint(ma) != fmt.Sprint(mb) {
						t.Fatalf("step %d: matches %v and %v", step, ma, mb)
					}
				}
			}
			if shortcuts < 100 {
				t.Fatalf("only %d replies took the shortcut: the test does not exercise it", shortcuts)
			}
		})
	}
}

// A prompt whose middle the engine dropped (a dead slot under live
// children) is walked, not skipped: Extend brings the dead block back.
func TestExtendRevivesADeadPrefix(t *testing.T) {
	m := New(Options{})
	m.AddReplica("r", 1000)
	p := chain("p", 5, 0)
	m.Record(0, p, 1)
	if removed, left := m.Remove(0, p[2].Hash, false); !removed || left {
		t.Fatalf("remove: %v %v", removed, left)
	}
	full := extend(p, 5, 3, "reply")
	m.Extend(0, full, 5, 2)
	if st, _ := m.Stats(0); st.Blocks != 8 {
		t.Fatalf("%d blocks held, want the 5 of the prompt (the dropped one cached again) and 3 of the reply", st.Blocks)
	}
}

// BenchmarkExtend learns a 16-block reply after a prompt of 128 or 2,048
// blocks the replica holds, walking the prompt again or starting at its
// last block.
func BenchmarkExtend(b *testing.B) {
	for _, blocks := range []int{128, 2048} {
		for _, walk := range []bool{true, false} {
			name := "shortcut"
			if walk {
				name = "walk"
			}
			b.Run(fmt.Sprintf("prompt=%d/%s", blocks, name), func(b *testing.B) {
				m := New(Options{})
				m.noShortcut = walk
				m.AddReplica("r", int64(blocks)*64)
				p := chain("prompt", blocks, 0)
				m.Record(0, p, 1)
				replies := make([][]blockhash.Block, 64)
				for i := range replies {
					replies[i] = extend(p, blocks, 16, fmt.Sprint(i))
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					m.Extend(0, replies[i%len(replies)], blocks, int64(i+2))
				}
			})
		}
	}
}

// A replica that holds a block but not its parent (a Store with
// hasParent=false of a block the tree has under a parent, as a bad peer's
// snapshot or a key collision would make) while every slot is plainly on
// the GPU: Release's walk up from the last block neither panics nor
// touches the other replica's slots. (Found by a helper's review.)
func TestReleaseWalkUnheldAncestor(t *testing.T) {
	for _, rid := range []int{0, 1} {
		m := New(Options{Policy: eviction.NewVLLM})
		m.AddReplica("a", 0)
		m.AddReplica("b", 0)
		c := chain("p", 3, 0)
		other := 1 - rid
		m.Record(other, c, 1)
		if ok, _ := m.Store(rid, 0, false, c[2:], false, 2); !ok {
			t.Fatal("store")
		}
		if m.irregular != 0 {
			t.Fatal("a slot is not plainly on the GPU: the walk up is not taken")
		}
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Errorf("rid %d: Release panicked: %v", rid, r)
				}
			}()
			m.Free(rid, c, 99)
		}()
		n := m.nodes.get(c[1].Hash)
		i, _ := m.find(n, int32(other))
		if got := m.at(n, i).lastUsed; got != 1 {
			t.Errorf("rid %d: replica %d's slot of block 1 has lastUsed %d, want 1 (written by the other replica's Release)", rid, other, got)
		}
	}
}
