// Package policies holds the eviction policies of the cache model: which
// cached block a replica drops first when its token budget is exceeded.
//
// The cache model owns the blocks; a policy sees only the evictable ones (the
// leaves of one replica's cached tree) and keeps them in its own order. The
// model tells it what became evictable, what was touched and what was removed,
// and asks it for a victim. Time is passed in as int64 nanoseconds on the
// caller's clock (wall or virtual); no policy reads a clock.
//
// A Policy is not safe for concurrent use: the cache model serialises calls.
package policies

import (
	"container/heap"
	"fmt"
	"sort"

	"github.com/semroute/semroute/blockhash"
)

// Info describes one cached block on one replica.
type Info struct {
	Kind   blockhash.Kind
	Tokens int32 // estimated tokens, ≥ 1
	Depth  int32 // position in its chain; 0 is the first block
	// LastUsed is when the block was last inserted or hit, in nanoseconds.
	LastUsed int64
	// Inserted is when the block was first cached on this replica.
	Inserted int64
	// Hits counts the lookups that reused the block after its insertion.
	Hits int32
}

// Policy orders the evictable blocks of one replica.
type Policy interface {
	// Evictable adds key, which has just become a leaf (no cached child on
	// this replica), to the candidates for eviction.
	Evictable(key uint64, info Info)
	// Touched reports that key was used (inserted again or hit) at
	// info.LastUsed. It is called whether or not key is evictable; a policy
	// ignores keys it does not hold unless it keeps history.
	Touched(key uint64, info Info)
	// Removed drops key from the candidates: it gained a child or left the
	// cache. Unknown keys are ignored.
	Removed(key uint64)
	// Victim removes and returns the candidate to evict next; ok is false when
	// there is none.
	Victim() (key uint64, ok bool)
	// Len returns the number of candidates.
	Len() int
}

// Factory makes a fresh policy for one replica.
type Factory func() Policy

var registry = map[string]Factory{
	"lru": func() Policy { return NewLRU() },
}

// Names returns the registered policy names, sorted.
func Names() []string {
	out := make([]string, 0, len(registry))
	for n := range registry {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Lookup returns the factory registered under name.
func Lookup(name string) (Factory, error) {
	f, ok := registry[name]
	if !ok {
		return nil, fmt.Errorf("unknown eviction policy %q (have %v)", name, Names())
	}
	return f, nil
}

// LRU evicts the least recently used leaf; among leaves used at the same
// instant, the deepest first, so a request's tail goes before its head.
// Evictable, Touched, Removed and Victim are O(log n).
type LRU struct{ h prioHeap }

var _ Policy = (*LRU)(nil)

// NewLRU returns an empty LRU policy.
func NewLRU() *LRU { return &LRU{h: newPrioHeap()} }

// Evictable implements Policy.
func (p *LRU) Evictable(key uint64, info Info) { p.h.set(key, info.LastUsed, -int64(info.Depth)) }

// Touched implements Policy.
func (p *LRU) Touched(key uint64, info Info) { p.h.update(key, info.LastUsed, -int64(info.Depth)) }

// Removed implements Policy.
func (p *LRU) Removed(key uint64) { p.h.remove(key) }

// Victim implements Policy.
func (p *LRU) Victim() (uint64, bool) { return p.h.pop() }

// Len implements Policy.
func (p *LRU) Len() int { return p.h.Len() }

// prioHeap is a min-heap of keys ordered by (a, b), with an index for
// updates and removals by key.
type prioHeap struct {
	items []*item
	index map[uint64]*item
}

type item struct {
	key  uint64
	a, b int64
	pos  int
}

func newPrioHeap() prioHeap { return prioHeap{index: make(map[uint64]*item)} }

func (h *prioHeap) Len() int { return len(h.items) }
func (h *prioHeap) Less(i, j int) bool {
	x, y := h.items[i], h.items[j]
	if x.a != y.a {
		return x.a < y.a
	}
	if x.b != y.b {
		return x.b < y.b
	}
	return x.key < y.key
}
func (h *prioHeap) Swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.items[i].pos, h.items[j].pos = i, j
}
func (h *prioHeap) Push(x any) {
	it := x.(*item)
	it.pos = len(h.items)
	h.items = append(h.items, it)
}
func (h *prioHeap) Pop() any {
	n := len(h.items) - 1
	it := h.items[n]
	h.items[n] = nil
	h.items = h.items[:n]
	return it
}

// set inserts key or moves it to the new priority.
func (h *prioHeap) set(key uint64, a, b int64) {
	if it, ok := h.index[key]; ok {
		it.a, it.b = a, b
		heap.Fix(h, it.pos)
		return
	}
	it := &item{key: key, a: a, b: b}
	h.index[key] = it
	heap.Push(h, it)
}

// update moves key to the new priority if it is present.
func (h *prioHeap) update(key uint64, a, b int64) {
	if it, ok := h.index[key]; ok {
		it.a, it.b = a, b
		heap.Fix(h, it.pos)
	}
}

func (h *prioHeap) remove(key uint64) {
	if it, ok := h.index[key]; ok {
		heap.Remove(h, it.pos)
		delete(h.index, key)
	}
}

func (h *prioHeap) pop() (uint64, bool) {
	if len(h.items) == 0 {
		return 0, false
	}
	it := heap.Pop(h).(*item)
	delete(h.index, it.key)
	return it.key, true
}
