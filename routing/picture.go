package routing

import (
	"sync"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
)

// Picture is the router's picture of every replica's cache, its only
// holder and its only writer: the engine, its Leases and its fleet's and
// replay's records read and change it through its named operations alone.
// It holds the block picture (cachemodel.Model), with each replica's
// capacity (its engine's KV, as reported) and the budget its picture
// evicts down to (the capacity, corrected by feedback); the blending
// replicas' segments; and the running requests' blocks by replica
// (active), which the Leases count load with.
//
// Units: blocks carry tokens in the engine's units (Engine.Prepare scales
// estimates); times are unix nanoseconds on the engine's clock (int64) or
// time.Time where the caller holds one. Safe for concurrent use: every
// operation takes the model's locks, and active and the budgets their own.
type Picture struct {
	model  *cachemodel.Model
	segs   *cachemodel.Segments // the blending replicas' segments; nil: none blends
	active *active              // running requests' blocks (EngineOptions.SharedActive); nil: off

	mu sync.Mutex // SetBudget against correct's read-modify-write
}

// newPicture returns the picture over model and segs (nil: no replica
// blends); shared counts the blocks running requests share once in their
// replica's load (EngineOptions.SharedActive).
func newPicture(model *cachemodel.Model, segs *cachemodel.Segments, shared bool) *Picture {
	p := &Picture{model: model, segs: segs}
	if shared {
		p.active = &active{by: map[int]map[uint64]int32{}}
	}
	return p
}

// Picture returns the engine's cache picture.
func (e *Engine) Picture() *Picture { return e.pic }

// NumReplicas returns how many replica ids the picture has had.
func (p *Picture) NumReplicas() int { return p.model.NumReplicas() }

// Stats returns replica id's picture's size and budget; ok is false for an
// unknown id.
func (p *Picture) Stats(id int) (cachemodel.Stats, bool) { return p.model.Stats(id) }

// Sizes appends every replica's held tokens to out, by id.
func (p *Picture) Sizes(out []int64) []int64 { return p.model.Sizes(out) }

// EventDriven reports whether replica id's picture follows its engine's
// KV events.
func (p *Picture) EventDriven(id int) bool { return p.model.EventDriven(id) }

// Chain appends to dst the chain of blocks ending at key, from the first,
// if the picture holds every one of them.
func (p *Picture) Chain(key uint64, dst []blockhash.Block) ([]blockhash.Block, bool) {
	return p.model.Chain(key, dst)
}

// Walk calls fn for every block replica id holds, each after its parent.
func (p *Picture) Walk(id int, fn func(parent uint64, hasParent bool, b blockhash.Block, cpu bool)) {
	p.model.Walk(id, fn)
}

// Store records that replica id's engine stored blocks, chained after
// parent (hasParent) or from the prompt's start: a KV event, or a peer's
// snapshot. cpu: they were stored in the engine's CPU tier. ok is false when
// the picture does not hold parent; evicted is the blocks evicted to make
// room.
func (p *Picture) Store(id int, parent uint64, hasParent bool, blocks []blockhash.Block, cpu bool, now int64) (ok bool, evicted int) {
	return p.model.Store(id, parent, hasParent, blocks, cpu, now)
}

// Remove records that replica id's engine removed block key (from its CPU
// tier when cpu): a KV event. left reports whether the replica still holds
// it in the other tier.
func (p *Picture) Remove(id int, key uint64, cpu bool) (removed, left bool) {
	return p.model.Remove(id, key, cpu)
}

// SetEventDriven makes replica id's picture follow its engine's KV events
// (on) or the routing decisions (off).
func (p *Picture) SetEventDriven(id int, on bool) { p.model.SetEventDriven(id, on) }

// ExpirePending drops the blocks routed to event-driven replicas that no
// event confirmed in time, as of now (unix nanoseconds).
func (p *Picture) ExpirePending(now int64) { p.model.ExpirePending(now) }

// Clear empties replica id's pictures, its cache's and its segments' (its
// engine restarted, or reported that it cleared its cache).
func (p *Picture) Clear(id int) {
	p.model.Clear(id)
	if p.segs != nil {
		p.segs.Clear(id)
	}
}

// drop forgets replica id's pictures (it left).
func (p *Picture) drop(id int) {
	p.model.RemoveReplica(id)
	if p.segs != nil {
		p.segs.RemoveReplica(id)
	}
}

// Routed records blocks on replica id for a request another router routed
// there whose lease this router does not keep (its bound on peers' requests
// was reached): recorded, not pinned, its load not counted.
func (p *Picture) Routed(id int, blocks []blockhash.Block, now time.Time) {
	if len(blocks) > 0 {
		p.model.Record(id, blocks, now.UnixNano())
	}
}

// Replied records that replica id cached a reply, chain[from:], after its
// prompt chain[:from] (as Engine.LearnReply does for this router's own
// requests): a peer's reply record, or a replay's recorded reply.
func (p *Picture) Replied(id int, chain []blockhash.Block, from int, now time.Time) {
	if len(chain) > 0 {
		p.model.Extend(id, chain, from, now.UnixNano())
	}
}

// SetBudget sets replica id's budget to what its engine reports (tokens;
// vllm:cache_config_info): the picture evicts down to it at its next
// record, and feedback corrections (Engine.Feedback) start again from it,
// held within a quarter and four times it.
func (p *Picture) SetBudget(id int, tokens int64) {
	p.mu.Lock()
	p.model.SetBudget(id, tokens) // the capacity: the next correction's base
	p.mu.Unlock()
}

// correct moves replica id's budget by −diff/8 tokens, within a quarter
// and four times its capacity, and evicts its oldest blocks to the amount
// of diff when diff > 0. It returns the tokens evicted.
func (p *Picture) correct(id int, diff int64) int64 {
	p.mu.Lock() // with SetBudget: a reported budget is never overwritten by one read before it
	if st, ok := p.model.Stats(id); ok && st.Budget > 0 && st.Capacity > 0 {
		base := st.Capacity
		p.model.SetTarget(id, min(max(st.Budget-diff/8, base/4), base*4))
	}
	p.mu.Unlock()
	if diff > 0 {
		return p.model.Shrink(id, diff)
	}
	return 0
}

// Match returns, for every replica by id, how much of blocks' prefix its
// picture holds, every kind weighing 1.
func (p *Picture) Match(blocks []blockhash.Block) []cachemodel.Match {
	return p.model.Match(blocks, nil, nil)
}

// The operations below are the engine's own, in this package: a decision's
// reads (lookup, matches, hot), its Lease's writes (pin, unpin, record,
// freeChain, activate) and the pool's joins (addReplica). Each is safe for
// concurrent use; a Lease's own order is its goroutine's.

// lookup fills sc with the picture's answers for blocks, weighted by w:
// each replica's match, by id (cachemodel.Match, with the confirmed blocks
// it holds past it, Past), its held tokens and capacity (tokens; 0:
// unknown) and, when some replica blends, the tokens of its segments
// beyond the match (sc.beyond, unweighted). It allocates only to grow sc.
func (p *Picture) lookup(blocks []blockhash.Block, w *cachemodel.Weights, sc *scratch) {
	sc.matches = p.model.Match(blocks, w, sc.matches[:0])
	sc.sizes, sc.budgets = p.model.SizesBudgets(sc.sizes[:0], sc.budgets[:0])
	p.model.Past(blocks, sc.matches)
	sc.beyond = sc.beyond[:0]
	if p.segs != nil {
		sc.beyond = append(sc.beyond, make([]float64, len(sc.matches))...)
		p.segs.Beyond(blocks, sc.matches, sc.beyond)
	}
}

// matches returns, for every replica by id, how much of blocks' prefix
// its picture holds, weighted by w (nil: every kind 1), in out (grown if
// short).
func (p *Picture) matches(blocks []blockhash.Block, w *cachemodel.Weights, out []cachemodel.Match) []cachemodel.Match {
	return p.model.Match(blocks, w, out)
}

// hot returns the prefix of blocks that is hot as of now (unix ns):
// cachemodel.Model.Hot, at least minUses requests and more than minShare
// of all used each block in the last half-life.
func (p *Picture) hot(blocks []blockhash.Block, w *cachemodel.Weights, minUses, minShare float64, now int64) cachemodel.Match {
	return p.model.Hot(blocks, w, minUses, minShare, now)
}

// blending reports whether the picture keeps the blending replicas'
// segments (some replica may blend).
func (p *Picture) blending() bool { return p.segs != nil }

// recordSegments records blocks' segments on blending replica id at now
// (unix ns): a decision committed there (blendReuse).
func (p *Picture) recordSegments(id int, blocks []blockhash.Block, now int64) {
	if p.segs != nil {
		p.segs.Record(id, blocks, now)
	}
}

// pin records blocks, a chain from the prompt's first block, on replica id
// at now (unix ns), and pins them until unpin: a running request's blocks
// are not evicted (cachemodel.Model.Commit). It returns the pins.
func (p *Picture) pin(id int, blocks []blockhash.Block, now int64) cachemodel.Pins {
	_, pins := p.model.Commit(id, blocks, now)
	return pins
}

// record records blocks, a chain from the prompt's first block, on replica
// id at now (unix ns), unpinned (cachemodel.Model.Record).
func (p *Picture) record(id int, blocks []blockhash.Block, now int64) {
	p.model.Record(id, blocks, now)
}

// unpin releases the pins pin gave for blocks on replica id and records
// their free time now (unix ns), for vLLM's free-queue order
// (cachemodel.Model.Done).
func (p *Picture) unpin(id int, blocks []blockhash.Block, pins cachemodel.Pins, now int64) {
	p.model.Done(id, blocks, pins, now)
}

// freeChain records the free time now (unix ns) of the chain ending at
// block last on replica id, if the picture still holds all of it: an
// unpinned request's end, whose blocks were not kept (cachemodel.Model.Free).
func (p *Picture) freeChain(id int, last uint64, now int64) {
	var buf [64]blockhash.Block
	if chain, ok := p.model.Chain(last, buf[:0]); ok {
		p.model.Free(id, chain, now)
	}
}

// sharesActive reports whether running requests' shared blocks count once
// in their replica's load (EngineOptions.SharedActive).
func (p *Picture) sharesActive() bool { return p.active != nil }

// activate adds delta (±1 request) to the running count of each of blocks
// on replica id and returns the tokens that became held (delta 1) or
// released (delta −1): with SharedActive, only those of blocks no other
// running request holds; without, all of them.
func (p *Picture) activate(id int, blocks []blockhash.Block, delta int32) int64 {
	if p.active == nil {
		var n int64
		for _, b := range blocks {
			n += int64(b.Tokens)
		}
		return n
	}
	return p.active.add(id, blocks, delta)
}

// addReplica gives a joining replica an empty picture under budget
// tokens (0: unlimited) and returns its id (cachemodel.Model.AddReplica).
func (p *Picture) addReplica(name string, budget int64) (int, error) {
	return p.model.AddReplica(name, budget)
}

// setSegments gives blending replica id a segment picture of budget
// tokens (blends) or takes it away; nothing when no replica blends.
func (p *Picture) setSegments(id int, blends bool, budget int64) {
	switch {
	case p.segs == nil:
	case blends:
		p.segs.AddReplica(id, budget)
	default:
		p.segs.RemoveReplica(id)
	}
}

// active counts, per replica, the running requests that use each block
// (EngineOptions.SharedActive), so that a block several of them share
// counts once in the replica's KV load, as engines with cascade attention
// store it once. Safe for concurrent use.
type active struct {
	mu sync.Mutex
	by map[int]map[uint64]int32 // replica id → block hash → running requests
}

// add is Picture.activate's count, under SharedActive.
func (a *active) add(id int, blocks []blockhash.Block, delta int32) int64 {
	var n int64
	a.mu.Lock()
	defer a.mu.Unlock()
	m := a.by[id]
	if m == nil {
		m = map[uint64]int32{}
		a.by[id] = m
	}
	for _, b := range blocks {
		before := m[b.Hash]
		after := before + delta
		if after <= 0 {
			delete(m, b.Hash)
		} else {
			m[b.Hash] = after
		}
		if (delta > 0 && before == 0) || (delta < 0 && after <= 0 && before > 0) {
			n += int64(b.Tokens)
		}
	}
	return n
}
