package routing

import (
	"math"
	"time"

	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/servicetime"
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
// is free, costs against waiting for the replica it waits for: its
// predicted time to first token on r, plus the tokens it would compute
// again there at the fleet's speed (a copy's cost, as the semantic policy
// counts it once), over its predicted time to first token on the replica
// it waits for, behind the requests of its priority or higher held there;
// each from that replica's service-time model (Service) and the picture as
// it is now (a deferred decision's matches are as old as its wait, and the
// requests sent meanwhile may have brought its prefix to r). Below 1 is a
// gain, the smaller the larger: the router's queue gives a slot to the
// request that gains most, after those that wait for that replica (0). It
// is +Inf when the request would start no sooner on r (it waits for its
// own replica), and near 0 when its replica cannot take requests.
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
	ur, uw := uncached(r.ID), uncached(want.ID)
	tokens := int64(d.Tokens)
	pr, fleet := e.Service(r), e.fleetService()
	there := pr.TTFT(r.State(tokens, d.priority), ur) + max(ur-uw, 0)*fleet.PerToken
	if !want.Available(e.o.Now()) {
		return there * 1e-9 // its own replica never comes: before any other gain
	}
	pw := e.Service(want)
	// d counts among those held for want (Wait): it waits behind the rest.
	sw := want.State(tokens, d.priority)
	sw.Queued--
	home := pw.TTFT(sw, uw)
	if there >= home {
		return math.Inf(1)
	}
	return there / home
}

// PerRequest returns the seconds a request holds a slot, on the fleet's
// service-time model (servicetime.Params.Run).
func (e *Engine) PerRequest() float64 {
	p := e.fleetService()
	return p.Run
}

// Service returns r's service-time parameters (replica.Replica.Service),
// or the fleet's (fleetService) while r has learned them from fewer than
// OwnSamples answers: a replica's first answers say little apart from its
// prior, and one that looked slow on them would get no more answers to
// learn from.
func (e *Engine) Service(r *replica.Replica) servicetime.Params {
	if p, _ := r.Service(); p.Samples >= OwnSamples {
		return p
	}
	return e.fleetService()
}

// OwnSamples is the answers a replica's service time is learned from
// before it is used instead of the fleet's.
const OwnSamples = 16

// fleetService returns the median of the learned service-time parameters
// of the pool's replicas that learned from OwnSamples answers, or the
// prior while none did (servicetime.Prior: a fit of a few answers, whose
// requests differ little, can put a whole cost in one term and none in
// another, and ties every candidate), recomputed when a replica learned
// since, but over its first answers at most every fleetEvery.
func (e *Engine) fleetService() servicetime.Params {
	now, gen := e.o.Now().UnixNano(), e.learned.Load()
	if f := e.fleet.Load(); f != nil && (f.gen == gen || gen > fleetWarm && now-f.at < int64(fleetEvery) && now >= f.at) {
		return f.p
	}
	var ps []servicetime.Params
	for _, r := range e.pool.Replicas() {
		if p, ok := r.Service(); ok && p.Samples >= OwnSamples {
			ps = append(ps, p)
		}
	}
	f := &fleetParams{at: now, gen: gen, p: servicetime.Median(ps)}
	e.fleet.Store(f)
	return f.p
}

// fleetParams is a fleet's service-time parameters as of at (unix
// nanoseconds).
type fleetParams struct {
	at  int64
	gen int64 // Engine.learned's count
	p   servicetime.Params
}

// A fleet's parameters are recomputed at every answer learned until
// fleetWarm were, then at most every fleetEvery.
const (
	fleetWarm  = 256
	fleetEvery = 100 * time.Millisecond
)
