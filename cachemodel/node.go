package cachemodel

import (
	"math"
	"sort"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/eviction"
)

// node is one block of the shared tree: 64 bytes, in nodeTable's slabs.
// Its holders (the replicas caching it, sorted by replica id) are one
// inline slot plus, for the few blocks several replicas hold, a slice in
// the model's side table (Model.more).
type node struct {
	hash   uint64
	parent *node
	heat   float32 // requests that used the block, decayed, as of heatAt
	heatAt uint32  // seconds on the caller's clock
	tokens uint16
	depth  uint16 // position in the chain, saturating at 65,535
	kind   blockhash.Kind
	multi  bool // more than one holder: the rest are in Model.more
	one    slot // the first holder; replica −1 when the block has none
}

// maxPins is where a slot's pin count saturates.
const maxPins = math.MaxUint16

// slot is one replica's holding of a block: 32 bytes.
type slot struct {
	replica  int32
	children int32 // cached children on this replica, dead ones included
	hits     int32
	// flags say where the block is (see fGPU): none means the slot is
	// dead, kept only because the replica holds some of its children.
	flags uint8
	// pins counts the running requests using the block (Commit to Done),
	// saturating at 65,535: the engine does not evict their blocks, so a
	// pinned leaf is not the policy's candidate until its last pin goes.
	pins uint16
	// lastUsed is when the block was last inserted or hit, or, for
	// policies that order by free time, freed.
	lastUsed int64
	inserted int64
}

// candidate reports whether s is its replica's policy's to evict: held,
// a leaf (no cached children) and not pinned by a running request.
func (s *slot) candidate() bool { return s.flags != 0 && s.children == 0 && s.pins == 0 }

// pin counts one more running request using the block, saturating.
func (s *slot) pin() {
	if s.pins < maxPins {
		s.pins++
	}
}

// Slot flags: where a replica holds a block. A routing record marks the
// blocks it caches fGPU, or fPending on a replica whose engine confirms
// its blocks itself (SetEventDriven) until Store confirms them or
// PendingTTL passes; Store marks them fGPU or fCPU. A slot with no flag
// is dead: the engine dropped the block while holding some of its
// children, which no prefix lookup can reach any more; it goes when its
// last child goes.
const (
	fGPU uint8 = 1 << iota
	fCPU
	fPending
)

// freeNode forgets n, which no replica holds any more, and keeps it for
// reuse. m.mu must be held.
func (m *Model) freeNode(n *node) {
	delete(m.more, n)
	m.nodes.remove(n)
}

func clampTokens(t int32) uint16 { return uint16(min(max(t, 1), math.MaxUint16)) }
func clampDepth(i int) uint16    { return uint16(min(i, math.MaxUint16)) }

// holders returns n's holders: the inline one (nil when none) and the rest.
// m.mu must be held.
func (m *Model) holders(n *node) (first *slot, rest []slot) {
	if n.one.replica < 0 {
		return nil, nil
	}
	if n.multi {
		rest = m.more[n]
	}
	return &n.one, rest
}

// count returns how many replicas hold n.
func (m *Model) count(n *node) int {
	first, rest := m.holders(n)
	if first == nil {
		return 0
	}
	return 1 + len(rest)
}

// at returns n's i-th holder.
func (m *Model) at(n *node, i int) *slot {
	if i == 0 {
		return &n.one
	}
	return &m.more[n][i-1]
}

// find returns the index of rid's slot in n, or where it would be inserted.
func (m *Model) find(n *node, rid int32) (int, bool) {
	first, rest := m.holders(n)
	switch {
	case first == nil:
		return 0, false
	case rid <= first.replica:
		return 0, rid == first.replica
	}
	i := sort.Search(len(rest), func(j int) bool { return rest[j].replica >= rid })
	return i + 1, i < len(rest) && rest[i].replica == rid
}

// insert puts s at index i (from find) of n's holders.
func (m *Model) insert(n *node, i int, s slot) {
	if s.flags != fGPU {
		m.irregular++
	}
	c := m.count(n)
	if c == 0 {
		n.one = s
		return
	}
	m.more[n] = append(m.more[n], slot{})
	n.multi = true
	for j := c; j > i; j-- {
		*m.at(n, j) = *m.at(n, j-1)
	}
	*m.at(n, i) = s
}

// remove drops n's holder at index i.
func (m *Model) remove(n *node, i int) {
	if m.at(n, i).flags != fGPU {
		m.irregular--
	}
	c := m.count(n)
	for j := i; j < c-1; j++ {
		*m.at(n, j) = *m.at(n, j+1)
	}
	switch {
	case c == 1:
		n.one = slot{replica: -1}
	case c == 2:
		delete(m.more, n)
		n.multi = false
	default:
		m.more[n] = m.more[n][:c-2]
	}
}

func (n *node) info(s *slot) eviction.Info {
	return eviction.Info{Kind: n.kind, Tokens: int32(n.tokens), Depth: int32(n.depth), LastUsed: s.lastUsed, Inserted: s.inserted, Hits: s.hits}
}

// seconds converts the caller's nanoseconds to the heat clock.
func seconds(now int64) uint32 { return uint32(max(now, 0) / 1e9) }

// warm counts one more request using n at now.
func (m *Model) warm(n *node, now int64) {
	n.heat = float32(m.heatAt(n, now)) + 1
	n.heatAt = max(n.heatAt, seconds(now))
}

func (m *Model) heatAt(n *node, now int64) float64 {
	if dt := int64(seconds(now)) - int64(n.heatAt); dt > 0 {
		return float64(n.heat) * math.Exp2(-float64(dt)*1e9/m.hotHalf)
	}
	return float64(n.heat)
}

// Hot returns the longest prefix of blocks whose every block is hot: used,
// over all replicas, by at least minUses requests per HotHalfLife and by
// more than minShare of all requests recorded (both decayed counts at now,
// in whole seconds). Such a prefix carries more traffic than one replica
// should take and will soon be on several. w weights tokens by kind (nil:
// unit weights). O(hot blocks).
func (m *Model) Hot(blocks []blockhash.Block, w *Weights, minUses, minShare float64, now int64) Match {
	if w == nil {
		w = UnitWeights()
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	threshold := max(minUses, minShare*m.heatAt(&m.fleet, now))
	var out Match
	for _, b := range blocks {
		n := m.nodes.get(b.Hash)
		if n == nil || m.heatAt(n, now) < threshold {
			break
		}
		out.Blocks++
		out.Tokens += int(b.Tokens) // the request's unit, as Match counts
		out.Weighted += w[b.Kind] * float64(b.Tokens)
	}
	return out
}
