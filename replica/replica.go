// Package replica is the pool of inference replicas the router sends to: their
// membership, availability and load signals.
//
// A Replica's counters are atomics and its methods are safe for concurrent
// use. A Pool publishes its membership as an immutable snapshot, so readers
// never lock; changes build a new snapshot (copy-on-write).
package replica

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/semroute/semroute/plugin"
	"github.com/semroute/semroute/servicetime"
)

// Spec is one replica's static configuration.
type Spec struct {
	Name string
	URL  string // base URL, e.g. http://10.0.0.5:8000
	// BudgetTokens is the replica's KV cache size in tokens; 0 means unknown
	// (the cache model then treats it as unlimited).
	BudgetTokens int64
	// Weight scales the replica's share of load: a replica of weight 2 is
	// considered half as loaded by the same work. Zero means 1.
	Weight float64
	// KVEvents is where the replica's engine publishes its KV events; the
	// zero value: it publishes none.
	KVEvents KVEvents
	// Reuse is what the replica's engine reuses of a prompt's KV beyond
	// the exact prefix; the zero value: the prefix only, as vLLM's prefix
	// caching.
	Reuse Reuse
	// MaxRunning is how many requests the replica's engine runs at once
	// before it queues the next (vLLM's --max-num-seqs); 0: learned from
	// what it reports (Replica.Capacity).
	MaxRunning int64
	// Role is what the replica's engine does in disaggregated serving
	// (RolePrefill, RoleDecode); the zero value, RoleBoth, is a whole
	// engine that computes prompts and answers alike.
	Role Role
	// Scheduling is the replica's engine's scheduling policy (vLLM's
	// --scheduling-policy); the zero value, SchedulingFCFS, serves in
	// arrival order. The router gives a SchedulingPriority engine each
	// request's priority.
	Scheduling Scheduling
	// DataParallel is the engine's data-parallel ranks behind URL (vLLM's
	// --data-parallel-size with its own load balancing): a spec of Size
	// over 1 is one routing target a rank (see Ranks), each request sent
	// with HeaderDataParallelRank. The zero value: one rank.
	DataParallel DataParallel
}

// Scheduling is an engine's scheduling policy.
type Scheduling string

// Scheduling policies (Spec.Scheduling).
const (
	// SchedulingFCFS: first come, first served, vLLM's default. The zero
	// value.
	SchedulingFCFS Scheduling = ""
	// SchedulingPriority: waiting requests by their body's priority,
	// lower first, then by arrival; the least important running request
	// preempted when the KV cache runs out.
	SchedulingPriority Scheduling = "priority"
)

// Check reports a policy that is not one of the Scheduling policies
// ("fcfs" is SchedulingFCFS).
func (s Scheduling) Check() error {
	switch s {
	case SchedulingFCFS, "fcfs", SchedulingPriority:
		return nil
	}
	return fmt.Errorf("scheduling %q is not fcfs or priority", string(s))
}

// Prioritized reports whether an engine of policy s schedules by the
// body's priority.
func (s Scheduling) Prioritized() bool { return s == SchedulingPriority }

// Role is a replica's part in prefill/decode disaggregation.
type Role string

// Roles (Spec.Role).
const (
	// RoleBoth: prefill and decode on the one engine (aggregated), as
	// without disaggregation. The zero value.
	RoleBoth Role = ""
	// RolePrefill: computes prompts only (vLLM with a KV connector as a
	// producer); their KV goes to a decode replica.
	RolePrefill Role = "prefill"
	// RoleDecode: generates answers from KV a prefill replica computed,
	// or computes the prompt itself when given none.
	RoleDecode Role = "decode"
)

// Check reports a role that is not one of Roles ("both" is RoleBoth).
func (r Role) Check() error {
	switch r {
	case RoleBoth, "both", RolePrefill, RoleDecode:
		return nil
	}
	return fmt.Errorf("role %q is not prefill, decode or both", string(r))
}

// Prefills reports whether a replica of role r computes prompts for
// others (RolePrefill).
func (r Role) Prefills() bool { return r == RolePrefill }

// Decodes reports whether a replica of role r generates answers: any role
// but RolePrefill.
func (r Role) Decodes() bool { return r != RolePrefill }

// Reuse modes (Reuse.Mode).
const (
	// ReusePrefix: only the longest cached exact prefix (vLLM, SGLang).
	ReusePrefix = "prefix"
	// ReuseBlend: also each cached segment (a message, a content part)
	// wherever it appears, recomputing a share of its tokens to repair
	// cross-attention (CacheBlend, EuroSys 2025, in LMCache; EPIC).
	ReuseBlend = "blend"
	// ReuseDonor: when the exact prefix falls short, also the cached KV of
	// an earlier prompt similar enough to this one (a donor), as SGLang's
	// SemanticPrefixProvider (PR 20806) and Dynamo's semantic KV provider
	// (PR 7520) let an engine do: the donor's tokens are looked up in the
	// prefix cache and what is held of them is reused in place of this
	// prompt's own.
	ReuseDonor = "donor"
)

// Reuse is an engine's capability to reuse KV beyond the exact prefix.
// The zero value is ReusePrefix.
type Reuse struct {
	// Mode is ReusePrefix ("" too), ReuseBlend or ReuseDonor.
	Mode string
	// Recompute is the share of a blended segment's tokens the engine
	// computes again, in [0, 1); default 0.15 (CacheBlend's, LMCache's
	// blend_recompute_ratio).
	Recompute float64
	// BudgetTokens is the tokens of segments the engine keeps for
	// blending (LMCache's store, apart from the GPU's prefix cache); 0:
	// the replica's BudgetTokens.
	BudgetTokens int64
	// MinSimilarity is the least similarity, in [0, 1], of a donor the
	// engine reuses (ReuseDonor); 0: DefaultMinSimilarity.
	MinSimilarity float64
}

// DefaultMinSimilarity is Reuse.MinSimilarity's default, the matcher's
// (Dynamo's reference provider takes 0.6; SGLang's interface has none).
const DefaultMinSimilarity = 0.5

// DefaultRecompute is Reuse.Recompute's default.
const DefaultRecompute = 0.15

// Blend reports whether the engine blends segments.
func (u Reuse) Blend() bool { return u.Mode == ReuseBlend }

// Donor reports whether the engine reuses similar donors' KV.
func (u Reuse) Donor() bool { return u.Mode == ReuseDonor }

// Similarity returns the least similarity of a donor the engine reuses:
// MinSimilarity, or its default if 0.
func (u Reuse) Similarity() float64 {
	if u.MinSimilarity == 0 {
		return DefaultMinSimilarity
	}
	return u.MinSimilarity
}

// Share returns the share of a blended segment's tokens the engine does
// not compute: 1 − Recompute (its default if 0).
func (u Reuse) Share() float64 {
	r := u.Recompute
	if r == 0 {
		r = DefaultRecompute
	}
	return 1 - r
}

// Spec returns u as the plugin spec of its mode (routing's reuse modes):
// the mode, "" read as ReusePrefix, with the parameters that mode takes and
// u sets (blend: recompute; donor: min_similarity); a parameter left 0 is
// the mode's default. BudgetTokens is the pool's, not the mode's.
func (u Reuse) Spec() plugin.Spec {
	s := plugin.Spec{Type: u.Mode}
	switch u.Mode {
	case "":
		s.Type = ReusePrefix
	case ReuseBlend:
		if u.Recompute != 0 {
			s.Params = plugin.Params{"recompute": u.Recompute}
		}
	case ReuseDonor:
		if u.MinSimilarity != 0 {
			s.Params = plugin.Params{"min_similarity": u.MinSimilarity}
		}
	}
	return s
}

// Check validates u.
func (u Reuse) Check() error {
	switch u.Mode {
	case "", ReusePrefix, ReuseBlend, ReuseDonor:
	default:
		return fmt.Errorf("reuse mode %q: want %s, %s or %s", u.Mode, ReusePrefix, ReuseBlend, ReuseDonor)
	}
	if u.Recompute < 0 || u.Recompute >= 1 || u.BudgetTokens < 0 || !(u.MinSimilarity >= 0 && u.MinSimilarity <= 1) {
		return fmt.Errorf("reuse: recompute must be in [0, 1), budget_tokens ≥ 0, min_similarity in [0, 1]")
	}
	return nil
}

// KVEvents are the ZeroMQ addresses of an engine's KV events (vLLM's
// --kv-events-config: endpoint, replay_endpoint, topic). Endpoint is the
// engine's bound PUB, which the router dials; Listen, instead, is an
// address the router binds and the engine dials. DataParallelRank is the
// rank whose batches are followed (-1 every rank). The fields are
// configs.KVEventsConfig's, which converts to it.
type KVEvents struct {
	Endpoint, Listen, ReplayEndpoint, Topic string
	DataParallelRank                        int
}

// Load is a replica's queued work, the load term of routing scores. Token
// fields are divided by the replica's weight.
type Load struct {
	InFlight int64 // requests sent and not finished
	// PendingTokens is the estimated prefill tokens (uncached prompt tokens)
	// of requests sent whose prefill has not finished, and of requests the
	// router's queue holds for the replica (Replica.Wait): the work ahead
	// of the next request either way.
	PendingTokens float64
	// ActiveTokens is the prompt tokens of requests in flight: the KV cache
	// their sequences hold while they decode.
	ActiveTokens float64
	// RecentTokens is the prefill tokens of requests whose prefill finished
	// recently, decayed with the pool's half-life: it keeps load meaningful
	// when requests are short and rarely overlap. A request's tokens count in
	// PendingTokens until its prefill is done and here after, never in both.
	RecentTokens float64
	// Observed are the replica's own gauges (scraped, or set by a simulator).
	Observed
}

// Observed are load gauges the replica reports about itself. The zero value
// means nothing was reported.
type Observed struct {
	Running int64   // sequences running (vllm:num_requests_running)
	Waiting int64   // requests queued (vllm:num_requests_waiting)
	KVUsage float64 // fraction of the KV cache in use, 0..1 (vllm:kv_cache_usage_perc)
}

// Work is one request's load on a replica. The caller owns it and passes the
// same Work to Begin, PrefillDone and End.
type Work struct {
	Prefill int64 // estimated uncached prompt tokens
	Tokens  int64 // prompt tokens
	done    bool  // prefill finished
	drained bool  // the engine finished it (Drained or End)
	start   int64 // when it was sent (Begin), unix nanoseconds
	remote  bool  // its prefill is another replica's (Remote): its first token teaches no timing
	// first and end are when its prefill and the engine finished it
	// (PrefillDone, Drained), unix nanoseconds; 0 until then.
	first, end int64
	// at is the replica's state when it was sent (Begin), for the
	// service-time model (LearnService).
	at servicetime.State
	// batch is the sequences the engine ran when it was sent, itself
	// included.
	batch int64
	// Predicted is its time to first token as predicted when it was
	// committed, in seconds (0: none): the model's error (LearnService).
	Predicted float64
}

// Remote counts w, begun on r, as a request whose prompt another replica
// computes (disaggregated prefill): its prefill is no longer pending work
// here, and its time to first token (the KV transfer's) teaches r no
// prefill timing.
func (r *Replica) Remote(w *Work) {
	if !w.done {
		r.pending.Add(-w.Prefill)
	}
	w.Prefill, w.remote = 0, true
}

// Replica is one inference server.
type Replica struct {
	Name   string
	URL    *url.URL
	Weight float64
	// Reuse is its engine's capability (Spec.Reuse).
	Reuse Reuse
	// Role is its part in disaggregated serving (Spec.Role).
	Role Role
	// Scheduling is its engine's scheduling policy (Spec.Scheduling).
	Scheduling Scheduling
	// DataParallel is its rank of its engine's (Spec.DataParallel).
	DataParallel DataParallel
	// ID is the replica's id in the cache model, set once when it joins a
	// pool and never changed.
	ID int

	halfLife time.Duration
	// budget is the token budget; 0 means unknown (the scraper may learn it
	// from vllm:cache_config_info).
	budget   atomic.Int64
	inFlight atomic.Int64
	pending  atomic.Int64 // tokens
	waiting  atomic.Int64 // tokens held for it in the router's queue (Wait)
	heldMu   sync.Mutex
	heldBy   map[int]int64 // requests held for it there by priority (Wait), under heldMu
	active   atomic.Int64  // tokens
	// downUntil is when the replica may take traffic again, in unix
	// nanoseconds; 0 when up.
	downUntil atomic.Int64
	observed  atomic.Pointer[Observed]
	models    atomic.Pointer[Models] // nil, or Served nil: not known yet
	// maxRunning is Spec.MaxRunning; learned is the most the engine
	// reported running while it queued (0: none seen): see Capacity.
	// engaged counts the requests in flight the engine has not finished
	// (Begin to Drained or End).
	maxRunning int64
	learned    atomic.Int64
	engaged    atomic.Int64
	// reserved counts the slots the router's queue kept for requests it
	// dispatched here that have not been decided yet (Reserve).
	reserved atomic.Int64
	// drains counts the requests the engine finished here (Drained);
	// drainsSeen is its value at the last Observe.
	drains, drainsSeen atomic.Int64
	// activeDown is set by failed active health checks; draining by an
	// operator removing the replica.
	activeDown atomic.Bool
	draining   atomic.Bool
	// recent is the recent-work counter; readers load it without a lock,
	// writers replace it under mu. (It sits with the other fields every
	// decision reads, so that reading a replica's load touches two cache
	// lines.)
	recent atomic.Pointer[recentWork]
	mu     sync.Mutex

	hmu       sync.Mutex
	fails     int          // consecutive failed active checks
	oks       int          // consecutive good active checks
	ejections int          // consecutive passive ejections
	strikes   atomic.Int64 // soft failures since the last success (Strike)
	timeouts  atomic.Int64 // timeouts since the last success (TimedOut)
	softOut   atomic.Bool  // the last ejection came from soft failures (Strike)
	probe     atomic.Bool  // ejected for timeouts, not answered since: one request at a time (Available)

	omu     sync.Mutex
	outcome outcomes // answers and soft failures, for Strike's volume and share

	// service is its engine's service time, learned from the requests it
	// served (LearnService); params its parameters as last learned, read
	// without a lock (Service).
	service servicetime.Model
	params  atomic.Pointer[servicetime.Params]
}

// outcomes counts a replica's answers and soft failures in the current
// interval (from at, unix nanoseconds) and the one before it, and the
// sources of those failures.
type outcomes struct {
	at                   int64
	total, fails         int
	prevTotal, prevFails int
	srcs, prevSrcs       sources
}

// add counts one answer at now, a soft failure from source if failed, and
// returns the counts of the current and previous intervals together: the
// answers, the failures and the failures' distinct sources (at most
// MaxEjectSources).
func (o *outcomes) add(now int64, interval time.Duration, failed bool, source uint64) (total, fails, srcs int) {
	switch d := now - o.at; {
	case d >= 2*int64(interval):
		*o = outcomes{at: now}
	case d >= int64(interval):
		*o = outcomes{at: o.at + int64(interval), prevTotal: o.total, prevFails: o.fails, prevSrcs: o.srcs}
	}
	o.total++
	if failed {
		o.fails++
		o.srcs.add(source)
	}
	return o.total + o.prevTotal, o.fails + o.prevFails, o.srcs.union(&o.prevSrcs)
}

// sources are the distinct keys of the clients whose requests failed, up to
// MaxEjectSources: enough to tell whether Ejection.MinSources were seen.
type sources struct {
	n    int
	keys [MaxEjectSources]uint64
}

func (s *sources) has(k uint64) bool {
	for _, v := range s.keys[:s.n] {
		if v == k {
			return true
		}
	}
	return false
}

func (s *sources) add(k uint64) {
	if s.n < len(s.keys) && !s.has(k) {
		s.keys[s.n] = k
		s.n++
	}
}

// union returns how many distinct keys s and t hold together, at most
// MaxEjectSources.
func (s *sources) union(t *sources) int {
	n := s.n
	for _, k := range t.keys[:t.n] {
		if !s.has(k) {
			n++
		}
	}
	return min(n, MaxEjectSources)
}

// recentWork is the recent-work counter: tokens, as of at (unix nanoseconds).
// It is immutable once published.
type recentWork struct {
	tokens float64
	at     int64
}

// Begin counts w as sent to the replica at now.
func (r *Replica) Begin(w *Work, now time.Time) {
	w.done, w.drained, w.start, w.first, w.end = false, false, now.UnixNano(), 0, 0
	w.at, w.batch = r.State(w.Tokens, 0), r.engaged.Load()+1
	r.inFlight.Add(1)
	r.engaged.Add(1)
	r.pending.Add(w.Prefill)
	r.active.Add(w.Tokens)
}

// PrefillDone counts w's prefill as finished at now: its tokens move from
// pending to recent work. Calling it again, or after End, does nothing.
func (r *Replica) PrefillDone(w *Work, now time.Time) {
	if w.done {
		return
	}
	w.done, w.first = true, now.UnixNano()
	r.pending.Add(-w.Prefill)
	r.mu.Lock()
	r.recent.Store(&recentWork{tokens: r.decayed(now.UnixNano()) + float64(w.Prefill), at: now.UnixNano()})
	r.mu.Unlock()
}

// Drained counts w as finished by the replica's engine at now (its slot
// free), though its client may still be reading the answer: it no longer
// counts toward Saturated. Calling it again, or after End, does nothing.
func (r *Replica) Drained(w *Work, now time.Time) {
	if w.drained {
		return
	}
	w.drained, w.end = true, now.UnixNano()
	r.engaged.Add(-1)
	r.drains.Add(1)
}

// End counts the end of w at now, finishing its prefill if that was not
// reported.
func (r *Replica) End(w *Work, now time.Time) {
	r.PrefillDone(w, now)
	r.Drained(w, now)
	r.inFlight.Add(-1)
	r.active.Add(-w.Tokens)
}

// Wait counts a request of priority the router's queue holds for the
// replica (the one it would go to, were it not saturated), and its
// prefill tokens as pending work, as its engine would count them were the
// request queued there; Unwait takes them back when the request leaves the
// queue.
func (r *Replica) Wait(tokens int64, priority int) {
	r.waiting.Add(tokens)
	r.heldMu.Lock()
	if r.heldBy == nil {
		r.heldBy = map[int]int64{}
	}
	r.heldBy[priority]++
	r.heldMu.Unlock()
}

// Unwait undoes Wait(tokens, priority).
func (r *Replica) Unwait(tokens int64, priority int) {
	r.waiting.Add(-tokens)
	r.heldMu.Lock()
	if r.heldBy[priority]--; r.heldBy[priority] <= 0 {
		delete(r.heldBy, priority)
	}
	r.heldMu.Unlock()
}

// Deferred returns how many requests of priority or higher the router's queue
// holds for the replica (Wait): those a request of that priority waits
// behind.
func (r *Replica) Deferred(priority int) int64 {
	r.heldMu.Lock()
	defer r.heldMu.Unlock()
	var n int64
	for p, c := range r.heldBy {
		if p >= priority {
			n += c
		}
	}
	return n
}

// Reserve keeps one of the replica's slots for a request the router's
// queue dispatched to it, until Unreserve: it counts toward Saturated as a
// request in flight does, so that no request arriving meanwhile takes it.
// Each Reserve needs one Unreserve.
func (r *Replica) Reserve() { r.reserved.Add(1) }

// Unreserve gives back a slot Reserve kept: the request it was kept for
// was sent (and counts in flight by itself), or left.
func (r *Replica) Unreserve() { r.reserved.Add(-1) }

// Observe records the replica's own load gauges. A report of requests
// waiting beside requests running teaches the replica's capacity: its
// engine ran that many and queued the next.
func (r *Replica) Observe(o Observed) {
	r.drainsSeen.Store(r.drains.Load())
	r.observed.Store(&o)
	if o.Waiting > 0 && o.Running > r.learned.Load() {
		r.learned.Store(o.Running)
	}
}

// Capacity returns how many requests the replica runs at once before its
// engine queues the next: Spec.MaxRunning when set, else the most it was
// seen running while it queued (vllm:num_requests_running beside a
// nonzero vllm:num_requests_waiting: --max-num-seqs once it has been
// reached; a KV cache that binds first is Saturated's other test), else 0:
// not known yet. The most, not the last: a router that keeps its engines
// from queueing would otherwise never see a larger count again.
func (r *Replica) Capacity() int64 {
	if r.maxRunning > 0 {
		return r.maxRunning
	}
	return r.learned.Load()
}

// SaturatedKV is the KV cache usage (vllm:kv_cache_usage_perc) at which a
// replica counts as saturated: its engine would queue, or preempt, the next
// request.
const SaturatedKV = 0.98

// Saturated reports whether the replica's engine would queue the next
// request sent to it now: its KV cache was SaturatedKV full at its last
// report and no request has finished there since (a gauge scraped seconds
// ago says nothing of the blocks freed since), or, when its
// Capacity is known, the requests in flight to it that its engine has not
// finished (this router's and, in a fleet, its peers') reach it; when it is
// not, the replica reports requests waiting. (A known capacity is read
// against the router's own counts, which change with every request, not
// against the waiting gauge, which is as old as the last scrape.) A
// replica of unknown capacity that reports nothing is not saturated.
func (r *Replica) Saturated() bool {
	if r.kvFull() {
		return true
	}
	if c := r.Capacity(); c > 0 {
		return r.engaged.Load()+r.reserved.Load() >= c
	}
	o := r.observed.Load()
	return o != nil && o.Waiting > 0
}

// kvFull reports whether the replica's KV cache was SaturatedKV full at
// its last report and no request has finished there since (a gauge
// scraped seconds ago says nothing of the blocks freed since).
func (r *Replica) kvFull() bool {
	o := r.observed.Load()
	return o != nil && o.KVUsage >= SaturatedKV && r.drains.Load() == r.drainsSeen.Load()
}

// Free returns how many more requests the replica's engine would run now
// without queueing (Capacity less the requests in flight to it and the
// slots kept, none while its KV cache is full as Saturated reads it), and
// whether that is known: not while its capacity is not.
func (r *Replica) Free() (free int64, known bool) {
	c := r.Capacity()
	if c <= 0 {
		return 0, false
	}
	if r.kvFull() {
		return 0, true
	}
	return max(0, c-r.engaged.Load()-r.reserved.Load()), true
}

// decayed returns the recent-work counter at now.
func (r *Replica) decayed(now int64) float64 {
	rw := r.recent.Load()
	if r.halfLife <= 0 || rw == nil {
		return 0
	}
	dt := now - rw.at
	if dt <= 0 {
		return rw.tokens
	}
	return rw.tokens * math.Exp2(-float64(dt)/float64(r.halfLife))
}

// Load returns the replica's load at now.
func (r *Replica) Load(now time.Time) Load {
	var l Load
	r.LoadInto(&l, now.UnixNano())
	return l
}

// LoadInto sets *l to the replica's load at now (Unix nanoseconds): Load
// without a copy, for a decision that reads every replica's into its
// candidates.
func (r *Replica) LoadInto(l *Load, now int64) {
	l.InFlight = r.inFlight.Load()
	l.PendingTokens = float64(r.pending.Load()+r.waiting.Load()) / r.Weight
	l.ActiveTokens = float64(r.active.Load()) / r.Weight
	l.RecentTokens = r.decayed(now) / r.Weight
	l.Observed = Observed{}
	if o := r.observed.Load(); o != nil {
		l.Observed = *o
	}
}

// Available reports whether the replica may take traffic at now: it passes
// its active health checks, is not ejected, and is not draining; and, if
// timeouts ejected it (TimedOut) and it has not answered since, it has no
// request in flight: back from its cool-down it is tried by one request
// at a time, as a circuit breaker's half-open state, so that a replica
// still hung costs one request a cool-down, not every one sent to it
// until the next timeout.
func (r *Replica) Available(now time.Time) bool {
	return now.UnixNano() >= r.downUntil.Load() && !r.activeDown.Load() && !r.draining.Load() &&
		!(r.probe.Load() && r.engaged.Load() > 0)
}

// Up reports whether the replica is in rotation but for draining: it
// passes its active checks and is not ejected.
func (r *Replica) Up(now time.Time) bool {
	return now.UnixNano() >= r.downUntil.Load() && !r.activeDown.Load()
}

// Usable reports whether the replica may take a request when passive
// ejection has taken out every replica it could use: it passes its active
// health checks, is not draining, and is in rotation or out only for soft
// failures (Strike), which may have been the requests' own. A replica out
// for refused connections or 502/503 answers is not usable.
func (r *Replica) Usable(now time.Time) bool {
	return !r.activeDown.Load() && !r.draining.Load() &&
		(now.UnixNano() >= r.downUntil.Load() || r.softOut.Load())
}

// Healthy reports whether the replica passes its active health checks and
// is not ejected (whether or not it drains).
func (r *Replica) Healthy(now time.Time) bool {
	return now.UnixNano() >= r.downUntil.Load() && !r.activeDown.Load()
}

// Ejection tunes passive ejection. Zero fields take the defaults.
type Ejection struct {
	// Base is the first cool-down; each further ejection while the replica
	// keeps failing doubles it, up to Max. Defaults 2s and 60s.
	Base, Max time.Duration
	// Forgive: an ejection this long after the previous one's cool-down
	// ended starts again from Base. Default 30s.
	Forgive time.Duration
	// Soft failures (Strike: answers of 500 or 504, answers later than
	// the timeouts) may be the requests' own (vLLM answers 500 to some
	// inputs), so they eject a replica only on evidence from many
	// requests of more than one client, after Envoy's outlier detection:
	//
	//   - Consecutive soft failures with no success between (default 5,
	//     Envoy's consecutive_5xx default);
	//   - over the current and the previous Interval (default 10s, Envoy's
	//     interval), at least MinVolume answers (default 20; Envoy's
	//     failure_percentage_request_volume is 50 per interval, a volume
	//     a replica at low traffic seldom has), of which at least
	//     FailureShare percent failed (default 50; Envoy's
	//     failure_percentage_threshold is 85, where the two detectors eject
	//     independently, not both required as here);
	//   - those failures came from at least MinSources distinct clients
	//     (default 2, at most MaxEjectSources; Envoy has no such rule).
	//
	// So one client sending any number of requests that make a replica
	// answer 500 cannot take it out; a replica failing most answers to
	// several clients is. Behind a proxy that hides the clients'
	// addresses every request has one source: set MinSources to 1.
	Consecutive  int
	MinVolume    int
	FailureShare int
	MinSources   int
	Interval     time.Duration
	// Timeouts: this many timeouts (TimedOut: no answer within a bound
	// set from the request's own work, as a prefill's is) with no
	// success between eject the replica, whatever the traffic and
	// however many clients sent them: such a bound is the replica's to
	// keep, and at low traffic the evidence Strike weighs never comes.
	// Until the replica answers again, one more timeout ejects it again
	// (for twice as long), so a hung replica back from its cool-down
	// costs one request, not Timeouts more. Default 3
	// (DefaultEjectTimeouts).
	Timeouts int
}

// Defaults of Ejection and of a pool's load half-life.
const (
	DefaultEjectBase     = 2 * time.Second
	DefaultEjectMax      = time.Minute
	DefaultEjectForgive  = 30 * time.Second
	DefaultEjectStrikes  = 5
	DefaultEjectVolume   = 20
	DefaultEjectShare    = 50
	DefaultEjectWindow   = 10 * time.Second
	DefaultEjectSources  = 2
	DefaultEjectTimeouts = 3
	DefaultHalfLife      = 10 * time.Second
)

// MaxEjectSources bounds Ejection.MinSources: the distinct sources of soft
// failures a replica remembers per interval.
const MaxEjectSources = 8

func (e *Ejection) defaults() {
	e.Base = cmp.Or(max(e.Base, 0), DefaultEjectBase)
	e.Max = cmp.Or(max(e.Max, 0), DefaultEjectMax)
	e.Forgive = cmp.Or(max(e.Forgive, 0), DefaultEjectForgive)
	e.Consecutive = cmp.Or(max(e.Consecutive, 0), DefaultEjectStrikes)
	e.MinVolume = cmp.Or(max(e.MinVolume, 0), DefaultEjectVolume)
	e.FailureShare = cmp.Or(min(max(e.FailureShare, 0), 100), DefaultEjectShare)
	e.MinSources = cmp.Or(min(max(e.MinSources, 0), MaxEjectSources), DefaultEjectSources)
	e.Interval = cmp.Or(max(e.Interval, 0), DefaultEjectWindow)
	e.Timeouts = cmp.Or(max(e.Timeouts, 0), DefaultEjectTimeouts)
}

// Strike records a soft failure at now of a request from source: one that
// may be the request's own rather than the replica's (vLLM answers 500 to
// some inputs; a long prompt on a busy replica may outlast a timeout).
// source is a key of the request's client (its address; 0 where not
// known, which counts as one source). It ejects the replica (Fail, but
// Usable) only on the evidence Ejection describes: e.Consecutive of them
// with no success between, among at least e.MinVolume recent answers of
// which e.FailureShare percent failed, from at least e.MinSources
// sources; or, whatever the evidence, once e.Timeouts timeouts (TimedOut)
// came with no success between. It returns the cool-down, or 0 if the
// replica was not ejected by it.
func (r *Replica) Strike(now time.Time, e Ejection, source uint64) time.Duration {
	e.defaults()
	r.omu.Lock()
	total, fails, srcs := r.outcome.add(now.UnixNano(), e.Interval, true, source)
	r.omu.Unlock()
	n := r.strikes.Add(1)
	timedOut := r.timeouts.Load() >= int64(e.Timeouts)
	if !timedOut && (n < int64(e.Consecutive) || total < e.MinVolume || 100*fails < e.FailureShare*total || srcs < e.MinSources) {
		return 0
	}
	r.strikes.Store(0)
	if timedOut {
		r.probe.Store(true)
	}
	return r.fail(now, e, true)
}

// TimedOut counts a request that got no answer within a bound set from
// its own work (a prefill's, from the tokens of its prompt the replica
// had to compute: limits.Timeouts.Prefill), so that the replica, not the
// request, is at fault: hung, or far behind. It ejects nothing itself:
// the Strike that records the failure next (routing.Engine.Strike, which
// tells the fleet) ejects the replica once Ejection.Timeouts of them
// came with no success between, at any traffic. The count is not reset
// by the ejection: until the replica answers again, each further timeout
// ejects it again, and it takes one request at a time (Available).
func (r *Replica) TimedOut() { r.timeouts.Add(1) }

// Succeeded records an answer below 500 at now: the strikes and timeouts
// start again, and the answer counts in the volume Strike weighs.
func (r *Replica) Succeeded(now time.Time, e Ejection) {
	e.defaults()
	r.omu.Lock()
	r.outcome.add(now.UnixNano(), e.Interval, false, 0)
	r.omu.Unlock()
	if r.strikes.Load() != 0 {
		r.strikes.Store(0)
	}
	if r.timeouts.Load() != 0 {
		r.timeouts.Store(0)
	}
	if r.probe.Load() {
		r.probe.Store(false)
	}
}

// Fail records a hard passive failure at now (the connection refused or
// reset, a 502 or 503 answer): the replica is ejected for a cool-down that doubles with every
// ejection while it keeps failing, so a replica that flaps does not take
// traffic on every flip. A failure during the cool-down changes nothing. It
// returns the cool-down, or 0 if the replica was already ejected.
func (r *Replica) Fail(now time.Time, e Ejection) time.Duration {
	return r.fail(now, e, false)
}

func (r *Replica) fail(now time.Time, e Ejection, soft bool) time.Duration {
	e.defaults()
	r.hmu.Lock()
	defer r.hmu.Unlock()
	if now.UnixNano() < r.downUntil.Load() {
		if !soft { // out for soft failures, now a hard one: no longer usable in a panic
			r.softOut.Store(false)
		}
		return 0
	}
	prevEnd := time.Unix(0, r.downUntil.Load())
	if r.ejections > 0 && now.Sub(prevEnd) > e.Forgive {
		r.ejections = 0
	}
	cool := e.Base << min(r.ejections, 20)
	if cool > e.Max || cool <= 0 {
		cool = e.Max
	}
	r.ejections++
	r.softOut.Store(soft)
	r.downUntil.Store(now.Add(cool).UnixNano())
	return cool
}

// Eject takes the replica out of rotation until at least until, as
// another router of the fleet ejected it (package cluster). It is not an
// ejection of this router's: the cool-down of the next Fail is unchanged.
func (r *Replica) Eject(until time.Time) {
	r.hmu.Lock()
	defer r.hmu.Unlock()
	if u := until.UnixNano(); u > r.downUntil.Load() {
		r.downUntil.Store(u)
	}
}

// Checked records an active health check's result: fall consecutive
// failures mark the replica down, rise consecutive successes mark it up.
// It reports whether the replica's state changed.
func (r *Replica) Checked(ok bool, fall, rise int) bool {
	r.hmu.Lock()
	defer r.hmu.Unlock()
	if ok {
		r.oks++
		r.fails = 0
		if r.activeDown.Load() && r.oks >= rise {
			r.activeDown.Store(false)
			return true
		}
		return false
	}
	r.fails++
	r.oks = 0
	if !r.activeDown.Load() && r.fails >= fall {
		r.activeDown.Store(true)
		return true
	}
	return false
}

// Drain stops new traffic to the replica; requests in flight finish.
func (r *Replica) Drain() { r.draining.Store(true) }

// Undrain lets a drained replica take new traffic again.
func (r *Replica) Undrain() { r.draining.Store(false) }

// PublicURL returns the replica's base URL without its user information:
// the form to show, log or export, never carrying credentials.
func (r *Replica) PublicURL() string { return PublicURL(r.URL) }

// PublicURL returns u without its user information.
func PublicURL(u *url.URL) string {
	c := *u
	c.User = nil
	return c.String()
}

// Draining reports whether the replica is draining.
func (r *Replica) Draining() bool { return r.draining.Load() }

// Budget returns the replica's KV cache in tokens; 0 means unknown.
func (r *Replica) Budget() int64 { return r.budget.Load() }

// SetBudget sets a budget learned after the replica joined.
func (r *Replica) SetBudget(tokens int64) { r.budget.Store(tokens) }

// Options configure a Pool. The zero value is usable.
type Options struct {
	// HalfLife of the recent-work load signal (the router's default is
	// DefaultHalfLife). Zero disables it, leaving only in-flight work.
	HalfLife time.Duration
}

// Pool is a set of replicas.
type Pool struct {
	opts Options
	snap atomic.Pointer[[]*Replica]
	// prefills counts the replicas of role prefill in snap (publish), so
	// that a request asks whether there are any without a scan.
	prefills atomic.Int32
	mu       sync.Mutex // serialises writers (Add, Remove)
}

// publish makes rs the pool's replicas. p.mu is held, or p is not shared
// yet.
func (p *Pool) publish(rs []*Replica) {
	var n int32
	for _, r := range rs {
		if r.Role.Prefills() {
			n++
		}
	}
	p.prefills.Store(n)
	p.snap.Store(&rs)
}

// HasPrefill reports whether some replica of the pool has role prefill
// (disaggregation is on).
func (p *Pool) HasPrefill() bool { return p.prefills.Load() > 0 }

// NewPool returns a pool of the given replicas. join is called with each
// replica before it is published and returns its cache-model id.
func NewPool(specs []Spec, o Options, join func(Spec) (int, error)) (*Pool, error) {
	p := &Pool{opts: o}
	var rs []*Replica
	seen := map[string]bool{}
	for i, s := range specs {
		r, err := p.build(s)
		if err != nil {
			return nil, fmt.Errorf("replicas[%d]: %w", i, err)
		}
		if seen[r.Name] {
			return nil, fmt.Errorf("replicas[%d]: duplicate name %q", i, r.Name)
		}
		seen[r.Name] = true
		if r.ID, err = join(s); err != nil {
			return nil, fmt.Errorf("replicas[%d]: %w", i, err)
		}
		rs = append(rs, r)
	}
	p.publish(rs)
	return p, nil
}

// Bounds of a Spec, checked by Validate. MaxBudgetTokens (2^40, a
// trillion tokens) also bounds a budget a replica reports.
const (
	MaxBudgetTokens = 1 << 40
	MaxNameBytes    = 128      // a replica name's length
	MinWeight       = 1.0 / 64 // a replica's weight, when not 0 (meaning 1)
	MaxWeight       = 64.0
)

// ValidateName checks a replica name: 1 to MaxNameBytes printable ASCII
// characters other than space (it is a metric label and a header value).
func ValidateName(name string) error {
	if name == "" {
		return errors.New("is required")
	}
	if len(name) > MaxNameBytes {
		return fmt.Errorf("is %d bytes, more than %d", len(name), MaxNameBytes)
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("%q has a character other than printable ASCII", name)
		}
	}
	return nil
}

// ValidateWeight checks a replica weight: 0 (meaning 1) or in [MinWeight,
// MaxWeight].
func ValidateWeight(w float64) error {
	if w != 0 && !(w >= MinWeight && w <= MaxWeight) { // also NaN
		return fmt.Errorf("%v is not 0 or in [%v, %v]", w, MinWeight, MaxWeight)
	}
	return nil
}

// ParseURL parses a replica's base URL: http or https with a host, and no
// query or fragment. Errors never quote user information.
func ParseURL(raw string) (*url.URL, error) {
	if raw != "" && !strings.Contains(raw, "://") {
		// host:port alone: url.Parse would say "first path segment in URL
		// cannot contain colon". Not echoed: it may hold credentials.
		return nil, errors.New("no scheme: write it as http://host:port (or https://)")
	}
	u, err := url.Parse(raw)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // without the URL, which may carry credentials
		}
		return nil, err
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("%q: want http(s)://host[:port][/path]", PublicURL(u))
	}
	return u, nil
}

// Validate checks a spec: its name, URL (see ParseURL), budget and weight.
// It returns the parsed URL.
func (s Spec) Validate() (*url.URL, error) {
	if err := ValidateName(s.Name); err != nil {
		return nil, fmt.Errorf("name %w", err)
	}
	u, err := ParseURL(s.URL)
	if err != nil {
		return nil, fmt.Errorf("url: %w", err)
	}
	if s.BudgetTokens < 0 || s.BudgetTokens > MaxBudgetTokens {
		return nil, fmt.Errorf("budget_tokens %d is not in [0, %d]", s.BudgetTokens, int64(MaxBudgetTokens))
	}
	if err := ValidateWeight(s.Weight); err != nil {
		return nil, fmt.Errorf("weight %w", err)
	}
	if err := CheckDataParallelSize(s.DataParallel.Size); err != nil {
		return nil, fmt.Errorf("data_parallel_size %w", err)
	}
	if d := s.DataParallel; d.Rank < 0 || (d.On() && d.Rank >= d.Size) {
		return nil, fmt.Errorf("data-parallel rank %d is not in [0, %d)", d.Rank, max(d.Size, 1))
	}
	return u, nil
}

func (p *Pool) build(s Spec) (*Replica, error) {
	u, err := s.Validate()
	if err != nil {
		return nil, err
	}
	if s.Weight == 0 {
		s.Weight = 1
	}
	if err := s.Reuse.Check(); err != nil {
		return nil, fmt.Errorf("replica %s: %w", s.Name, err)
	}
	if s.MaxRunning < 0 {
		return nil, fmt.Errorf("replica %s: negative max_running %d", s.Name, s.MaxRunning)
	}
	if err := s.Role.Check(); err != nil {
		return nil, fmt.Errorf("replica %s: %w", s.Name, err)
	}
	role := s.Role
	if role == "both" {
		role = RoleBoth
	}
	if err := s.Scheduling.Check(); err != nil {
		return nil, fmt.Errorf("replica %s: %w", s.Name, err)
	}
	sched := s.Scheduling
	if sched == "fcfs" {
		sched = SchedulingFCFS
	}
	r := &Replica{Name: s.Name, URL: u, Weight: s.Weight, Reuse: s.Reuse, Role: role, Scheduling: sched, DataParallel: s.DataParallel, halfLife: p.opts.HalfLife, maxRunning: s.MaxRunning}
	r.budget.Store(s.BudgetTokens)
	return r, nil
}

// Replicas returns the current members. The slice is shared and must not be
// modified.
func (p *Pool) Replicas() []*Replica { return *p.snap.Load() }

// Add adds a replica; join returns its cache-model id.
func (p *Pool) Add(s Spec, join func(Spec) (int, error)) (*Replica, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r, err := p.build(s)
	if err != nil {
		return nil, err
	}
	cur := p.Replicas()
	for _, x := range cur {
		if x.Name == r.Name {
			return nil, fmt.Errorf("replica %q already exists", r.Name)
		}
	}
	if r.ID, err = join(s); err != nil {
		return nil, err
	}
	next := append(append(make([]*Replica, 0, len(cur)+1), cur...), r)
	p.publish(next)
	return r, nil
}

// Remove takes the named replica out of the pool at once and returns it;
// requests in flight on it finish. Drain first to let traffic move off.
func (p *Pool) Remove(name string) (*Replica, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	cur := p.Replicas()
	for i, x := range cur {
		if x.Name == name {
			next := append(append(make([]*Replica, 0, len(cur)-1), cur[:i]...), cur[i+1:]...)
			p.publish(next)
			return x, true
		}
	}
	return nil, false
}

// Get returns the member named name.
func (p *Pool) Get(name string) (*Replica, bool) {
	for _, r := range p.Replicas() {
		if r.Name == name {
			return r, true
		}
	}
	return nil, false
}
