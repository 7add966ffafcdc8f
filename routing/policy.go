package routing

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/servicetime"
)

// View is what a policy knows of the request being routed: the policy's
// view, as Request is the engine's input.
type View struct {
	Blocks []blockhash.Block
	// Tokens is the prompt's estimated tokens; Weighted the same with the
	// kind weights applied.
	Tokens   int
	Weighted float64
	// Key is the session key: a hash of X-Session-ID, else of the body's
	// user, else the first block's hash.
	Key uint64
	// BlockTokens is the block size in tokens (the last block may be
	// shorter).
	BlockTokens int
	// AvgPrefill is the mean uncached prompt tokens of recent requests
	// (an exponentially weighted average): the work a queued request stands
	// for when only a count is known.
	AvgPrefill float64
	// Hot is the request's leading blocks that are hot (EngineOptions.HotUses
	// and HotShare): they carry more than one replica's share of the
	// traffic, so they will soon be on several replicas.
	Hot cachemodel.Match
	// budgets are the replicas' KV capacities, by id (Budget).
	budgets []int64
	// e is the engine deciding, for Service; nil outside Score.
	e *Engine
}

// Service returns c's replica's service-time parameters (Engine.Service:
// its own, or its fleet's until it learned them); the prior outside a
// policy's Score.
func (v *View) Service(c *Candidate) servicetime.Params {
	if v.e == nil {
		return servicetime.Prior()
	}
	return v.e.Service(c.Replica)
}

// Active returns the tokens of the request's matched prefix on c's
// replica that requests running there hold (cachemodel.Model.Active): its
// engine needs no new room for them. 0 outside a policy's Score.
func (v *View) Active(c *Candidate) int {
	if v.e == nil || c.Match.Blocks == 0 {
		return 0
	}
	return v.e.pic.model.Active(c.Replica.ID, v.Blocks[:min(c.Match.Blocks, len(v.Blocks))])
}

// FleetService returns the fleet's service-time parameters (the median of
// its replicas' learned ones; the prior outside a policy's Score).
func (v *View) FleetService() servicetime.Params {
	if v.e == nil {
		return servicetime.Prior()
	}
	return v.e.fleetService()
}

// Budget returns c's replica's KV cache, in tokens, as its engine reports
// it or config sets it (not as feedback corrects the picture's); 0 when
// unknown or unlimited, and during an Observer's Chosen.
func (v *View) Budget(c *Candidate) int64 {
	if id := c.Replica.ID; id < len(v.budgets) {
		return v.budgets[id]
	}
	return 0
}

// Candidate is one available replica as a policy sees it.
type Candidate struct {
	Replica *replica.Replica
	Match   cachemodel.Match
	Load    replica.Load
	// tie breaks a tie of rounded scores before the rendezvous hash, lower
	// first: 0 for every candidate unless the policy sets it.
	tie float64
	// CacheTokens is the tokens the replica holds in the cache picture.
	CacheTokens int64
	// Reuse is the prompt tokens past Match that the replica's engine is
	// expected to reuse (replica.Reuse): for a blending engine, the tokens
	// of the reusable blocks it holds elsewhere in its segments, less its
	// recompute share. 0 on a prefix-only engine.
	Reuse float64
	// State is what the request would meet on the replica, sent now
	// (replica.Replica.State): the input of its service-time model.
	State servicetime.State
	// TTFT is the seconds to the first token the policy predicted for the
	// request on this replica (servicetime.Params.TTFT), 0 when it
	// predicts none.
	TTFT float64
	// Tier and Score are the policy's cost for sending the request here;
	// lower is better, Tier first (a spilled replica, a replica not
	// sampled, more requests in flight), then Score in the policy's unit.
	// Policies set them; Tier is 0 unless a policy ranks in tiers.
	Tier  int64
	Score float64
	// Reason is a short word on why the score is what it is ("match",
	// "miss", "spill", ...), for logs and the decision API.
	Reason string
	// adapter ranks a LoRA adapter's replicas before any tier: 0 with it
	// loaded (or not an adapter request), 1 with room for it, 2 else (see
	// replica.Models.AdapterRank). The engine sets it; policies do not see it.
	adapter int8
	// predicted is Predicted's, when learned is set (the engine gathered
	// the candidate).
	predicted int
	learned   bool
}

// Predicted is the cached tokens the replica's engine is expected to
// report for the request, had it been sent when it was ranked: the
// confirmed prefix, read as the engine is learned to count (counting):
// with the blocks routed there whose events have not come yet, and the
// held blocks past the prefix, where it counts those too.
func (c *Candidate) Predicted() int {
	if !c.learned {
		return c.Match.Confirmed
	}
	return c.predicted
}

// Policy scores candidates. Score sets every candidate's Score (lower wins)
// and may set Reason. It must not reorder cands.
//
// The engine ranks candidates by Tier, then by Score rounded to a whole
// unit (so that float noise never decides), then by the rendezvous weight
// of the session key and the replica name: a policy whose scores differ by
// less than one unit leaves the choice to the rendezvous tie-break, and one
// that wants finer distinctions scales its scores up.
type Policy interface {
	Name() string
	Score(in *View, cands []Candidate)
}

// Observer is implemented by policies that keep state about past choices;
// the engine calls Chosen when a decision is recorded.
type Observer interface {
	Chosen(in *View, c *Candidate)
}

// PrefixCostParams are the semantic policy's parameters (PrefixCost).
type PrefixCostParams struct {
	// LoadWeight, when above 0, makes the cost the token formula of
	// earlier releases (see PrefixCost), with queued work (tokens) at this
	// weight: an advanced override. Default 0: the cost is in seconds.
	LoadWeight float64 `json:"load_weight"`
	// RecentWeight is the share of a replica's recently finished prefill
	// tokens (replica.Load.RecentTokens) counted as queued work: it predicts
	// the queue a replica will have and keeps load meaningful when requests
	// rarely overlap. Default 1; negative means 0.
	RecentWeight float64 `json:"recent_weight"`
	// SpillFactor and SpillMarginTokens: a replica whose queued work exceeds
	// SpillFactor × the mean + SpillMarginTokens is skipped (ranked after
	// every other). Defaults 2 (at least 1) and 2048 (at least 0).
	SpillFactor       float64 `json:"spill_factor"`
	SpillMarginTokens float64 `json:"spill_margin_tokens"`
	// PrefixOnly credits only the exact prefix, whatever else an engine
	// reuses (Candidate.Reuse): the baseline that engine-aware credit is
	// measured against.
	PrefixOnly bool `json:"prefix_only"`
	// CopyWeight is how many computations of a prefix a second copy of it
	// costs the fleet, in the seconds cost (see PrefixCost). Default 8
	// (DefaultCopyWeight); at least 0.
	CopyWeight float64 `json:"copy_weight"`
}

// Defaults of PrefixCostParams.
const (
	DefaultLoadWeight        = 0
	DefaultCopyWeight        = 8
	DefaultRecentWeight      = 1.0
	DefaultSpillFactor       = 2.0
	DefaultSpillMarginTokens = 2048.0
)

// DefaultPrefixCostParams returns the semantic policy's defaults.
func DefaultPrefixCostParams() PrefixCostParams {
	return PrefixCostParams{LoadWeight: DefaultLoadWeight, RecentWeight: DefaultRecentWeight, CopyWeight: DefaultCopyWeight,
		SpillFactor: DefaultSpillFactor, SpillMarginTokens: DefaultSpillMarginTokens}
}

func (c *PrefixCostParams) valid() error {
	c.RecentWeight = max(c.RecentWeight, 0)
	if c.LoadWeight < 0 || c.CopyWeight < 0 || c.SpillFactor < 1 || c.SpillMarginTokens < 0 {
		return fmt.Errorf("load_weight must be ≥ 0, spill_factor ≥ 1, spill_margin_tokens ≥ 0")
	}
	return nil
}

// nonNegative returns an error naming the first of names whose value in
// vals is negative (or not a number).
func nonNegative(names []string, vals ...float64) error {
	for i, v := range vals {
		if !(v >= 0) {
			return fmt.Errorf("%s must be ≥ 0, not %v", names[i], v)
		}
	}
	return nil
}

// PrefixCost is semroute's own policy. Its cost is in seconds, what a
// client waits: the time to the request's first token on replica r, as
// r's service-time model predicts it (View.Service, package servicetime:
// learned from r's own answers), plus what sending it away from its
// prefix's home costs the fleet, computed again elsewhere:
//
//	cost(r)     = TTFT(r) + copy(r)
//	TTFT(r)     = wait(r) + Overhead(r) + PerToken(r) × uncached(r) + PerAhead(r) × ahead(r)
//	uncached(r) = Tokens − max(Match(r).Tokens + Reuse(r), Hot.Tokens)
//	copy(r)     = min(CopyWeight × dup(r), dup(r) + the fleet's Run)
//	dup(r)      = (max over replicas of matched − matched(r)) × the fleet's PerToken
//
// where wait(r) is the requests r must finish before a slot frees for this
// one (its engine's max-num-seqs, its queue, the router's queue for it)
// at r's learned wait per request, plus r's learned wait for KV room when
// the request does not fit r's free KV cache; ahead(r) is the prefill work
// already sent there. matched is weighted by kind (Weighted). A replica
// three times as fast is worth three times the uncached tokens, a queue
// of long requests more than one of short ones, and a prefix held where
// requests wait for seconds is left for one computed at once, without a
// weight tuned to one engine. copy(r) values the prefix by the
// computations of it a second copy costs the fleet: the memory the copy
// takes evicts other prefixes, and the session's later requests split
// between two homes. CopyWeight is in those computations, a property of
// the workload, not of an engine: the replay of both public traces (see
// BENCHMARKS.md) put the hit rate within 1% of the best port's from 8 on,
// with the lowest TTFT p50 and a p99 within 1% of the lowest, where 1 lost
// 8% of the hit rate. A hot
// prefix (View.Hot), held soon everywhere, costs no copy. Past computing
// it once, staying with a prefix is worth at most a mean request's run
// (servicetime.Params.Run): a long prefix does not hold a request behind a
// queue of minutes. A replica whose engine has no KV room for the
// request's blocks now, beyond those its running requests hold (it would
// not admit it: State.KVShort), and holds less than HomeShare of the
// prompt is ranked after those that have (Tier 1, reason "kv"); one that
// holds more is weighed in seconds, its learned wait for room against the
// recompute elsewhere; one whose whole KV cache is smaller than the
// request goes after every other (Tier 2, "too_long"). A miss everywhere
// goes to the replica that starts it first, ties in time to the one whose
// picture holds the least of its budget (tieOf). Scores are in units of Resolution × the cheapest
// candidate's cost (rank rounds them): closer costs are ties, left to the
// session's rendezvous; Candidate.TTFT keeps the prediction in seconds.
//
// With LoadWeight above 0 the cost is the token formula of earlier
// releases, an advanced override:
//
//	cost(r)    = (Weighted − matched(r)) + LoadWeight × queued(r)
//	matched(r) = max(Match(r).Weighted + Reuse(r), Hot.Weighted)
//	queued(r)  = max(PendingTokens(r), Waiting(r) × AvgPrefill) + RecentWeight × RecentTokens(r)
//
// the type-weighted prompt tokens replica r would still have to compute
// (Reuse: what a blending engine reuses past the prefix, unless PrefixOnly), plus
// the work queued on it: prefill tokens in flight from this router, or the
// replica's own waiting queue (vllm:num_requests_waiting, which also holds
// other routers' requests) if that is larger, and a share of the prefill
// that finished recently (see replica.Load). LoadWeight below 1 values a matched
// token above a queued one: sending a request away from its prefix also
// costs a duplicate copy of that prefix in the fleet's cache, which later
// requests miss (the replay of the public traces measures this; see
// docs/replay.md). A miss everywhere goes to the least-loaded replica. A hot prefix
// (View.Hot: more traffic than one replica's share) counts as held by every
// replica, since it soon will be: load decides where requests sharing a
// global system prompt go, and the prefix is replicated wherever they land. A replica whose queued work is above
// SpillFactor × mean + SpillMarginTokens, or whose KV cache is at least
// KVSpill full (vllm:kv_cache_usage_perc: it would queue or preempt), is
// ranked last (reason "spill"), as is one whose engine has no room for the
// request's blocks now (reason "kv", see fits); if it still wins nothing
// else was available.
type PrefixCost struct{ cfg PrefixCostParams }

var _ Policy = (*PrefixCost)(nil)

// Name implements Policy.
func (*PrefixCost) Name() string { return "semantic" }

// Score implements Policy.
func (p *PrefixCost) Score(in *View, cands []Candidate) {
	if p.cfg.LoadWeight > 0 {
		p.scoreTokens(in, cands)
		return
	}
	best := 0.0
	for i := range cands {
		best = max(best, p.matched(in, &cands[i]).Weighted)
	}
	fleet := in.FleetService()
	least := math.Inf(1)
	for i := range cands {
		c := &cands[i]
		m := p.matched(in, c)
		sp := in.Service(c)
		st := c.State
		// c.State counted the whole prompt against its free room; fits
		// leaves out what its running requests hold already.
		st.KVShort = c.Load.KVUsage >= KVSpill || !fits(in, c)
		c.TTFT = sp.TTFT(st, max(float64(in.Tokens)-m.Tokens, 0))
		dup := (best - m.Weighted) * fleet.PerToken // seconds to compute the copy once
		c.Score = c.TTFT + min(p.cfg.CopyWeight*dup, dup+fleet.Run)
		least = min(least, c.Score)
		switch {
		case tooLong(in, c):
			c.Tier, c.Reason = 2, reasonTooLong
		case st.KVShort && float64(c.Match.Tokens) < HomeShare*float64(in.Tokens):
			c.Tier, c.Reason = 1, reasonNoRoom // little of it there: not worth a wait for room
		case st.KVShort:
			c.Reason = reasonNoRoom // its home: the wait for room against the recompute, in seconds
		case st.Queued > 0:
			c.Reason = "queue"
		default:
			c.Reason = p.reason(in, c)
		}
	}
	unit := max(Resolution*least, minResolution)
	for i := range cands {
		cands[i].Score /= unit
		cands[i].tie = tieOf(in, &cands[i])
	}
}

// tieOf is the semantic policy's tie-break before the session's
// rendezvous: the share of its KV budget the replica's picture holds, in
// hundredths. Among replicas alike in time, a new session goes where its
// blocks evict least, as SGLang's router sends a miss to the smallest tree:
// sessions of tenants whose prefixes are long spread by memory, not by
// count, and no replica ends up holding more tenants than its cache.
func tieOf(in *View, c *Candidate) float64 {
	b := in.Budget(c)
	if b <= 0 {
		return 0
	}
	return math.Floor(100 * float64(c.CacheTokens) / float64(b))
}

// HomeShare is the share of a request's prompt a replica must hold, as its
// exact prefix (not what a blending engine reuses past it, which is less
// sure), for a wait for KV room there to be weighed in seconds against
// computing the prompt elsewhere: a replica short of room that holds less is ranked
// after those that have room (Tier 1), however its time compares, as a
// request of a session that holds little there is better started where it
// fits than queued behind its engine's admission. SGLang's router keeps a
// request where more than half of it matches (cache_threshold 0.5).
const HomeShare = 0.5

// Resolution is the share of the cheapest candidate's cost within which
// the semantic policy's costs tie (rank rounds scores to whole units):
// replicas whose predicted times differ by less are alike to a model
// learned from noisy answers, and the session's rendezvous chooses among
// them, so that alike replicas share cold sessions rather than the one a
// noise made fastest taking them all. minResolution (seconds) is the
// unit's floor.
const (
	Resolution    = 0.05
	minResolution = 1e-4
)

// matched returns the prompt tokens c's replica is credited with holding,
// and their kind-weighted tokens: the prefix matched and, unless
// PrefixOnly, what its engine reuses past it (Reuse), or the hot prefix if
// more.
func (p *PrefixCost) matched(in *View, c *Candidate) (m struct{ Tokens, Weighted float64 }) {
	reuse := c.Reuse
	if p.cfg.PrefixOnly {
		reuse = 0
	}
	m.Tokens = max(float64(c.Match.Tokens)+reuse, float64(in.Hot.Tokens))
	m.Weighted = max(c.Match.Weighted+reuse, in.Hot.Weighted)
	return m
}

// reason names why c's cost is what it is, past load: "hot", "match", its
// engine's reuse mode, or "miss".
func (p *PrefixCost) reason(in *View, c *Candidate) string {
	switch {
	case in.Hot.Blocks > c.Match.Blocks:
		return "hot"
	case c.Match.Blocks > 0:
		return "match"
	case c.Reuse > 0 && !p.cfg.PrefixOnly:
		return c.Replica.Reuse.Mode // the engine's reuse mode: "blend" or "donor"
	}
	return "miss"
}

// scoreTokens is Score's token formula (LoadWeight above 0).
func (p *PrefixCost) scoreTokens(in *View, cands []Candidate) {
	mean := 0.0
	for i := range cands {
		mean += p.queued(cands[i].Load, in.AvgPrefill)
	}
	mean /= float64(len(cands))
	limit := p.cfg.SpillFactor*mean + p.cfg.SpillMarginTokens
	for i := range cands {
		c := &cands[i]
		load := p.queued(c.Load, in.AvgPrefill)
		reuse := c.Reuse
		if p.cfg.PrefixOnly {
			reuse = 0
		}
		matched := max(c.Match.Weighted+reuse, in.Hot.Weighted)
		c.Score = in.Weighted - matched + p.cfg.LoadWeight*load
		switch {
		case tooLong(in, c):
			c.Tier, c.Reason = 2, reasonTooLong
		case load > limit || c.Load.KVUsage >= KVSpill:
			c.Tier, c.Reason = 1, reasonSpill // after every replica that is not spilled
		case !fits(in, c):
			c.Tier, c.Reason = 1, reasonNoRoom // it would wait for room: spilled too
		default:
			c.Reason = p.reason(in, c)
		}
	}
}

// fits reports whether the request's tokens fit in the KV cache c's engine
// has free now (1 − vllm:kv_cache_usage_perc of its budget). An engine runs
// a request only when its blocks fit, its cached but idle blocks included
// (vLLM's scheduler takes them off the free queue, and keeps the request
// waiting otherwise, first come first served), so one that does not fit
// waits for running requests to end, however long its prefix. Blocks that
// requests running there hold already need no room (View.Active): a
// session's home, whose other requests hold its tenant's prefix, is not
// short of room for the prefix it shares. True when the engine reports no
// usage or the budget is unknown.
func fits(in *View, c *Candidate) bool {
	budget := in.Budget(c)
	if budget <= 0 || c.Load.KVUsage <= 0 {
		return true
	}
	free := (1 - c.Load.KVUsage) * float64(budget)
	return float64(in.Tokens) <= free || float64(in.Tokens-in.Active(c)) <= free
}

// tooLong reports whether the request's tokens are more than c's engine's
// whole KV cache (its budget, when known): it would refuse it (vLLM, "the
// kv cache does not have sufficient capacity"), however empty.
func tooLong(in *View, c *Candidate) bool {
	budget := in.Budget(c)
	return budget > 0 && int64(in.Tokens) > budget
}

func (p *PrefixCost) queued(l replica.Load, avgPrefill float64) float64 {
	return max(l.PendingTokens, float64(l.Waiting)*avgPrefill) + p.cfg.RecentWeight*l.RecentTokens
}

// The semantic policy's reasons for ranking a replica after the others.
const (
	reasonSpill   = "spill"
	reasonNoRoom  = "kv"
	reasonTooLong = "too_long"
)

// KVSpill is the KV cache usage from which the semantic policy skips a
// replica.
const KVSpill = 0.98

// RoundRobin sends requests to each replica in turn: in turn within each
// set of candidates it is given, so that requests that may use only some
// replicas (a role, a model, a gateway's subset) each go round their own
// set. One turn for all would not: a disaggregated request's decode and
// prefill decisions, taken one after the other, would each always land on
// the same parity of their sets, one replica of each.
type RoundRobin struct {
	next atomic.Uint64 // the turn of sets past maxRoundRobinSets
	sets sync.Map      // roundRobinSet → *atomic.Uint64
	n    atomic.Int64  // sets held
}

// roundRobinSet names a set of candidates: its first replica and its size.
type roundRobinSet struct{ first, n int }

// maxRoundRobinSets bounds the sets RoundRobin keeps a turn for; past it
// they share one.
const maxRoundRobinSets = 256

// Name implements Policy.
func (*RoundRobin) Name() string { return "round_robin" }

// turn returns the counter of cands' set.
func (p *RoundRobin) turn(cands []Candidate) *atomic.Uint64 {
	key := roundRobinSet{cands[0].Replica.ID, len(cands)}
	if c, ok := p.sets.Load(key); ok {
		return c.(*atomic.Uint64)
	}
	if p.n.Load() >= maxRoundRobinSets {
		return &p.next
	}
	c, loaded := p.sets.LoadOrStore(key, new(atomic.Uint64))
	if !loaded {
		p.n.Add(1)
	}
	return c.(*atomic.Uint64)
}

// Score implements Policy: the replica whose turn it is in cands' set
// scores 0, the next 1, and so on.
func (p *RoundRobin) Score(_ *View, cands []Candidate) {
	if len(cands) == 0 {
		return
	}
	n := uint64(len(cands))
	start := (p.turn(cands).Add(1) - 1) % n
	for i := range cands {
		cands[i].Score = float64((uint64(i) + n - start) % n)
		cands[i].Reason = "turn"
	}
}

// Random scores replicas uniformly at random.
type Random struct{ rng *seededRand }

// Name implements Policy.
func (*Random) Name() string { return "random" }

// Score implements Policy.
func (p *Random) Score(_ *View, cands []Candidate) {
	for i := range cands {
		cands[i].Score = p.rng.float() * 1e9 // whole units: rank rounds scores
		cands[i].Reason = "random"
	}
}

// LeastLoad scores a replica by its in-flight requests, then its queued
// tokens: the least-loaded replica wins whatever it has cached.
type LeastLoad struct{}

// Name implements Policy.
func (LeastLoad) Name() string { return "least_load" }

// Score implements Policy.
func (LeastLoad) Score(_ *View, cands []Candidate) {
	for i := range cands {
		l := cands[i].Load
		cands[i].Tier, cands[i].Score = l.InFlight, l.PendingTokens+l.RecentTokens
		cands[i].Reason = "load"
	}
}

// rank returns the best k candidates, in order, leaving cands as they are:
// lowest tier, then lowest score (rounded to whole units) first, ties broken by the highest
// rendezvous weight of (key, replica name), so a tie never means "the first
// replica wins". One pass keeping the best k so far: O(len(cands) × k) at
// worst; a rendezvous weight is computed only on a tie, once per candidate.
func rank(cands []Candidate, key uint64, k int) []Candidate {
	k = min(k, len(cands))
	type entry struct {
		j       int
		adapter int8
		tier    int64
		score   float64
		tie     float64
		rv      uint64
		rvDone  bool
	}
	weight := func(e *entry) uint64 {
		if !e.rvDone {
			e.rv, e.rvDone = rendezvous(key, cands[e.j].Replica.Name), true
		}
		return e.rv
	}
	better := func(a, b *entry) bool {
		if a.adapter != b.adapter {
			return a.adapter < b.adapter
		}
		if a.tier != b.tier {
			return a.tier < b.tier
		}
		if a.score != b.score {
			return a.score < b.score
		}
		if a.tie != b.tie {
			return a.tie < b.tie
		}
		return weight(a) > weight(b)
	}
	var buf [17]entry // routing.attempts is at most 16: no allocation
	top := buf[:0]    // best first
	if k+1 > len(buf) {
		top = make([]entry, 0, k+1)
	}
	for j := range cands {
		e := entry{j: j, adapter: cands[j].adapter, tier: cands[j].Tier, score: math.Round(cands[j].Score), tie: cands[j].tie}
		if len(top) == k && !better(&e, &top[k-1]) {
			continue
		}
		i := len(top)
		for i > 0 && better(&e, &top[i-1]) {
			i--
		}
		top = append(top, entry{})
		copy(top[i+1:], top[i:])
		top[i] = e
		top = top[:min(len(top), k)]
	}
	out := make([]Candidate, len(top))
	for i := range top {
		out[i] = cands[top[i].j]
	}
	return out
}
