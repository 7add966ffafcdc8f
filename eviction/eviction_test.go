package eviction

import (
	"fmt"
	"math"
	"math/rand"
	"sort"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/plugin"
)

func drain(p Policy) []uint64 {
	var got []uint64
	for {
		k, ok := p.Victim()
		if !ok {
			return got
		}
		got = append(got, k)
	}
}

func TestOrders(t *testing.T) {
	type ev struct {
		key  uint64
		info Info
	}
	// Four leaves: 1 old and hit often, 2 new and never hit, 3 oldest by
	// insertion but touched recently, 4 system prompt hit once.
	leaves := []ev{
		{1, Info{Kind: blockhash.KindUserHistory, Tokens: 64, Inserted: 20, LastUsed: 30, Hits: 5}},
		{2, Info{Kind: blockhash.KindUserQuery, Tokens: 64, Inserted: 50, LastUsed: 50}},
		{3, Info{Kind: blockhash.KindOther, Tokens: 64, Inserted: 10, LastUsed: 60, Hits: 1}},
		{4, Info{Kind: blockhash.KindSystem, Tokens: 64, Inserted: 15, LastUsed: 40, Hits: 1}},
	}
	cases := []struct {
		policy string
		want   string
	}{
		{"fifo", "[3 4 1 2]"},
		{"lru", "[1 4 2 3]"},
		{"lfu", "[2 4 3 1]"},           // hits 0, 1 (older), 1, 5
		{"kind_weighted", "[2 3 4 1]"}, // values 0, ln2, 2 ln2, ln6
		{"vllm", "[1 4 2 3]"},          // nothing freed: as LRU
	}
	for _, tc := range cases {
		t.Run(tc.policy, func(t *testing.T) {
			f, err := Lookup(tc.policy)
			if err != nil {
				t.Fatal(err)
			}
			p := f()
			for _, e := range leaves {
				p.Evictable(e.key, e.info)
			}
			if got := fmt.Sprint(drain(p)); got != tc.want {
				t.Fatalf("victims %s, want %s", got, tc.want)
			}
		})
	}
}

func TestLRUTiesTailFirstAndTouch(t *testing.T) {
	p := NewLRU()
	p.Evictable(1, Info{LastUsed: 5, Depth: 0})
	p.Evictable(2, Info{LastUsed: 5, Depth: 3})
	p.Evictable(3, Info{LastUsed: 5, Depth: 1})
	p.Touched(2, Info{LastUsed: 9, Depth: 3})
	p.Touched(7, Info{LastUsed: 1}) // not evictable: ignored
	p.Removed(8)                    // unknown: ignored
	if got := fmt.Sprint(drain(p)); got != "[3 1 2]" {
		t.Fatalf("victims %s", got)
	}
}

func TestVLLMOrdersByFreeTime(t *testing.T) {
	p := NewVLLM()
	p.Evictable(1, Info{LastUsed: 10})
	p.Evictable(2, Info{LastUsed: 20})
	// Request 1 ran long: its block was freed after request 2's.
	p.(FreeObserver).Freed(1, Info{LastUsed: 10, Freed: 30})
	p.(FreeObserver).Freed(2, Info{LastUsed: 20, Freed: 25})
	if got := fmt.Sprint(drain(p)); got != "[2 1]" {
		t.Fatalf("victims %s, want [2 1]", got)
	}
}

func TestSizeLRUPrefersBigBlocksAndAges(t *testing.T) {
	p := NewSizeLRU()
	p.Evictable(1, Info{Tokens: 64, LastUsed: 1})
	p.Evictable(2, Info{Tokens: 8, LastUsed: 2})
	if k, _ := p.Victim(); k != 1 {
		t.Fatalf("victim %d, want the 64-token block", k)
	}
	// L is now 1/64: a new big block (1/64 + 1/64) still loses to the small
	// one (1/8) ...
	p.Evictable(3, Info{Tokens: 64, LastUsed: 3})
	if k, _ := p.Victim(); k != 3 {
		t.Fatalf("victim %d, want 3", k)
	}
	// ... but every eviction inflates L by 1/64, and once L passes the small
	// block's credit (1/8) its old credit loses to new big blocks.
	for i := uint64(10); ; i++ {
		p.Evictable(i, Info{Tokens: 64, LastUsed: int64(i)})
		k, _ := p.Victim()
		if k == 2 {
			if i < 15 {
				t.Fatalf("small block evicted after %d big ones, too soon", i-10)
			}
			break
		}
		if i > 30 {
			t.Fatal("the old small block is never evicted")
		}
	}
}

func TestAdaptiveLearnsAndDecays(t *testing.T) {
	const s = int64(1e9)
	p := NewAdaptiveKind(AdaptiveParams{AdmitBelow: 0.9}).(*adaptive)
	base := p.ap.Weights[blockhash.KindCode]
	// Regret: a code block evicted and inserted again raises code's weight.
	p.Evictable(1, Info{Kind: blockhash.KindCode, Tokens: 64, LastUsed: 1 * s})
	k, _ := p.Victim()
	p.Evicted(k, Info{Kind: blockhash.KindCode})
	p.Evictable(1, Info{Kind: blockhash.KindCode, Tokens: 64, LastUsed: 2 * s})
	if w := p.weight(blockhash.KindCode, 2*s); math.Abs(w-(base+0.05)) > 1e-9 {
		t.Fatalf("after regret: weight %v, want %v", w, base+0.05)
	}
	// Hits raise it more; idle time decays it back toward the base.
	for i := 0; i < 10; i++ {
		p.Touched(1, Info{Kind: blockhash.KindCode, Tokens: 64, LastUsed: 2 * s, Hits: int32(i + 1)})
	}
	if w := p.weight(blockhash.KindCode, 2*s); math.Abs(w-(base+0.15)) > 1e-9 {
		t.Fatalf("after hits: %v", w)
	}
	if w := p.weight(blockhash.KindCode, 62*s); math.Abs(w-(base+0.075)) > 1e-9 {
		t.Fatalf("after one half-life: %v, want %v", w, base+0.075)
	}
	// An idle block loses to a fresh one of the same value.
	// Block 1's 10 hits are worth about 3.6×, under two half-lives of
	// idleness: a fresh block inserted 100 s later still loses to it, one
	// inserted 300 s later wins.
	p.Evictable(2, Info{Kind: blockhash.KindCode, Tokens: 64, LastUsed: 100 * s})
	if k, _ := p.Victim(); k != 2 {
		t.Fatalf("victim %d, want the fresh unhit block", k)
	}
	p.Evictable(3, Info{Kind: blockhash.KindCode, Tokens: 64, LastUsed: 300 * s})
	if k, _ := p.Victim(); k != 1 {
		t.Fatalf("victim %d, want the long-idle block", k)
	}
	// Admission: when full, a kind far below the mean is refused.
	q := Info{Kind: blockhash.KindUserQuery, Tokens: 64, LastUsed: 100 * s}
	if p.Admit(q, 1000, 1000) { // user_query 0.5 vs a mean above 1.1
		t.Fatal("low-value kind admitted into a full cache")
	}
	if !p.Admit(q, 0, 1000) {
		t.Fatal("refused with room to spare")
	}
}

func TestLookup(t *testing.T) {
	for _, n := range Names() {
		if f, err := Lookup(n); err != nil || f() == nil {
			t.Errorf("Lookup(%q): %v", n, err)
		}
	}
	if _, err := Lookup("nope"); err == nil {
		t.Fatal("Lookup accepted an unknown name")
	}
	if _, err := Lookup(Default); err != nil {
		t.Fatal(err)
	}
}

// refPolicy is the O(n) reference: it keeps every candidate's Info and scans
// for the lowest key under its own less function.
type refPolicy struct {
	m    map[uint64]Info
	less func(a, b Info) bool
}

func (r *refPolicy) victim() (uint64, bool) {
	keys := make([]uint64, 0, len(r.m))
	for k := range r.m {
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return 0, false
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := r.m[keys[i]], r.m[keys[j]]
		if r.less(a, b) != r.less(b, a) {
			return r.less(a, b)
		}
		return keys[i] < keys[j]
	})
	delete(r.m, keys[0])
	return keys[0], true
}

// byFields compares Infos field by field, the first field that differs
// deciding; each field function returns a number, lower evicted first.
func byFields(fs ...func(Info) float64) func(a, b Info) bool {
	return func(a, b Info) bool {
		for _, f := range fs {
			if x, y := f(a), f(b); x != y {
				return x < y
			}
		}
		return false
	}
}

var (
	lastUsed = func(i Info) float64 { return float64(i.LastUsed) }
	deeper   = func(i Info) float64 { return -float64(i.Depth) }
)

var references = map[string]func(a, b Info) bool{
	"fifo": byFields(func(i Info) float64 { return float64(i.Inserted) }, deeper),
	"lru":  byFields(lastUsed, deeper),
	"lfu":  byFields(func(i Info) float64 { return float64(i.Hits) }, lastUsed, deeper),
	"vllm": byFields(func(i Info) float64 { return float64(max(i.LastUsed, i.Freed)) }, deeper),
	"kind_weighted": byFields(func(i Info) float64 {
		return DefaultKindValues()[i.Kind] * math.Log(1+float64(i.Hits)) // tokens^(1-1) = 1
	}, lastUsed, deeper),
}

// FuzzPoliciesAgainstReference drives each stateless policy and its O(n)
// reference with the same operations and compares every victim.
func FuzzPoliciesAgainstReference(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11})
	f.Add([]byte{3, 3, 3, 1, 1, 2, 0, 0, 0, 250, 7, 7, 7})
	f.Add([]byte{0, 17, 0, 33, 0, 49, 1, 17, 3, 0, 3, 0})
	f.Fuzz(func(t *testing.T, ops []byte) {
		for name, less := range references {
			fac, _ := Lookup(name)
			p, ref := fac(), &refPolicy{m: map[uint64]Info{}, less: less}
			for i := 0; i+2 < len(ops); i += 3 {
				key := uint64(ops[i+1] % 16)
				info := Info{
					Kind: blockhash.Kind(ops[i+2] % uint8(blockhash.NumKinds)), Tokens: 64,
					LastUsed: int64(ops[i+1] / 16), Inserted: int64(ops[i+2] / 32), Depth: int32(ops[i] / 64),
					Hits: int32(ops[i+2] % 3),
				}
				switch ops[i] % 4 {
				case 0:
					p.Evictable(key, info)
					ref.m[key] = info
				case 1:
					if old, ok := ref.m[key]; ok { // a hit on a candidate: keep its identity
						old.LastUsed, old.Hits, old.Freed = old.LastUsed+info.LastUsed, old.Hits+1, info.Inserted
						ref.m[key] = old
						p.Touched(key, old)
						if fo, ok := p.(FreeObserver); ok {
							fo.Freed(key, old)
						}
					} else {
						p.Touched(key, info)
					}
				case 2:
					p.Removed(key)
					delete(ref.m, key)
				case 3:
					k1, ok1 := p.Victim()
					k2, ok2 := ref.victim()
					if k1 != k2 || ok1 != ok2 {
						t.Fatalf("%s, op %d: victim %d,%v want %d,%v", name, i/3, k1, ok1, k2, ok2)
					}
				}
				if p.Len() != len(ref.m) {
					t.Fatalf("%s: Len %d, want %d", name, p.Len(), len(ref.m))
				}
			}
		}
	})
}

// FuzzStatefulPolicies checks what holds for every policy, including the
// stateful ones: a victim is always a current candidate, exactly once.
func FuzzStatefulPolicies(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11})
	f.Add([]byte{0, 5, 0, 6, 3, 0, 0, 5, 3, 1, 3, 9})
	f.Fuzz(func(t *testing.T, ops []byte) {
		for _, name := range Names() {
			fac, _ := Lookup(name)
			p := fac()
			in := map[uint64]bool{}
			for i := 0; i+1 < len(ops); i += 2 {
				key := uint64(ops[i+1] % 16)
				info := Info{Kind: blockhash.Kind(ops[i+1] % uint8(blockhash.NumKinds)), Tokens: int32(1 + ops[i]%64), LastUsed: int64(i) * 1e9, Inserted: int64(i)}
				switch ops[i] % 4 {
				case 0:
					p.Evictable(key, info)
					in[key] = true
				case 1:
					p.Touched(key, info)
				case 2:
					p.Removed(key)
					delete(in, key)
				case 3:
					k, ok := p.Victim()
					if ok != (len(in) > 0) || (ok && !in[k]) {
						t.Fatalf("%s: victim %d,%v from %v", name, k, ok, in)
					}
					delete(in, k)
					if e, isE := p.(Evicted); isE && ok {
						e.Evicted(k, info)
					}
				}
				if p.Len() != len(in) {
					t.Fatalf("%s: Len %d, want %d", name, p.Len(), len(in))
				}
			}
		}
	})
}

func BenchmarkPolicyChurn(b *testing.B) {
	for _, name := range Names() {
		b.Run(name, func(b *testing.B) {
			fac, _ := Lookup(name)
			p := fac()
			rng := rand.New(rand.NewSource(1))
			for i := 0; i < 100000; i++ {
				p.Evictable(uint64(i), Info{Tokens: 64, LastUsed: int64(i)})
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				k, _ := p.Victim()
				p.Evictable(k, Info{Tokens: 64, LastUsed: int64(100000 + i), Depth: int32(rng.Intn(8)), Hits: int32(rng.Intn(3))})
			}
		})
	}
}

// refGDS is GreedyDual-Size written the obvious way: credits in a map,
// linear scan for the victim.
type refGDS struct {
	l float64
	h map[uint64]float64
	i map[uint64]Info
}

func (r *refGDS) set(k uint64, info Info) {
	r.h[k], r.i[k] = r.l+1/float64(max(info.Tokens, 1)), info
}

func (r *refGDS) victim() (uint64, bool) {
	best, found := uint64(0), false
	for k := range r.h {
		if !found {
			best, found = k, true
			continue
		}
		a, b := r.h[k], r.h[best]
		ia, ib := r.i[k], r.i[best]
		if a < b || (a == b && (ia.LastUsed < ib.LastUsed || (ia.LastUsed == ib.LastUsed && (ia.Depth > ib.Depth || (ia.Depth == ib.Depth && k < best))))) {
			best = k
		}
	}
	if found {
		r.l = r.h[best]
		delete(r.h, best)
		delete(r.i, best)
	}
	return best, found
}

// refAdaptive re-implements the adaptive policy's rules directly: learned
// weights per kind, ghosts as a plain map (no bound), and a linear scan over
// decayed values.
type refAdaptive struct {
	ap     AdaptiveParams
	w      [blockhash.NumKinds]float64
	at     [blockhash.NumKinds]int64
	ghosts map[uint64]blockhash.Kind
	cands  map[uint64]Info
	keys   map[uint64]float64 // order key computed when the block was last queued or touched
}

func (r *refAdaptive) victim() (uint64, bool) {
	best, found := uint64(0), false
	for k := range r.cands {
		if !found {
			best, found = k, true
			continue
		}
		a, b := r.keys[k], r.keys[best]
		da, db := r.cands[k].Depth, r.cands[best].Depth
		if a < b || (a == b && (da > db || (da == db && k < best))) {
			best = k
		}
	}
	return best, found
}

func (r *refAdaptive) weight(k blockhash.Kind, now int64) float64 {
	if r.at[k] != 0 && now > r.at[k] {
		base := r.ap.Weights[k]
		r.w[k] = base + (r.w[k]-base)*math.Pow(2, -float64(now-r.at[k])/float64(r.ap.WeightHalfLife))
	}
	if now > r.at[k] {
		r.at[k] = now
	}
	return r.w[k]
}

func (r *refAdaptive) learn(k blockhash.Kind, g float64, now int64) {
	r.w[k] = math.Min(math.Max(r.weight(k, now)+g, r.ap.MinWeight), r.ap.MaxWeight)
}

func (r *refAdaptive) key(i Info) float64 {
	t := float64(max(i.Tokens, 1))
	v := (1 + math.Log(1+float64(i.Hits))) * r.weight(i.Kind, i.LastUsed) * t / math.Pow(t, r.ap.SizeExponent)
	return float64(i.LastUsed) + float64(r.ap.WeightHalfLife)/math.Ln2*math.Log(v)
}

// FuzzStatefulAgainstReference compares size_lru and kind_adaptive with
// their references, each over the same operations.
func FuzzStatefulAgainstReference(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14})
	f.Add([]byte{0, 5, 9, 3, 0, 0, 0, 5, 200, 1, 5, 7, 3, 1, 1})
	f.Add([]byte("00020001B0X0700100700"))
	type op struct {
		kind int // 0 insert, 1 hit (if a candidate, else insert), 2 remove, 3 victim
		key  uint64
		info Info
	}
	decode := func(ops []byte) []op {
		var out []op
		for i := 0; i+2 < len(ops); i += 3 {
			out = append(out, op{int(ops[i] % 4), uint64(ops[i+1] % 8), Info{
				Kind: blockhash.Kind(ops[i+2] % uint8(blockhash.NumKinds)), Tokens: int32(1 + ops[i+2]%64),
				LastUsed: int64(i) * 1e9, Depth: int32(ops[i] / 64), Hits: int32(ops[i+1] / 32),
			}})
		}
		return out
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		ops := decode(raw)
		// GreedyDual-Size.
		gds, gref := NewSizeLRU(), &refGDS{h: map[uint64]float64{}, i: map[uint64]Info{}}
		for n, o := range ops {
			switch o.kind {
			case 0, 1:
				if old, ok := gref.i[o.key]; ok && o.kind == 1 {
					o.info.Kind, o.info.Tokens, o.info.Depth, o.info.Hits = old.Kind, old.Tokens, old.Depth, old.Hits+1
					gds.Touched(o.key, o.info)
				} else {
					gds.Evictable(o.key, o.info)
				}
				gref.set(o.key, o.info)
			case 2:
				gds.Removed(o.key)
				delete(gref.h, o.key)
				delete(gref.i, o.key)
			case 3:
				k1, ok1 := gds.Victim()
				k2, ok2 := gref.victim()
				if k1 != k2 || ok1 != ok2 {
					t.Fatalf("size_lru op %d: victim %d,%v want %d,%v", n, k1, ok1, k2, ok2)
				}
			}
		}
		// Adaptive semantic.
		ap := AdaptiveParams{}
		ap.defaults()
		ad := NewAdaptiveKind(ap).(*adaptive)
		aref := &refAdaptive{ap: ap, w: *ap.Weights, ghosts: map[uint64]blockhash.Kind{}, cands: map[uint64]Info{}, keys: map[uint64]float64{}}
		for n, o := range ops {
			switch o.kind {
			case 0, 1:
				if old, ok := aref.cands[o.key]; ok && o.kind == 1 {
					o.info.Kind, o.info.Tokens, o.info.Depth, o.info.Hits = old.Kind, old.Tokens, old.Depth, old.Hits+1
					ad.Touched(o.key, o.info)
					aref.learn(o.info.Kind, ap.HitGain, o.info.LastUsed)
				} else {
					ad.Evictable(o.key, o.info)
					if k, ok := aref.ghosts[o.key]; ok {
						delete(aref.ghosts, o.key)
						aref.learn(k, ap.RegretGain, o.info.LastUsed)
					}
				}
				aref.cands[o.key], aref.keys[o.key] = o.info, aref.key(o.info)
			case 2:
				ad.Removed(o.key)
				delete(aref.cands, o.key)
				delete(aref.keys, o.key)
			case 3:
				a1, ok1 := ad.Victim()
				a2, ok2 := aref.victim()
				if a1 != a2 || ok1 != ok2 {
					t.Fatalf("adaptive op %d: victim %d,%v want %d,%v", n, a1, ok1, a2, ok2)
				}
				if ok1 {
					ad.Evicted(a1, aref.cands[a1])
					aref.ghosts[a1] = aref.cands[a1].Kind
					delete(aref.cands, a1)
					delete(aref.keys, a1)
				}
			}
			for k := range ad.w {
				now := o.info.LastUsed
				if got, want := ad.weight(blockhash.Kind(k), now), aref.weight(blockhash.Kind(k), now); math.Abs(got-want) > 1e-9 {
					t.Fatalf("op %d: learned weight of %s %v, reference %v", n, blockhash.Kind(k), got, want)
				}
			}
		}
	})
}

// Items popped or removed are reused: evicting chains leaf first, as the
// cache picture does, allocates nothing per block.
func TestPrioHeapReusesItems(t *testing.T) {
	p := NewLRU()
	allocs := testing.AllocsPerRun(100, func() {
		for i := uint64(0); i < 64; i++ {
			p.Evictable(i, Info{LastUsed: int64(i)})
			if k, ok := p.Victim(); !ok || k != i {
				t.Fatalf("victim %d %v, want %d", k, ok, i)
			}
		}
	})
	if allocs > 1 {
		t.Fatalf("%.0f allocations for 64 set/pop rounds", allocs)
	}
}

// TestPrioHeapAgainstScan: over random sets, updates, removals and pops —
// pops followed at once by a set, as eviction does when a leaf's parent
// becomes a leaf, half the time — the heap pops what a scan for the
// lowest (a, b, c, key) finds, and Len counts what is held.
func TestPrioHeapAgainstScan(t *testing.T) {
	rng := rand.New(rand.NewSource(7))
	h := newPrioHeap()
	ref := map[uint64]prio{}
	less := func(k1 uint64, p1 prio, k2 uint64, p2 prio) bool {
		if p1 != p2 {
			return p1.a < p2.a || p1.a == p2.a && (p1.b < p2.b || p1.b == p2.b && p1.c < p2.c)
		}
		return k1 < k2
	}
	// c is negative, as -depth is in the real policies: a zeroed stale
	// root would otherwise pass for the lowest.
	randPrio := func() prio { return prio{a: float64(rng.Intn(4)), b: int64(rng.Intn(8)), c: -int64(rng.Intn(3))} }
	for op := 0; op < 200000; op++ {
		k := uint64(rng.Intn(64))
		switch r := rng.Intn(10); {
		case r < 4:
			p := randPrio()
			h.set(k, p)
			ref[k] = p
		case r < 5:
			p := randPrio()
			h.update(k, p)
			if _, ok := ref[k]; ok {
				ref[k] = p
			}
		case r < 6:
			h.remove(k)
			delete(ref, k)
		default:
			var want uint64
			found := false
			for rk, rp := range ref {
				if !found || less(rk, rp, want, ref[want]) {
					want, found = rk, true
				}
			}
			got, ok := h.pop()
			if ok != found || got != want {
				t.Fatalf("op %d: pop %d,%v, want %d,%v", op, got, ok, want, found)
			}
			delete(ref, want)
			if found && rng.Intn(2) == 0 { // the parent becomes a leaf
				k := uint64(64 + rng.Intn(64))
				p := randPrio()
				h.set(k, p)
				ref[k] = p
			}
		}
		if h.Len() != len(ref) {
			t.Fatalf("op %d: Len %d, want %d", op, h.Len(), len(ref))
		}
	}
}

// TestNewWithParams: the parametrised policies take their parameters by
// name, refuse wrong ones with the names they have, and the others take
// none.
func TestNewWithParams(t *testing.T) {
	for _, name := range Names() {
		if _, err := Lookup(name); err != nil {
			t.Errorf("%s with defaults: %v", name, err)
		}
		if ParamNames(name) == nil {
			if _, err := New(plugin.Spec{Type: name, Params: plugin.Params{"x": 1}}); err == nil {
				t.Errorf("%s took a parameter", name)
			}
		}
	}
	good := plugin.Params{"weights": map[string]any{"system": 5, "user_query": 0}, "size_exponent": 0.5, "hit_gain": 0.1,
		"weight_half_life": "30s", "ghosts": 100, "admit_below": -1}
	f, err := New(plugin.Spec{Type: "adaptive_semantic", Params: good})
	if err != nil {
		t.Fatal(err)
	}
	if ap := f().(*adaptive).ap; ap.Weights[blockhash.KindSystem] != 5 || ap.Weights[blockhash.KindTools] != 2 || ap.SizeExponent != 0.5 ||
		ap.WeightHalfLife != 30*time.Second || ap.Ghosts != 100 || ap.AdmitBelow != -1 || ap.RegretGain != 0.05 {
		t.Errorf("adaptive params %+v", ap)
	}
	for _, bad := range []plugin.Spec{
		{Type: "static_semantic", Params: plugin.Params{"weights": map[string]any{"sytem": 1}}},
		{Type: "kind_weighted", Params: plugin.Params{"size_exponent": 0}},
		{Type: "kind_adaptive", Params: plugin.Params{"min_weight": 5, "max_weight": 1}},
		{Type: "kind_adaptive", Params: plugin.Params{"weight_half_life": "soon"}},
		{Type: "kind_adaptive", Params: plugin.Params{"ghost": 1}},
		{Type: "nope"},
	} {
		if _, err := New(bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}
