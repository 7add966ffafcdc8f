package replay

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"runtime"
	"sync"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/matcher"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/router"
	"github.com/semroute/semroute/routing"
)

// Result is what one policy (or reference) did with the trace.
type Result struct {
	Name               string  `json:"name"`
	Requests           int     `json:"requests"`
	PromptTokens       int64   `json:"prompt_tokens"`
	CachedTokens       int64   `json:"cached_tokens"`
	Blocks             int64   `json:"blocks"`
	HitBlocks          int64   `json:"hit_blocks"`
	TokenHitRate       float64 `json:"token_hit_rate"` // cached prompt tokens ÷ prompt tokens
	BlockHitRate       float64 `json:"block_hit_rate"`
	PrefillTokensSaved int64   `json:"prefill_tokens_saved"`
	TTFTMeanMS         float64 `json:"ttft_ms_mean"`
	TTFTP50MS          float64 `json:"ttft_ms_p50"`
	TTFTP90MS          float64 `json:"ttft_ms_p90"`
	TTFTP99MS          float64 `json:"ttft_ms_p99"`
	// LoadImbalance is the most-loaded replica's prefill tokens computed ÷
	// the mean over replicas (1 is perfect balance); over the prefill
	// replicas, disaggregated (Config.Roles).
	LoadImbalance float64 `json:"load_imbalance"`
	// PrefillComputed is each replica's prefill tokens computed.
	PrefillComputed []int64 `json:"prefill_computed_per_replica"`
	// PeakKV is each replica's most KV tokens held at once by the requests
	// it admitted (a replica admits a request only while they fit its
	// budget, unless it runs alone).
	PeakKV []int64 `json:"peak_kv_tokens_per_replica"`
	// KVWaits counts the requests that waited, first in their replica's
	// queue, for room in its KV cache: the engines were KV-bound.
	KVWaits     int     `json:"kv_waits,omitempty"`
	WallSeconds float64 `json:"wall_seconds"`
	// Changed counts, for a decision log, the requests this policy would
	// send to another replica than the live router did; ChangedShare is
	// their share.
	Changed      int     `json:"changed,omitempty"`
	ChangedShare float64 `json:"changed_share,omitempty"`

	// LoadOverTime[b][r] is the prefill tokens replica r started computing
	// in time slice b of the trace.
	LoadOverTime [][]float64 `json:"-"`
	// TTFTQuantiles holds the TTFT (ms) at each percentile 0..100.
	TTFTQuantiles []float64 `json:"-"`
	// Disaggregated counts the requests a prefill replica computed
	// (Config.Roles); TransferTokens the tokens of KV their decode
	// replicas pulled from it.
	Disaggregated  int   `json:"disaggregated,omitempty"`
	TransferTokens int64 `json:"transfer_tokens,omitempty"`
	// Prediction is set for a run with a picture mode (Run.Picture): the
	// cached tokens, above, are then the engines' own.
	Prediction *Prediction `json:"prediction,omitempty"`
	// Classes is what the run did on each replica class of a mixed fleet
	// (Config.Classes), in their order.
	Classes []ClassResult `json:"classes,omitempty"`
	rows    []row
}

// Prediction compares, request by request, the cached tokens the router's
// picture predicted on the replica it chose (the served candidate's
// Match.Tokens when it routed) with those the replica's engine found
// cached when it scheduled the prefill.
type Prediction struct {
	Picture         string `json:"picture"`
	PredictedTokens int64  `json:"predicted_cached_tokens"`
	ActualTokens    int64  `json:"actual_cached_tokens"`
	// Error is (Σ predicted − Σ actual) ÷ Σ actual: positive when the
	// picture promised more than the engines had. (A Σ actual of 0 counts
	// as 1.)
	Error float64 `json:"relative_error"`
	// MeanAbsError is the mean over requests of |predicted − actual|,
	// divided by the mean actual: errors of both signs add up here.
	MeanAbsError float64 `json:"mean_abs_error"`
	// Over and Under count the requests predicted above and below what the
	// engine found.
	Over  int `json:"requests_over"`
	Under int `json:"requests_under"`
	// EngineEvictions counts the blocks the engines evicted.
	EngineEvictions int64 `json:"engine_evicted_blocks"`
	// LostWaitingTokens and NotHeldTokens split the tokens of the prompt
	// blocks the picture predicted and the engine did not have when it
	// scheduled the prefill: those its engine held when the request was
	// routed and evicted while the request waited (for its turn, for KV
	// room), and those it did not hold then (the picture kept blocks the
	// engine had evicted, or counted blocks of a request routed before it
	// and not yet computed).
	LostWaitingTokens int64 `json:"lost_while_waiting_tokens"`
	NotHeldTokens     int64 `json:"not_held_when_routed_tokens"`
	// Orphans counts, in the events mode, the blocks an engine stored that
	// the picture could not chain: it had dropped their parent already.
	Orphans int64 `json:"event_orphan_blocks"`
	// PendingExpired counts, in the events mode, the routed blocks no
	// engine event confirmed within the picture's PendingTTL.
	PendingExpired int64 `json:"pending_expired_blocks"`
}

// predicted fills r.Prediction from each request's predicted and actual
// cached tokens.
func (r *Result) predicted(pred, actual []int) {
	p := &Prediction{}
	var abs int64
	for i := range pred {
		p.PredictedTokens += int64(pred[i])
		p.ActualTokens += int64(actual[i])
		if i < len(r.rows) {
			r.rows[i].predicted = pred[i]
		}
		d := int64(pred[i] - actual[i])
		switch {
		case d > 0:
			p.Over++
			abs += d
		case d < 0:
			p.Under++
			abs -= d
		}
	}
	den := float64(max(p.ActualTokens, 1))
	p.Error = float64(p.PredictedTokens-p.ActualTokens) / den
	p.MeanAbsError = float64(abs) / den // Σ|d|/n ÷ Σa/n
	r.Prediction = p
}

type row struct {
	arrivalMS    float64
	replica      int
	prefill      int // its prefill replica, disaggregated; else -1
	promptTokens int
	cachedTokens int
	ttftMS       float64
	predicted    int
	kvWaited     bool
}

// pool, when not nil, says which replicas the load imbalance is measured
// over (the prefill replicas, disaggregated).
func (r *Result) finish(ttft []float64, reps []simReplica, pool func(int) bool, rep, pre, cached []int, reqs []Request) {
	if r.PromptTokens > 0 {
		r.TokenHitRate = float64(r.CachedTokens) / float64(r.PromptTokens)
	}
	if r.Requests > 0 {
		r.ChangedShare = float64(r.Changed) / float64(r.Requests)
	}
	if r.Blocks > 0 {
		r.BlockHitRate = float64(r.HitBlocks) / float64(r.Blocks)
	}
	r.PrefillTokensSaved = r.CachedTokens
	sorted := sortedCopy(ttft)
	sum := 0.0
	for _, x := range ttft {
		sum += x
	}
	if len(ttft) > 0 {
		r.TTFTMeanMS = sum / float64(len(ttft))
	}
	r.TTFTP50MS, r.TTFTP90MS, r.TTFTP99MS = percentile(sorted, 0.5), percentile(sorted, 0.9), percentile(sorted, 0.99)
	r.TTFTQuantiles = make([]float64, 101)
	for p := range r.TTFTQuantiles {
		r.TTFTQuantiles[p] = percentile(sorted, float64(p)/100)
	}
	var total, most int64
	n := 0
	for k, st := range reps {
		r.PrefillComputed = append(r.PrefillComputed, st.computed)
		r.PeakKV = append(r.PeakKV, st.peak)
		if pool != nil && !pool(k) {
			continue
		}
		n++
		total += st.computed
		most = max(most, st.computed)
	}
	if total > 0 {
		r.LoadImbalance = float64(most) / (float64(total) / float64(n))
	}
	r.rows = make([]row, len(reqs))
	for i := range reqs {
		r.rows[i] = row{arrivalMS: float64(reqs[i].Arrival) / 1e6, replica: rep[i], prefill: pre[i], promptTokens: reqs[i].Tokens, cachedTokens: cached[i], ttftMS: ttft[i]}
	}
}

// Summary is a whole replay: the trace, the model, every policy's result and
// the two references.
type Summary struct {
	Trace    string `json:"trace"`
	Format   string `json:"format"`
	Requests int    `json:"requests"`
	// TiedArrivals is the requests arriving in the same millisecond as
	// the one before them, in the trace as read (Ties).
	TiedArrivals int          `json:"tied_arrivals"`
	Replicas     int          `json:"replicas"`
	ReplicaNames []string     `json:"replica_names,omitempty"` // as Config.ReplicaNames
	BudgetTokens int64        `json:"budget_tokens"`
	Model        ModelSummary `json:"model"`
	Policies     []*Result    `json:"policies"`
	Pooled       *Result      `json:"pooled"`
	Infinite     *Result      `json:"infinite"`
	WallSeconds  float64      `json:"wall_seconds"`
	Extra        []*Result    `json:"extra,omitempty"` // ablations and variants
	// Arms holds, for a decision log, what each live arm observed.
	Arms    []ArmStats    `json:"arms,omitempty"`
	Started time.Time     `json:"-"`
	Elapsed time.Duration `json:"-"`
}

// ModelSummary records the replica model's parameters.
type ModelSummary struct {
	BlockTokens       int            `json:"block_tokens"`
	MaxRunning        int            `json:"max_running"`
	PrefillOverheadMS float64        `json:"prefill_overhead_ms"`
	PrefillPerTokenUS float64        `json:"prefill_per_token_us"`
	InterTokenMS      float64        `json:"inter_token_ms"`
	Eviction          string         `json:"eviction"`
	EvictionParams    map[string]any `json:"eviction_params,omitempty"`
	Speedup           float64        `json:"speedup"`
	SpreadTiesMS      float64        `json:"spread_ties_ms,omitempty"`
	RecordReplies     bool           `json:"record_replies"`
	SharedActive      bool           `json:"shared_active"`
	Seed              uint64         `json:"seed"`
	Matcher           bool           `json:"semantic_matcher"`
	// Reuse is the engines' reuse beyond the exact prefix (Config.Reuse:
	// "blend" or "donor"); empty for exact-prefix engines.
	Reuse string `json:"reuse,omitempty"`
	// Disaggregation, when some replica prefills (Config.Roles).
	Disaggregation *PDSummary `json:"disaggregation,omitempty"`
	// Fleet is the replica classes of a mixed fleet (Config.Classes),
	// in replica order; the fields above are then what a class that
	// sets none of its own takes.
	Fleet []ClassSummary `json:"fleet,omitempty"`
}

// PDSummary records a disaggregated model's parameters.
type PDSummary struct {
	PrefillReplicas    int     `json:"prefill_replicas"`
	DecodeReplicas     int     `json:"decode_replicas"` // including role both
	TransferLatencyMS  float64 `json:"transfer_latency_ms"`
	TransferPerTokenUS float64 `json:"transfer_per_token_us"`
	MinPrefillTokens   int     `json:"min_prefill_tokens"`
}

// Run is one policy to replay: a routing policy by name, with the model's
// parameters for it (Config.Params) unless Params is set, and kind weights
// unless Weights is set. Label names it in the report (default: Policy).
type Run struct {
	Label   string
	Policy  string
	Params  routing.Params
	Weights *cachemodel.Weights
	Matcher bool
	// Picture is how the router's cache picture learns what the engines
	// hold: PictureApproximate, PictureFeedback or PictureEvents; "" is
	// PictureFeedback, the live router's default for engines without KV
	// events. Every replica's engine cache is simulated apart from the
	// picture (engineCaches), as vLLM's scheduler runs it: a request runs
	// only when its blocks fit beside those of the requests running, so an
	// engine never holds more than its budget. Cached tokens, hit rates and
	// prefill times are the engines', and Result.Prediction measures the
	// picture's error.
	Picture string
	// Routers > 1 sends each request to one of that many routers at
	// random, as a Kubernetes Service would, each with its own picture and
	// load; Sync says whether they share them (SyncNone or SyncShared,
	// applied SyncDelay after the fact).
	Routers   int
	Sync      string
	SyncDelay time.Duration
	// FlowControl holds in the router's queue (package flow) a request
	// whose replica would queue it, and decides it again when a slot is
	// free for it, as the live router does with flow_control.enabled; one
	// router only.
	FlowControl bool
}

// Replay runs every run over reqs under model m, in parallel, plus the
// pooled and infinite references, and returns the summary. Runs are
// independent and deterministic.
func Replay(reqs []Request, m Config, runs []Run) (*Summary, error) {
	if err := m.defaults(); err != nil {
		return nil, err
	}
	start := time.Now()
	ties := Ties(reqs)
	reqs = SpreadTies(reqs, m.SpreadTies)
	sum := m.summary(len(reqs), ties, start)
	if err := checkRuns(reqs, &m, runs); err != nil {
		return nil, err
	}
	type job struct {
		i   int
		run func() (*Result, error)
	}
	var jobs []job
	results := make([]*Result, len(runs)+2)
	for i, r := range runs {
		jobs = append(jobs, job{i, func() (*Result, error) { return runPolicy(reqs, &m, r) }})
	}
	jobs = append(jobs,
		job{len(runs), func() (*Result, error) { return runReference(reqs, &m, "pooled", m.totalBudget()) }},
		job{len(runs) + 1, func() (*Result, error) { return runReference(reqs, &m, "infinite", 0) }})
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
		work  = make(chan job)
	)
	for w := 0; w < runtime.GOMAXPROCS(0); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range work {
				t0 := time.Now()
				res, err := j.run()
				if err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					continue
				}
				res.WallSeconds = time.Since(t0).Seconds()
				results[j.i] = res
			}
		}()
	}
	for _, j := range jobs {
		work <- j
	}
	close(work)
	wg.Wait()
	if first != nil {
		return nil, first
	}
	sum.Policies = results[:len(runs)]
	sum.Pooled, sum.Infinite = results[len(runs)], results[len(runs)+1]
	sum.Elapsed = time.Since(start)
	sum.WallSeconds = sum.Elapsed.Seconds()
	return sum, nil
}

// summary begins the summary of a replay of n requests, ties of them
// tied in arrival, under model m, started at start.
func (m *Config) summary(n, ties int, start time.Time) *Summary {
	sum := &Summary{
		Requests: n, TiedArrivals: ties, Replicas: m.Replicas, BudgetTokens: m.BudgetTokens, Started: start,
		ReplicaNames: m.ReplicaNames,
		Model: ModelSummary{
			BlockTokens: m.BlockTokens, MaxRunning: m.MaxRunning,
			PrefillOverheadMS: float64(m.PrefillOverhead) / 1e6, PrefillPerTokenUS: float64(m.PrefillPerToken) / 1e3,
			InterTokenMS: float64(m.InterToken) / 1e6, Eviction: m.Eviction, EvictionParams: m.EvictionParams, Speedup: m.Speedup, SpreadTiesMS: float64(m.SpreadTies) / 1e6,
			RecordReplies: m.RecordReplies, SharedActive: m.SharedActive, Seed: m.Seed, Matcher: m.Matcher != nil,
			Fleet: m.fleetSummary(),
		},
	}
	if m.Reuse.Blend() || m.Reuse.Donor() {
		sum.Model.Reuse = m.Reuse.Mode
	}
	if m.disaggregated() {
		pd := &PDSummary{TransferLatencyMS: float64(m.TransferLatency) / 1e6, TransferPerTokenUS: float64(m.TransferPerToken) / 1e3,
			MinPrefillTokens: cmp.Or(m.MinPrefillTokens, DefaultMinPrefillTokens)}
		for r := range m.Replicas {
			if m.prefills(r) {
				pd.PrefillReplicas++
			} else {
				pd.DecodeReplicas++
			}
		}
		sum.Model.Disaggregation = pd
	}
	return sum
}

// checkRuns checks that runs can replay reqs under model m.
func checkRuns(reqs []Request, m *Config, runs []Run) error {
	if m.disaggregated() {
		for i := range reqs {
			if reqs[i].Logged != nil {
				return errors.New("a decision log is replayed aggregated: set no replica roles")
			}
		}
	}
	for _, r := range runs {
		if err := checkPicture(r.Picture); err != nil {
			return fmt.Errorf("run %s: %w", cmp.Or(r.Label, r.Policy), err)
		}
		if err := checkSync(r); err != nil {
			return fmt.Errorf("run %s: %w", cmp.Or(r.Label, r.Policy), err)
		}
	}
	return nil
}

func runPolicy(reqs []Request, m *Config, run Run) (*Result, error) {
	label := cmp.Or(run.Label, run.Policy)
	mode := cmp.Or(run.Picture, PictureFeedback)
	var clock int64
	rs, err := newRouters(reqs, m, run, &clock)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", label, err)
	}
	var d decider = rs[0]
	var fleet *fleetDecider
	if len(rs) > 1 {
		fleet = newFleet(rs, len(reqs), m.Seed, run, &clock)
		d = fleet
	}
	s := &sim{m: m, reqs: reqs, d: d, res: &Result{Name: label}}
	var pools []*replica.Pool
	for _, r := range rs {
		pools = append(pools, r.pool)
	}
	if s.engines, err = newEngineCaches(m, m.budgets()); err != nil {
		return nil, err
	}
	if mode == PictureEvents { // the engines' caches reach the pictures as KV events would
		s.engines.sink = rs[0]
		if fleet != nil {
			s.engines.sink = fleet
		}
		for _, x := range rs {
			for _, r := range x.pool.Replicas() {
				x.pic.SetEventDriven(r.ID, true)
			}
		}
	}
	if err := s.run(pools...); err != nil {
		return nil, fmt.Errorf("%s: %w", label, err)
	}
	if p := s.res.Prediction; p != nil {
		p.Picture = mode
		for _, x := range rs {
			x.predicted(p)
		}
	}
	return s.res, nil
}

// newRouters builds a run's routers (Run.Routers, at least one), on the
// shared clock.
func newRouters(reqs []Request, m *Config, run Run, clock *int64) ([]*engineDecider, error) {
	routers := max(run.Routers, 1)
	switch {
	case m.disaggregated() && (run.FlowControl || routers > 1):
		return nil, errors.New("disaggregation is replayed with one router and no flow control")
	case run.FlowControl && routers > 1:
		return nil, fmt.Errorf("flow control with %d routers: one router only", routers)
	}
	rs := make([]*engineDecider, routers)
	for k := range rs {
		d, err := newEngineDecider(reqs, m, run, clock)
		if err != nil {
			return nil, err
		}
		rs[k] = d
	}
	return rs, nil
}

// newFleet makes routers rs one fleet for n requests: each request goes
// to one picked at random, and with Run.Sync shared they tell each other
// what they decide after Run.SyncDelay.
func newFleet(rs []*engineDecider, n int, seed uint64, run Run, clock *int64) *fleetDecider {
	fleet := &fleetDecider{rs: rs, of: make([]int, n), rng: rand.New(rand.NewPCG(seed, uint64(len(rs))))}
	if run.Sync == SyncShared {
		fleet.sync = &fleetSync{rs: rs, delay: run.SyncDelay.Nanoseconds(), works: make([]map[uint64]*routing.Lease, len(rs))}
		for k, r := range rs {
			fleet.sync.works[k] = map[uint64]*routing.Lease{}
			r.eng.SetSync(&sender{s: fleet.sync, from: k, now: clock})
		}
	}
	return fleet
}

// budgets returns each replica's KV cache in tokens: its class's, its
// own (Config.Budgets) or the config's for all.
func (m *Config) budgets() []int64 {
	budgets := make([]int64, m.Replicas)
	for i := range budgets {
		budgets[i] = m.fleet[i].budget
	}
	return budgets
}

// totalBudget is the fleet's KV cache in tokens: the pooled reference's
// one cache.
func (m *Config) totalBudget() int64 {
	var total int64
	for _, e := range m.fleet {
		total += e.budget
	}
	return total
}

// predicted adds to p what router e's picture counted: the stored blocks
// whose parent it had lost, the pending blocks that expired.
func (e *engineDecider) predicted(p *Prediction) {
	p.Orphans += e.orphans
	for _, r := range e.pool.Replicas() {
		if st, ok := e.pic.Stats(r.ID); ok {
			p.PendingExpired += st.PendingExpired
		}
	}
}

// newEngineDecider builds one router of a run: its engine, picture and
// replica pool on the shared clock, and the live router's core over them
// running the run's policy.
func newEngineDecider(reqs []Request, m *Config, run Run, clock *int64) (*engineDecider, error) {
	params := run.Params
	if p, ok := routing.LookupPolicy(run.Policy); ok && params == nil {
		params = m.Params[p.Name]
	}
	pol, err := routing.NewSeededPolicy(routing.PolicySpec{Type: run.Policy, Params: params}, m.Seed)
	if err != nil {
		return nil, err
	}
	evict, err := m.evictionPolicy()
	if err != nil {
		return nil, err
	}
	index, err := m.routerMatcher(run)
	if err != nil {
		return nil, err
	}
	eng, err := routing.New(routing.Options{
		Replicas: m.specs(), LoadHalfLife: m.LoadHalfLife, Eviction: evict, Split: blockhash.Options{BlockTokens: m.BlockTokens},
		Engine: routing.EngineOptions{Weights: cmp.Or(run.Weights, m.Weights), Attempts: 1,
			Now: func() time.Time { return time.Unix(0, *clock) }, SharedActive: m.SharedActive,
			Matcher: index, PreferDonor: run.Matcher, PreferSimilarity: matcher.DefaultMinSimilarity, MatcherThreshold: m.MatcherThreshold},
	})
	if err != nil {
		return nil, err
	}
	d := &engineDecider{m: m, reqs: reqs, eng: eng, pic: eng.Picture(), pool: eng.Pool(), clock: clock,
		ps: make([]*router.Placement, len(reqs)), cached: make([]int, len(reqs)), picture: cmp.Or(run.Picture, PictureFeedback),
		deferred: map[*router.Deferral]int{}, deferral: map[int]*router.Deferral{}}
	co := router.CoreOptions{Engine: eng, Arms: []router.Arm{{Name: "replay", Policy: pol, Weight: 1}},
		PD: router.PDOptions{MinPrefillTokens: m.MinPrefillTokens}}
	if run.FlowControl { // as bounded as the trace needs: a request waits as long as it must
		co.Flow = &flow.Options[*replica.Replica]{MaxRequests: math.MaxInt32, MaxBytes: math.MaxInt64, TTL: math.MaxInt64}
		co.OnGrant = d.granted
	}
	if d.core, err = router.NewCore(co); err != nil {
		return nil, err
	}
	return d, nil
}

// routerMatcher returns a router's semantic index for run: its own donor
// index, apart from the engines', down to what they take (donor reuse),
// or the run's matcher; nil for none.
func (m *Config) routerMatcher(run Run) (routing.Matcher, error) {
	switch {
	case m.Reuse.Donor():
		return matcher.New(matcher.Options{MinSimilarity: min(m.Reuse.Similarity(), matcher.DefaultMinSimilarity)})
	case run.Matcher && m.Matcher != nil:
		return m.Matcher(), nil
	}
	return nil, nil
}

// specs returns the replicas a router of the run is told of. Each
// engine's running limit and budget are told, as an operator sets
// replicas[].max_running to vLLM's --max-num-seqs; its speed is not.
func (m *Config) specs() []replica.Spec {
	specs := make([]replica.Spec, m.Replicas)
	budgets := m.budgets()
	for i := range specs {
		specs[i] = replica.Spec{Name: fmt.Sprintf("replica-%d", i), URL: fmt.Sprintf("http://replica-%d.sim", i), BudgetTokens: budgets[i], Reuse: m.Reuse,
			MaxRunning: int64(m.fleet[i].maxRunning)}
		if i < len(m.Roles) {
			specs[i].Role = m.Roles[i]
		}
		if len(m.ReplicaNames) > 0 {
			specs[i].Name = m.ReplicaNames[i]
		}
	}
	return specs
}

func runReference(reqs []Request, m *Config, name string, budget int64) (*Result, error) {
	evict, err := m.evictionPolicy()
	if err != nil {
		return nil, err
	}
	cache := cachemodel.New(cachemodel.Options{Policy: evict})
	if _, err := cache.AddReplica(name, budget); err != nil {
		return nil, err
	}
	s := &sim{m: m, reqs: reqs, res: &Result{Name: name}}
	s.d = &pooledDecider{m: m, reqs: reqs, cache: cache, s: s}
	if err := s.run(); err != nil {
		return nil, err
	}
	return s.res, nil
}

// Ablations are the semantic policy with every kind weight 1, without the
// cost of a prefix's second copy (copy_weight 0: time to first token
// alone), and on the token formula of earlier releases (load_weight 0.1),
// to show what each part contributes; base is its parameters otherwise.
func Ablations(base routing.Params) []Run {
	with := func(p routing.Params) routing.Params {
		out := maps.Clone(base)
		if out == nil {
			out = routing.Params{}
		}
		maps.Copy(out, p)
		return out
	}
	return []Run{
		{Label: "semantic-unit-weights", Policy: "semantic", Params: base, Weights: cachemodel.UnitWeights()},
		{Label: "semantic-no-copy", Policy: "semantic", Params: with(routing.Params{"copy_weight": 0})},
		{Label: "semantic-tokens", Policy: "semantic", Params: with(routing.Params{"load_weight": 0.1})},
	}
}
