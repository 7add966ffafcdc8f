package cachemodel

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// check holds t to ref (block hash → node) and to its own invariants:
// every node found, each slot's tag and distance those of its node's hash,
// Robin Hood order, counts, load, the free list apart from the index.
func (t *nodeTable) check(tb testing.TB, ref map[uint64]*node) {
	tb.Helper()
	if t.len() != len(ref) {
		tb.Fatalf("len %d, reference %d", t.len(), len(ref))
	}
	for k, n := range ref {
		if got := t.get(k); got != n {
			tb.Fatalf("get(%#x) = %p, want %p", k, got, n)
		}
	}
	indexed := map[uint32]bool{}
	for si := range t.shard {
		s := &t.shard[si]
		c, full := len(s.slots), 0
		for i, e := range s.slots {
			if e.dist == 0 {
				continue
			}
			full++
			h := e.handle()
			if indexed[h] {
				tb.Fatalf("handle %#x indexed twice", h)
			}
			indexed[h] = true
			mk := t.mix(t.at(h).hash)
			if t.shardOf(mk) != s {
				tb.Fatalf("shard %d holds a node of shard %d", si, mk>>(64-ixShardBits))
			}
			if d := (i - s.home(mk) + c) % c; e.tag != uint8(mk) || int(e.dist) != d+1 {
				tb.Fatalf("shard %d slot %d: tag %#x dist %d, want %#x and %d", si, i, e.tag, e.dist, uint8(mk), d+1)
			}
			// Robin Hood order: a node off its home follows a full slot
			// whose node is at most one step nearer its own.
			if p := s.slots[(i-1+c)%c]; e.dist > 1 && p.dist < e.dist-1 {
				tb.Fatalf("shard %d slot %d: distance %d after one of %d", si, i, e.dist, p.dist)
			}
		}
		if full != s.n {
			tb.Fatalf("shard %d: %d full slots, counted %d", si, full, s.n)
		}
		if s.n*4 > c*3 || (c > max(ixMinSlots, s.floor) && s.n*4 < c) {
			tb.Fatalf("shard %d: %d nodes in %d slots", si, s.n, c)
		}
	}
	if len(indexed) != t.len() {
		tb.Fatalf("%d nodes indexed, len %d", len(indexed), t.len())
	}
	for _, h := range t.free {
		if indexed[h] {
			tb.Fatalf("handle %#x both free and indexed", h)
		}
	}
	if handed := (len(t.slabs)-1)*slabNodes + t.used; len(t.slabs) > 0 && len(t.free)+t.len() != handed {
		tb.Fatalf("%d free and %d indexed of %d handed out", len(t.free), t.len(), handed)
	}
	seen := 0
	t.each(func(n *node) {
		if seen++; ref[n.hash] != n {
			tb.Fatalf("each yields %#x, not in the table", n.hash)
		}
	})
	if seen != len(ref) {
		tb.Fatalf("each yields %d nodes, want %d", seen, len(ref))
	}
	for range 100 {
		if k := rand.Uint64(); ref[k] == nil && t.get(k) != nil {
			tb.Fatalf("get(%#x) found a hash never added", k)
		}
	}
}

// addHeld adds k as record does, held by replica 0 so that each sees it.
func (t *nodeTable) addHeld(k uint64) *node {
	n := t.add(k)
	n.one.replica = 0
	return n
}

func TestNodeTableAgainstMap(t *testing.T) {
	for _, tc := range []struct {
		name string
		keys uint64 // hashes drawn from [0, keys) scrambled, so that they repeat
		ops  int
	}{
		{"few", 40, 20_000},
		{"many", 50_000, 300_000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(7, tc.keys))
			x := newNodeTable()
			ref := map[uint64]*node{}
			for i := range tc.ops {
				k := r.Uint64N(tc.keys) * 0x9e3779b97f4a7c15
				switch n := ref[k]; {
				case r.IntN(10) == 0:
					if got := x.get(k); got != n {
						t.Fatalf("op %d: get(%#x) = %p, want %p", i, k, got, n)
					}
				case n == nil && r.IntN(5) < 3:
					ref[k] = x.addHeld(k)
				case n != nil:
					x.remove(n)
					delete(ref, k)
				}
				if i%(tc.ops/20) == 0 {
					x.check(t, ref)
				}
			}
			x.check(t, ref)
		})
	}
}

// TestNodeTableGrowsShrinksAndReuses: filled, the table grows by steps and
// stays at most 3/4 full; emptied, it gives its slots back; filled again,
// it reuses the nodes it freed, most recently freed first, before it adds
// a slab.
func TestNodeTableGrowsShrinksAndReuses(t *testing.T) {
	x := newNodeTable()
	ref := map[uint64]*node{}
	slots := func() int {
		c := 0
		for i := range x.shard {
			c += len(x.shard[i].slots)
		}
		return c
	}
	const n = 400_000 // past 1,024 slots a shard: grown by quarters
	for i := range uint64(n) {
		k := i * 0x9e3779b97f4a7c15
		ref[k] = x.addHeld(k)
	}
	x.check(t, ref)
	if c := slots(); c*3 < n*4 || c > n*2 {
		t.Fatalf("%d nodes in %d slots", n, c)
	}
	slabs := len(x.slabs)
	freed := map[*node]bool{}
	var last *node
	for _, keep := range []int{n / 10, 0} { // emptied to a tenth, then empty
		for k, nd := range ref {
			if len(ref) == keep {
				break
			}
			x.remove(nd)
			delete(ref, k)
			freed[nd], last = true, nd
		}
		x.check(t, ref)
	}
	if c := slots(); c > ixShards*ixMinSlots {
		t.Fatalf("%d slots left when empty", c)
	}
	if nd := x.addHeld(1); nd != last {
		t.Fatal("the node removed last is not the first reused")
	} else {
		ref[1] = nd
	}
	for i := range uint64(n - 1) {
		k := i*0x9e3779b97f4a7c15 + 2
		nd := x.addHeld(k)
		if !freed[nd] {
			t.Fatalf("add %d: a node never freed while %d were", i, len(freed))
		}
		if nd.hash != k || nd.one.replica != 0 || nd.parent != nil || nd.heat != 0 {
			t.Fatalf("add %d: a reused node not cleared: %+v", i, *nd)
		}
		delete(freed, nd)
		ref[k] = nd
	}
	x.check(t, ref)
	if len(x.slabs) != slabs {
		t.Fatalf("%d slabs after refilling, %d before", len(x.slabs), slabs)
	}
}

// TestNodeTableFarFromHome: nodes whose hashes all mix into one narrow
// stretch of a shard fall more than ixMaxDist from home; the shard then
// grows until they do not, stays that large while they are there, and
// every node is still found.
func TestNodeTableFarFromHome(t *testing.T) {
	// 300 mixed hashes in shard 5, all with one tag, 2⁻¹⁶ or 2⁻²⁰ of the
	// shard apart: the load alone would grow the shard to 512 slots,
	// where they span 2.3 or 0.15. The second needs the shard doubled
	// more than once at a time.
	for _, spacing := range []uint{48, 44} {
		t.Run(fmt.Sprintf("2^-%d", 64-spacing), func(t *testing.T) {
			x := newNodeTable()
			ref := map[uint64]*node{}
			const count, shard = 300, 5
			for i := range uint64(count) {
				frac := 0x3c00_0000_0000_0000 + i<<spacing
				k := x.unmix(shard<<(64-ixShardBits) | frac>>ixShardBits)
				ref[k] = x.addHeld(k)
			}
			x.check(t, ref)
			s := &x.shard[shard]
			if c := len(s.slots); c < 1024 || s.floor != c {
				t.Fatalf("%d slots (floor %d) for %d nodes close together: the shard never grew past the load's 512", c, s.floor, count)
			}
			for k, nd := range ref {
				x.remove(nd)
				delete(ref, k)
				if len(ref)%50 == 0 {
					x.check(t, ref)
				}
			}
			if c := len(s.slots); c != ixMinSlots || s.floor != 0 {
				t.Fatalf("emptied, the shard keeps %d slots (floor %d)", c, s.floor)
			}
		})
	}
}

// unmix inverts mix: the hash that mixes to mk.
func (t *nodeTable) unmix(mk uint64) uint64 {
	inverse := func(a uint64) uint64 { // of an odd a, mod 2⁶⁴ (Newton)
		x := a
		for range 6 {
			x *= 2 - a*x
		}
		return x
	}
	k := mk
	k ^= k >> 33 // x ^= x>>33 undoes itself
	k *= inverse(0xc4ceb9fe1a85ec53)
	k ^= k >> 33
	k *= inverse(0xff51afd7ed558ccd)
	k ^= k >> 33
	return k ^ t.seed
}

func TestUnmix(t *testing.T) {
	x := newNodeTable()
	for range 1000 {
		if mk := rand.Uint64(); x.mix(x.unmix(mk)) != mk {
			t.Fatalf("mix(unmix(%#x)) = %#x", mk, x.mix(x.unmix(mk)))
		}
	}
}
