package kvsync

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// check holds x to ref and to its own invariants: every entry found from
// its home in Robin Hood order, counts right, load within bounds.
func (x *keyIndex) check(t *testing.T, ref map[uint64]uint64) {
	t.Helper()
	if x.Len() != len(ref) {
		t.Fatalf("Len %d, reference %d", x.Len(), len(ref))
	}
	for h, v := range ref {
		if got, ok := x.Get(h); !ok || got != v {
			t.Fatalf("Get(%#x) = %#x, %v; want %#x", h, got, ok, v)
		}
	}
	n := 0
	if x.hasAside {
		n++
	}
	for si := range x.shards {
		s := &x.shards[si]
		full := 0
		for i, e := range s.slots {
			if e.mk == 0 {
				continue
			}
			full++
			if int(e.mk>>(64-keyShardBits)) != si {
				t.Fatalf("shard %d holds an entry of shard %d", si, e.mk>>(64-keyShardBits))
			}
			// Robin Hood order: an entry off its home follows a full
			// slot whose entry is at most one step nearer its own.
			p := i - 1
			if p < 0 {
				p = len(s.slots) - 1
			}
			if d := s.dist(i, e.mk); d > 0 && (s.slots[p].mk == 0 || s.dist(p, s.slots[p].mk) < d-1) {
				t.Fatalf("shard %d slot %d: distance %d after a slot at %d", si, i, d, s.dist(p, s.slots[p].mk))
			}
		}
		if full != s.n {
			t.Fatalf("shard %d: %d full slots, counted %d", si, full, s.n)
		}
		if c := len(s.slots); s.n*8 > c*7 || (c > keyMinSlots && s.n*4 < c) {
			t.Fatalf("shard %d: %d entries in %d slots", si, s.n, c)
		}
		n += full
	}
	if n != x.Len() {
		t.Fatalf("%d entries in the shards, Len %d", n, x.Len())
	}
	for range 100 {
		h := rand.Uint64()
		if _, in := ref[h]; in {
			continue
		}
		if _, ok := x.Get(h); ok {
			t.Fatalf("Get(%#x) found a hash never put", h)
		}
	}
}

func TestKeyIndexAgainstMap(t *testing.T) {
	for _, tc := range []struct {
		name  string
		keys  uint64 // hashes drawn from [0, keys) scrambled, so some repeat
		ops   int
		seed0 bool // seed 0: hash 0 goes aside
	}{
		{"few keys, many overwrites", 50, 20_000, false},
		{"many keys", 30_000, 200_000, false},
		{"seed 0", 2_000, 50_000, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(1, tc.keys))
			x := newKeyIndex()
			if tc.seed0 {
				x = keyIndex{}
			}
			ref := map[uint64]uint64{}
			hash := func() uint64 {
				k := r.Uint64N(tc.keys)
				if k == 0 {
					return x.seed // the hash that mixes to 0
				}
				return k * 0x9e3779b97f4a7c15
			}
			for i := range tc.ops {
				h := hash()
				switch op := r.IntN(10); {
				case op < 6:
					v := r.Uint64()
					x.Put(h, v)
					ref[h] = v
				case op < 9:
					_, want := ref[h]
					if got := x.Delete(h); got != want {
						t.Fatalf("op %d: Delete(%#x) = %v, want %v", i, h, got, want)
					}
					delete(ref, h)
				default:
					gv, gok := x.Get(h)
					wv, wok := ref[h]
					if gv != wv || gok != wok {
						t.Fatalf("op %d: Get(%#x) = %#x, %v; want %#x, %v", i, h, gv, gok, wv, wok)
					}
				}
				if i%(tc.ops/20) == 0 {
					x.check(t, ref)
				}
			}
			x.check(t, ref)
		})
	}
}

// TestKeyIndexGrowsAndShrinks: filled, the index grows by steps and stays
// at most 7/8 full; emptied, it gives its slots back; filled again, it
// holds everything.
func TestKeyIndexGrowsAndShrinks(t *testing.T) {
	x := newKeyIndex()
	ref := map[uint64]uint64{}
	slots := func() int {
		c := 0
		for i := range x.shards {
			c += len(x.shards[i].slots)
		}
		return c
	}
	for round := range 2 {
		const n = 100_000
		for i := range uint64(n) {
			h := i*0x9e3779b97f4a7c15 + uint64(round)
			x.Put(h, i)
			ref[h] = i
		}
		x.check(t, ref)
		if c := slots(); c*7 < n*8 || c > n*2 {
			t.Fatalf("round %d: %d entries in %d slots", round, n, c)
		}
		for _, keep := range []int{n / 10, 0} { // check emptied to a tenth, then empty
			for h := range ref {
				if len(ref) == keep {
					break
				}
				if !x.Delete(h) {
					t.Fatalf("round %d: Delete(%#x) missed", round, h)
				}
				delete(ref, h)
			}
			x.check(t, ref)
		}
		if c := slots(); c > keyShards*keyMinSlots {
			t.Fatalf("round %d: %d slots left when empty", round, c)
		}
	}
}

// TestKeyIndexDeleteShiftsBack: deleting in a run of colliding entries
// keeps every other entry reachable, whichever one goes.
func TestKeyIndexDeleteShiftsBack(t *testing.T) {
	x := newKeyIndex()
	ref := map[uint64]uint64{}
	// Enough entries in one shard that runs form, then delete each in
	// turn and put it back.
	for i := uint64(1); len(ref) < 7*keyMinSlots; i++ {
		h := i * 0x9e3779b97f4a7c15
		if x.mix(h)>>(64-keyShardBits) == 0 {
			x.Put(h, i)
			ref[h] = i
		}
	}
	x.check(t, ref)
	for h, v := range ref {
		if !x.Delete(h) {
			t.Fatalf("Delete(%#x) missed", h)
		}
		delete(ref, h)
		x.check(t, ref)
		x.Put(h, v)
		ref[h] = v
		x.check(t, ref)
	}
}

// BenchmarkKeyIndex puts n hashes into an empty index, gets each and
// deletes each, against a Go map doing the same: ns per hash for the
// three together.
func BenchmarkKeyIndex(b *testing.B) {
	for _, n := range []int{1 << 10, 1 << 20} {
		hs := make([]uint64, n)
		for i := range hs {
			hs[i] = rand.Uint64()
		}
		b.Run(fmt.Sprintf("index/n=%d", n), func(b *testing.B) {
			for range b.N {
				x := newKeyIndex()
				for i, h := range hs {
					x.Put(h, uint64(i))
				}
				for _, h := range hs {
					if _, ok := x.Get(h); !ok {
						b.Fatal("lost")
					}
				}
				for _, h := range hs {
					x.Delete(h)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/hash")
		})
		b.Run(fmt.Sprintf("map/n=%d", n), func(b *testing.B) {
			for range b.N {
				x := map[uint64]uint64{}
				for i, h := range hs {
					x[h] = uint64(i)
				}
				for _, h := range hs {
					if _, ok := x[h]; !ok {
						b.Fatal("lost")
					}
				}
				for _, h := range hs {
					delete(x, h)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/hash")
		})
	}
}
