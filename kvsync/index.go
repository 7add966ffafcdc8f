package kvsync

import (
	"math/bits"
	"math/rand/v2"

	"github.com/semroute/semroute/internal/mix"
)

// keyIndex maps an engine's block hashes to router keys in 16-byte slots:
// 18–23 bytes an entry once large, where a Go map took about 30. It is
// open addressing with linear probing in Robin Hood order (an entry passes
// those nearer their home slot, so a miss stops early) and backward-shift
// deletion (no tombstones). The entries are spread over keyShards tables
// by their hash's top bits; a table grows when 7/8 full (doubling up to
// 1,024 slots, then by a quarter) and shrinks to half full when under 1/4
// full, so that no growth rehashes more than a keyShards-th of the
// entries and the index stays proportional to what it holds.
//
// Each slot keeps the engine hash mixed with a random seed (mix): a
// bijection, so equal mixed hashes are equal hashes, the slot needs no
// other key, and nobody who does not know the seed can choose hashes that
// collide. Mixed 0 marks an empty slot; the one engine hash that mixes to
// 0 is kept aside.
//
// The zero value is an empty index (seeded with 0). Not safe for
// concurrent use.
type keyIndex struct {
	seed   uint64
	n      int // entries, the one aside included
	shards [keyShards]keyShard
	// aside is the router key of the engine hash that mixes to 0 (the
	// seed), held when hasAside.
	aside    uint64
	hasAside bool
}

const (
	keyShardBits = 6
	keyShards    = 1 << keyShardBits
	keyMinSlots  = 8 // the fewest slots a shard has once used
)

type keyShard struct {
	slots []keySlot
	n     int // full slots
}

// keySlot is one entry: mk is the engine hash mixed, 0 when the slot is
// empty; val its router key.
type keySlot struct{ mk, val uint64 }

// newKeyIndex returns an empty index with a random seed.
func newKeyIndex() keyIndex { return keyIndex{seed: rand.Uint64()} }

// mix is the index's hash: murmur3's finalizer of the seeded hash, a
// bijection of the 64-bit words that maps 0 to 0.
func (x *keyIndex) mix(h uint64) uint64 { return mix.Fmix64(h ^ x.seed) }

func (x *keyIndex) shard(mk uint64) *keyShard { return &x.shards[mk>>(64-keyShardBits)] }

// Len returns the entries held.
func (x *keyIndex) Len() int { return x.n }

// Get returns engine hash h's router key. O(1) expected.
func (x *keyIndex) Get(h uint64) (uint64, bool) {
	mk := x.mix(h)
	if mk == 0 {
		return x.aside, x.hasAside
	}
	s := x.shard(mk)
	if i := s.find(mk); i >= 0 {
		return s.slots[i].val, true
	}
	return 0, false
}

// Put maps engine hash h to router key v, replacing any key it had.
// O(1) amortized.
func (x *keyIndex) Put(h, v uint64) {
	mk := x.mix(h)
	if mk == 0 {
		if !x.hasAside {
			x.n++
		}
		x.aside, x.hasAside = v, true
		return
	}
	if x.shard(mk).put(mk, v) {
		x.n++
	}
}

// Delete forgets engine hash h and reports whether it was held. O(1)
// expected, amortized.
func (x *keyIndex) Delete(h uint64) bool {
	mk := x.mix(h)
	if mk == 0 {
		held := x.hasAside
		if held {
			x.n--
		}
		x.aside, x.hasAside = 0, false
		return held
	}
	s := x.shard(mk)
	if !s.delete(mk) {
		return false
	}
	x.n--
	return true
}

// home is where a key mixed to mk belongs in s: the bits below the shard's
// scaled to the table, so that any size will do.
func (s *keyShard) home(mk uint64) int {
	hi, _ := bits.Mul64(mk<<keyShardBits, uint64(len(s.slots)))
	return int(hi)
}

// dist is how far slot i's entry, mixed to mk, is from its home.
func (s *keyShard) dist(i int, mk uint64) int {
	d := i - s.home(mk)
	if d < 0 {
		d += len(s.slots)
	}
	return d
}

// find returns mk's slot, or −1.
func (s *keyShard) find(mk uint64) int {
	c := len(s.slots)
	if c == 0 {
		return -1
	}
	i := s.home(mk)
	for d := 0; ; d++ {
		e := s.slots[i].mk
		if e == mk {
			return i
		}
		// Robin Hood order: mk would be here, before any entry nearer
		// its own home.
		if e == 0 || s.dist(i, e) < d {
			return -1
		}
		if i++; i == c {
			i = 0
		}
	}
}

// put maps mk to v and reports whether mk is new. It walks from mk's home
// as find does, and where find would give up, mk goes, moving the entries
// it passes on.
func (s *keyShard) put(mk, v uint64) bool {
	if c := len(s.slots); (s.n+1)*8 > c*7 {
		s.resize(grown(c))
	}
	c := len(s.slots)
	i := s.home(mk)
	for d := 0; ; d++ {
		o := &s.slots[i]
		if o.mk == mk {
			o.val = v
			return false
		}
		if o.mk == 0 || s.dist(i, o.mk) < d {
			s.place(i, d, keySlot{mk, v})
			s.n++
			return true
		}
		if i++; i == c {
			i = 0
		}
	}
}

// grown is the size a full shard of c slots grows to: doubled while small,
// then a quarter more, so that a large index is never much larger than it
// needs.
func grown(c int) int {
	if c < 1024 {
		return max(keyMinSlots, 2*c)
	}
	return c + c/4
}

// place puts e, absent, in slot i, d slots from its home, and moves on
// the entries from there (Robin Hood: each takes the place of the first
// entry nearer its own home) until one lands in an empty slot. s must
// have one.
func (s *keyShard) place(i, d int, e keySlot) {
	c := len(s.slots)
	for ; ; d++ {
		o := &s.slots[i]
		if o.mk == 0 {
			*o = e
			return
		}
		if od := s.dist(i, o.mk); od < d {
			*o, e, d = e, *o, od
		}
		if i++; i == c {
			i = 0
		}
	}
}

// delete removes mk and shifts the entries after it back towards their
// homes; it reports whether mk was there.
func (s *keyShard) delete(mk uint64) bool {
	i := s.find(mk)
	if i < 0 {
		return false
	}
	c := len(s.slots)
	for {
		j := i + 1
		if j == c {
			j = 0
		}
		o := s.slots[j]
		if o.mk == 0 || s.dist(j, o.mk) == 0 {
			break
		}
		s.slots[i] = o
		i = j
	}
	s.slots[i] = keySlot{}
	if s.n--; s.n*4 < c && c > keyMinSlots {
		s.resize(max(keyMinSlots, 2*s.n))
	}
	return true
}

// resize moves s's entries into a table of c slots.
func (s *keyShard) resize(c int) {
	old := s.slots
	s.slots = make([]keySlot, c)
	for _, e := range old {
		if e.mk != 0 {
			s.place(s.home(e.mk), 0, e)
		}
	}
}
