package router

import (
	"cmp"
	"context"
	"errors"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// Deferrals is the router's queue (flow control): a request whose best
// replica's engine would queue it is deferred here instead (Defer), and a
// slot that frees (Freed, or room the replicas' gauges show at Tick) goes
// to the waiting request that would compute least there, which is then
// placed again (Core.Resume). It also counts each priority's demand, for
// the slots a request leaves free for the traffic it gives way to (keep).
// Safe for concurrent use.
type Deferrals struct {
	e       *routing.Engine
	q       *flow.Queue[*Deferral, *replica.Replica]
	demand  *flow.Demand
	reserve int // CoreOptions.Reserve
	metrics *Metrics
	// freed is Freed, made once: every request's lease calls it
	// (routing.Request.OnDrain).
	freed func(*replica.Replica)
	// onGrant, if set, hears of every deferral given a slot (virtual
	// time: nothing blocks in Wait); nil: the waiting goroutine wakes.
	onGrant func(*Deferral)
	// untaken maps a replica ID to the queue's generation when a slot
	// offered there by Tick went untaken: offering it again before the
	// queue changes would only compute the same costs again.
	untaken sync.Map
	// ttl is the queue's TTL: the longest a request waits.
	ttl time.Duration
	// corrections maps a priority to the float64 bits (*atomic.Uint64) of
	// the factor the waits Wait predicts for it are multiplied by: the
	// recent mean, in log space, of the waits its requests met over those
	// predicted when they were queued (learnWait); none, or 0, means 1. A
	// priority's own: a low one waits also for the higher ones arriving
	// after it, which the count ahead of it does not show.
	corrections sync.Map
}

// correction returns priority's wait correction's bits (0 means 1).
func (w *Deferrals) correction(priority int) *atomic.Uint64 {
	if c, ok := w.corrections.Load(priority); ok {
		return c.(*atomic.Uint64)
	}
	c, _ := w.corrections.LoadOrStore(priority, new(atomic.Uint64))
	return c.(*atomic.Uint64)
}

// ErrTooLate: the router's queue predicts that the request could not start
// within its deadline (its TTFT target, or the queue's TTL): it is refused
// at once rather than after waiting that long.
var ErrTooLate = errors.New("router: the queue predicts no slot frees for the request within its deadline")

// Deferral is a request deferred in the router's queue: the request, its
// decision when it was deferred, and its place in the queue.
type Deferral struct {
	cr    CoreRequest
	arm   *Arm
	d     *routing.Decision
	t     *flow.Ticket[*Deferral, *replica.Replica]
	start time.Time                    // of its first decision
	keep  func(*replica.Replica) int64 // its first decision's Keep, for the next
	slot  *replica.Replica             // the replica whose slot was kept for it, once its turn came
	// decode, when set, is the decode decision of a disaggregated request
	// whose prefill decision was deferred.
	decode *Routed
	// predicted is the wait Deferrals.Wait predicted when it was queued
	// (0: none could be).
	predicted time.Duration
}

// newDeferrals returns the router's queue of bounds o, its clock e's.
func newDeferrals(e *routing.Engine, o flow.Options[*replica.Replica], reserve int, m *Metrics) *Deferrals {
	w := &Deferrals{e: e, demand: flow.NewDemand(0), reserve: reserve, metrics: m, ttl: cmp.Or(o.TTL, flow.DefaultTTL)}
	o.OnLost = w.unreserve // a request that left as it was dispatched: its slot is free again
	o.Now = e.Now
	w.q = flow.New[*Deferral](o)
	w.freed = w.Freed
	return w
}

// view returns, for a decision of priority that may be deferred at now,
// the slots it must leave free for the traffic it gives way to
// (routing.Request.Keep), and whether it is protected traffic, which takes
// a free slot wherever it is rather than wait for its best replica's
// (routing.Request.Room).
func (w *Deferrals) view(priority int, now time.Time) (keep func(*replica.Replica) int64, room bool) {
	yields, protected := w.demand.View(priority, now)
	return w.keep(yields), protected
}

// Defer queues cr, whose decision d (made at start, with keep) by arm's
// policy found its best replica would queue it, and counts its uncached
// prefill there as pending work (routing.Engine.Wait). A request the queue
// predicts could not start within its deadline (Wait: past cr.Deadline,
// or the queue's TTL) is refused at once (ErrTooLate), its Retry-After the
// seconds until it would.
func (w *Deferrals) Defer(cr CoreRequest, arm *Arm, d *routing.Decision, keep func(*replica.Replica) int64, start time.Time) (*Deferral, error) {
	limit := w.ttl
	if cr.Deadline > 0 {
		limit = min(limit, cr.Deadline-w.e.Now().Sub(start))
	}
	wait, known := w.Wait(cr.Priority, cr.Flow, d.Chosen().Replica)
	if known && wait > limit {
		w.e.Drop(d)
		w.metrics.shed(ErrTooLate)
		return nil, &QueueError{Err: ErrTooLate, RetryAfter: max((wait - limit).Round(time.Second), time.Second)}
	}
	def := &Deferral{cr: cr, arm: arm, d: d, keep: keep, start: start}
	if known {
		def.predicted = wait
	}
	w.e.Wait(d, cr.Priority) // before the queue shows it: a dispatch may read it at once
	t, err := w.q.Enqueue(flow.Item[*Deferral]{Priority: cr.Priority, Flow: cr.Flow, Home: d.Chosen().Replica.ID,
		Bytes: cr.Bytes, Tokens: int64(d.Tokens), Value: def})
	if err != nil {
		w.e.Unwait(d)
		w.e.Drop(d)
		w.metrics.shed(err)
		return nil, &QueueError{Err: err, RetryAfter: time.Second}
	}
	def.t = t
	return def, nil
}

// Wait predicts how long a request of priority and flow queued now for
// replica home (nil: any) would wait for a slot: the longer of its turn
// among the requests queued ahead of it (flow.Queue.Ahead: a higher
// priority's, and its own priority's as flows take turns), each a turn of the pool's
// slots, which free at the rate every available replica of known
// capacity finishes requests (its slots over a mean request's run there,
// servicetime.Params.Rate), and its turn among those of its priority or
// higher held for home, at home's rate (a request waits for its prefix's
// replica while that is sooner than computing it elsewhere: a hot home's
// line is longer than the pool's); times the factor by which the waits met
// lately exceeded those predicted (learnWait). It reports false while no
// replica's capacity is known.
func (w *Deferrals) Wait(priority int, flow string, home *replica.Replica) (time.Duration, bool) {
	now := w.e.Now()
	var rate, homeRate float64
	for _, r := range w.e.Pool().Replicas() {
		if c := r.Capacity(); c > 0 && r.Available(now) {
			p := w.e.Service(r)
			rr := p.Rate(float64(c))
			rate += rr
			if r == home {
				homeRate = rr
			}
		}
	}
	if rate <= 0 {
		return 0, false
	}
	ahead := w.q.Ahead(priority, flow)
	wait := float64(ahead+1) / rate
	if homeRate > 0 { // those held for home, no more than are ahead of it anywhere
		wait = max(wait, float64(min(home.Deferred(priority), int64(ahead))+1)/homeRate)
	}
	if c := w.correction(priority).Load(); c != 0 {
		wait *= math.Float64frombits(c)
	}
	return time.Duration(wait * float64(time.Second)), true
}

// Wait blocks until def's turn comes (a slot is kept for it: resume it
// with Core.Resume) or it leaves the queue: ctx ended (its error), or the
// queue shed or expired it (a *QueueError). A nil ctx ends only with the
// queue's TTL.
func (def *Deferral) Wait(ctx context.Context) error {
	ctx = cmpCtx(ctx)
	err := def.t.Wait(ctx)
	if err != nil && ctx.Err() == nil {
		err = &QueueError{Err: err, RetryAfter: time.Second}
	}
	return err
}

// taken ends def's wait in the queue, its turn come (err nil) or not: its
// pending work is taken back and its first decision given up. It returns
// the replica whose slot was kept for it (nil when it left without one),
// which the caller must unreserve once the request is decided.
func (w *Deferrals) taken(def *Deferral, err error) *replica.Replica {
	w.e.Unwait(def.d)
	w.e.Drop(def.d)
	if err == nil || errors.Is(err, flow.ErrExpired) { // it waited its whole wait
		w.learnWait(def.cr.Priority, def.predicted, def.waited())
	}
	if err != nil {
		if qe, ok := err.(*QueueError); ok {
			w.metrics.shed(qe.Err)
		}
		return nil
	}
	w.metrics.queued(def.cr.Priority, def.waited())
	return def.t.Grant()
}

// learnWait moves the correction of priority's predicted waits an eighth of the
// way, in log space, to waited over predicted (a wait the TTL cut short
// counts as it was: at least that much), held within [1/4, 64]. Waits of
// under 10 ms on either side say nothing of the queue's pace.
func (w *Deferrals) learnWait(priority int, predicted, waited time.Duration) {
	if predicted < 10*time.Millisecond || waited < 10*time.Millisecond {
		return
	}
	c := w.correction(priority)
	for {
		old := c.Load()
		cur := 1.0
		if old != 0 {
			cur = math.Float64frombits(old)
		}
		// predicted was made with cur applied: the uncorrected wait is predicted ÷ cur.
		ratio := float64(waited) / (float64(predicted) / cur)
		next := math.Exp(math.Log(cur) + (math.Log(ratio)-math.Log(cur))/8)
		next = min(max(next, 0.25), 64)
		if c.CompareAndSwap(old, math.Float64bits(next)) {
			return
		}
	}
}

// waited returns how long def waited in the queue, until now.
func (def *Deferral) waited() time.Duration { return def.t.Waited() }

// unreserve gives back the slot kept on r for a request now decided (it
// counts in flight by itself wherever it went), and offers it again: the
// request may have gone to a better replica with room.
func (w *Deferrals) unreserve(r *replica.Replica) {
	r.Unreserve()
	w.offer(r)
}

// Freed offers the queue the slot a request's end freed on r: the waiting
// request that would compute least there goes. The lease's drain calls it
// once per request (routing.Request.OnDrain).
func (w *Deferrals) Freed(r *replica.Replica) { w.offer(r) }

// offer gives the router's queue a slot on r if r is not saturated, and
// reports whether a waiting request took it, and whether some request was
// refused it to keep it for traffic it gives way to (reserve: that changes
// with time, not only with the queue); the slot is kept for the request
// that took it until it is decided (Replica.Reserve), so that no request
// arriving meanwhile takes it.
func (w *Deferrals) offer(r *replica.Replica) (taken, keptFor bool) {
	now := w.e.Now()
	if r.Saturated() || !r.Available(now) {
		return false, false
	}
	free, known := r.Free() // this slot among them
	var kept map[int]bool   // keep's verdicts by priority: a few per offer
	r.Reserve()
	t, ok := w.q.Dispatch(r.ID, func(t *flow.Ticket[*Deferral, *replica.Replica]) float64 {
		forOthers, ok := kept[t.Priority]
		if !ok {
			if keep := w.keep(w.demand.YieldsTo(t.Priority, now)); keep != nil {
				forOthers = known && free <= keep(r)
			}
			if kept == nil {
				kept = map[int]bool{}
			}
			kept[t.Priority] = forOthers
		}
		if forOthers {
			keptFor = true
			return math.Inf(1) // the slot is kept for the traffic it gives way to
		}
		return w.e.DispatchCost(t.Value.d, r)
	}, r)
	if !ok {
		r.Unreserve()
		return false, keptFor
	}
	if w.onGrant != nil {
		w.onGrant(t.Value)
	}
	return true, keptFor
}

// Tick expires the requests waiting past the queue's TTL and offers the
// queue a slot on each replica that is not saturated (its gauges show room
// that no request's end announced: a peer's requests ended, a scrape), as
// many as it has, but not again to a replica whose offer went untaken
// while nothing was queued or left since (unless a slot was kept for a
// reservation, which time may end).
func (w *Deferrals) Tick() {
	w.q.Expire()
	gen := w.q.Generation()
	for _, r := range w.e.Pool().Replicas() {
		if g, ok := w.untaken.Load(r.ID); ok && g.(uint64) == gen {
			continue
		}
		taken, kept := w.offer(r)
		for taken {
			taken, kept = w.offer(r)
		}
		if !r.Saturated() && !kept {
			w.untaken.Store(r.ID, w.q.Generation())
		}
	}
}

// keep returns how many free slots of a replica a request must leave
// there (routing.Request.Keep): the slots kept there for the traffic it
// gives way to, y (flow.Demand.YieldsTo; concentrate says where and how
// many), less those that traffic fills now. Nil where it gives way to
// nothing, or the reserve keeps none.
func (w *Deferrals) keep(y map[int]flow.Yielded) func(*replica.Replica) int64 {
	if w.reserve < 0 || len(y) == 0 {
		return nil
	}
	var kept map[int]int64 // by replica ID, made at the first call
	return func(r *replica.Replica) int64 {
		if kept == nil {
			kept = w.concentrate(y)
		}
		return max(kept[r.ID]-y[r.ID].InFlight, 0)
	}
}

// concentrate spreads the slots kept for traffic y (flow.Demand.YieldsTo)
// over as few replicas as hold them: those it arrives at most first, each
// filled to its capacity before the next. A replica whose engine runs
// only that traffic keeps only its prefixes in its cache, where a flood
// spread over every replica would evict them. The slots kept are the
// reserve's count, or by default by square-root staffing on the traffic's
// expected concurrency by Little's law, m = its rate times the seconds a
// request holds a slot (routing.Engine.PerRequest), m + √m rounded (it
// waits in about one case in five; a trickle keeps nothing).
func (w *Deferrals) concentrate(y map[int]flow.Yielded) map[int]int64 {
	var rate float64
	ids := make([]int, 0, len(y))
	for id, v := range y {
		if v.Rate > 0 {
			rate += v.Rate
			ids = append(ids, id)
		}
	}
	n := int64(w.reserve)
	if n == 0 {
		m := rate * w.e.PerRequest()
		n = int64(math.Round(m + math.Sqrt(m)))
	}
	slices.SortFunc(ids, func(a, b int) int { return cmp.Or(cmp.Compare(y[b].Rate, y[a].Rate), cmp.Compare(a, b)) })
	capacity := make(map[int]int64, len(ids))
	for _, r := range w.e.Pool().Replicas() {
		capacity[r.ID] = r.Capacity()
	}
	kept := make(map[int]int64, len(ids))
	for _, id := range ids {
		if n <= 0 {
			break
		}
		if cp, ok := capacity[id]; ok { // not gone since
			k := min(n, max(cp, 1))
			kept[id], n = k, n-k
		}
	}
	return kept
}

// Len returns the requests and bytes waiting; none for a nil w (flow
// control off).
func (w *Deferrals) Len() (requests int, bytes int64) {
	if w == nil {
		return 0, 0
	}
	return w.q.Len()
}

// Bands returns the requests waiting at each priority and the flows
// waiting; none for a nil w (flow control off).
func (w *Deferrals) Bands() (requests map[int]int, flows int) {
	if w == nil {
		return nil, 0
	}
	return w.q.Bands()
}
