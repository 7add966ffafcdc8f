package cachemodel

import (
	"slices"
	"sync"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/eviction"
)

// Segments is the picture of what each blending engine keeps for
// position-independent reuse (CacheBlend's segments, in LMCache's store
// beside the GPU's prefix cache): the blocks of its served prompts by
// their segment keys (blockhash.Block.Seg), so that a document is found
// wherever it sits in a later prompt. Each replica's blocks live under
// its own token budget, evicted by an eviction.Policy of the model's
// factory, every block a candidate.
//
// Only blocks of the kinds given to NewSegments are kept: the ones worth
// routing for (retrieved documents, tool outputs), not every segment an
// engine may blend. Safe for concurrent use.
type Segments struct {
	factory eviction.Factory
	kinds   [blockhash.NumKinds]bool

	mu      sync.RWMutex
	holders map[uint64][]int32 // segment key → replicas holding it, sorted
	reps    []*segReplica      // by replica id; nil where none
}

type segReplica struct {
	budget, tokens int64
	evictions      int64
	blocks         map[uint64]segBlock
	policy         eviction.Policy
}

type segBlock struct {
	tokens   int32
	kind     blockhash.Kind
	inserted int64
	hits     int32
}

// NewSegments returns an empty picture keeping blocks of kinds, each
// replica's evicted by a policy from factory (nil: LRU).
func NewSegments(factory eviction.Factory, kinds []blockhash.Kind) *Segments {
	if factory == nil {
		factory = eviction.NewLRU
	}
	s := &Segments{factory: factory, holders: map[uint64][]int32{}}
	for _, k := range kinds {
		if k < blockhash.NumKinds {
			s.kinds[k] = true
		}
	}
	return s
}

// Reusable reports whether blocks of kind k are kept.
func (s *Segments) Reusable(k blockhash.Kind) bool { return k < blockhash.NumKinds && s.kinds[k] }

// AddReplica starts an empty picture for replica id (the cache model's
// id) under budget tokens (0: unlimited), replacing any it had.
func (s *Segments) AddReplica(id int, budget int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(s.reps) <= id {
		s.reps = append(s.reps, nil)
	}
	s.clear(id)
	s.reps[id] = &segReplica{budget: budget, blocks: map[uint64]segBlock{}, policy: s.factory()}
}

// RemoveReplica forgets replica id.
func (s *Segments) RemoveReplica(id int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clear(id)
	if id >= 0 && id < len(s.reps) {
		s.reps[id] = nil
	}
}

// Clear empties replica id's picture (its engine restarted).
func (s *Segments) Clear(id int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clear(id)
}

func (s *Segments) clear(id int) {
	if id < 0 || id >= len(s.reps) || s.reps[id] == nil {
		return
	}
	r := s.reps[id]
	for k := range r.blocks {
		s.unhold(k, int32(id))
	}
	r.blocks, r.tokens, r.policy = map[uint64]segBlock{}, 0, s.factory()
}

// Record keeps the reusable blocks of a prompt served by replica id at
// now (nanoseconds), refreshing those it had, then evicts to the budget.
// It returns the blocks evicted. Unknown ids are ignored.
func (s *Segments) Record(id int, blocks []blockhash.Block, now int64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if id < 0 || id >= len(s.reps) || s.reps[id] == nil {
		return 0
	}
	r := s.reps[id]
	for i := range blocks {
		b := &blocks[i]
		if b.Seg == 0 || !s.Reusable(b.Kind) {
			continue
		}
		if sb, ok := r.blocks[b.Seg]; ok {
			sb.hits++
			r.blocks[b.Seg] = sb
			r.policy.Touched(b.Seg, sb.info(now))
			continue
		}
		sb := segBlock{tokens: max(b.Tokens, 1), kind: b.Kind, inserted: now}
		r.blocks[b.Seg] = sb
		r.tokens += int64(sb.tokens)
		r.policy.Evictable(b.Seg, sb.info(now))
		s.hold(b.Seg, int32(id))
	}
	n := 0
	for r.budget > 0 && r.tokens > r.budget {
		k, ok := r.policy.Victim()
		if !ok {
			break
		}
		sb, ok := r.blocks[k]
		if !ok {
			continue
		}
		delete(r.blocks, k)
		r.tokens -= int64(sb.tokens)
		r.evictions++
		s.unhold(k, int32(id))
		n++
	}
	return n
}

func (b segBlock) info(now int64) eviction.Info {
	return eviction.Info{Kind: b.kind, Tokens: b.tokens, LastUsed: now, Inserted: b.inserted, Hits: b.hits}
}

func (s *Segments) hold(k uint64, id int32) {
	h := s.holders[k]
	i, found := slices.BinarySearch(h, id)
	if !found {
		s.holders[k] = slices.Insert(h, i, id)
	}
}

func (s *Segments) unhold(k uint64, id int32) {
	h := s.holders[k]
	i, found := slices.BinarySearch(h, id)
	if !found {
		return
	}
	if h = slices.Delete(h, i, i+1); len(h) == 0 {
		delete(s.holders, k)
	} else {
		s.holders[k] = h
	}
}

// Beyond adds to out[r], for each replica r, the tokens of the reusable
// blocks of blocks it holds that lie past its exact prefix match
// (prefix[r].Blocks): what a blending engine there could reuse besides
// the prefix, before its recompute share. out must have a slot per
// replica (len(prefix)); it is not cleared. A segment key repeated in the
// prompt counts once per occurrence. It does not allocate.
func (s *Segments) Beyond(blocks []blockhash.Block, prefix []Match, out []float64) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if len(s.holders) == 0 {
		return
	}
	for i := range blocks {
		b := &blocks[i]
		if b.Seg == 0 || !s.Reusable(b.Kind) {
			continue
		}
		for _, r := range s.holders[b.Seg] {
			if int(r) < len(prefix) && int(r) < len(out) && i >= prefix[r].Blocks {
				out[r] += float64(b.Tokens)
			}
		}
	}
}

// SegmentStats describes one replica's segment picture.
type SegmentStats struct {
	Blocks, Tokens, Budget, Evictions int64
}

// Stats returns replica id's segment picture; ok is false for an unknown
// id.
func (s *Segments) Stats(id int) (st SegmentStats, ok bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if id < 0 || id >= len(s.reps) || s.reps[id] == nil {
		return st, false
	}
	r := s.reps[id]
	return SegmentStats{Blocks: int64(len(r.blocks)), Tokens: r.tokens, Budget: r.budget, Evictions: r.evictions}, true
}
