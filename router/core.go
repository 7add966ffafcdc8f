package router

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
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
	// TTFTTargets maps an inference objective's name (the request's
	// objective header, as Arrival.Priorities) to its time-to-first-token
	// target: a request of that objective the router's queue predicts
	// could not start within it is refused at once (CoreRequest.Deadline).
	TTFTTargets map[string]time.Duration
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
	// Unreleased bounds the decisions awaiting Release (gRPC): past its
	// caps the oldest is finished as expired, and one never released stops
	// counting as load after Unreleased.ReleaseAfter.
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
	Flow *flow.Options[*replica.Replica]
	// Reserve is how many slots of the pool a request keeps free for the
	// higher priorities (flow.Demand.YieldsTo) while they arrive, on as few
	// replicas as they go to, with flow control on: 0 sizes it by
	// square-root staffing on their expected concurrency m (their rate
	// times the seconds a request holds a slot), m + √m; a positive value
	// is that many slots; a negative one keeps none.
	Reserve int
	// OnGrant, if set, hears of each deferred request whose turn came (a
	// slot is kept for it: Resume it) instead of waking its Wait: the
	// replay, in virtual time, resumes it as an event.
	OnGrant func(*Deferral)
	// PD tunes prefill/decode disaggregation, which replicas of role
	// prefill turn on (pd.go); both front ends read it.
	PD PDOptions
	// StrictResponses refuses a request naming a stored response that the
	// router cannot prove is the caller's tenant's (set when API keys
	// decide the tenant); else such a request is routed as any other and
	// the replica answers for itself.
	StrictResponses bool
	// ChainBytes bounds the memory kept of stored responses'
	// conversations, to route their continuations (chains.go): 0,
	// DefaultChainBytes; negative, none kept.
	ChainBytes int64
	// ShareChain, if set, is given the record of each stored response's
	// conversation kept (cluster.Fleet.ShareChain); peers' records come
	// back through AddChain.
	ShareChain func(rec []byte)
}

// Tokenizer gives the engine's token ids of an OpenAI request body of
// endpoint ep whose model the router's parse read as model
// (tokenizer.Client: a replica's /tokenize). It reads the body's fields as
// the engine does, and only until it returns. Errors are classed by
// tokenizer.ErrSlow and tokenizer.ErrNoReplica.
type Tokenizer interface {
	Body(ctx context.Context, ep blockhash.Endpoint, model string, body []byte) ([]int32, error)
}

// Core is the routing core that every front door and the replay share:
// it admits a request (Admit), assigns it an arm and places it through the
// engine with the arm's policy, deferring it in the router's queue while
// its best replica is saturated (Place), and ends and logs each decision
// (Finish). Its one clock is the engine's. Safe for concurrent use.
type Core struct {
	o    CoreOptions
	e    *routing.Engine
	arms atomic.Pointer[armSet]
	// q is the router's queue (CoreOptions.Flow); nil: flow control off.
	q *Deferrals
	// unreleased keeps the gRPC API's decisions until their Release.
	unreleased *Unreleased
	// ids issues and checks the ids of stored responses, for the
	// requests that continue or fetch them, through either front end.
	ids *responseIDs
	// chains keeps the conversations stored responses hold (chains.go).
	chains *chains
	log    decisionRecorder
	// transfer is transferPerToken's float64 bits; 0 until learned.
	transfer atomic.Uint64
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
	c := &Core{o: o, e: o.Engine, ids: newResponseIDs(o.StrictResponses), chains: newChains(o.ChainBytes),
		log: decisionRecorder{e: o.Engine, raw: o.RawIDs, prompts: o.LogPrompts}}
	c.unreleased = newUnreleased(o.Unreleased, func(rt *Routed, o Outcome) { c.Finish(rt, o, nil) }, o.Metrics)
	if o.Flow != nil {
		c.q = newDeferrals(o.Engine, *o.Flow, o.Reserve, o.Metrics)
		c.q.onGrant = o.OnGrant
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

// Deferrals returns the router's queue; nil without flow control.
func (c *Core) Deferrals() *Deferrals { return c.q }

// Unreleased returns the decisions awaiting the gRPC API's Release.
func (c *Core) Unreleased() *Unreleased { return c.unreleased }

// PickArm returns the arm a request of session, tenant and key is
// assigned (armSet.pick): the same session always gets the same arm.
func (c *Core) PickArm(session, tenant string, key uint64) *Arm {
	return c.arms.Load().pick(c.o.Salt, session, tenant, key)
}

// pick assigns a request to an arm: a hash of the salt and the session
// id, else the tenant id, else the request's key, placed on the arms'
// cumulative weights. The same session always gets the same arm.
func (set *armSet) pick(salt, session, tenant string, key uint64) *Arm {
	if len(set.arms) == 1 {
		return &set.arms[0]
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(salt)
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
	// Deadline is how long after its arrival the request may wait for a
	// slot (its objective's TTFT target); 0: the queue's TTL.
	Deadline time.Duration
	// Prefill routes the request among the replicas of role prefill
	// (disaggregation's first step); otherwise a prefill replica is never
	// a candidate.
	Prefill bool
	// Disaggregate places the request on a decode replica and, when that
	// replica would compute enough of its prompt, a prefill replica
	// (Place); Admit sets it for a chat or completions request of a model
	// a prefill replica serves. Whole says it cannot be split (several
	// prompts or answers: splittable), and goes to its decode replica
	// alone.
	Disaggregate, Whole bool
	// Immediate places the request at once, never deferred in the
	// router's queue (the replay's requests of a decision log, which keep
	// their live timing).
	Immediate bool
	// chain, for a Responses request the engine keeps, drafts the
	// conversation it stores for the answer (chains.go): kept under the
	// answer's id once it has come back whole, and shared with the fleet.
	chain *chainDraft
	// Unknown says the request continues a stored response whose
	// conversation the router does not know: it was routed on its new
	// input alone, and the engine's count of its tokens is left out of the
	// agreement check.
	Unknown bool
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

// prepare makes the engine's input for a parsed request whose body is
// body: in precise mode (CoreOptions.Tokenizer) from the engine's token
// ids, else, or when they cannot be had in time, from the estimate.
// Requests given as token ids are exact already; a request with no body
// (gRPC messages) is estimated.
func (c *Core) prepare(ctx context.Context, req *blockhash.Request, body []byte, session string) routing.Request {
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

// SetRemote counts decode decision rt's replica as taking its prompt's KV
// from its prefill replica (routing.Lease.Remote): not computing it.
func (rt *Routed) SetRemote() {
	rt.remote = true
	rt.Lease().Remote()
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
	now := c.e.Now()
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
			c.learnTransfer(rt.first.Sub(rt.remoteAt).Seconds(), rt.Uncached(rt.Served.Replica.ID))
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
func (c *Core) EngineDone(rt *Routed) { rt.Lease().EngineDone(c.e.Now()) }

// Outcome is how a routed request ended, as the front end saw it.
type Outcome = decisionlog.Outcome

// Finish ends a recorded request: its work stops counting, the reply (if
// given) is learned on the replica that wrote it, and the decision is logged
// with o. TTFT and duration are filled in from the core's clock when zero.
func (c *Core) Finish(rt *Routed, o Outcome, reply []byte) {
	defer c.e.Recycle(rt.Decision) // after the decision log's record read the candidates
	now := c.e.Now()
	c.q.ended(rt) // before the lease's end offers its slot
	learned := c.learn(rt, &o, reply)
	prefix := c.prefix(rt, &o)
	if o.DurationNs == 0 {
		o.DurationNs = now.Sub(rt.start).Nanoseconds()
	}
	if o.TTFTNs == 0 && !rt.first.IsZero() {
		o.TTFTNs = rt.first.Sub(rt.start).Nanoseconds()
	}
	c.o.Metrics.finished(rt, &o)
	c.o.Metrics.prefixed(rt, &prefix)
	if c.o.Log == nil || rt.req.PassThrough {
		return
	}
	o.Replica = rt.Served.Replica.Name
	o.ReplyBlocks = logBlocks(learned)
	rec := c.log.record(rt, &o)
	rec.Prefix = logPrefix(&prefix)
	c.o.Log.Log(rec)
}

// prefix classifies rt's prompt tokens by what became of their prefix
// caching (routing.PrefixOutcomes), as its outcome o reports them, to
// within a block of the splitter's; a request that waited in the router's
// queue waited for room. A disaggregated request's decode part, whose
// prompt its prefill replica computed, is not classified: its prefill
// decision is.
func (c *Core) prefix(rt *Routed, o *Outcome) routing.PrefixTokens {
	if rt.remote || rt.req.PassThrough {
		return routing.PrefixTokens{}
	}
	return routing.PrefixOutcomes(rt.Decision, rt.Served, routing.Usage{OK: o.Status == 200, PromptTokens: o.PromptTokens,
		CachedTokens: o.CachedTokens, CachedReported: o.CachedReported}, rt.Queued > 0, c.e.Splitter().BlockTokens())
}

// logPrefix is p as the decision log writes it; nil when not classified.
func logPrefix(p *routing.PrefixTokens) *decisionlog.Prefix {
	if p.Sum() == 0 {
		return nil
	}
	return &decisionlog.Prefix{Hit: p[routing.PrefixHit], Cold: p[routing.PrefixCold], RoutedAway: p[routing.PrefixRoutedAway],
		RoutedAwayLoad: p[routing.PrefixRoutedAwayLoad], Evicted: p[routing.PrefixEvicted], Waited: p[routing.PrefixWaited]}
}

// learn ends rt's lease and teaches the engine what the request's outcome
// o and reply say (routing.Engine.Finish: its prompt tokens, cached tokens
// and reply), and the agreement tracker its tokens; it returns the reply's
// blocks learned. A disaggregated request's decode replica reports the
// tokens the transfer brought as cached: they teach nothing of its own
// cache.
func (c *Core) learn(rt *Routed, o *Outcome, reply []byte) []blockhash.Block {
	learned, trimmed := c.e.Finish(rt.Decision, routing.Usage{OK: o.Status == 200, PromptTokens: o.PromptTokens,
		CachedTokens: o.CachedTokens, CachedReported: o.CachedReported, OutputTokens: o.OutputTokens, Streamed: o.Streamed,
		Feedback: c.o.Feedback, Reply: reply})
	if trimmed > 0 {
		c.o.Metrics.trimmed(rt, trimmed)
	}
	if c.o.Agreement != nil && o.PromptTokens > 0 && o.Status == 200 && !rt.req.PassThrough && !rt.remote && !rt.req.Unknown {
		c.o.Agreement.Finished(rt.Served.Replica.Name, rt.Decision.Precise(), rt.Tokens, int(o.PromptTokens),
			rt.Served.Predicted(), int(o.CachedTokens), o.CachedReported)
		if o.Streamed {
			c.o.Agreement.Timed(rt.Served.Replica.Name, rt.Lease().Work().Predicted, rt.ttft().Seconds())
		}
	}
	return learned
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

// decisionRecorder makes a finished decision's decision-log record.
type decisionRecorder struct {
	e       *routing.Engine
	raw     bool // CoreOptions.RawIDs
	prompts bool // CoreOptions.LogPrompts
}

// id returns a session or tenant id as logged: hashed unless raw.
func (c decisionRecorder) id(v string) string {
	if v == "" || c.raw {
		return v
	}
	return fmt.Sprintf("h:%016x", xxhash.Sum64String(v))
}

// record returns rt's record, ended with o.
func (c decisionRecorder) record(rt *Routed, o *Outcome) *decisionlog.Record {
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
	if c.prompts {
		for _, t := range rt.req.Input.Text {
			r.Text = append(r.Text, string(t))
		}
	}
	return r
}
