package router

import (
	"container/list"
	"errors"
	"sync"
	"time"

	"github.com/semroute/semroute/limits"
)

// ErrUnknownDecision is returned by Release for an id not awaiting it.
var ErrUnknownDecision = errors.New("unknown or already released decision")

// Unreleased keeps the decisions the gRPC API made (Route) until their
// caller reports their end (Release), up to its bounds: past its caps the
// oldest is finished as expired, and one never released is finished after
// ReleaseAfter (Expire). Safe for concurrent use.
type Unreleased struct {
	lim     limits.Unreleased
	finish  func(*Routed, Outcome) // Core.Finish, without a reply
	metrics *Metrics

	mu     sync.Mutex
	byID   map[string]*list.Element
	order  list.List // of *Routed, oldest first
	blocks int       // of the decisions kept
}

func newUnreleased(lim limits.Unreleased, finish func(*Routed, Outcome), m *Metrics) *Unreleased {
	return &Unreleased{lim: lim.WithDefaults(), finish: finish, metrics: m, byID: map[string]*list.Element{}}
}

// Add keeps a recorded decision until Release, until ReleaseAfter passes
// (see Expire), or until the caps push it out, oldest first. Decisions
// pushed out are finished as expired before Add returns.
func (u *Unreleased) Add(rt *Routed) {
	var out []*Routed
	u.mu.Lock()
	u.byID[rt.ID] = u.order.PushBack(rt)
	u.blocks += len(rt.Blocks)
	for u.order.Len() > u.lim.Max || (u.blocks > u.lim.MaxBlocks && u.order.Len() > 1) {
		out = append(out, u.removeLocked(u.order.Front()))
	}
	u.mu.Unlock()
	u.expired(out, "cap")
}

// removeLocked removes e from the kept decisions; u.mu is held.
func (u *Unreleased) removeLocked(e *list.Element) *Routed {
	rt := u.order.Remove(e).(*Routed)
	delete(u.byID, rt.ID)
	u.blocks -= len(rt.Blocks)
	return rt
}

// expired finishes decisions that were never released, counting them by
// reason ("cap" or "timeout").
func (u *Unreleased) expired(rts []*Routed, reason string) {
	for _, rt := range rts {
		u.finish(rt, Outcome{Error: "never released"})
	}
	u.metrics.unreleasedExpired(reason, len(rts))
}

// Release finishes the decision id with o.
func (u *Unreleased) Release(id string, o Outcome) error {
	u.mu.Lock()
	e, ok := u.byID[id]
	var rt *Routed
	if ok {
		rt = u.removeLocked(e)
	}
	u.mu.Unlock()
	if !ok {
		return ErrUnknownDecision
	}
	u.finish(rt, o)
	return nil
}

// Expire finishes the decisions older than ReleaseAfter at now and
// returns how many. It costs O(expired): decisions are kept in the order
// they were made.
func (u *Unreleased) Expire(now time.Time) int {
	var old []*Routed
	u.mu.Lock()
	for e := u.order.Front(); e != nil && now.Sub(e.Value.(*Routed).start) >= u.lim.ReleaseAfter; e = u.order.Front() {
		old = append(old, u.removeLocked(e))
	}
	u.mu.Unlock()
	u.expired(old, "timeout")
	return len(old)
}

// Len returns how many decisions await Release, and the blocks they keep.
func (u *Unreleased) Len() (decisions, blocks int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.order.Len(), u.blocks
}
