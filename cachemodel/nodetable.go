package cachemodel

import (
	"math/bits"
	"math/rand/v2"

	"github.com/semroute/semroute/internal/mix"
)

// nodeTable holds the tree's nodes and finds them by block hash, in about
// 8–10 bytes a node besides the node's own 64, where a map[uint64]*node
// took about 30.
//
// Nodes live in slabs of slabNodes and are named by a 32-bit handle (slab
// number, place in the slab); removed nodes are reused, the last removed
// first, before a slab is added. The index is open addressing over 6-byte slots — a tag
// byte from the hash, the distance from the hash's home slot, the handle —
// with linear probing in Robin Hood order (an entry passes those nearer
// their home, so a miss stops early) and backward-shift deletion (no
// tombstones). The hash itself is read from the node when a slot's tag and
// distance match, about once a lookup. The slots are spread over ixShards
// tables by the hash's top bits; a table grows when 3/4 full (doubling up
// to 1,024 slots, then by a quarter) and shrinks to half full when under
// 1/4 full, so that no growth rehashes more than an ixShards-th of the
// nodes and the index stays proportional to the nodes held. (A shard also
// grows when a node would fall more than ixMaxDist slots from home, which
// takes hashes chosen to collide; it then shrinks no further until it is
// empty.)
//
// The zero value is an empty table whose hash is seeded with 0; New seeds
// it at random, so that no one can choose block hashes that collide. Not
// safe for concurrent use: the Model's lock guards it.
type nodeTable struct {
	slabs []*[slabNodes]node
	used  int      // nodes handed out of the last slab
	free  []uint32 // handles of removed nodes
	n     int      // nodes in the index
	seed  uint64
	shard [ixShards]ixShard
}

const (
	// slabBits is the handle's bits for the place in a slab.
	slabBits = 12
	// slabNodes is how many nodes are allocated at once.
	slabNodes = 1 << slabBits

	ixShardBits = 8
	ixShards    = 1 << ixShardBits
	// ixMinSlots is the fewest slots a shard has once used (384 bytes):
	// with fewer, the shards of a small picture, a few nodes each, would
	// grow and shrink as often as its blocks come and go.
	ixMinSlots = 64
	ixMaxDist  = 254 // past it a shard grows: see ixSlot.dist
)

type ixShard struct {
	slots []ixSlot
	n     int // full slots
	// floor is the fewest slots the shard's nodes last fitted in without
	// one falling more than ixMaxDist from home, when that was more than
	// their load asked for: the shard shrinks no further until empty.
	floor int
}

// ixSlot is one node in the index: 6 bytes.
type ixSlot struct {
	tag uint8 // the low byte of the node's mixed hash
	// dist is 1 + how far the slot is from the node's home slot, at most
	// ixMaxDist; 0 marks an empty slot.
	dist   uint8
	lo, hi uint16 // the node's handle
}

func (e ixSlot) handle() uint32 { return uint32(e.hi)<<16 | uint32(e.lo) }

func newNodeTable() nodeTable { return nodeTable{seed: rand.Uint64()} }

// mix is the index's hash: murmur3's finalizer of the seeded block hash.
func (t *nodeTable) mix(k uint64) uint64 { return mix.Fmix64(k ^ t.seed) }

func (t *nodeTable) shardOf(mk uint64) *ixShard { return &t.shard[mk>>(64-ixShardBits)] }

// home is where a hash mixed to mk belongs in s: the bits below the
// shard's scaled to the table, so that any size will do.
func (s *ixShard) home(mk uint64) int {
	hi, _ := bits.Mul64(mk<<ixShardBits, uint64(len(s.slots)))
	return int(hi)
}

// at returns the node of handle h.
func (t *nodeTable) at(h uint32) *node { return &t.slabs[h>>slabBits][h&(slabNodes-1)] }

// len returns the nodes in the table.
func (t *nodeTable) len() int { return t.n }

// get returns the node of block hash k, or nil. O(1) expected; it reads
// one node's hash when k is there, rarely one when it is not.
func (t *nodeTable) get(k uint64) *node {
	mk := t.mix(k)
	s := t.shardOf(mk)
	c := len(s.slots)
	if c == 0 {
		return nil
	}
	i, tag := s.home(mk), uint8(mk)
	for d := uint8(1); ; d++ {
		e := s.slots[i]
		if e.dist < d { // empty, or a node nearer its home: k would be here
			return nil
		}
		if e.dist == d && e.tag == tag {
			if n := t.at(e.handle()); n.hash == k {
				return n
			}
		}
		if i++; i == c {
			i = 0
		}
	}
}

// add returns a new node of block hash k, which must not be in the table:
// cleared, holder-less, indexed. O(1) amortized.
func (t *nodeTable) add(k uint64) *node {
	h := t.alloc()
	n := t.at(h)
	n.hash = k
	mk := t.mix(k)
	s := t.shardOf(mk)
	if c := len(s.slots); (s.n+1)*4 > c*3 {
		t.resize(s, ixGrown(c), nil)
	}
	e := ixSlot{tag: uint8(mk), lo: uint16(h), hi: uint16(h >> 16)}
	if out, ok := s.place(s.home(mk), e); !ok {
		t.resize(s, ixGrown(len(s.slots)), &out)
		s.floor = len(s.slots)
	}
	s.n++
	t.n++
	return n
}

// ixGrown is the size a shard of c slots grows to: doubled while small,
// then a quarter more, so that a large index is never much larger than it
// needs.
func ixGrown(c int) int {
	if c < 1024 {
		return max(ixMinSlots, 2*c)
	}
	return c + c/4
}

// alloc returns the handle of a cleared node with no holder, reusing a
// removed one when it can.
func (t *nodeTable) alloc() uint32 {
	if k := len(t.free); k > 0 {
		h := t.free[k-1]
		t.free = t.free[:k-1]
		return h
	}
	if len(t.slabs) == 0 || t.used == slabNodes {
		if len(t.slabs) == 1<<(32-slabBits) {
			panic("cachemodel: more than 2³² blocks tracked")
		}
		t.slabs = append(t.slabs, new([slabNodes]node))
		t.used = 0
	}
	h := uint32(len(t.slabs)-1)<<slabBits | uint32(t.used)
	t.used++
	t.at(h).one.replica = -1
	return h
}

// place puts e, its dist not set yet, in slot i, its home, and moves on
// the entries from there (Robin Hood: each takes the place of the first
// entry nearer its own home) until one lands in an empty slot. s must have
// one. It reports false, with the entry it then carries, when that entry
// would be more than ixMaxDist from home: s must grow.
func (s *ixShard) place(i int, e ixSlot) (ixSlot, bool) {
	c := len(s.slots)
	for e.dist = 1; ; e.dist++ {
		o := &s.slots[i]
		if o.dist == 0 {
			*o = e
			return ixSlot{}, true
		}
		if o.dist < e.dist {
			*o, e = e, *o
		}
		if e.dist == ixMaxDist {
			return e, false
		}
		if i++; i == c {
			i = 0
		}
	}
}

// resize moves s's entries, and carry if not nil, into a table of c
// slots, or twice as many as often as some node would still fall more
// than ixMaxDist from home, reading each node's hash to find its new home.
func (t *nodeTable) resize(s *ixShard, c int, carry *ixSlot) {
	old := s.slots
	for doubled := false; ; c, doubled = 2*c, true {
		s.slots = make([]ixSlot, c)
		if t.rehome(s, old, carry) {
			if doubled {
				s.floor = c
			}
			return
		}
	}
}

// rehome places old's entries and carry (if not nil) in s, and reports
// whether each fell within ixMaxDist of its home.
func (t *nodeTable) rehome(s *ixShard, old []ixSlot, carry *ixSlot) bool {
	if carry != nil {
		if _, ok := s.place(s.home(t.mix(t.at(carry.handle()).hash)), *carry); !ok {
			return false
		}
	}
	// The nodes' hashes are read a batch at a time, in a loop of
	// independent loads, so that the memory fetches them together: one
	// at a time, between placements, each waited for a cache miss.
	var hs [32]uint64
	for len(old) > 0 {
		b := old[:min(len(old), len(hs))]
		old = old[len(b):]
		for i, e := range b {
			if e.dist != 0 {
				hs[i] = t.at(e.handle()).hash
			}
		}
		for i, e := range b {
			if e.dist != 0 {
				if _, ok := s.place(s.home(t.mix(hs[i])), e); !ok {
					return false
				}
			}
		}
	}
	return true
}

// remove takes n, which must be in the table, out of the index and keeps
// its handle for reuse. O(1) amortized.
func (t *nodeTable) remove(n *node) {
	mk := t.mix(n.hash)
	s := t.shardOf(mk)
	c := len(s.slots)
	i := s.home(mk)
	for d := uint8(1); ; d++ {
		e := s.slots[i]
		if e.dist < d {
			panic("cachemodel: removing a node not in the table")
		}
		if e.dist == d && t.at(e.handle()) == n {
			break
		}
		if i++; i == c {
			i = 0
		}
	}
	h := s.slots[i].handle()
	// Shift the entries after it back towards their homes.
	for {
		j := i + 1
		if j == c {
			j = 0
		}
		o := s.slots[j]
		if o.dist <= 1 { // empty, or at home
			break
		}
		o.dist--
		s.slots[i] = o
		i = j
	}
	s.slots[i] = ixSlot{}
	s.n--
	t.n--
	if s.n == 0 {
		s.floor = 0
	}
	if s.n*4 < c && c > max(ixMinSlots, s.floor) {
		t.resize(s, max(ixMinSlots, 2*s.n, s.floor), nil)
	}
	*n = node{one: slot{replica: -1}}
	t.free = append(t.free, h)
}

// each calls f with every node in the table, in handle order. f may
// remove the node it is given.
func (t *nodeTable) each(f func(*node)) {
	for si, sl := range t.slabs {
		end := slabNodes
		if si == len(t.slabs)-1 {
			end = t.used
		}
		for i := range sl[:end] {
			if n := &sl[i]; n.one.replica >= 0 {
				f(n)
			}
		}
	}
}
