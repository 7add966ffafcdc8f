package router

import (
	"cmp"
	"container/list"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/semroute/semroute/agreement"
	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
	"github.com/semroute/semroute/tokenizer"
)

// Arm is one routing policy taking a share of traffic.
type Arm struct {
	Name   string
	Policy routing.Policy
	// Weight is the arm's share of sessions, relative to the other arms'.
	Weight float64
}

// DecisionLogger receives a record per finished decision. It must not block.
type DecisionLogger interface {
	Log(*decisionlog.Record)
}

// CoreOptions configure a Core. Engine is required.
type CoreOptions struct {
	Engine *routing.Engine
	// Arms split traffic between routing policies; at least one. The arms
	// own the routing policy: the engine has none of its own.
	Arms []Arm
	// Salt is mixed into arm assignment, so a new experiment reshuffles
	// sessions.
	Salt string
	// Log, if set, receives every recorded decision when it finishes.
	Log DecisionLogger
	// RawIDs logs session and tenant ids as given instead of hashed.
	RawIDs bool
	// LogPrompts logs the prompt's text with each decision. Off by default.
	LogPrompts bool
	// Held bounds the decisions held for Release (gRPC): past its caps the
	// oldest is finished as expired, and one never released stops counting
	// as load after Held.ReleaseAfter.
	Unreleased limits.Unreleased
	// Metrics, if set, receives per-request metrics.
	Metrics *Metrics
	// Tokenizer, if set, is precise mode: each request is routed on the
	// engine's own token ids, cut into blocks of BlockTokens (the engine's
	// block size, default 16), as KV events key the engine's blocks. When
	// it fails or is slow the request is routed on the estimate.
	Tokenizer   Tokenizer
	BlockTokens int
	// Feedback corrects the picture of replicas without KV events from the
	// cached tokens they report (routing.Engine.Feedback).
	Feedback bool
	// Agreement, if set, hears every finished request's tokens and cached
	// tokens, predicted and reported, to judge each replica's sources.
	Agreement *agreement.Tracker
	// RefreshModels, if set, reads the replicas' models again (paced by
	// its implementation): a request for a model no replica lists is
	// decided once more after it, before it is refused, since the model
	// may be an adapter loaded since the last scrape.
	RefreshModels func(context.Context)
	// Flow, if set, turns flow control on with a queue of these bounds
	// (package flow; its OnLost is the core's): a request whose best
	// replica's engine would queue it waits in the router instead, for
	// that replica or a slot elsewhere worth moving to, and is decided
	// again when its turn comes (see ARCHITECTURE.md). Nil: every request
	// goes to a replica at once, as engines queue.
	Flow *flow.Options
	// PD tunes prefill/decode disaggregation, which replicas of role
	// prefill turn on (pd.go); both front ends read it.
	PD PDOptions
	// StrictResponses refuses a request naming a stored response that the
	// router cannot prove is the caller's tenant's (set when API keys
	// decide the tenant); else such a request is routed as any other and
	// the replica answers for itself.
	StrictResponses bool
}

// Tokenizer gives the engine's token ids of an OpenAI request body of
// endpoint ep whose model the router's parse read as model
// (tokenizer.Client: a replica's /tokenize). It reads the body's fields as
// the engine does, and only until it returns. Errors are classed by
// tokenizer.ErrSlow and tokenizer.ErrNoReplica.
type Tokenizer interface {
	Body(ctx context.Context, ep blockhash.Endpoint, model string, body []byte) ([]int32, error)
}

// Core is the routing core that the HTTP and gRPC front ends share: it
// assigns each request an arm, decides through the engine with the arm's
// policy, and ends and logs each decision. Safe for concurrent use.
type Core struct {
	o    CoreOptions
	e    *routing.Engine
	arms atomic.Pointer[armSet]
	q    *flow.Queue // flow control's (CoreOptions.Flow); nil: off
	// demand counts arrivals by priority and replica, for the slots a
	// request leaves free for higher priorities (keep).
	demand *flow.Demand
	// untaken maps a replica ID to the queue's generation when a slot
	// offered there by dispatchFree went untaken: offering it again before
	// the queue changes would only compute the same costs again.
	untaken sync.Map

	mu         sync.Mutex
	held       map[string]*list.Element // gRPC decisions awaiting Release, by id
	heldOrder  list.List                // of *Routed, oldest first
	heldBlocks int                      // blocks of the held decisions
	// ids issues and checks the ids of stored responses, for the
	// requests that continue or fetch them, through either front end.
	ids *responseIDs
}

// armSet is an immutable set of arms with their total weight.
type armSet struct {
	arms []Arm
	sum  float64
}

// NewCore returns a Core.
func NewCore(o CoreOptions) (*Core, error) {
	if o.Engine == nil {
		return nil, errors.New("router: CoreOptions.Engine is required")
	}
	o.Unreleased = o.Unreleased.WithDefaults()
	c := &Core{o: o, e: o.Engine, held: map[string]*list.Element{}, ids: newResponseIDs(o.StrictResponses)}
	if o.Flow != nil {
		fo := *o.Flow
		fo.OnLost = c.lost
		c.q = flow.New(fo)
		c.demand = flow.NewDemand(0)
	}
	if err := c.SetArms(o.Arms); err != nil {
		return nil, err
	}
	for _, r := range c.e.Pool().Replicas() {
		o.Metrics.Replica(r.Name)
	}
	return c, nil
}

// SetArms replaces the arms (config reload); requests already routed keep
// theirs. There must be at least one.
func (c *Core) SetArms(arms []Arm) error {
	if len(arms) == 0 {
		return errors.New("router: at least one arm is required")
	}
	set := &armSet{arms: append([]Arm(nil), arms...)}
	seen := map[string]bool{}
	for _, a := range set.arms {
		if a.Name == "" || a.Policy == nil || a.Weight <= 0 {
			return fmt.Errorf("router: arm %q needs a name, a policy and a positive weight", a.Name)
		}
		if seen[a.Name] {
			return fmt.Errorf("router: duplicate arm %q", a.Name)
		}
		seen[a.Name] = true
		set.sum += a.Weight
	}
	c.arms.Store(set)
	for _, a := range set.arms {
		c.o.Metrics.arm(a) // its counters exist, at 0, from the first scrape
	}
	return nil
}

// Engine returns the core's engine.
func (c *Core) Engine() *routing.Engine { return c.e }

// Arms returns the current arms.
func (c *Core) Arms() []Arm { return c.arms.Load().arms }

// PickArm assigns a request to an arm: a hash of the salt and the session
// id, else the tenant id, else the request's key, placed on the arms'
// cumulative weights. The same session always gets the same arm.
func (c *Core) PickArm(session, tenant string, key uint64) *Arm {
	set := c.arms.Load()
	if len(set.arms) == 1 {
		return &set.arms[0]
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(c.o.Salt)
	switch {
	case session != "":
		_, _ = d.WriteString("\x00s")
		_, _ = d.WriteString(session)
	case tenant != "":
		_, _ = d.WriteString("\x00t")
		_, _ = d.WriteString(tenant)
	default:
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], key)
		_, _ = d.WriteString("\x00k")
		_, _ = d.Write(b[:])
	}
	x := float64(d.Sum64()>>11) / float64(1<<53) * set.sum
	for i := range set.arms {
		if x < set.arms[i].Weight {
			return &set.arms[i]
		}
		x -= set.arms[i].Weight
	}
	return &set.arms[len(set.arms)-1]
}

// CoreRequest is a request to route.
type CoreRequest struct {
	Input                  routing.Request
	Model, Session, Tenant string
	// Route names the front end's route for metrics: "chat",
	// "completions" or "grpc".
	Route string
	// API is the API the request's body was parsed as (its answer's
	// shape); the zero value is chat's.
	API blockhash.Endpoint
	// DryRun decides without recording anything; the result has no ID and
	// must not be finished.
	DryRun bool
	// PassThrough marks a request without a prompt (embeddings, files, …):
	// it goes to the least-loaded replica under the "passthrough" arm, and
	// is not written to the decision log.
	PassThrough bool
	// Ctx ends a wait in the router's queue (flow control); nil: none
	// ends it but the queue's TTL.
	Ctx context.Context
	// Priority (higher first; negative: never queued), Flow (fairness
	// within a priority) and Bytes (the body's, against the queue's bound)
	// place the request in the router's queue.
	Priority int
	Flow     string
	Bytes    int64
	// Prefill routes the request among the replicas of role prefill
	// (disaggregation's first step); otherwise a prefill replica is never
	// a candidate.
	Prefill bool
}

// QueueError is a request the router's queue would not hold or hold any
// longer (flow.ErrFull, ErrShed, ErrExpired, ErrSheddable): the client
// should come back after RetryAfter.
type QueueError struct {
	Err        error
	RetryAfter time.Duration
}

func (e *QueueError) Error() string {
	return "router: the replicas for this request are saturated: " + e.Err.Error()
}
func (e *QueueError) Unwrap() error { return e.Err }

// Prepare makes the engine's input for a parsed request whose body is
// body: in precise mode (CoreOptions.Tokenizer) from the engine's token
// ids, else, or when they cannot be had in time, from the estimate.
// Requests given as token ids are exact already; a request with no body
// (gRPC messages) is estimated.
func (c *Core) Prepare(ctx context.Context, req *blockhash.Request, body []byte, session string) routing.Request {
	if c.o.Tokenizer != nil && len(body) > 0 && !req.TokenIDsOnly() {
		ep := endpointOf(req)
		if req.Endpoint == blockhash.Responses || req.Endpoint == blockhash.Messages {
			// /tokenize takes a chat: the same conversation as one.
			chat, err := chatForTokenize(req)
			if err != nil {
				c.o.Metrics.Tokenized("failed")
				return c.e.Prepare(req, session, c.o.LogPrompts)
			}
			body = chat
		}
		ids, err := c.o.Tokenizer.Body(ctx, ep, req.Model, body)
		switch {
		case err == nil && len(ids) > 0:
			c.o.Metrics.Tokenized("ok")
			return c.e.PrepareTokens(req, ids, cmp.Or(c.o.BlockTokens, 16), session, c.o.LogPrompts)
		case errors.Is(err, tokenizer.ErrSlow):
			c.o.Metrics.Tokenized("slow")
		case errors.Is(err, tokenizer.ErrNoReplica):
			c.o.Metrics.Tokenized("no_replica")
		default:
			c.o.Metrics.Tokenized("failed")
		}
	}
	return c.e.Prepare(req, session, c.o.LogPrompts)
}

// endpointOf tells a parsed request's endpoint from its parts: a
// completions body's are prompts (strings or token ids), a chat body's
// never are.
func endpointOf(req *blockhash.Request) blockhash.Endpoint {
	if len(req.Parts) > 0 && (req.Parts[0].Role == blockhash.RolePrompt || req.Parts[0].Role == blockhash.RoleTokens) {
		return blockhash.Completion
	}
	return blockhash.Chat
}

// modelsRefreshWait bounds how long a request for an unknown model waits
// for the replicas' model lists.
const modelsRefreshWait = 2 * time.Second

// passThrough is the arm of requests without a prompt.
var passThrough = &Arm{Name: "passthrough", Policy: routing.LeastLoad{}, Weight: 1}

// Routed is a decision and, once recorded, the request in flight.
type Routed struct {
	*routing.Decision
	ID     string // empty for a dry run
	Arm    *Arm
	Served *routing.Candidate // the candidate carrying the request now
	// Queued is how long the request waited in the router's queue.
	Queued time.Duration
	req    CoreRequest
	start  time.Time
	first  time.Time // first response byte; zero until then
	once   sync.Once
	// stage, pair and prefill link a disaggregated request's two
	// decisions in the decision log (decisionlog.Record's Stage, Pair and
	// Prefill).
	stage, pair, prefill string
	remote               bool      // its replica takes the prompt's KV from its prefill replica (Core.remote)
	remoteAt             time.Time // when the router sent it there with the prefill's kv_transfer_params, last; zero in ext_proc mode (the decode sidecar sends the prefill)
}

// pairPD links the prefill decision prt and the decode decision rt of one
// disaggregated request, for the decision log.
func pairPD(prt, rt *Routed) {
	prt.stage, prt.pair = "prefill", rt.ID
	rt.stage, rt.pair, rt.prefill = "decode", prt.ID, prt.Served.Replica.Name
}

// remote counts decode decision rt's replica as taking its prompt's KV
// from its prefill replica (routing.Lease.Remote): not computing it.
func (c *Core) remote(rt *Routed) {
	rt.remote = true
	rt.Lease().Remote()
}

// Route assigns an arm and decides. Unless req.DryRun, the decision is
// recorded and the caller must call Finish (or Hold, for Release to finish).
func (c *Core) Route(req CoreRequest) (*Routed, error) {
	arm := passThrough
	if !req.PassThrough {
		arm = c.PickArm(req.Session, req.Tenant, req.Input.Key)
	}
	req.Input.Policy = arm.Policy
	if req.Prefill || c.e.Pool().HasPrefill() {
		req.Input.Allow = allowBoth(req.Input.Allow, roleOf(req.Prefill))
	}
	start := c.e.Now()
	t0 := time.Now()
	// With flow control a request whose best replica would queue it waits
	// in the router's queue instead.
	req.Input.Defer = c.q != nil && !req.DryRun && !req.PassThrough
	if req.Input.Defer {
		yields, protected := c.demand.View(req.Priority, t0)
		req.Input.Keep = c.keep(yields)
		// Traffic that others keep slots for takes a free one wherever
		// it is rather than wait for its best replica's.
		req.Input.Room = protected
	}
	d, err := c.e.Decide(req.Input, !req.DryRun)
	if req.Input.Defer && err == nil {
		c.demand.Arrive(req.Priority, d.Chosen().Replica.ID, t0)
	}
	var waited time.Duration
	if err == nil && d.Deferred {
		var slot *replica.Replica
		waited, slot, err = c.wait(&req, d)
		c.e.Drop(d)
		if err != nil {
			return nil, err
		}
		req.Input.Defer, req.Input.Room, req.Input.Slot = false, true, slot // its turn came with a slot kept on slot: to the best replica with room
		d, err = c.e.Decide(req.Input, true)
		c.unreserve(slot)
	}
	if errors.Is(err, routing.ErrUnknownModel) && c.o.RefreshModels != nil {
		ctx, cancel := context.WithTimeout(context.Background(), modelsRefreshWait)
		c.o.RefreshModels(ctx)
		cancel()
		d, err = c.e.Decide(req.Input, !req.DryRun)
	}
	if err != nil {
		return nil, err
	}
	rt := &Routed{Decision: d, Arm: arm, Served: d.Chosen(), req: req, start: start, Queued: waited}
	if c.demand != nil && !req.DryRun && !req.PassThrough {
		c.demand.Begin(req.Priority, d.Chosen().Replica.ID, t0) // Finish ends it
	}
	if !req.DryRun {
		rt.ID = strconv.FormatUint(rand.Uint64(), 16)
		c.o.Metrics.routed(rt, time.Since(t0).Seconds())
	}
	return rt, nil
}

// roleOf returns the filter of the replicas that prefill for others
// (prefill set), or of those that decode.
func roleOf(prefill bool) func(*replica.Replica) bool {
	if prefill {
		return prefills
	}
	return decodes
}

// ttft returns the time from the decision to the first response byte, or 0.
func (rt *Routed) ttft() time.Duration {
	if rt.first.IsZero() {
		return 0
	}
	return rt.first.Sub(rt.start)
}

// ready reports whether some replica may take a request (Usable: what
// routing falls back on when passive ejection took out the rest).
func (c *Core) ready() bool {
	now := time.Now()
	for _, r := range c.e.Pool().Replicas() {
		if r.Usable(now) {
			return true
		}
	}
	return false
}

// FirstByte reports that the first response byte arrived: the replica's
// prefill is done. Only the first call counts.
func (c *Core) FirstByte(rt *Routed) {
	rt.once.Do(func() {
		rt.first = c.e.Now()
		rt.Lease().FirstToken(rt.first)
		if !rt.remoteAt.IsZero() {
			c.o.Metrics.decodeFirst(rt.first.Sub(rt.remoteAt))
		}
	})
}

// Failover moves the request to the next-ranked candidate, ending its work
// on the current one; it reports false when none is left.
func (c *Core) Failover(rt *Routed, next int) bool {
	if next >= len(rt.Ranked) {
		return false
	}
	rt.Lease().End(c.e.Now())
	rt.Served = &rt.Ranked[next]
	c.e.Commit(rt.Decision, rt.Served)
	if rt.remote {
		rt.Lease().Remote() // the next decode replica takes the same prefill's KV
		if !rt.remoteAt.IsZero() {
			rt.remoteAt = c.e.Now()
		}
	}
	c.o.Metrics.retried(rt)
	return true
}

// EngineDone reports that the replica's answer to rt has ended whole:
// the engine is done with the prompt's blocks, which the picture may now
// evict, though the client may still be reading. Finish does it if this
// was not called.
func (c *Core) EngineDone(rt *Routed) {
	if l := rt.Lease(); l.State() < routing.LeaseDrained {
		l.EngineDone(c.e.Now())
		c.freed(rt)
	}
}

// wait queues req, whose decision d's best replica would queue it, and
// waits for its turn; it returns how long it waited and the replica whose
// slot was kept for it (Replica.Reserve), which the caller must unreserve.
func (c *Core) wait(req *CoreRequest, d *routing.Decision) (time.Duration, *replica.Replica, error) {
	t, err := c.q.Enqueue(flow.Item{Priority: req.Priority, Flow: req.Flow, Home: d.Chosen().Replica.ID, Bytes: req.Bytes, Tokens: int64(d.Tokens), Value: d})
	if err != nil {
		c.o.Metrics.shed(err)
		return 0, nil, &QueueError{Err: err, RetryAfter: time.Second}
	}
	ctx := req.Ctx
	if ctx == nil {
		ctx = context.Background()
	}
	c.e.Wait(d, req.Priority)
	err = t.Wait(ctx)
	c.e.Unwait(d)
	if err != nil {
		if ctx.Err() != nil {
			return 0, nil, err
		}
		c.o.Metrics.shed(err)
		return 0, nil, &QueueError{Err: err, RetryAfter: time.Second}
	}
	waited := time.Since(t.Enqueued())
	c.o.Metrics.queued(req.Priority, waited)
	return waited, t.Grant().(*replica.Replica), nil
}

// unreserve gives back the slot kept on r for a request now decided (it
// counts in flight by itself wherever it went), and offers it again: the
// request may have gone to a better replica with room.
func (c *Core) unreserve(r *replica.Replica) {
	r.Unreserve()
	c.offer(r)
}

// freed offers the slot rt's request held on its replica to the router's
// queue: the waiting request that would compute least there goes. The
// lease's drain (EngineDone, or End without it) calls it once.
func (c *Core) freed(rt *Routed) {
	if c.q != nil && !rt.req.PassThrough {
		c.offer(rt.Served.Replica)
	}
}

// offer gives the router's queue a slot on r if r is not saturated, and
// reports whether a waiting request took it, and whether some request was
// refused it to keep it for traffic it gives way to (reserve: that changes
// with time, not only with the queue); the slot is kept for the request
// that took it until it is decided (Replica.Reserve), so that no request
// arriving meanwhile takes it.
func (c *Core) offer(r *replica.Replica) (taken, keptFor bool) {
	if r.Saturated() || !r.Available(time.Now()) {
		return false, false
	}
	free, known := r.Free() // this slot among them
	var kept map[int]bool   // keep's verdicts by priority: a few per offer
	now := time.Now()
	r.Reserve()
	if _, ok := c.q.Dispatch(r.ID, func(t *flow.Ticket) float64 {
		held, ok := kept[t.Priority]
		if !ok {
			if keep := c.keep(c.demand.YieldsTo(t.Priority, now)); keep != nil {
				held = known && free <= keep(r)
			}
			if kept == nil {
				kept = map[int]bool{}
			}
			kept[t.Priority] = held
		}
		if held {
			keptFor = true
			return math.Inf(1) // the slot is kept for the traffic it gives way to
		}
		return c.e.DispatchCost(t.Value.(*routing.Decision), r)
	}, r); ok {
		return true, keptFor
	}
	r.Unreserve()
	return false, keptFor
}

// keep returns how many free slots of a replica a request must leave
// there (routing.Request.Keep): the slots kept there for the traffic it
// gives way to, y (flow.Demand.YieldsTo; concentrate says where and how
// many), less those that traffic fills now. Nil where it gives way to
// nothing, or flow_control.reserve keeps none.
func (c *Core) keep(y map[int]flow.Yielded) func(*replica.Replica) int64 {
	if c.o.Flow.Reserve < 0 || len(y) == 0 {
		return nil
	}
	var kept map[int]int64 // by replica ID, made at the first call
	return func(r *replica.Replica) int64 {
		if kept == nil {
			kept = c.concentrate(y)
		}
		return max(kept[r.ID]-y[r.ID].InFlight, 0)
	}
}

// concentrate spreads the slots kept for traffic y (flow.Demand.YieldsTo)
// over as few replicas as hold them: those it arrives at most first, each
// filled to its capacity before the next. A replica whose engine runs
// only that traffic keeps only its prefixes in its cache, where a flood
// spread over every replica would evict them. The slots kept are
// flow.Options.Reserve's count, or by default by square-root staffing on
// the traffic's expected concurrency by Little's law, m = its rate times
// the seconds a request holds a slot (routing.Engine.PerRequest), m + √m
// rounded (it waits in about one case in five; a trickle keeps nothing).
func (c *Core) concentrate(y map[int]flow.Yielded) map[int]int64 {
	var rate float64
	ids := make([]int, 0, len(y))
	for id, v := range y {
		if v.Rate > 0 {
			rate += v.Rate
			ids = append(ids, id)
		}
	}
	n := int64(c.o.Flow.Reserve)
	if n == 0 {
		m := rate * c.e.PerRequest()
		n = int64(math.Round(m + math.Sqrt(m)))
	}
	slices.SortFunc(ids, func(a, b int) int { return cmp.Or(cmp.Compare(y[b].Rate, y[a].Rate), cmp.Compare(a, b)) })
	capacity := make(map[int]int64, len(ids))
	for _, r := range c.e.Pool().Replicas() {
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

// lost takes back the slot kept for a request that left as it was
// dispatched (flow.Options.OnLost).
func (c *Core) lost(grant any) { c.unreserve(grant.(*replica.Replica)) }

// dispatchFree offers the queue a slot on each replica that is not
// saturated (its gauges show room that no request's end announced: a
// peer's requests ended, a scrape), as many as it has, but not again to a
// replica whose offer went untaken while nothing was queued or left since
// (unless a slot was kept for a reservation, which time may end).
func (c *Core) dispatchFree() {
	if c.q == nil {
		return
	}
	gen := c.q.Generation()
	for _, r := range c.e.Pool().Replicas() {
		if g, ok := c.untaken.Load(r.ID); ok && g.(uint64) == gen {
			continue
		}
		taken, kept := c.offer(r)
		for taken {
			taken, kept = c.offer(r)
		}
		if !r.Saturated() && !kept {
			c.untaken.Store(r.ID, c.q.Generation())
		}
	}
}

// Outcome is how a routed request ended, as the front end saw it.
type Outcome = decisionlog.Outcome

// Finish ends a recorded request: its work stops counting, the reply (if
// given) is learned on the replica that wrote it, and the decision is logged
// with o. TTFT and duration are filled in from the core's clock when zero.
func (c *Core) Finish(rt *Routed, o Outcome, reply []byte) {
	defer c.e.Recycle(rt.Decision) // after the decision log's record read the candidates
	now := c.e.Now()
	drained := rt.Lease().State() >= routing.LeaseDrained // the slot was offered then
	rt.Lease().End(now)
	if c.demand != nil && !rt.req.PassThrough {
		c.demand.End(rt.req.Priority, rt.Chosen().Replica.ID) // where Route began it: a failover moves Served, not the choice
	}
	if !drained {
		c.freed(rt)
	}
	// A disaggregated request's decode replica reports the tokens the
	// transfer brought as cached: they teach nothing of its own cache.
	if o.PromptTokens > 0 && o.Status == 200 && !rt.req.PassThrough && !rt.remote {
		c.e.ObserveUsage(rt.req.Model, rt.Decision, int(o.PromptTokens))
		if c.o.Agreement != nil {
			c.o.Agreement.Finished(rt.Served.Replica.Name, rt.Decision.Precise(), rt.Tokens, int(o.PromptTokens),
				rt.Served.Predicted(), int(o.CachedTokens), o.CachedReported)
		}
		if o.CachedReported && c.o.Feedback {
			if n := c.e.Feedback(rt.Decision, rt.Served, int(o.CachedTokens)); n > 0 {
				c.o.Metrics.trimmed(rt, n)
			}
		}
	}
	var learned []blockhash.Block
	if reply != nil {
		learned = c.e.LearnReply(rt.Decision, rt.Served.Replica, reply)
	}
	if o.DurationNs == 0 {
		o.DurationNs = now.Sub(rt.start).Nanoseconds()
	}
	if o.TTFTNs == 0 && !rt.first.IsZero() {
		o.TTFTNs = rt.first.Sub(rt.start).Nanoseconds()
	}
	c.o.Metrics.finished(rt, &o)
	if c.o.Log == nil || rt.req.PassThrough {
		return
	}
	o.Replica = rt.Served.Replica.Name
	o.ReplyBlocks = logBlocks(learned)
	c.o.Log.Log(c.record(rt, &o))
}

func logBlocks(bl []blockhash.Block) []decisionlog.Block {
	if len(bl) == 0 {
		return nil
	}
	out := make([]decisionlog.Block, len(bl))
	for i, b := range bl {
		out[i] = decisionlog.Block{Hash: fmt.Sprintf("%016x", b.Hash), Kind: b.Kind.String(), Tokens: b.Tokens}
	}
	return out
}

func (c *Core) id(v string) string {
	if v == "" || c.o.RawIDs {
		return v
	}
	return fmt.Sprintf("h:%016x", xxhash.Sum64String(v))
}

func (c *Core) record(rt *Routed, o *Outcome) *decisionlog.Record {
	r := &decisionlog.Record{
		TimeNs: rt.start.UnixNano(), ID: rt.ID, Arm: rt.Arm.Name, Policy: rt.Arm.Policy.Name(), Model: rt.req.Model,
		Session: c.id(rt.req.Session), Tenant: c.id(rt.req.Tenant), Key: fmt.Sprintf("%016x", rt.Key),
		Tokens: rt.Tokens, Blocks: logBlocks(rt.Blocks), Chosen: rt.Chosen().Replica.Name, Outcome: o,
		QueueNs: rt.Queued.Nanoseconds(), Stage: rt.stage, Pair: rt.pair, Prefill: rt.prefill,
	}
	for _, rep := range c.e.Pool().Replicas() {
		r.Replicas = append(r.Replicas, rep.Name)
		r.Budgets = append(r.Budgets, rep.Budget())
	}
	for _, cand := range rt.Candidates {
		engine := "" // the exact prefix alone
		if u := cand.Replica.Reuse; u.Blend() || u.Donor() {
			engine = u.Mode
		}
		r.Candidates = append(r.Candidates, decisionlog.Candidate{
			Replica: cand.Replica.Name, Tier: cand.Tier, Score: cand.Score, Matched: cand.Match.Tokens, InFlight: cand.Load.InFlight,
			Pending: cand.Load.PendingTokens, Recent: cand.Load.RecentTokens, Reason: cand.Reason,
			Running: cand.Load.Running, Waiting: cand.Load.Waiting, KVUsage: cand.Load.KVUsage,
			Engine: engine, Reuse: math.Round(cand.Reuse),
		})
	}
	if c.o.LogPrompts {
		for _, t := range rt.req.Input.Text {
			r.Text = append(r.Text, string(t))
		}
	}
	return r
}

// ErrUnknownDecision is returned by Release for an id not held.
var ErrUnknownDecision = errors.New("unknown or already released decision")

// Hold keeps a recorded decision until Release, until ReleaseAfter passes
// (see Expire), or until the caps on held decisions push it out, oldest
// first. Decisions pushed out are finished as expired before Hold returns.
func (c *Core) Hold(rt *Routed) {
	var out []*Routed
	c.mu.Lock()
	c.held[rt.ID] = c.heldOrder.PushBack(rt)
	c.heldBlocks += len(rt.Blocks)
	for c.heldOrder.Len() > c.o.Unreleased.Max || (c.heldBlocks > c.o.Unreleased.MaxBlocks && c.heldOrder.Len() > 1) {
		out = append(out, c.unholdLocked(c.heldOrder.Front()))
	}
	c.mu.Unlock()
	c.expired(out, "cap")
}

// unholdLocked removes e from the held decisions; c.mu is held.
func (c *Core) unholdLocked(e *list.Element) *Routed {
	rt := c.heldOrder.Remove(e).(*Routed)
	delete(c.held, rt.ID)
	c.heldBlocks -= len(rt.Blocks)
	return rt
}

// expired finishes decisions that were never released, counting them by
// reason ("cap" or "timeout").
func (c *Core) expired(rts []*Routed, reason string) {
	for _, rt := range rts {
		c.Finish(rt, Outcome{Error: "never released"}, nil)
	}
	c.o.Metrics.unreleasedExpired(reason, len(rts))
}

// Release finishes a held decision with o.
func (c *Core) Release(id string, o Outcome) error {
	c.mu.Lock()
	e, ok := c.held[id]
	var rt *Routed
	if ok {
		rt = c.unholdLocked(e)
	}
	c.mu.Unlock()
	if !ok {
		return ErrUnknownDecision
	}
	c.Finish(rt, o, nil)
	return nil
}

// Expire finishes held decisions older than ReleaseAfter at now and
// returns how many. It costs O(expired): held decisions are kept in the
// order they were made.
func (c *Core) Expire(now time.Time) int {
	var old []*Routed
	c.mu.Lock()
	for e := c.heldOrder.Front(); e != nil && now.Sub(e.Value.(*Routed).start) >= c.o.Unreleased.ReleaseAfter; e = c.heldOrder.Front() {
		old = append(old, c.unholdLocked(e))
	}
	c.mu.Unlock()
	c.expired(old, "timeout")
	return len(old)
}

// Run expires unreleased decisions every interval until ctx ends.
func (c *Core) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var queue <-chan time.Time // the router's queue: its TTL, and room no request's end announced
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
			c.Expire(now)
		case <-queue:
			c.q.Expire()
			c.dispatchFree()
		}
	}
}

// QueueTick is how often Run expires the router's queue and offers it the
// room replicas' gauges show (a request's end offers its slot at once).
const QueueTick = 20 * time.Millisecond

// Queued returns the requests and bytes waiting in the router's queue; 0
// without flow control.
func (c *Core) Queued() (requests int, bytes int64) {
	if c.q == nil {
		return 0, 0
	}
	return c.q.Len()
}

// QueuedBy returns the requests waiting in the router's queue at each
// priority and the flows waiting; nil and 0 without flow control.
func (c *Core) QueuedBy() (requests map[int]int, flows int) {
	if c.q == nil {
		return nil, 0
	}
	return c.q.Bands()
}

// Held returns how many decisions await Release, and the blocks they keep.
func (c *Core) Held() (decisions, blocks int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.heldOrder.Len(), c.heldBlocks
}
