package policies

import (
	"fmt"
	"math"
	"math/rand"
	"sort"
	"testing"

	"github.com/semroute/semroute/blockhash"
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
		{"lfu", "[2 4 3 1]"},             // hits 0, 1 (older), 1, 5
		{"static_semantic", "[2 3 4 1]"}, // values 0, ln2, 2 ln2, ln6
		{"vllm", "[1 4 2 3]"},            // nothing freed: as LRU
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
	p := NewAdaptiveSemantic(AdaptiveParams{AdmitBelow: 0.9}).(*adaptive)
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
	"static_semantic": byFields(func(i Info) float64 {
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
