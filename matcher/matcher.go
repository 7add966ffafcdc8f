// Package matcher is the reference semantic matcher (routing.Matcher): it
// finds a donor request whose text is similar to a new one, by the Jaccard
// similarity of their sets of word shingles, estimated with bottom-k MinHash
// sketches (Broder, 1997; Cohen and Kaplan, 2007).
//
// A request's sketch is the K smallest distinct hashes of its Shingle-word
// windows, over at most MaxWords words, so sketching is O(words × log K)
// and a donor costs O(K) memory. Donors live in an LRU of MaxDonors; an
// inverted index from sketch value to the latest PerValue donors holding it
// finds candidates in O(K × PerValue). A MinHash is safe for concurrent use.
package matcher

import (
	"cmp"
	"container/heap"
	"errors"
	"slices"
	"sort"
	"sync"

	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2/simplelru"
)

// Options configure a MinHash. Zero fields take the defaults.
type Options struct {
	Shingle       int     // words per shingle; default 5
	K             int     // sketch size; default 64
	MinSimilarity float64 // least estimated Jaccard similarity of a donor; default 0.5
	MaxDonors     int     // donors remembered; default 10,000
	MaxWords      int     // words read per request; default 20,000
}

// MinHash is a bounded donor index.
type MinHash struct {
	o Options

	mu     sync.Mutex
	donors *lru.LRU[donorKey, donor]
	index  map[uint64][]donorKey // sketch value → the latest PerValue donors holding it, oldest first
}

// PerValue bounds the donors an index entry lists: a document that
// thousands of donors share costs a lookup at most K × PerValue votes, and
// the latest donors holding it are the ones kept.
const PerValue = 64

// donor is a registered prompt: its sketch and its tokens.
type donor struct {
	sketch []uint64
	tokens int
}

type donorKey struct {
	replica int
	key     uint64
}

// New returns an empty MinHash matcher.
// Defaults of Options.MinSimilarity and MaxDonors.
const (
	DefaultMinSimilarity = 0.5
	DefaultMaxDonors     = 10000
)

func New(o Options) (*MinHash, error) {
	if o.Shingle == 0 {
		o.Shingle = 5
	}
	if o.K == 0 {
		o.K = 64
	}
	o.MinSimilarity = cmp.Or(o.MinSimilarity, DefaultMinSimilarity)
	o.MaxDonors = cmp.Or(o.MaxDonors, DefaultMaxDonors)
	if o.MaxWords == 0 {
		o.MaxWords = 20000
	}
	if o.Shingle < 1 || o.K < 1 || o.MaxDonors < 1 || o.MaxWords < 1 || !(o.MinSimilarity >= 0 && o.MinSimilarity <= 1) {
		return nil, errors.New("matcher: shingle, k, max donors and max words must be positive and min similarity in [0, 1]")
	}
	m := &MinHash{o: o, index: map[uint64][]donorKey{}}
	m.donors, _ = lru.NewLRU[donorKey, donor](o.MaxDonors, m.unindex) // MaxDonors > 0
	return m, nil
}

// maxHeap keeps the K smallest values seen: its root is the largest kept.
type maxHeap []uint64

func (h maxHeap) Len() int           { return len(h) }
func (h maxHeap) Less(i, j int) bool { return h[i] > h[j] }
func (h maxHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *maxHeap) Push(x any)        { *h = append(*h, x.(uint64)) }
func (h *maxHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

func isSpace(c byte) bool { return c == ' ' || c == '\n' || c == '\t' || c == '\r' }

// Sketch implements routing.Matcher: it returns text's bottom-k sketch,
// sorted ascending, a new slice. A non-empty model salts every shingle's
// hash (and mixes it again, so that the K smallest are a fresh sample), so
// that sketches of different models share no values and are never similar;
// "" leaves the hashes as they are.
func (m *MinHash) Sketch(model string, text [][]byte) []uint64 {
	salt := uint64(0)
	if model != "" {
		salt = xxhash.Sum64String(model)
	}
	var words [][2]int // per part: word start and end offsets
	h := make(maxHeap, 0, m.o.K+1)
	seen := make(map[uint64]struct{}, m.o.K*2)
	total := 0
	for _, t := range text {
		words = appendWords(words[:0], t, m.o.MaxWords-total)
		total += len(words)
		n := min(m.o.Shingle, len(words))
		for w := 0; w+n <= len(words) && n > 0; w++ {
			v := xxhash.Sum64(t[words[w][0]:words[w+n-1][1]])
			if salt != 0 {
				v = mix64(v ^ salt)
			}
			if _, dup := seen[v]; dup {
				continue
			}
			if len(h) < m.o.K {
				seen[v] = struct{}{}
				heap.Push(&h, v)
			} else if v < h[0] {
				delete(seen, h[0])
				seen[v] = struct{}{}
				h[0] = v
				heap.Fix(&h, 0)
			}
		}
	}
	out := []uint64(h)
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// appendWords appends the start and end offsets of t's first limit words
// (runs of bytes other than spaces) to words.
func appendWords(words [][2]int, t []byte, limit int) [][2]int {
	for i, n := 0, 0; i < len(t) && n < limit; {
		for i < len(t) && isSpace(t[i]) {
			i++
		}
		start := i
		for i < len(t) && !isSpace(t[i]) {
			i++
		}
		if i > start {
			words = append(words, [2]int{start, i})
			n++
		}
	}
	return words
}

// mix64 is SplitMix64's finaliser (Steele, Lea and Flood, 2014): a
// bijection of uint64 whose outputs look independent of its inputs.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// Similarity estimates the Jaccard similarity of the sets two sorted
// sketches summarise: among the K smallest values of their union, the share
// present in both.
func (m *MinHash) Similarity(a, b []uint64) float64 {
	i, j, taken, both := 0, 0, 0, 0
	for taken < m.o.K && (i < len(a) || j < len(b)) {
		switch {
		case j >= len(b) || (i < len(a) && a[i] < b[j]):
			i++
		case i >= len(a) || b[j] < a[i]:
			j++
		default:
			both++
			i++
			j++
		}
		taken++
	}
	if taken == 0 {
		return 0
	}
	return float64(both) / float64(taken)
}

// Donors implements routing.Matcher: it calls each, replica by replica
// in ascending order, with the replica's most similar donor at least
// MinSimilarity similar to the text sk sketches (Sketch): its key, the
// prompt tokens it was registered with and the estimated similarity. Ties
// go to the donor with more tokens, then the lower key. Only donors that
// share at least half of MinSimilarity × len(sk) of sk's values are
// compared (a donor J similar shares about 2J ÷ (1 + J) ≥ J of them). A
// donor found is kept longer. each is called without m's lock held.
func (m *MinHash) Donors(sk []uint64, each func(replica int, key uint64, tokens int, similarity float64)) {
	if len(sk) == 0 {
		return
	}
	var found []match // the best per replica, few
	m.mu.Lock()
	votes := make(map[donorKey]int, PerValue) // donor → how many of sk's values list it
	for _, v := range sk {
		for _, d := range m.index[v] {
			votes[d]++
		}
	}
	least := int(m.o.MinSimilarity * float64(len(sk)) / 2)
	for d, n := range votes {
		if n < least {
			continue
		}
		dn, ok := m.donors.Peek(d)
		if !ok {
			continue
		}
		sim := m.Similarity(sk, dn.sketch)
		if sim < m.o.MinSimilarity {
			continue
		}
		c := match{d, dn.tokens, sim}
		if i := slices.IndexFunc(found, func(b match) bool { return b.d.replica == d.replica }); i < 0 {
			found = append(found, c)
		} else if c.beats(found[i]) {
			found[i] = c
		}
	}
	slices.SortFunc(found, func(a, b match) int { return cmp.Compare(a.d.replica, b.d.replica) })
	for _, b := range found { // in replica order: the LRU's order is the same from run to run
		m.donors.Get(b.d) // a donor that helped is kept longer
	}
	m.mu.Unlock()
	for _, b := range found {
		each(b.d.replica, b.d.key, b.tokens, b.sim)
	}
}

// match is a donor found for Donors: its key, tokens and similarity.
type match struct {
	d      donorKey
	tokens int
	sim    float64
}

// beats reports whether donor a is preferred to b: more similar, then
// more tokens, then the lower key.
func (a match) beats(b match) bool {
	if a.sim != b.sim {
		return a.sim > b.sim
	}
	if a.tokens != b.tokens {
		return a.tokens > b.tokens
	}
	return a.d.key < b.d.key
}

// Register implements routing.Matcher: it records the text sk sketches
// (Sketch; m keeps sk), of tokens prompt tokens, as a donor on replica
// keyed by key.
func (m *MinHash) Register(key uint64, replica, tokens int, sk []uint64) {
	if len(sk) == 0 {
		return
	}
	d := donorKey{replica, key}
	m.mu.Lock()
	defer m.mu.Unlock()
	if old, ok := m.donors.Peek(d); ok {
		m.unindex(d, old)
	}
	m.donors.Add(d, donor{sk, tokens})
	for _, v := range sk {
		list := m.index[v]
		if len(list) == PerValue { // the oldest donor listed leaves this entry
			list = append(list[:0], list[1:]...)
		}
		m.index[v] = append(list, d)
	}
}

// Forget implements router.Matcher.
func (m *MinHash) Forget(replica int, key uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.donors.Remove(donorKey{replica, key}) // unindex runs as the eviction callback
}

// Len returns the number of donors held.
func (m *MinHash) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.donors.Len()
}

// unindex removes a donor's sketch from the index; m.mu is held.
func (m *MinHash) unindex(d donorKey, dn donor) {
	for _, v := range dn.sketch {
		list := m.index[v]
		if i := slices.Index(list, d); i >= 0 {
			list = slices.Delete(list, i, i+1)
		}
		if len(list) == 0 {
			delete(m.index, v)
		} else {
			m.index[v] = list
		}
	}
}
