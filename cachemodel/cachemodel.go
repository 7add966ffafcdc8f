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
	"math"
	"sync"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/policies"
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
	Tokens   int     // their estimated tokens
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
	Policy policies.Factory
	// OnEvict, if set, is called with every block evicted from a replica,
	// after the model's lock is released, in eviction order.
	OnEvict func(replica int, key uint64)
	// HotHalfLife is the half-life of each block's request rate, counted on
	// every Record across all replicas (see Hot). Default 10s.
	HotHalfLife time.Duration
}

// Model is the picture of every replica's cache.
type Model struct {
	policy  policies.Factory
	onEvict func(replica int, key uint64)
	hotHalf float64 // nanoseconds

	// fleet counts every Record (one request) like a block's heat.
	fleet node

	mu       sync.RWMutex
	nodes    map[uint64]*node
	replicas []*replicaState // by id; nil where removed
}

type replicaState struct {
	Stats
	policy policies.Policy
}

type node struct {
	hash   uint64
	parent *node
	tokens int32
	depth  int32
	kind   blockhash.Kind
	heat   float32 // requests that used the block, decayed by HotHalfLife, as of heatAt
	heatAt int64
	slots  []slot // one per replica holding the block, sorted by replica
}

// warm counts one more request using n at now.
func (m *Model) warm(n *node, now int64) {
	n.heat = float32(m.heatAt(n, now)) + 1
	n.heatAt = max(n.heatAt, now)
}

func (m *Model) heatAt(n *node, now int64) float64 {
	if dt := now - n.heatAt; dt > 0 {
		return float64(n.heat) * math.Exp2(-float64(dt)/m.hotHalf)
	}
	return float64(n.heat)
}

// Hot returns the longest prefix of blocks whose every block is hot: used,
// over all replicas, by at least minUses requests per HotHalfLife and by
// more than minShare of all requests recorded (both decayed counts at now).
// Such a prefix carries more traffic than one replica should take and will
// soon be on several. w weights tokens by kind (nil: unit weights).
// O(hot blocks).
func (m *Model) Hot(blocks []blockhash.Block, w *Weights, minUses, minShare float64, now int64) Match {
	if w == nil {
		w = UnitWeights()
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	threshold := max(minUses, minShare*m.heatAt(&m.fleet, now))
	var out Match
	for _, b := range blocks {
		n := m.nodes[b.Hash]
		if n == nil || m.heatAt(n, now) < threshold {
			break
		}
		out.Blocks++
		out.Tokens += int(n.tokens)
		out.Weighted += w[n.kind] * float64(n.tokens)
	}
	return out
}

type slot struct {
	replica  int32
	children int32 // cached children on this replica
	hits     int32
	lastUsed int64
	inserted int64
	freed    int64
}

// New returns an empty model with no replicas.
func New(o Options) *Model {
	if o.Policy == nil {
		o.Policy = func() policies.Policy { return policies.NewLRU() }
	}
	if o.HotHalfLife <= 0 {
		o.HotHalfLife = 10 * time.Second
	}
	return &Model{policy: o.Policy, onEvict: o.OnEvict, hotHalf: float64(o.HotHalfLife), nodes: make(map[uint64]*node)}
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
		if i, ok := n.find(int32(id)); ok {
			n.slots = append(n.slots[:i], n.slots[i+1:]...)
			if len(n.slots) == 0 {
				delete(m.nodes, h)
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
	var prev *node
	matched, tokens, weighted := 0, 0, 0.0 // of blocks[:i]
	for i := range blocks {
		n := m.nodes[blocks[i].Hash]
		if n == nil || len(n.slots) == 0 {
			break
		}
		if prev != nil && len(n.slots) < len(prev.slots) {
			settleLeavers(out, prev.slots, n.slots, i, tokens, weighted)
		}
		prev = n
		tokens += int(n.tokens)
		weighted += w[n.kind] * float64(n.tokens)
		matched = i + 1
	}
	if prev != nil {
		for _, s := range prev.slots {
			out[s.replica] = Match{Blocks: matched, Tokens: tokens, Weighted: weighted}
		}
	}
	return out
}

// settleLeavers records a match of i blocks for every replica in before but
// not in after (both sorted by replica).
func settleLeavers(out []Match, before, after []slot, i, tokens int, weighted float64) {
	j := 0
	for _, s := range before {
		for j < len(after) && after[j].replica < s.replica {
			j++
		}
		if j < len(after) && after[j].replica == s.replica {
			continue
		}
		out[s.replica] = Match{Blocks: i, Tokens: tokens, Weighted: weighted}
	}
}

// Record caches blocks, a whole chain from block 0, on replica id at time now
// (nanoseconds on the caller's clock), refreshing the recency of blocks it
// already holds, then evicts down to the replica's budget. A policy that is a
// policies.Admitter may refuse a new block; it and the rest of the chain are
// then not cached. Record returns the number of blocks evicted. Unknown ids
// are ignored.
func (m *Model) Record(id int, blocks []blockhash.Block, now int64) int {
	m.mu.Lock()
	evicted := m.record(id, blocks, now)
	m.mu.Unlock()
	if m.onEvict != nil {
		for _, k := range evicted {
			m.onEvict(id, k)
		}
	}
	return len(evicted)
}

func (m *Model) record(id int, blocks []blockhash.Block, now int64) []uint64 {
	if !m.valid(id) || len(blocks) == 0 {
		return nil
	}
	st := m.replicas[id]
	rid := int32(id)
	m.warm(&m.fleet, now)
	admit, _ := st.policy.(policies.Admitter)
	var parent *node
	parentFresh := false // parent was added by this call and never made evictable
	last := len(blocks) - 1
	for i, b := range blocks {
		n := m.nodes[b.Hash]
		if n != nil {
			m.warm(n, now)
			if si, ok := n.find(rid); ok {
				s := &n.slots[si]
				s.lastUsed = now
				s.hits++
				st.policy.Touched(n.hash, n.info(s))
				parent, parentFresh = n, false
				continue
			}
		}
		tokens := max(b.Tokens, 1)
		if admit != nil && st.Budget > 0 &&
			!admit.Admit(policies.Info{Kind: b.Kind, Tokens: tokens, Depth: int32(i), LastUsed: now, Inserted: now}, st.Tokens, st.Budget) {
			last = i - 1
			break
		}
		if n == nil {
			n = &node{hash: b.Hash, parent: parent, tokens: tokens, depth: int32(i), kind: b.Kind}
			m.nodes[b.Hash] = n
			m.warm(n, now)
		}
		si, _ := n.find(rid)
		n.slots = append(n.slots, slot{})
		copy(n.slots[si+1:], n.slots[si:])
		n.slots[si] = slot{replica: rid, lastUsed: now, inserted: now}
		st.Blocks++
		st.Tokens += int64(n.tokens)
		if parent != nil {
			pi, _ := parent.find(rid)
			ps := &parent.slots[pi]
			ps.children++
			if ps.children == 1 && !parentFresh {
				st.policy.Removed(parent.hash)
			}
		}
		parent, parentFresh = n, true
	}
	if parentFresh && last >= 0 { // the deepest new block is a leaf
		pi, _ := parent.find(rid)
		st.policy.Evictable(parent.hash, parent.info(&parent.slots[pi]))
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
// (policies.FreeObserver). Blocks the replica no longer holds are skipped.
func (m *Model) Release(id int, blocks []blockhash.Block, now int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.valid(id) {
		return
	}
	st := m.replicas[id]
	fo, _ := st.policy.(policies.FreeObserver)
	for _, b := range blocks {
		n := m.nodes[b.Hash]
		if n == nil {
			return
		}
		si, ok := n.find(int32(id))
		if !ok {
			return
		}
		s := &n.slots[si]
		s.freed = max(s.freed, now)
		if fo != nil {
			fo.Freed(n.hash, n.info(s))
		}
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
	i, ok := n.find(rid)
	if !ok {
		return false
	}
	if e, ok := st.policy.(policies.Evicted); ok {
		e.Evicted(k, n.info(&n.slots[i]))
	}
	n.slots = append(n.slots[:i], n.slots[i+1:]...)
	st.Blocks--
	st.Tokens -= int64(n.tokens)
	if len(n.slots) == 0 {
		delete(m.nodes, k)
	}
	if p := n.parent; p != nil {
		if pi, ok := p.find(rid); ok {
			ps := &p.slots[pi]
			ps.children--
			if ps.children == 0 {
				st.policy.Evictable(p.hash, p.info(ps))
			}
		}
	}
	return true
}

// find returns the index of rid's slot, or where it would be inserted.
func (n *node) find(rid int32) (int, bool) {
	lo, hi := 0, len(n.slots)
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if n.slots[mid].replica < rid {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo, lo < len(n.slots) && n.slots[lo].replica == rid
}

func (n *node) info(s *slot) policies.Info {
	return policies.Info{Kind: n.kind, Tokens: n.tokens, Depth: n.depth, LastUsed: s.lastUsed, Inserted: s.inserted, Freed: s.freed, Hits: s.hits}
}
