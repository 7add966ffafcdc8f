package router

import (
	"cmp"
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// Placement is where a request goes: its decision (the decode replica's,
// when disaggregated) and, for a disaggregated request, the prefill
// replica's that computes its prompt first.
type Placement struct {
	*Routed
	// Prefill is the prefill decision, paired with the decode one for the
	// decision log; nil: the request goes to its replica alone.
	Prefill *Routed
	// Fallback, for a request meant to be disaggregated that goes to its
	// decode replica alone for want of a prefill replica, says why (a
	// *pdFallbackError, counted by its reason).
	Fallback error
}

// Place places cr (Begin), waiting in the router's queue while it is
// deferred there (Deferral.Wait; cr.Ctx ends the wait) and placing it
// again when its turn comes (Resume). Unless cr.DryRun, each decision is
// recorded and the caller must Finish it (or keep it Unreleased).
func (c *Core) Place(cr CoreRequest) (*Placement, error) {
	p, def, err := c.Begin(cr)
	for def != nil && err == nil {
		p, def, err = c.Resume(def, def.Wait(cr.Ctx))
	}
	return p, err
}

// Begin is Place up to the router's queue: it assigns cr an arm and
// decides where it goes, aggregated or (cr.Disaggregate) on a decode and
// a prefill replica. With flow control a request whose best replica would
// queue it is deferred instead: Begin returns its Deferral, whose turn
// the caller awaits (Deferral.Wait, or the queue's grant in virtual time)
// before it calls Resume.
func (c *Core) Begin(cr CoreRequest) (*Placement, *Deferral, error) {
	arm := passThrough
	if !cr.PassThrough {
		arm = c.PickArm(cr.Session, cr.Tenant, cr.Input.Key)
	}
	rt, def, err := c.decide(cr, arm, nil)
	if rt == nil {
		return nil, def, err
	}
	return c.placed(rt, cr)
}

// Resume places a deferred request whose wait ended with err (nil: its
// turn came, with a slot kept for it): decided again, to the best replica
// with room. A wait that ended otherwise returns its error, or, for the
// prefill decision of a disaggregated request, the decode decision alone
// with the fallback.
func (c *Core) Resume(def *Deferral, err error) (*Placement, *Deferral, error) {
	def.slot = c.q.taken(def, err)
	if err != nil {
		if def.decode != nil {
			return fallback(c.o.Metrics, def.decode, err)
		}
		return nil, nil, err
	}
	cr := def.cr
	rt, _, err := c.decide(cr, def.arm, def)
	c.q.unreserve(def.slot)
	switch {
	case def.decode != nil && err != nil:
		return fallback(c.o.Metrics, def.decode, err)
	case def.decode != nil:
		return paired(def.decode, rt), nil, nil
	case err != nil:
		return nil, nil, err
	}
	return c.placed(rt, cr)
}

// decide decides cr with arm's policy, recording the decision unless
// cr.DryRun. With flow control, a first decision (def nil) whose best
// replica would queue the request defers it instead: it returns the
// Deferral and no decision. def is the deferral whose turn came.
// The request's input, cr.Input, is left as given: a deferred request is
// decided again from it, and a disaggregated one's prefill decision too.
func (c *Core) decide(cr CoreRequest, arm *Arm, def *Deferral) (*Routed, *Deferral, error) {
	in := cr.Input
	in.Policy, in.Priority = arm.Policy, cr.Priority
	if cr.Prefill || c.e.Pool().HasPrefill() {
		in.Allow = allowBoth(in.Allow, roleOf(cr.Prefill))
	}
	now := c.e.Now()
	start := now // the request's, which a deferred one keeps
	if def != nil {
		start = def.start
	}
	tracked := c.q.input(&in, &cr, def, now)
	first := tracked && def == nil
	d, err := decideKnown(c.e, c.o.RefreshModels, in, !cr.DryRun)
	if err != nil {
		return nil, nil, err
	}
	if first {
		c.q.demand.Arrive(cr.Priority, d.Chosen().Replica.ID, now)
	}
	if d.Deferred {
		def, err := c.q.Defer(cr, arm, d, in.Keep, start)
		return nil, def, err
	}
	rt := &Routed{Decision: d, Arm: arm, Served: d.Chosen(), req: cr, start: start}
	if def != nil {
		rt.Queued = def.waited()
	}
	if tracked {
		c.q.demand.Begin(cr.Priority, d.Chosen().Replica.ID, now) // Finish ends it
	}
	if !cr.DryRun {
		rt.ID = strconv.FormatUint(rand.Uint64(), 16)
		c.o.Metrics.routed(rt, c.e.Now().Sub(now).Seconds())
	}
	return rt, nil, nil
}

// input readies in, cr's input, for the router's queue, and reports
// whether the request is tracked there (its demand counts, its lease's
// drain offers its slot): with flow control, a request with a prompt
// that is recorded. A first decision may be deferred (unless
// cr.Immediate), leaving free the slots kept for the traffic it gives way
// to; one whose turn came (def) goes to the best replica with room, the
// slot kept for it counting as room.
func (w *Deferrals) input(in *routing.Request, cr *CoreRequest, def *Deferral, now time.Time) (tracked bool) {
	if w == nil || cr.DryRun || cr.PassThrough {
		return false
	}
	in.OnDrain = w.freed
	switch {
	case def != nil:
		in.Keep, in.Room, in.Slot = def.keep, true, def.slot
	case !cr.Immediate:
		in.Defer = true
		in.Keep, in.Room = w.view(cr.Priority, now)
	}
	return true
}

// decideKnown decides in through e (recording it if record); a request
// for a model no replica lists is decided once more after refresh, if
// set, reads the replicas' models again (paced by its implementation), as
// the model may be an adapter loaded since the last scrape.
func decideKnown(e *routing.Engine, refresh func(context.Context), in routing.Request, record bool) (*routing.Decision, error) {
	d, err := e.Decide(in, record)
	if errors.Is(err, routing.ErrUnknownModel) && refresh != nil {
		ctx, cancel := context.WithTimeout(context.Background(), modelsRefreshWait)
		refresh(ctx)
		cancel()
		d, err = e.Decide(in, record)
	}
	return d, err
}

// placed completes the placement of rt, cr's decision: alone, or for a
// disaggregated request whose decode replica would compute at least
// MinPrefillTokens of its prompt, with a prefill decision by the policy
// among the available prefill replicas (their cache), which may be
// deferred in turn. The prefill decision takes only available prefill
// replicas, never those passive ejection took out (routing's panic mode
// would try them again): with none, the request goes to its decode
// replica alone, counted as a fallback (no_prefill_replica).
func (c *Core) placed(rt *Routed, cr CoreRequest) (*Placement, *Deferral, error) {
	if !cr.Disaggregate || !needsPrefill(c.o.PD, c.o.Metrics, rt) {
		return &Placement{Routed: rt}, nil, nil
	}
	if cr.Whole {
		c.o.Metrics.disaggregated("batch")
		return &Placement{Routed: rt}, nil, nil
	}
	if c.o.PD.MinPrefillTokens >= 0 && c.localSooner(rt, cr.Priority) { // negative: every request is disaggregated
		c.o.Metrics.disaggregated("local")
		return &Placement{Routed: rt}, nil, nil
	}
	now := c.e.Now()
	cr.Input = cr.Input.Copy() // the decode decision owns the blocks
	cr.Input.Allow = allowBoth(cr.Input.Allow, func(r *replica.Replica) bool { return r.Available(now) })
	cr.Prefill = true
	prt, def, err := c.decide(cr, rt.Arm, nil)
	switch {
	case def != nil:
		def.decode = rt
		return nil, def, nil
	case err != nil:
		return fallback(c.o.Metrics, rt, err)
	}
	return paired(rt, prt), nil, nil
}

// needsPrefill reports whether decode decision rt's request goes through
// a prefill replica: its decode replica would compute at least
// pd.MinPrefillTokens of its prompt. A request that does not is counted
// short.
func needsPrefill(pd PDOptions, m *Metrics, rt *Routed) bool {
	least := cmp.Or(pd.MinPrefillTokens, DefaultMinPrefillTokens)
	if least > 0 && rt.Uncached(rt.Served.Replica.ID) < float64(least) {
		m.disaggregated("short")
		return false
	}
	return true
}

// localSooner reports whether decode decision rt's replica is predicted to
// give the request's first token sooner computing its prompt itself than
// any available prefill replica would, its KV then moved: each replica's
// time to first token from its service-time model
// (routing.Engine.Service) with what it holds of the prompt, plus the
// transfer of what the decode replica does not hold at the seconds per
// token transfers took (Core.transfer). Disaggregation is for throughput
// too: a decode replica's decode stalls while it prefills, which its
// model's decode times show as they grow.
func (c *Core) localSooner(rt *Routed, priority int) bool {
	dec := rt.Served.Replica
	tokens := int64(rt.Tokens)
	ttft := func(r *replica.Replica, uncached float64) float64 {
		p := c.e.Service(r)
		return p.TTFT(r.State(tokens, priority), uncached)
	}
	moved := rt.Uncached(dec.ID)
	local := ttft(dec, moved)
	m := c.e.Picture().Match(rt.Blocks)
	now := c.e.Now()
	remote := math.Inf(1)
	for _, r := range c.e.Pool().Replicas() {
		if r.Role != replica.RolePrefill || !r.Available(now) {
			continue
		}
		held := 0
		if r.ID < len(m) {
			held = m[r.ID].Tokens
		}
		remote = min(remote, ttft(r, max(float64(tokens-int64(held)), 0)))
	}
	if math.IsInf(remote, 1) {
		return false // none available: the prefill decision's fallback counts it
	}
	return local <= remote+moved*c.transferPerToken()
}

// transferPerToken is the seconds a token of KV took to reach a decode
// replica from its prefill replica, learned from the first tokens of the
// disaggregated requests (learnTransfer); transferPrior until one came.
func (c *Core) transferPerToken() float64 {
	if v := c.transfer.Load(); v != 0 {
		return math.Float64frombits(v)
	}
	return transferPrior
}

// learnTransfer moves transferPerToken an eighth of the way to sec
// seconds for moved tokens.
func (c *Core) learnTransfer(sec, moved float64) {
	if !(sec > 0) || !(moved >= 1) {
		return
	}
	for {
		old := c.transfer.Load()
		cur := transferPrior
		if old != 0 {
			cur = math.Float64frombits(old)
		}
		if c.transfer.CompareAndSwap(old, math.Float64bits(cur+(sec/moved-cur)/8)) {
			return
		}
	}
}

// transferPrior is the seconds a token's KV is taken to move before any
// transfer was seen: 10 µs, an 8B model's 128 KiB a token over about
// 13 GB/s (RDMA, NIXL), the decode's first step included.
const transferPrior = 10e-6

// paired returns the placement of a disaggregated request: decode
// decision rt and prefill decision prt, linked for the decision log.
func paired(rt, prt *Routed) *Placement {
	prt.stage, prt.pair = "prefill", rt.ID
	rt.stage, rt.pair, rt.prefill = "decode", prt.ID, prt.Served.Replica.Name
	return &Placement{Routed: rt, Prefill: prt}
}

// fallback returns decode decision rt alone, its prefill decision having
// failed with err: no_prefill_replica when no prefill replica could take
// it, else prefill_failed (the router's queue shed it, or it left).
func fallback(m *Metrics, rt *Routed, err error) (*Placement, *Deferral, error) {
	reason := pdPrefillFailed
	if errors.Is(err, routing.ErrNoReplica) || errors.Is(err, routing.ErrUnknownModel) {
		reason = pdNoPrefill
	}
	m.pdFallback(reason)
	return &Placement{Routed: rt, Fallback: &pdFallbackError{reason: reason, err: err}}, nil, nil
}

// ended ends the demand rt's request counted where it was placed.
func (w *Deferrals) ended(rt *Routed) {
	if w != nil && !rt.req.PassThrough {
		w.demand.End(rt.req.Priority, rt.Chosen().Replica.ID) // where Place began it: a failover moves Served, not the choice
	}
}

// Run expires unreleased decisions every interval, and ticks the router's
// queue every QueueTick (Deferrals.Tick), until ctx ends.
func (c *Core) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var queue <-chan time.Time
	if c.q != nil {
		qt := time.NewTicker(QueueTick)
		defer qt.Stop()
		queue = qt.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			c.unreleased.Expire(now)
		case <-queue:
			c.q.Tick()
		}
	}
}

// QueueTick is how often Run ticks the router's queue: its TTL, and the
// room replicas' gauges show (a request's end offers its slot at once).
const QueueTick = 20 * time.Millisecond
