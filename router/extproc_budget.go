package router

import (
	"sync/atomic"

	"github.com/semroute/semroute/limits"
)

// BodyBudget bounds the bytes of request bodies the endpoint picker holds
// across all of its streams. A stream takes room as its body's buffer
// grows (the buffer's capacity, not only the bytes in it) and gives it all
// back once its request is routed or answered, or its stream ends, however
// it ends. A stream that cannot take the room it needs is answered 429.
//
// One budget per process: give every ExtProcService the same one. Safe for
// concurrent use; use NewBodyBudget, the zero value has no room.
type BodyBudget struct {
	max  int64 // bytes
	used atomic.Int64
	peak atomic.Int64
}

// NewBodyBudget returns a budget of max bytes; max <= 0 means
// limits.DefaultExtProcBufferBytes.
func NewBodyBudget(max int64) *BodyBudget {
	if max <= 0 {
		max = limits.DefaultExtProcBufferBytes
	}
	return &BodyBudget{max: max}
}

// Max returns the budget's size, in bytes.
func (b *BodyBudget) Max() int64 { return b.max }

// Used returns the bytes taken now.
func (b *BodyBudget) Used() int64 { return b.used.Load() }

// Peak returns the most bytes ever taken at once. It never exceeds Max.
func (b *BodyBudget) Peak() int64 { return b.peak.Load() }

// take takes n bytes and reports true, or takes nothing and reports false
// when that would pass Max. O(1), lock-free.
func (b *BodyBudget) take(n int64) bool {
	for {
		u := b.used.Load()
		if u+n > b.max {
			return false
		}
		if b.used.CompareAndSwap(u, u+n) {
			b.notePeak(u + n)
			return true
		}
	}
}

// give gives back n bytes taken before.
func (b *BodyBudget) give(n int64) {
	if n != 0 {
		b.used.Add(-n)
	}
}

func (b *BodyBudget) notePeak(u int64) {
	for {
		p := b.peak.Load()
		if u <= p || b.peak.CompareAndSwap(p, u) {
			return
		}
	}
}
