package routing

import (
	"sync"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
)

// Picture is the router's picture of every replica's cache, and its only
// writer: what others may change in it they change through its named
// operations (the engine's own requests through Engine.Commit, Leases and
// LearnReply). It holds the cache picture (cachemodel.Model), with each
// replica's capacity (its engine's KV, as reported) and the budget its
// picture evicts down to (the capacity, corrected by feedback), and the
// blending replicas' segments. Safe for concurrent use.
type Picture struct {
	cache *cachemodel.Model
	segs  *cachemodel.Segments // the blending replicas' segments; nil: none blends

	mu sync.Mutex // SetBudget against correct's read-modify-write
}

// Picture returns the engine's cache picture.
func (e *Engine) Picture() *Picture { return e.pic }

// NumReplicas returns how many replica ids the picture has had.
func (p *Picture) NumReplicas() int { return p.cache.NumReplicas() }

// Stats returns replica id's picture's size and budget; ok is false for an
// unknown id.
func (p *Picture) Stats(id int) (cachemodel.Stats, bool) { return p.cache.Stats(id) }

// Sizes appends every replica's held tokens to out, by id.
func (p *Picture) Sizes(out []int64) []int64 { return p.cache.Sizes(out) }

// EventDriven reports whether replica id's picture follows its engine's
// KV events.
func (p *Picture) EventDriven(id int) bool { return p.cache.EventDriven(id) }

// Chain appends to dst the chain of blocks ending at key, from the first,
// if the picture holds every one of them.
func (p *Picture) Chain(key uint64, dst []blockhash.Block) ([]blockhash.Block, bool) {
	return p.cache.Chain(key, dst)
}

// Walk calls fn for every block replica id holds, each after its parent.
func (p *Picture) Walk(id int, fn func(parent uint64, hasParent bool, b blockhash.Block, cpu bool)) {
	p.cache.Walk(id, fn)
}

// Store records that replica id's engine stored blocks, chained after
// parent (hasParent) or from the prompt's start: a KV event, or a peer's
// snapshot. cpu: they were stored in the engine's CPU tier. ok is false when
// the picture does not hold parent; evicted is the blocks evicted to make
// room.
func (p *Picture) Store(id int, parent uint64, hasParent bool, blocks []blockhash.Block, cpu bool, now int64) (ok bool, evicted int) {
	return p.cache.Store(id, parent, hasParent, blocks, cpu, now)
}

// Remove records that replica id's engine removed block key (from its CPU
// tier when cpu): a KV event. left reports whether the replica still holds
// it in the other tier.
func (p *Picture) Remove(id int, key uint64, cpu bool) (removed, left bool) {
	return p.cache.Remove(id, key, cpu)
}

// SetEventDriven makes replica id's picture follow its engine's KV events
// (on) or the routing decisions (off).
func (p *Picture) SetEventDriven(id int, on bool) { p.cache.SetEventDriven(id, on) }

// ExpirePending drops the blocks routed to event-driven replicas that no
// event confirmed in time, as of now (unix nanoseconds).
func (p *Picture) ExpirePending(now int64) { p.cache.ExpirePending(now) }

// Clear empties replica id's pictures, its cache's and its segments' (its
// engine restarted, or reported that it cleared its cache).
func (p *Picture) Clear(id int) {
	p.cache.Clear(id)
	if p.segs != nil {
		p.segs.Clear(id)
	}
}

// drop forgets replica id's pictures (it left).
func (p *Picture) drop(id int) {
	p.cache.RemoveReplica(id)
	if p.segs != nil {
		p.segs.RemoveReplica(id)
	}
}

// Routed records blocks on replica id for a request another router routed
// there whose lease this router does not keep (its bound on peers' requests
// was reached): recorded, not pinned, its load not counted.
func (p *Picture) Routed(id int, blocks []blockhash.Block, now time.Time) {
	if len(blocks) > 0 {
		p.cache.Record(id, blocks, now.UnixNano())
	}
}

// Replied records that replica id cached a reply, chain[from:], after its
// prompt chain[:from] (as Engine.LearnReply does for this router's own
// requests): a peer's reply record, or a replay's recorded reply.
func (p *Picture) Replied(id int, chain []blockhash.Block, from int, now time.Time) {
	if len(chain) > 0 {
		p.cache.Extend(id, chain, from, now.UnixNano())
	}
}

// SetBudget sets replica id's budget to what its engine reports (tokens;
// vllm:cache_config_info): the picture evicts down to it at its next
// record, and feedback corrections (Engine.Feedback) start again from it,
// held within a quarter and four times it.
func (p *Picture) SetBudget(id int, tokens int64) {
	p.mu.Lock()
	p.cache.SetBudget(id, tokens) // the capacity: the next correction's base
	p.mu.Unlock()
}

// correct moves replica id's budget by −diff/8 tokens, within a quarter
// and four times its capacity, and evicts its oldest blocks to the amount
// of diff when diff > 0. It returns the tokens evicted.
func (p *Picture) correct(id int, diff int64) int64 {
	p.mu.Lock() // with SetBudget: a reported budget is never overwritten by one read before it
	if st, ok := p.cache.Stats(id); ok && st.Budget > 0 && st.Capacity > 0 {
		base := st.Capacity
		p.cache.SetTarget(id, min(max(st.Budget-diff/8, base/4), base*4))
	}
	p.mu.Unlock()
	if diff > 0 {
		return p.cache.Shrink(id, diff)
	}
	return 0
}

// Match returns, for every replica by id, how much of blocks' prefix its
// picture holds, every kind weighing 1.
func (p *Picture) Match(blocks []blockhash.Block) []cachemodel.Match {
	return p.cache.Match(blocks, nil, nil)
}
