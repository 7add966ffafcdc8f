package routing

import (
	"math"

	"github.com/semroute/semroute/replica"
)

// A decision deferred in the router's queue (Request.Defer) waits for the
// replica it ranked first, as it would have waited in that engine's queue:
// its prefill counts there as pending work while it waits (Wait), and a
// slot that frees elsewhere takes it only when moving costs less than the
// wait (DispatchCost).

// Wait counts deferred decision d's uncached prefill on the replica it ranked
// first as that replica's pending work (replica.Replica.Wait), so that the
// requests decided meanwhile see the queue build there, as they would see
// the engine's. Its blocks are not recorded there: a slot elsewhere may
// take it (DispatchCost), and the picture would then send the requests
// sharing its prefix to a replica that never computed it (measured: on the
// conversation trace at its own rate, the engines' hit rate fell from
// 0.215 to 0.145). Unwait takes the work back; call it once when d leaves
// the router's queue, whatever the reason, and before Drop.
func (e *Engine) Wait(d *Decision, priority int) {
	r := d.Chosen().Replica
	d.waiting, d.priority = int64(d.Uncached(r.ID)), priority
	r.Wait(d.waiting, priority)
}

// Unwait undoes Wait.
func (e *Engine) Unwait(d *Decision) {
	d.Chosen().Replica.Unwait(d.waiting, d.priority)
}

// DispatchCost is what sending deferred decision d to replica r, whose slot
// is free, costs beyond sending it to the replica it waits for: its
// uncached prefill tokens there minus there (routing's unit), both read
// from the picture as it is now (a deferred decision's matches are as old as
// its wait, and the requests sent meanwhile may have brought its prefix to
// r). It is +Inf when computing them on r would take longer than moving
// saves: the request's expected wait for its own replica less the wait of
// those held for r, whose turn it would take (each counting the requests
// of its priority or higher held there: those it waits behind). A
// replica's wait is the requests held for it, each a slot's turn of its
// engine's time per request (replica.Replica.Timing; the pool's average
// where it has not learned its own). Before any engine's timing is known,
// waits are counted in prefill tokens queued per slot. A replica that
// cannot take requests saves an unbounded wait.
func (e *Engine) DispatchCost(d *Decision, r *replica.Replica) float64 {
	want := d.Chosen().Replica
	if r == want {
		return 0 // the same tokens either way: no picture to read
	}
	m := e.pic.matches(d.Blocks, e.o.Weights, nil)
	uncached := func(id int) float64 {
		matched := 0
		if id < len(m) {
			matched = m[id].Tokens
		}
		return d.uncached(d.candidate(id), matched)
	}
	regret := uncached(r.ID) - uncached(want.ID)
	now := e.o.Now()
	if regret <= 0 || !want.Available(now) {
		return regret
	}
	perToken, perHere := e.timing(r)
	_, perWant := e.timing(want)
	if perToken <= 0 || perWant <= 0 {
		pending := func(x *replica.Replica) float64 {
			return x.Load(now).PendingTokens * x.Weight / float64(max(x.Capacity(), 1))
		}
		if regret > pending(want)-pending(r) {
			return math.Inf(1)
		}
		return regret
	}
	wait := func(x *replica.Replica, per float64) float64 {
		return float64(x.Deferred(d.priority)) * per / float64(max(x.Capacity(), 1))
	}
	if regret*perToken > wait(want, perWant)-wait(r, perHere) {
		return math.Inf(1)
	}
	return regret
}

// PerRequest returns the seconds a request holds a slot, on the pool's
// average (replica.Replica.Timing), 0 until one engine's is learned.
func (e *Engine) PerRequest() float64 {
	_, perRequest := e.poolTiming()
	return perRequest
}

// timing returns r's learned timing (replica.Replica.Timing), each part
// the pool's average where r has not learned it.
func (e *Engine) timing(r *replica.Replica) (perToken, perRequest float64) {
	perToken, perRequest = r.Timing()
	if perToken > 0 && perRequest > 0 {
		return perToken, perRequest
	}
	tok, req := e.poolTiming()
	if perToken <= 0 {
		perToken = tok
	}
	if perRequest <= 0 {
		perRequest = req
	}
	return perToken, perRequest
}

// poolTiming returns the average of each part of the replicas' learned
// timing over those that learned it (0: none did).
func (e *Engine) poolTiming() (perToken, perRequest float64) {
	var tok, req float64
	var nt, nr int
	for _, o := range e.pool.Replicas() {
		t, q := o.Timing()
		if t > 0 {
			tok, nt = tok+t, nt+1
		}
		if q > 0 {
			req, nr = req+q, nr+1
		}
	}
	if nt > 0 {
		perToken = tok / float64(nt)
	}
	if nr > 0 {
		perRequest = req / float64(nr)
	}
	return perToken, perRequest
}
