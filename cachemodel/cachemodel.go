// Package cachemodel is the router's approximate picture of every replica's
// KV cache: one tree of block hashes shared by all replicas, where each node
// records which replicas hold it, plus a token budget per replica enforced by
// a pluggable eviction policy.
//
// Because a block's hash names its whole prefix, the tree is stored as an
// index from hash to node (nodeTable) with parent links. A replica's blocks
// are always a prefix-closed subtree (blocks are inserted with their whole
// prefix and only a replica's leaves are evicted), which is what makes Match
// cheap: the set of replicas holding block i+1 is a subset of those holding
// block i.
//
// A Model is safe for concurrent use: Match takes a read lock; Record, Clear
// and the replica calls take the write lock.
package cachemodel

import (
	"fmt"
	"sync"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/eviction"
)

// Weights are per-kind multipliers on matched tokens, indexed by Kind.
type Weights [blockhash.NumKinds]float64

// UnitWeights weights every kind 1.
func UnitWeights() *Weights {
	var w Weights
	for i := range w {
		w[i] = 1
	}
	return &w
}

// Match is one replica's longest cached prefix of a request.
type Match struct {
	Blocks   int     // matched blocks, from block 0
	Tokens   int     // their tokens, as the request counts them (Block.Tokens)
	Weighted float64 // Σ weight[kind] × tokens over the matched blocks
	// Confirmed is the tokens of the matched blocks before the first one
	// that is only pending (routed to an event-driven replica, not yet
	// confirmed by its engine): what the engine is expected to report
	// cached if the request were sent now. Tokens counts pending blocks
	// too, so that siblings routed in a burst land together.
	Confirmed int
	// Past is the tokens of the blocks after the match that the replica
	// holds, confirmed by its engine's events: an engine that counts every
	// cached block of a prompt as a hit, wherever its chain breaks
	// (llm-d-inference-sim), reports them too. Only Model.Past fills it,
	// and only on event-driven replicas, whose pictures have such holes.
	Past int
}

// Stats describes one replica's picture.
type Stats struct {
	Name   string
	Blocks int64 // blocks tracked
	Tokens int64 // their estimated tokens
	Budget int64 // token budget the picture evicts down to; 0 means unlimited
	// Capacity is the engine's KV cache as configured or reported
	// (SetBudget), tokens: Budget before any correction (SetTarget).
	Capacity  int64
	Evictions int64 // blocks evicted since the replica was added
	// PendingExpired counts the routed blocks no engine event confirmed
	// within PendingTTL (SetEventDriven).
	PendingExpired int64
}

// Options configure a Model. The zero value is usable.
type Options struct {
	// Policy makes each replica's eviction policy. Nil means LRU.
	Policy eviction.Factory
	// OnEvict, if set, is called with every block evicted from a replica,
	// after the model's lock is released, in eviction order.
	OnEvict func(replica int, key uint64)
	// HotHalfLife is the half-life of each block's request rate, counted on
	// every Record across all replicas (see Hot). Default 10s.
	HotHalfLife time.Duration
	// PendingTTL is how long a block routed to an event-driven replica
	// (SetEventDriven) counts as cached there before the engine's event
	// confirms it (Store): long enough for a burst of siblings to land
	// together, short enough that a routing the engine never confirmed is
	// soon forgotten. Default 2s.
	PendingTTL time.Duration
	// CPUCredit is the share of a block's weighted tokens credited in
	// Match when the replica holds it only in CPU memory (Store with
	// cpu set): loading it back is cheaper than recomputing it, dearer
	// than a GPU hit. Default 0.5; negative means 0.
	CPUCredit float64
}

// Model is the picture of every replica's cache.
type Model struct {
	policy    eviction.Factory
	onEvict   func(replica int, key uint64)
	hotHalf   float64 // nanoseconds
	pendTTL   int64   // nanoseconds
	cpuCredit float64

	// fleet counts every Record (one request) like a block's heat.
	fleet node

	// noShortcut makes Extend walk the whole chain (tests compare the two).
	noShortcut bool

	mu        sync.RWMutex
	epochs    uint64    // the last replicaState.epoch handed out
	irregular int       // slots whose flags are not just fGPU (see Match)
	nodes     nodeTable // by block hash
	more      map[*node][]slot
	replicas  []*replicaState // by id; nil where removed
}

type replicaState struct {
	Stats
	policy eviction.Policy
	// events: the replica's engine confirms its blocks (SetEventDriven),
	// so routing records mark them pending, listed oldest first in
	// pending[phead:] until they expire.
	events  bool
	pending []pendingBlock
	phead   int
	// epoch names the picture the replica's pins belong to: a Clear (or
	// a new replica in a reused id) starts another, and a Done with Pins
	// of an older one unpins nothing.
	epoch uint64
}

// pendingBlock is a block a routing record marked pending, and when.
type pendingBlock struct {
	key uint64
	at  int64
}

// New returns an empty model with no replicas.
func New(o Options) *Model {
	if o.Policy == nil {
		o.Policy = func() eviction.Policy { return eviction.NewLRU() }
	}
	if o.HotHalfLife <= 0 {
		o.HotHalfLife = 10 * time.Second
	}
	if o.PendingTTL <= 0 {
		o.PendingTTL = 2 * time.Second
	}
	if o.CPUCredit == 0 {
		o.CPUCredit = 0.5
	}
	return &Model{policy: o.Policy, onEvict: o.OnEvict, hotHalf: float64(o.HotHalfLife), pendTTL: int64(o.PendingTTL),
		cpuCredit: max(o.CPUCredit, 0), nodes: newNodeTable(),
		fleet: node{one: slot{replica: -1}}, more: map[*node][]slot{}}
}

// AddReplica adds a replica with an empty picture and the given token budget
// (0 = unlimited) and returns its id, the smallest free one. Ids index Match's
// output.
func (m *Model) AddReplica(name string, budgetTokens int64) (int, error) {
	if budgetTokens < 0 {
		return 0, fmt.Errorf("replica %s: negative token budget %d", name, budgetTokens)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.epochs++
	st := &replicaState{Stats: Stats{Name: name, Budget: budgetTokens, Capacity: budgetTokens}, policy: m.policy(), epoch: m.epochs}
	for id, r := range m.replicas {
		if r == nil {
			m.replicas[id] = st
			return id, nil
		}
	}
	m.replicas = append(m.replicas, st)
	return len(m.replicas) - 1, nil
}

// RemoveReplica forgets a replica and its blocks. O(tracked blocks).
func (m *Model) RemoveReplica(id int) {
	m.mu.Lock()
	var keys []uint64
	if m.valid(id) {
		keys = m.clear(id)
		m.replicas[id] = nil
	}
	m.mu.Unlock()
	m.evicted(id, keys)
}

// Clear empties a replica's picture, as after the replica restarted.
// O(tracked blocks). Every block it held is given to OnEvict.
func (m *Model) Clear(id int) {
	m.mu.Lock()
	var keys []uint64
	if m.valid(id) {
		keys = m.clear(id)
	}
	m.mu.Unlock()
	m.evicted(id, keys)
}

// clear empties replica id's picture and returns the keys it held, when
// there is an OnEvict to give them to. m.mu must be held.
func (m *Model) clear(id int) (keys []uint64) {
	m.nodes.each(func(n *node) {
		if i, ok := m.find(n, int32(id)); ok {
			if m.onEvict != nil && m.at(n, i).flags != 0 {
				keys = append(keys, n.hash)
			}
			m.remove(n, i)
			if m.count(n) == 0 {
				m.freeNode(n)
			}
		}
	})
	st := m.replicas[id]
	st.Blocks, st.Tokens = 0, 0
	st.policy = m.policy()
	st.pending, st.phead = nil, 0
	m.epochs++
	st.epoch = m.epochs
	return keys
}

// SetBudget sets a replica's capacity and token budget (0 = unlimited), as
// its engine reports or config sets them; the next Record on it evicts down
// to the new budget.
func (m *Model) SetBudget(id int, budgetTokens int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.valid(id) && budgetTokens >= 0 {
		m.replicas[id].Budget, m.replicas[id].Capacity = budgetTokens, budgetTokens
	}
}

// SetTarget sets the token budget a replica's picture evicts down to,
// leaving its capacity as reported: a correction of the picture, not of
// the engine.
func (m *Model) SetTarget(id int, budgetTokens int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.valid(id) && budgetTokens >= 0 {
		m.replicas[id].Budget = budgetTokens
	}
}

func (m *Model) valid(id int) bool { return id >= 0 && id < len(m.replicas) && m.replicas[id] != nil }

// NumReplicas returns one more than the largest replica id ever issued: the
// length Match's output needs.
func (m *Model) NumReplicas() int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return len(m.replicas)
}

// Stats returns a replica's counters; ok is false for an unknown id.
func (m *Model) Stats(id int) (s Stats, ok bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if !m.valid(id) {
		return Stats{}, false
	}
	return m.replicas[id].Stats, true
}

// Match writes, for every replica id, the longest prefix of blocks that the
// replica holds into out[id], growing out if it is shorter than NumReplicas,
// and returns it. Nothing after the first miss counts. w weights matched
// tokens by the request's block kinds; nil means UnitWeights. A block the
// replica holds only in CPU memory counts its full tokens but only
// CPUCredit of its weight. Match does not change recency.
//
// Cost: O(holders) per matched block; it stops at the first block no
// replica still matching holds. It does not allocate when out is long
// enough.
func (m *Model) Match(blocks []blockhash.Block, w *Weights, out []Match) []Match {
	if w == nil {
		w = UnitWeights()
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if cap(out) < len(m.replicas) {
		out = make([]Match, len(m.replicas))
	}
	out = out[:len(m.replicas)]
	clear(out)
	if m.irregular == 0 {
		return m.matchNested(blocks, w, out)
	}
	return m.matchHoles(blocks, w, out)
}

// Past fills out[r].Past, for every event-driven replica r, from out, the
// result of Match for blocks: the tokens of the blocks after r's match
// that r holds confirmed, in GPU or CPU memory. A replica whose engine
// evicted a chain's middle (its events said so) keeps the blocks past the
// hole. Cost: O(blocks × holders); nothing when no replica is
// event-driven.
func (m *Model) Past(blocks []blockhash.Block, out []Match) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	from := len(blocks)
	for r := range out {
		if r < len(m.replicas) && m.replicas[r] != nil && m.replicas[r].events {
			from = min(from, out[r].Blocks+1)
		}
	}
	count := func(s *slot, i int) {
		r := int(s.replica)
		if r < len(out) && out[r].Blocks < i && s.flags&(fGPU|fCPU) != 0 && m.replicas[r] != nil && m.replicas[r].events {
			out[r].Past += int(blocks[i].Tokens)
		}
	}
	for i := from; i < len(blocks); i++ {
		n := m.nodes.get(blocks[i].Hash)
		if n == nil {
			continue
		}
		first, rest := m.holders(n)
		if first == nil {
			continue
		}
		count(first, i)
		for j := range rest {
			count(&rest[j], i)
		}
	}
}

// matchHoles is Match when some slots are not plainly held. m.mu must be
// read-held and out cleared.
func (m *Model) matchHoles(blocks []blockhash.Block, w *Weights, out []Match) []Match {
	// Some slots are pending, CPU-only or dead, so a replica may be among
	// a block's holders without matching it. out[r].Blocks == i exactly
	// when replica r held blocks[:i]: a holder
	// of block i extends its match only then, so a replica that misses a
	// block keeps the match it had, whatever it holds further down.
	for i := range blocks {
		n := m.nodes.get(blocks[i].Hash)
		if n == nil {
			break
		}
		first, rest := m.holders(n)
		if first == nil {
			break
		}
		tokens := int(blocks[i].Tokens) // the request's unit (the engine's, once learned)
		weighted := w[blocks[i].Kind] * float64(blocks[i].Tokens)
		advanced := m.advance(out, first, i, tokens, weighted)
		for j := range rest {
			advanced = m.advance(out, &rest[j], i, tokens, weighted) || advanced
		}
		if !advanced {
			break
		}
	}
	return out
}

// matchNested is Match when every slot is plainly held on the GPU, as in
// a picture no engine events feed: a replica's blocks are then a
// prefix-closed subtree, so the holders of block i+1 are a subset of those
// of block i, and only the replicas leaving the set need work. O(matched
// blocks) index lookups, plus O(holders) only where the set shrinks.
func (m *Model) matchNested(blocks []blockhash.Block, w *Weights, out []Match) []Match {
	var prevFirst *slot
	var prevRest []slot
	matched, tokens, weighted := 0, 0, 0.0 // of blocks[:i]
	for i := range blocks {
		n := m.nodes.get(blocks[i].Hash)
		if n == nil {
			break
		}
		first, rest := m.holders(n)
		if first == nil {
			break
		}
		if prevFirst != nil && len(rest) < len(prevRest) {
			settleLeavers(out, prevFirst, prevRest, first, rest, i, tokens, weighted)
		}
		prevFirst, prevRest = first, rest
		tokens += int(blocks[i].Tokens)
		weighted += w[blocks[i].Kind] * float64(blocks[i].Tokens)
		matched = i + 1
	}
	if prevFirst != nil {
		mt := Match{Blocks: matched, Tokens: tokens, Weighted: weighted, Confirmed: tokens}
		out[prevFirst.replica] = mt
		for j := range prevRest {
			out[prevRest[j].replica] = mt
		}
	}
	return out
}

// settleLeavers records a match of i blocks for every replica holding the
// previous block (bFirst, bRest) but not this one (aFirst, aRest); holders
// are sorted by replica.
func settleLeavers(out []Match, bFirst *slot, bRest []slot, aFirst *slot, aRest []slot, i, tokens int, weighted float64) {
	at := func(first *slot, rest []slot, k int) int32 {
		if k == 0 {
			return first.replica
		}
		return rest[k-1].replica
	}
	j, na := 0, 1+len(aRest)
	for k, nb := 0, 1+len(bRest); k < nb; k++ {
		r := at(bFirst, bRest, k)
		for j < na && at(aFirst, aRest, j) < r {
			j++
		}
		if j < na && at(aFirst, aRest, j) == r {
			continue
		}
		out[r] = Match{Blocks: i, Tokens: tokens, Weighted: weighted, Confirmed: tokens}
	}
}

// advance extends holder s's match by block i if it matched every block
// before it, and reports whether it did.
func (m *Model) advance(out []Match, s *slot, i, tokens int, weighted float64) bool {
	o := &out[s.replica]
	if s.flags == 0 || o.Blocks != i {
		return false
	}
	if s.flags&(fGPU|fPending) == 0 { // in CPU memory only
		weighted *= m.cpuCredit
	}
	if s.flags&(fGPU|fCPU) != 0 && o.Confirmed == o.Tokens {
		o.Confirmed += tokens
	}
	o.Blocks, o.Tokens, o.Weighted = i+1, o.Tokens+tokens, o.Weighted+weighted
	return true
}

// Record caches blocks, a whole chain from block 0, on replica id at time now
// (nanoseconds on the caller's clock), refreshing the recency of blocks it
// already holds, then evicts down to the replica's budget. A policy that is a
// eviction.Admitter may refuse a new block; it and the rest of the chain are
// then not cached. Record returns the number of blocks evicted. Unknown ids
// are ignored.
func (m *Model) Record(id int, blocks []blockhash.Block, now int64) int {
	return m.Extend(id, blocks, 0, now)
}

// Extend caches blocks[from:], chained after blocks[:from], on replica id
// at time now, and evicts down to the budget. The first from blocks are a
// prefix the same request recorded already (its prompt, when its reply is
// learned): they are not counted again, neither as a use of each block (hot
// prefixes, hits) nor as a request, and their recency is left as the
// request's end set it (Free); only those the replica no longer holds are
// cached again. Extend(id, blocks, 0, now) is Record. It returns the number
// of blocks evicted.
func (m *Model) Extend(id int, blocks []blockhash.Block, from int, now int64) int {
	m.mu.Lock()
	mark := m.routedMark(id)
	var evicted []uint64
	var count int
	if n := m.heldPrefix(id, blocks, from, mark); n != nil {
		// The prompt is held whole: only the reply's blocks are new.
		evicted, count, _ = m.record(id, n, blocks[from:], 0, now, mark, false)
	} else {
		evicted, count, _ = m.record(id, nil, blocks, from, now, mark, false)
	}
	m.mu.Unlock()
	m.evicted(id, evicted)
	return count
}

// Commit is Record for a request replica id starts to run: its blocks
// are also pinned until Done, as vLLM holds a running request's blocks
// out of its free queue, so that the picture does not evict a prompt
// while the engine still computes with it. It returns the blocks evicted
// and the pins, which Done must be given.
func (m *Model) Commit(id int, blocks []blockhash.Block, now int64) (evicted int, pins Pins) {
	m.mu.Lock()
	keys, count, n := m.record(id, nil, blocks, 0, now, m.routedMark(id), true)
	if n > 0 {
		pins = Pins{n: n, epoch: m.replicas[id].epoch}
	}
	m.mu.Unlock()
	m.evicted(id, keys)
	return count, pins
}

// Pins is what one Commit pinned, for Done to unpin. The zero value pins
// nothing.
type Pins struct {
	n     int    // blocks pinned, from the first
	epoch uint64 // the replica's picture they were pinned in
}

// Blocks returns how many blocks, from the first, are pinned: all of the
// committed ones but for an eviction.Admitter's refusal.
func (p Pins) Blocks() int { return p.n }

// routedMark is the flag a routing record sets on replica id's blocks.
// m.mu must be held.
func (m *Model) routedMark(id int) uint8 {
	if m.valid(id) && m.replicas[id].events {
		return fPending
	}
	return fGPU
}

// heldPrefix returns the node of blocks[from-1] when Extend may start
// there instead of walking blocks[:from] again (2,048 lookups for a 128K
// prompt): every slot of the picture is plainly in GPU memory (no pending,
// CPU or dead slot anywhere, m.irregular == 0), so the picture is closed
// under prefixes — a held block's ancestors are held, as only leaves are
// evicted — and the walk would change nothing before from; and replica id
// holds blocks[from-1]. Otherwise nil. m.mu must be held.
func (m *Model) heldPrefix(id int, blocks []blockhash.Block, from int, mark uint8) *node {
	if m.noShortcut || from <= 0 || from > len(blocks) || mark != fGPU || m.irregular != 0 || !m.valid(id) {
		return nil
	}
	n := m.nodes.get(blocks[from-1].Hash)
	if n == nil {
		return nil
	}
	if i, ok := m.find(n, int32(id)); ok && m.at(n, i).flags == fGPU {
		return n
	}
	return nil
}

func (m *Model) evicted(id int, keys []uint64) {
	if m.onEvict != nil {
		for _, k := range keys {
			m.onEvict(id, k)
		}
	}
}

// Store records blocks the replica's engine reports it has cached (a KV
// event): blocks is a chain whose first block follows the block keyed
// parent (hasParent false: the first block starts a prompt), held in GPU
// memory, or in CPU memory when cpu is set. It confirms blocks a routing
// record marked pending and brings back dead ones; it is not a use of any
// block (no hits, no heat). It reports false, and stores nothing, when the
// replica does not hold the parent: the chain cannot be reached from a
// prompt's start. Evictions to keep the budget are returned as by Extend.
func (m *Model) Store(id int, parent uint64, hasParent bool, blocks []blockhash.Block, cpu bool, now int64) (ok bool, evicted int) {
	m.mu.Lock()
	if m.valid(id) {
		// Expiring pending blocks may drop the parent: before it is looked
		// up, not in record after.
		if st := m.replicas[id]; st.phead < len(st.pending) {
			m.expire(st, int32(id), now)
		}
	}
	var p *node
	if hasParent {
		p = m.nodes.get(parent)
		if !m.valid(id) || p == nil {
			m.mu.Unlock()
			return false, 0
		}
		if _, held := m.find(p, int32(id)); !held {
			m.mu.Unlock()
			return false, 0
		}
	}
	mark := fGPU
	if cpu {
		mark = fCPU
	}
	keys, count, _ := m.record(id, p, blocks, len(blocks), now, mark, false)
	m.mu.Unlock()
	m.evicted(id, keys)
	return true, count
}

// Remove records that the replica's engine dropped block key from GPU
// memory, or from CPU memory when cpu is set (a KV event). Once the block
// is in neither, the replica no longer holds it: Match stops there, even
// for the blocks after it the replica still holds, as the engine's own
// prefix lookup does. It reports whether the replica held the block in
// that medium, and whether it still holds it (in the other). A block the
// replica holds no more is given to OnEvict, as an eviction is.
func (m *Model) Remove(id int, key uint64, cpu bool) (removed, left bool) {
	removed, left = m.removeBlock(id, key, cpu)
	if removed && !left && m.onEvict != nil {
		m.onEvict(id, key)
	}
	return removed, left
}

func (m *Model) removeBlock(id int, key uint64, cpu bool) (removed, left bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.valid(id) {
		return false, false
	}
	n := m.nodes.get(key)
	if n == nil {
		return false, false
	}
	i, ok := m.find(n, int32(id))
	if !ok {
		return false, false
	}
	s := m.at(n, i)
	bit := fGPU
	if cpu {
		bit = fCPU
	}
	if s.flags&bit == 0 {
		return false, s.flags != 0
	}
	f := s.flags &^ bit
	if !cpu {
		f &^= fPending // the engine has it no more, whatever was routed
	}
	m.setFlags(s, f)
	if s.flags == 0 {
		m.drop(m.replicas[id], int32(id), n, i, false)
		return true, false
	}
	return true, true
}

// SetEventDriven says whether replica id's engine reports its blocks
// itself (KV events): if so, the blocks a routing record caches there
// are pending, counted for PendingTTL unless Store confirms them. When it
// stops (the events went silent), the pending blocks are taken as cached,
// as on any other replica.
func (m *Model) SetEventDriven(id int, on bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.valid(id) {
		return
	}
	st := m.replicas[id]
	if st.events == on {
		return
	}
	st.events = on
	if on {
		return
	}
	for _, p := range st.pending[st.phead:] {
		if n := m.nodes.get(p.key); n != nil {
			if i, ok := m.find(n, int32(id)); ok {
				if s := m.at(n, i); s.flags&fPending != 0 {
					m.setFlags(s, s.flags&^fPending|fGPU)
				}
			}
		}
	}
	st.pending, st.phead = nil, 0
}

// ExpirePending forgets, on every replica, the pending blocks routed
// before now − PendingTTL that no engine event confirmed. Routing records
// expire their replica's pending blocks themselves; call this
// periodically so that a replica no request goes to expires them too.
func (m *Model) ExpirePending(now int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for id, st := range m.replicas {
		if st != nil {
			m.expire(st, int32(id), now)
		}
	}
}

// expire drops st's pending blocks older than the TTL. m.mu must be held.
func (m *Model) expire(st *replicaState, rid int32, now int64) {
	cut := now - m.pendTTL
	for st.phead < len(st.pending) && st.pending[st.phead].at <= cut {
		k := st.pending[st.phead].key
		st.phead++
		n := m.nodes.get(k)
		if n == nil {
			continue
		}
		i, ok := m.find(n, rid)
		if !ok {
			continue
		}
		s := m.at(n, i)
		if s.flags&fPending == 0 {
			continue
		}
		if m.setFlags(s, s.flags&^fPending); s.flags == 0 {
			m.drop(st, rid, n, i, false)
			st.PendingExpired++
		}
	}
	if st.phead == len(st.pending) {
		st.pending, st.phead = st.pending[:0], 0
	} else if st.phead > 1024 && st.phead > len(st.pending)/2 {
		st.pending = append(st.pending[:0], st.pending[st.phead:]...)
		st.phead = 0
	}
}

// record caches blocks[from:] on replica id as mark (fGPU, fCPU or
// fPending), chained after parent (nil: blocks[0] starts a prompt) and
// blocks[:from], and evicts down to the budget; it returns the evicted
// keys. Blocks before from are not uses (see Extend). m.mu must be held.
//
// With pin, every block the call goes through (all of blocks, but for an
// Admitter's refusal) gains a pin; pinned is how many.
func (m *Model) record(id int, parent *node, blocks []blockhash.Block, from int, now int64, mark uint8, pin bool) (evicted []uint64, count, pinned int) {
	if !m.valid(id) || len(blocks) == 0 {
		return nil, 0, 0
	}
	st := m.replicas[id]
	rid := int32(id)
	depth0 := m.begin(st, rid, parent, from, now)
	admit, _ := st.policy.(eviction.Admitter)
	parentFresh := false // parent was added by this call and never made evictable
	last := len(blocks) - 1
	for i, b := range blocks {
		n := m.nodes.get(b.Hash)
		use := i >= from // a block of the prefix is not a new use
		if n != nil {
			if use {
				m.warm(n, now)
			}
			if si, ok := m.find(n, rid); ok {
				m.again(st, n, m.at(n, si), mark, now, use, pin)
				parent, parentFresh = n, false
				continue
			}
		}
		if refused(admit, st, b, depth0+i, now) {
			last = i - 1
			break
		}
		if n == nil {
			n = m.newNode(b, parent, depth0+i, use, now)
		}
		m.hold(st, rid, n, parent, parentFresh, mark, now, pin)
		parent, parentFresh = n, true
	}
	if parentFresh && last >= 0 && !pin { // the deepest new block is a leaf
		pi, _ := m.find(parent, rid)
		st.policy.Evictable(parent.hash, parent.info(m.at(parent, pi)))
	}
	if pin {
		pinned = last + 1
	}
	if st.Budget > 0 {
		evicted, count = m.evictTo(st, rid, st.Budget)
	}
	return evicted, count, pinned
}

// begin readies replica rid (st) for a record at now after parent, from
// block from on: its expired pending blocks go, a prompt's start warms the
// fleet's count, and it returns the first block's depth. m.mu must be held.
func (m *Model) begin(st *replicaState, rid int32, parent *node, from int, now int64) (depth0 int) {
	if st.phead < len(st.pending) {
		m.expire(st, rid, now)
	}
	if from == 0 && parent == nil {
		m.warm(&m.fleet, now)
	}
	if parent != nil {
		depth0 = int(parent.depth) + 1
	}
	return depth0
}

// newNode adds block b's node after parent at depth, warmed at now if the
// block is a use. m.mu must be held.
func (m *Model) newNode(b blockhash.Block, parent *node, depth int, use bool, now int64) *node {
	n := m.nodes.add(b.Hash)
	n.parent, n.tokens, n.depth, n.kind = parent, clampTokens(b.Tokens), clampDepth(depth), b.Kind
	if use {
		m.warm(n, now)
	}
	return n
}

// refused reports whether replica st's Admitter (nil: none) keeps block
// b, at depth, out of its picture: only under a budget.
func refused(admit eviction.Admitter, st *replicaState, b blockhash.Block, depth int, now int64) bool {
	if admit == nil || st.Budget <= 0 {
		return false
	}
	info := eviction.Info{Kind: b.Kind, Tokens: int32(clampTokens(b.Tokens)), Depth: int32(clampDepth(depth)), LastUsed: now, Inserted: now}
	return !admit.Admit(info, st.Tokens, st.Budget)
}

// again records block n, which replica st already has a slot for (s),
// as cached again as mark at now: a use unless it is of the prefix only
// (use), pinned with pin. A live slot is touched; a dead one (the engine
// dropped it, not its children) is held again and, having children, is
// no leaf. m.mu must be held.
func (m *Model) again(st *replicaState, n *node, s *slot, mark uint8, now int64, use, pin bool) {
	if s.flags == 0 {
		s.lastUsed, s.inserted = now, now
		m.mark(st, s, n.hash, mark, now)
		if pin {
			s.pin()
		}
		st.Blocks++
		st.Tokens += int64(n.tokens)
		return
	}
	m.mark(st, s, n.hash, mark, now)
	if use {
		s.lastUsed = now
		s.hits++
		st.policy.Touched(n.hash, n.info(s))
	}
	if pin {
		if s.candidate() { // until now
			st.policy.Removed(n.hash)
		}
		s.pin()
	}
}

// hold gives replica rid (st) a new slot on node n, chained after parent,
// cached as mark at now and pinned with pin; the parent, now with a child,
// stops being a leaf unless this call added it (parentFresh: never made
// evictable). m.mu must be held.
func (m *Model) hold(st *replicaState, rid int32, n, parent *node, parentFresh bool, mark uint8, now int64, pin bool) {
	si, _ := m.find(n, rid)
	var pins uint16
	if pin {
		pins = 1
	}
	m.insert(n, si, slot{replica: rid, lastUsed: now, inserted: now, pins: pins})
	m.mark(st, m.at(n, si), n.hash, mark, now)
	st.Blocks++
	st.Tokens += int64(n.tokens)
	if parent != nil {
		pi, _ := m.find(parent, rid)
		ps := m.at(parent, pi)
		ps.children++
		if ps.children == 1 && !parentFresh && ps.flags != 0 {
			st.policy.Removed(parent.hash)
		}
	}
}

// evictTo evicts replica rid's blocks in its policy's order until it holds
// at most tokens, or nothing is left to evict. It returns the keys evicted
// (only when there is an OnEvict to give them to) and how many. m.mu must
// be held.
func (m *Model) evictTo(st *replicaState, rid int32, tokens int64) (evicted []uint64, count int) {
	for st.Tokens > tokens {
		k, ok := st.policy.Victim()
		if !ok {
			break
		}
		if m.evict(st, rid, k) {
			count++
			if m.onEvict != nil { // the keys are kept only for the callback
				evicted = append(evicted, k)
			}
		}
	}
	st.Evictions += int64(count)
	return evicted, count
}

// setFlags sets s's flags, counting the slots that are not plainly on
// the GPU. m.mu must be held.
func (m *Model) setFlags(s *slot, f uint8) {
	if (s.flags != fGPU) != (f != fGPU) {
		if f == fGPU {
			m.irregular--
		} else {
			m.irregular++
		}
	}
	s.flags = f
}

// mark sets flag on a held or revived slot s of block key: fPending only
// where the engine has not confirmed the block, queued to expire; a
// confirmation (fGPU, fCPU) ends pending.
func (m *Model) mark(st *replicaState, s *slot, key uint64, flag uint8, now int64) {
	switch {
	case flag != fPending:
		m.setFlags(s, s.flags&^fPending|flag)
	case s.flags&(fGPU|fCPU) == 0:
		m.setFlags(s, s.flags|fPending)
		st.pending = append(st.pending, pendingBlock{key: key, at: now})
	}
}

// Free records that a request using blocks on replica id finished at now,
// for policies that order blocks by when they were freed
// (eviction.FreeObserver): for them a block's recency is the later of its
// last use and its last free. Other policies do not see it. It stops at
// the first block the replica no longer holds.
func (m *Model) Free(id int, blocks []blockhash.Block, now int64) {
	m.Done(id, blocks, Pins{}, now)
}

// Done is Free for a request Commit started: the blocks Commit pinned
// lose the request's pin, and a leaf left with none becomes a candidate
// for eviction again. Every one of them is unpinned that the replica
// still holds, wherever the release stops; none is if the replica's
// picture was cleared since (the pins went with it).
func (m *Model) Done(id int, blocks []blockhash.Block, pins Pins, now int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.valid(id) {
		return
	}
	st := m.replicas[id]
	fo, _ := st.policy.(eviction.FreeObserver)
	pinned := 0
	if pins.epoch == st.epoch {
		pinned = min(pins.n, len(blocks))
	}
	if fo == nil && pinned == 0 || len(blocks) == 0 {
		return
	}
	rid := int32(id)
	rest := len(blocks)
	if m.irregular == 0 && !m.noShortcut {
		if rest = m.doneUp(st, rid, fo, blocks, pinned, now); rest == 0 {
			return
		}
	}
	freeing := fo
	for i, b := range blocks[:rest] {
		if freeing == nil && i >= pinned {
			return
		}
		var s *slot
		n := m.nodes.get(b.Hash)
		if n != nil {
			if si, ok := m.find(n, rid); ok {
				s = m.at(n, si)
			}
		}
		if s == nil {
			freeing = nil // freeing stops at the first block not held
			continue
		}
		m.done(st, freeing, n, s, i < pinned, now)
	}
}

// doneUp ends a request's use of blocks on replica rid (st) from the
// last block up, by parent pointers, without a lookup a block: as in
// heldPrefix, with every slot plainly on the GPU a held block's ancestors
// are held. It returns how many blocks, from the first, it did not reach
// (0 when the chain was held whole, as a prompt usually is): a block
// stored without its parent (a bad peer's snapshot, a hash collision)
// breaks the walk, and the caller walks the rest down from the first
// block. m.mu must be held.
func (m *Model) doneUp(st *replicaState, rid int32, fo eviction.FreeObserver, blocks []blockhash.Block, pinned int, now int64) (rest int) {
	rest = len(blocks)
	for n := m.nodes.get(blocks[rest-1].Hash); rest > 0 && n != nil; rest-- {
		si, ok := m.find(n, rid)
		if !ok {
			break
		}
		m.done(st, fo, n, m.at(n, si), rest-1 < pinned, now)
		n = n.parent
	}
	return rest
}

// done ends one request's use of n, held in slot s: its free time goes to
// fo (if not nil), and with unpin its pin goes. Only a leaf that is not
// pinned is the policy's: the others' recency waits in lastUsed until
// they become candidates. m.mu must be held.
func (m *Model) done(st *replicaState, fo eviction.FreeObserver, n *node, s *slot, unpin bool, now int64) {
	if fo != nil {
		s.lastUsed = max(s.lastUsed, now)
	}
	if unpin && s.pins > 0 {
		if s.pins--; s.candidate() {
			st.policy.Evictable(n.hash, n.info(s))
			return
		}
	}
	if fo != nil && s.candidate() {
		fo.Freed(n.hash, n.info(s))
	}
}

// Sizes writes every replica's tracked tokens into out[id], growing out as
// Match does, and returns it.
func (m *Model) Sizes(out []int64) []int64 {
	out, _ = m.sizes(out, nil, false)
	return out
}

// SizesBudgets is Sizes, and the replicas' capacities (Stats.Capacity:
// their engines' KV as reported, tokens; 0: unknown) into budgets[id]
// likewise, under one lock.
func (m *Model) SizesBudgets(sizes, budgets []int64) ([]int64, []int64) {
	return m.sizes(sizes, budgets, true)
}

func (m *Model) sizes(sizes, budgets []int64, withBudgets bool) ([]int64, []int64) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	n := len(m.replicas)
	sizes = grow(sizes, n)
	if withBudgets {
		budgets = grow(budgets, n)
	}
	for id, r := range m.replicas {
		var t, b int64
		if r != nil {
			t, b = r.Tokens, r.Capacity
		}
		sizes[id] = t
		if withBudgets {
			budgets[id] = b
		}
	}
	return sizes, budgets
}

// grow returns s with length n, reallocated if its capacity is less.
func grow(s []int64, n int) []int64 {
	if cap(s) < n {
		return make([]int64, n)
	}
	return s[:n]
}

// evict drops replica rid's slot of block k, which the policy chose as a
// leaf, and reports whether it was there.
func (m *Model) evict(st *replicaState, rid int32, k uint64) bool {
	n := m.nodes.get(k)
	if n == nil {
		return false
	}
	i, ok := m.find(n, rid)
	if !ok || m.at(n, i).flags == 0 {
		return false
	}
	if e, ok := st.policy.(eviction.Evicted); ok {
		e.Evicted(k, n.info(m.at(n, i)))
	}
	m.drop(st, rid, n, i, true)
	return true
}

// drop ends replica rid's holding of n (its slot i, held until now; its
// flags may be cleared already): the slot goes if it
// has no children, and then so does every dead ancestor left without
// children; otherwise it stays, dead. A parent left a leaf becomes
// evictable. victim says the policy gave n as its victim, so holds it no
// more. m.mu must be held.
func (m *Model) drop(st *replicaState, rid int32, n *node, i int, victim bool) {
	s := m.at(n, i)
	st.Blocks--
	st.Tokens -= int64(n.tokens)
	if s.children > 0 {
		m.setFlags(s, 0) // dead: not a leaf, so not the policy's
		return
	}
	if !victim {
		st.policy.Removed(n.hash)
	}
	for {
		m.remove(n, i)
		p := n.parent
		if m.count(n) == 0 {
			m.freeNode(n)
		}
		if p == nil {
			return
		}
		pi, ok := m.find(p, rid)
		if !ok {
			return
		}
		ps := m.at(p, pi)
		if ps.children--; ps.children > 0 {
			return
		}
		if ps.flags != 0 {
			if ps.candidate() {
				st.policy.Evictable(p.hash, p.info(ps))
			}
			return
		}
		n, i = p, pi // a dead parent with no children left goes too
	}
}

// EventDriven reports whether replica id's blocks are confirmed by its
// engine's events (SetEventDriven).
func (m *Model) EventDriven(id int) bool {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.valid(id) && m.replicas[id].events
}

// Shrink evicts at least tokens of replica id's blocks, in its policy's
// order, as if its budget had been that much smaller: the engine reported
// it had lost blocks the picture still held. It returns the tokens
// evicted.
func (m *Model) Shrink(id int, tokens int64) int64 {
	m.mu.Lock()
	if !m.valid(id) || tokens <= 0 {
		m.mu.Unlock()
		return 0
	}
	st := m.replicas[id]
	before := st.Tokens
	evicted, _ := m.evictTo(st, int32(id), before-tokens)
	freed := before - st.Tokens
	m.mu.Unlock()
	m.evicted(id, evicted)
	return freed
}

// Active returns the tokens of the leading blocks of blocks that replica
// id holds pinned: used by requests running there (Commit to Done). Its
// engine needs no free KV room for those: they are in use already, where
// vLLM's usage counts them, and a request sharing them takes no more. It
// stops at the first block not held pinned. O(len(blocks)) lookups.
func (m *Model) Active(id int, blocks []blockhash.Block) int {
	m.mu.RLock()
	defer m.mu.RUnlock()
	tokens := 0
	for _, b := range blocks {
		n := m.nodes.get(b.Hash)
		if n == nil {
			break
		}
		i, ok := m.find(n, int32(id))
		if !ok || m.at(n, i).pins == 0 {
			break
		}
		tokens += int(b.Tokens)
	}
	return tokens
}
