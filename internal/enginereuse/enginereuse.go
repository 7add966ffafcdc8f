// Package enginereuse is how the simulated engines reuse KV past the exact
// prefix: the replica of package simreplica and the replay's engine model.
// A Store keeps blended segments (CacheBlend in LMCache); Donors is a donor
// provider (SGLang's SemanticPrefixProvider, a semantic KV provider behind
// Dynamo). It is written apart from the router's credit for the same
// reuse (package routing, cachemodel.Segments, package matcher), with its
// own similarity measure and defaults, so that what a simulated engine
// reuses is not what the router predicts by construction.
package enginereuse

import (
	"errors"
	"slices"
	"sync"

	lru "github.com/hashicorp/golang-lru/v2/simplelru"
)

// DefaultRecompute is the share of a blended segment's tokens an engine
// computes again: CacheBlend's selective recompute ratio (LMCache's
// blend_recompute_ratio, 0.15).
const DefaultRecompute = 0.15

// DefaultMinSimilarity is the least Jaccard similarity of a donor an
// engine reuses. SGLang's SemanticPrefixProvider interface leaves it to the
// provider; half the shingles shared is this simulation's choice.
const DefaultMinSimilarity = 0.5

// Store is an engine's segment store: segment key → its tokens, under a
// token budget, least recently used first out. Safe for concurrent use.
type Store struct {
	mu     sync.Mutex
	budget int
	lru    *lru.LRU[uint64, int]
	tokens int // held, ≤ budget
}

// NewStore returns a Store of budget tokens whose segments are at least
// minTokens long (which bounds its entries).
func NewStore(budget, minTokens int) (*Store, error) {
	if budget < 0 || minTokens < 1 {
		return nil, errors.New("enginereuse: a store's budget must be ≥ 0 and its least segment positive")
	}
	s := &Store{budget: budget}
	l, err := lru.NewLRU[uint64, int](budget/minTokens+1, func(_ uint64, n int) { s.tokens -= n })
	if err != nil {
		return nil, err
	}
	s.lru = l
	return s, nil
}

// Has reports whether the store holds segment key, and marks it used.
func (s *Store) Has(key uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.lru.Get(key)
	return ok
}

// Put stores segment key of tokens tokens, evicting the least recently
// used past the budget; a segment larger than the budget is not stored.
func (s *Store) Put(key uint64, tokens int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if tokens > s.budget || tokens <= 0 {
		return
	}
	if _, ok := s.lru.Get(key); ok {
		return
	}
	for s.tokens+tokens > s.budget {
		s.lru.RemoveOldest()
	}
	s.lru.Add(key, tokens)
	s.tokens += tokens
}

// Held returns the segments and tokens stored.
func (s *Store) Held() (segments, tokens int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lru.Len(), s.tokens
}

// Clear empties the store.
func (s *Store) Clear() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lru.Purge()
}

// Sample is a prompt's text as Donors compares it: the hashes of its
// 5-word shingles kept by mod-m sampling (Broder, 1997: the shingles whose
// hash is 0 mod m, an unbiased sample for the resemblance of two texts),
// sorted, distinct.
type Sample []uint64

const (
	shingleWords = 5
	sampleMod    = 4    // one shingle in four, on average
	maxWords     = 8192 // words read per prompt
	perValue     = 32   // donors an index entry lists, latest kept

	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// NewSample returns the sample of text, its parts read as one.
func NewSample(text [][]byte) Sample {
	var words [][]byte
	for _, p := range text {
		for _, w := range splitWords(p) {
			if len(words) == maxWords {
				break
			}
			words = append(words, w)
		}
	}
	var out Sample
	for i := 0; i+shingleWords <= len(words); i++ {
		v := uint64(fnvOffset) // FNV-1a over the words, each followed by a 0 byte
		for _, w := range words[i : i+shingleWords] {
			for _, c := range w {
				v = (v ^ uint64(c)) * fnvPrime
			}
			v *= fnvPrime // ^ 0
		}
		if v = mix(v); v%sampleMod == 0 { // FNV-1a's low bits see only the bytes' low bits: mixed first
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func splitWords(b []byte) [][]byte {
	var out [][]byte
	start := -1
	for i, c := range b {
		space := c == ' ' || c == '\n' || c == '\t' || c == '\r'
		switch {
		case space && start >= 0:
			out = append(out, b[start:i])
			start = -1
		case !space && start < 0:
			start = i
		}
	}
	if start >= 0 {
		out = append(out, b[start:])
	}
	return out
}

// mix is a 64-bit finaliser (Stafford's variant 13, as SplitMix64's): every
// output bit depends on every input bit.
func mix(x uint64) uint64 {
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// Jaccard returns |a ∩ b| ÷ |a ∪ b| of two samples.
func Jaccard(a, b Sample) float64 {
	if len(a) == 0 && len(b) == 0 {
		return 0
	}
	inter := 0
	for i, j := 0, 0; i < len(a) && j < len(b); {
		switch {
		case a[i] < b[j]:
			i++
		case a[i] > b[j]:
			j++
		default:
			inter++
			i++
			j++
		}
	}
	return float64(inter) / float64(len(a)+len(b)-inter)
}

// Donors is one engine's donor provider: the prompts it finished, found
// again by the Jaccard similarity of their samples. Donors live in an LRU
// of a bounded size; an index from sample value to the latest donors
// holding it finds the candidates. Safe for concurrent use.
type Donors struct {
	min float64

	mu     sync.Mutex
	donors *lru.LRU[donorKey, Sample]
	index  map[uint64][]donorKey
}

type donorKey struct {
	ns  int // a namespace: the model the prompt was served under
	key uint64
}

// NewDonors returns a provider of at most max donors (0: 4,096) that
// reuses one at least minSimilarity similar (0: DefaultMinSimilarity).
func NewDonors(minSimilarity float64, max int) (*Donors, error) {
	if !(minSimilarity >= 0 && minSimilarity <= 1) || max < 0 {
		return nil, errors.New("enginereuse: the least similarity must be in [0, 1] and the donors ≥ 0")
	}
	if minSimilarity == 0 {
		minSimilarity = DefaultMinSimilarity
	}
	if max == 0 {
		max = 4096
	}
	d := &Donors{min: minSimilarity, index: map[uint64][]donorKey{}}
	d.donors, _ = lru.NewLRU(max, d.unindex) // max > 0
	return d, nil
}

// Put registers a finished prompt of namespace ns, keyed by key, with its
// sample.
func (d *Donors) Put(ns int, key uint64, s Sample) {
	if len(s) == 0 {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	k := donorKey{ns, key}
	if d.donors.Contains(k) {
		d.donors.Remove(k)
	}
	d.donors.Add(k, s)
	for _, v := range s {
		l := append(d.index[v], k)
		if len(l) > perValue {
			l = l[len(l)-perValue:]
		}
		d.index[v] = l
	}
}

// unindex drops an evicted donor from the index. d.mu is held.
func (d *Donors) unindex(k donorKey, s Sample) {
	for _, v := range s {
		l := slices.DeleteFunc(d.index[v], func(x donorKey) bool { return x == k })
		if len(l) == 0 {
			delete(d.index, v)
		} else {
			d.index[v] = l
		}
	}
}

// Find returns the key of the donor of namespace ns most similar to s, if
// one is at least the least similarity.
func (d *Donors) Find(ns int, s Sample) (key uint64, ok bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	seen := map[donorKey]bool{}
	best := d.min
	for _, v := range s {
		for _, k := range d.index[v] {
			if k.ns != ns || seen[k] {
				continue
			}
			seen[k] = true
			ds, _ := d.donors.Peek(k)
			if j := Jaccard(s, ds); j >= best {
				best, key, ok = j, k.key, true
			}
		}
	}
	if ok {
		d.donors.Get(donorKey{ns, key}) // used
	}
	return key, ok
}

// Forget drops the donor of namespace ns keyed by key.
func (d *Donors) Forget(ns int, key uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.donors.Remove(donorKey{ns, key})
}

// Clear forgets every donor.
func (d *Donors) Clear() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.donors.Purge()
}
