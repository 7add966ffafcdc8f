package routing

import (
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
)

// Sync is told of every change a decision makes to this router's picture
// and load, so that other routers of a fleet can make the same change to
// theirs (package cluster). Each call comes after the engine has made the
// change itself, on the request's goroutine: it must be safe for concurrent
// use and must not block. Blocks and chains are the engine's: valid only
// during the call.
type Sync interface {
	// Committed: d's blocks were recorded on c's replica and its work
	// counted there (Engine.Commit). The Sync may set d.SyncID to name the
	// request in the calls that follow.
	Committed(d *Decision, c *Candidate)
	// PrefillDone: the replica finished d's prefill.
	PrefillDone(d *Decision, c *Candidate)
	// Done: d's work on c's replica ended and its blocks were released.
	Done(d *Decision, c *Candidate)
	// Learned: the reply chain[from:] was cached on r after the prompt
	// chain[:from] (Engine.LearnReply).
	Learned(d *Decision, r *replica.Replica, chain []blockhash.Block, from int)
	// Ejected: r was taken out of rotation for cool after failing
	// (Engine.Fail).
	Ejected(r *replica.Replica, cool time.Duration)
}

// SetSync makes s hear of every change decisions make (nil: none). Call it
// before the engine takes traffic.
func (e *Engine) SetSync(s Sync) { e.sync = s }

// Fail records a passive failure of r at now (replica.Replica.Fail) and,
// when it ejects r, tells the Sync. It returns the cool-down, 0 if r was
// ejected already.
func (e *Engine) Fail(r *replica.Replica, now time.Time, ej replica.Ejection) time.Duration {
	return e.ejected(r, r.Fail(now, ej))
}

// Strike records a soft failure of r at now of a request from source
// (replica.Replica.Strike) and, when it ejects r, tells the Sync. It
// returns the cool-down, 0 if r was not ejected by it.
func (e *Engine) Strike(r *replica.Replica, now time.Time, ej replica.Ejection, source uint64) time.Duration {
	return e.ejected(r, r.Strike(now, ej, source))
}

func (e *Engine) ejected(r *replica.Replica, cool time.Duration) time.Duration {
	if cool > 0 && e.sync != nil {
		e.sync.Ejected(r, cool)
	}
	return cool
}
