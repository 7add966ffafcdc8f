package policies

import (
	"math/rand"
	"sort"
	"testing"
)

func TestLRUOrder(t *testing.T) {
	cases := []struct {
		name  string
		steps func(p Policy)
		want  []uint64
	}{
		{"oldest first", func(p Policy) {
			p.Evictable(1, Info{LastUsed: 30})
			p.Evictable(2, Info{LastUsed: 10})
			p.Evictable(3, Info{LastUsed: 20})
		}, []uint64{2, 3, 1}},
		{"tail before head at one instant", func(p Policy) {
			p.Evictable(1, Info{LastUsed: 5, Depth: 0})
			p.Evictable(2, Info{LastUsed: 5, Depth: 3})
			p.Evictable(3, Info{LastUsed: 5, Depth: 1})
		}, []uint64{2, 3, 1}},
		{"touch moves back", func(p Policy) {
			p.Evictable(1, Info{LastUsed: 1})
			p.Evictable(2, Info{LastUsed: 2})
			p.Touched(1, Info{LastUsed: 3})
			p.Touched(9, Info{LastUsed: 0}) // not evictable: ignored
		}, []uint64{2, 1}},
		{"removed is gone", func(p Policy) {
			p.Evictable(1, Info{LastUsed: 1})
			p.Evictable(2, Info{LastUsed: 2})
			p.Removed(1)
			p.Removed(7)
		}, []uint64{2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := NewLRU()
			tc.steps(p)
			var got []uint64
			for {
				k, ok := p.Victim()
				if !ok {
					break
				}
				got = append(got, k)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("victims %v, want %v", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("victims %v, want %v", got, tc.want)
				}
			}
		})
	}
}

func TestLookup(t *testing.T) {
	if _, err := Lookup("lru"); err != nil {
		t.Fatal(err)
	}
	if _, err := Lookup("nope"); err == nil {
		t.Fatal("Lookup accepted an unknown name")
	}
}

// refLRU is the obvious O(n) reference.
type refLRU map[uint64]Info

func (r refLRU) victim() (uint64, bool) {
	keys := make([]uint64, 0, len(r))
	for k := range r {
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return 0, false
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := r[keys[i]], r[keys[j]]
		if a.LastUsed != b.LastUsed {
			return a.LastUsed < b.LastUsed
		}
		if a.Depth != b.Depth {
			return a.Depth > b.Depth
		}
		return keys[i] < keys[j]
	})
	delete(r, keys[0])
	return keys[0], true
}

func FuzzLRUAgainstReference(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})
	f.Add([]byte{3, 3, 3, 1, 1, 2, 0, 0, 0, 250})
	f.Fuzz(func(t *testing.T, ops []byte) {
		p, ref := NewLRU(), refLRU{}
		for i := 0; i+1 < len(ops); i += 2 {
			key := uint64(ops[i+1] % 16)
			info := Info{LastUsed: int64(ops[i+1] / 16), Depth: int32(ops[i] % 4)}
			switch ops[i] % 4 {
			case 0:
				p.Evictable(key, info)
				ref[key] = info
			case 1:
				p.Touched(key, info)
				if _, ok := ref[key]; ok {
					ref[key] = Info{LastUsed: info.LastUsed, Depth: ref[key].Depth}
					p.Touched(key, ref[key])
				}
			case 2:
				p.Removed(key)
				delete(ref, key)
			case 3:
				k1, ok1 := p.Victim()
				k2, ok2 := ref.victim()
				if k1 != k2 || ok1 != ok2 {
					t.Fatalf("op %d: victim %d,%v want %d,%v", i, k1, ok1, k2, ok2)
				}
			}
			if p.Len() != len(ref) {
				t.Fatalf("Len %d, want %d", p.Len(), len(ref))
			}
		}
	})
}

func BenchmarkLRUChurn(b *testing.B) {
	p := NewLRU()
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 100000; i++ {
		p.Evictable(uint64(i), Info{LastUsed: int64(i)})
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		k, _ := p.Victim()
		p.Evictable(k, Info{LastUsed: int64(100000 + i), Depth: int32(rng.Intn(8))})
	}
}
