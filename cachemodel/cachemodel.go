// Package cachemodel is the router's approximate picture of every replica's
// KV cache: one tree of block hashes shared by all replicas, where each node
// records which replicas hold it, plus a token budget per replica enforced by
// a pluggable eviction policy.
//
// Because a block's hash names its whole prefix, the tree is stored as a map
// from hash to node with parent links. A replica's blocks are always a
// prefix-closed subtree (blocks are inserted with their whole prefix and only
// a replica's leaves are evicted), which is what makes Match cheap: the set of
// replicas holding block i+1 is a subset of those holding block i.
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
}

// Stats describes one replica's picture.
type Stats struct {
	Name      string
	Blocks    int64 // blocks tracked
	Tokens    int64 // their estimated tokens
	Budget    int64 // token budget; 0 means unlimited
	Evictions int64 // blocks evicted since the replica was added
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
}

// Model is the picture of every replica's cache.
type Model struct {
	policy  eviction.Factory
	onEvict func(replica int, key uint64)
	hotHalf float64 // nanoseconds

	// fleet counts every Record (one request) like a block's heat.
	fleet node

	mu        sync.RWMutex
	nodes     map[uint64]*node
	slab      []node  // nodes not handed out yet
	freeNodes []*node // nodes to reuse
	more      map[*node][]slot
	replicas  []*replicaState // by id; nil where removed
}

type replicaState struct {
	Stats
	policy eviction.Policy
}

// New returns an empty model with no replicas.
func New(o Options) *Model {
	if o.Policy == nil {
		o.Policy = func() eviction.Policy { return eviction.NewLRU() }
	}
	if o.HotHalfLife <= 0 {
		o.HotHalfLife = 10 * time.Second
	}
	return &Model{policy: o.Policy, onEvict: o.OnEvict, hotHalf: float64(o.HotHalfLife), nodes: make(map[uint64]*node),
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
	st := &replicaState{Stats: Stats{Name: name, Budget: budgetTokens}, policy: m.policy()}
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
	defer m.mu.Unlock()
	if m.valid(id) {
		m.clear(id)
		m.replicas[id] = nil
	}
}

// Clear empties a replica's picture, as after the replica restarted.
// O(tracked blocks).
func (m *Model) Clear(id int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.valid(id) {
		m.clear(id)
	}
}

func (m *Model) clear(id int) {
	for h, n := range m.nodes {
		if i, ok := m.find(n, int32(id)); ok {
			m.remove(n, i)
			if m.count(n) == 0 {
				delete(m.nodes, h)
				m.freeNode(n)
			}
		}
	}
	st := m.replicas[id]
	st.Blocks, st.Tokens = 0, 0
	st.policy = m.policy()
}

// SetBudget changes a replica's token budget (0 = unlimited); the next Record
// on it evicts down to the new budget.
func (m *Model) SetBudget(id int, budgetTokens int64) {
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
// tokens by kind; nil means UnitWeights. Match does not change recency.
//
// Cost: O(matched blocks) map lookups, plus O(holders) work only where the set
// of holders shrinks. It does not allocate when out is long enough.
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
	var prevFirst *slot
	var prevRest []slot
	matched, tokens, weighted := 0, 0, 0.0 // of blocks[:i]
	for i := range blocks {
		n := m.nodes[blocks[i].Hash]
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
		// The request's own token counts: the unit it was estimated in
		// (the engine's, once learned), not the one the block was first
		// recorded in.
		tokens += int(blocks[i].Tokens)
		weighted += w[n.kind] * float64(blocks[i].Tokens)
		matched = i + 1
	}
	if prevFirst != nil {
		out[prevFirst.replica] = Match{Blocks: matched, Tokens: tokens, Weighted: weighted}
		for j := range prevRest {
			out[prevRest[j].replica] = Match{Blocks: matched, Tokens: tokens, Weighted: weighted}
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
		out[r] = Match{Blocks: i, Tokens: tokens, Weighted: weighted}
	}
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
// request's end set it (Release); only those the replica no longer holds are
// cached again. Extend(id, blocks, 0, now) is Record. It returns the number
// of blocks evicted.
func (m *Model) Extend(id int, blocks []blockhash.Block, from int, now int64) int {
	m.mu.Lock()
	evicted := m.record(id, blocks, from, now)
	m.mu.Unlock()
	if m.onEvict != nil {
		for _, k := range evicted {
			m.onEvict(id, k)
		}
	}
	return len(evicted)
}

func (m *Model) record(id int, blocks []blockhash.Block, from int, now int64) []uint64 {
	if !m.valid(id) || len(blocks) == 0 {
		return nil
	}
	st := m.replicas[id]
	rid := int32(id)
	if from == 0 {
		m.warm(&m.fleet, now)
	}
	admit, _ := st.policy.(eviction.Admitter)
	var parent *node
	parentFresh := false // parent was added by this call and never made evictable
	last := len(blocks) - 1
	for i, b := range blocks {
		n := m.nodes[b.Hash]
		use := i >= from // a block of the prefix is not a new use
		if n != nil {
			if use {
				m.warm(n, now)
			}
			if si, ok := m.find(n, rid); ok {
				if !use {
					parent, parentFresh = n, false // recorded by this request already
					continue
				}
				s := m.at(n, si)
				s.lastUsed = now
				s.hits++
				st.policy.Touched(n.hash, n.info(s))
				parent, parentFresh = n, false
				continue
			}
		}
		tokens := clampTokens(b.Tokens)
		if admit != nil && st.Budget > 0 &&
			!admit.Admit(eviction.Info{Kind: b.Kind, Tokens: int32(tokens), Depth: int32(clampDepth(i)), LastUsed: now, Inserted: now}, st.Tokens, st.Budget) {
			last = i - 1
			break
		}
		if n == nil {
			n = m.newNode()
			n.hash, n.parent, n.tokens, n.depth, n.kind = b.Hash, parent, tokens, clampDepth(i), b.Kind
			m.nodes[b.Hash] = n
			if use {
				m.warm(n, now)
			}
		}
		si, _ := m.find(n, rid)
		m.insert(n, si, slot{replica: rid, lastUsed: now, inserted: now})
		st.Blocks++
		st.Tokens += int64(n.tokens)
		if parent != nil {
			pi, _ := m.find(parent, rid)
			ps := m.at(parent, pi)
			ps.children++
			if ps.children == 1 && !parentFresh {
				st.policy.Removed(parent.hash)
			}
		}
		parent, parentFresh = n, true
	}
	if parentFresh && last >= 0 { // the deepest new block is a leaf
		pi, _ := m.find(parent, rid)
		st.policy.Evictable(parent.hash, parent.info(m.at(parent, pi)))
	}
	var evicted []uint64
	for st.Budget > 0 && st.Tokens > st.Budget {
		k, ok := st.policy.Victim()
		if !ok {
			break
		}
		if m.evict(st, rid, k) {
			evicted = append(evicted, k)
		}
	}
	st.Evictions += int64(len(evicted))
	return evicted
}

// Release records that a request using blocks on replica id finished at now,
// for policies that order blocks by when they were freed
// (eviction.FreeObserver): for them a block's recency is the later of its
// last use and its last free. Other policies do not see it. Blocks the
// replica no longer holds are skipped.
func (m *Model) Release(id int, blocks []blockhash.Block, now int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.valid(id) {
		return
	}
	fo, ok := m.replicas[id].policy.(eviction.FreeObserver)
	if !ok {
		return
	}
	for _, b := range blocks {
		n := m.nodes[b.Hash]
		if n == nil {
			return
		}
		si, ok := m.find(n, int32(id))
		if !ok {
			return
		}
		s := m.at(n, si)
		s.lastUsed = max(s.lastUsed, now)
		fo.Freed(n.hash, n.info(s))
	}
}

// Sizes writes every replica's tracked tokens into out[id], growing out as
// Match does, and returns it.
func (m *Model) Sizes(out []int64) []int64 {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if cap(out) < len(m.replicas) {
		out = make([]int64, len(m.replicas))
	}
	out = out[:len(m.replicas)]
	for id, r := range m.replicas {
		out[id] = 0
		if r != nil {
			out[id] = r.Tokens
		}
	}
	return out
}

// evict drops replica rid's slot of block k, which the policy chose as a
// leaf, and reports whether it was there.
func (m *Model) evict(st *replicaState, rid int32, k uint64) bool {
	n := m.nodes[k]
	if n == nil {
		return false
	}
	i, ok := m.find(n, rid)
	if !ok {
		return false
	}
	if e, ok := st.policy.(eviction.Evicted); ok {
		e.Evicted(k, n.info(m.at(n, i)))
	}
	m.remove(n, i)
	st.Blocks--
	st.Tokens -= int64(n.tokens)
	p := n.parent
	if m.count(n) == 0 {
		delete(m.nodes, k)
		m.freeNode(n)
	}
	if p != nil {
		if pi, ok := m.find(p, rid); ok {
			ps := m.at(p, pi)
			ps.children--
			if ps.children == 0 {
				st.policy.Evictable(p.hash, p.info(ps))
			}
		}
	}
	return true
}
