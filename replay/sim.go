package replay

import (
	"cmp"
	"container/heap"
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/eviction"
	"github.com/semroute/semroute/plugin"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/router"
	"github.com/semroute/semroute/routing"
)

// Config is the simulated fleet. Zero fields take the defaults.
type Config struct {
	Replicas     int   // default 8
	BudgetTokens int64 // KV cache per replica in tokens; default 1,000,000
	// Classes, when set, make the fleet mixed: the first class's Count
	// replicas come first, then the next class's, and so on; Replicas,
	// if set, must be their total. A class's zero fields take this
	// Config's MaxRunning, PrefillOverhead, PrefillPerToken, InterToken
	// and BudgetTokens. Routers are told each replica's budget and
	// running limit, not its speed: they learn that from its load.
	Classes []ReplicaClass
	// BlockTokens is the block size policies are told (Dynamo counts
	// blocks) and, for openai traces, the splitter's block size. Default 64;
	// the mooncake reader's blocks are 512 tokens.
	BlockTokens int
	// MaxRunning sequences per replica; more wait for a slot. Default 256
	// (vLLM's max_num_seqs).
	MaxRunning int
	// Prefill on a replica is one request at a time, first come first served:
	// PrefillOverhead + PrefillPerToken × uncached tokens. Defaults 5ms and
	// 100µs (about 10,000 prefill tokens/s, an 8B model on one A100).
	PrefillOverhead time.Duration
	PrefillPerToken time.Duration
	// InterToken: decode takes output tokens × InterToken after the first
	// token, alongside other requests' prefill. Default 20ms.
	InterToken time.Duration
	// Eviction is the replicas' eviction policy (eviction.New), with
	// EvictionParams. Default eviction.Default (vLLM's order).
	Eviction       string
	EvictionParams plugin.Params
	// Speedup divides every arrival time. Default 1.
	Speedup float64
	// SpreadTies spreads each run of requests that arrive in the same
	// millisecond evenly over this span, or up to the next run (SpreadTies),
	// as the arrivals of a trace whose timestamps were bucketed to it. 0
	// keeps them together; at most MaxSpreadTies.
	SpreadTies time.Duration
	// RecordReplies caches a reply's blocks on its replica when the request
	// finishes, where the trace shows the reply (openai traces).
	RecordReplies bool
	// SharedActive counts blocks shared by requests running at once on a
	// replica once in its KV load (engines with cascade attention).
	SharedActive bool
	// LoadHalfLife of the replicas' recent-work signal. Default 10s.
	LoadHalfLife time.Duration
	// Seed seeds the randomised policies and a fleet's spread of requests
	// over its routers; 0 draws one at random.
	Seed uint64
	// Params are each policy's parameters, by its registered name, for the
	// runs that set none of their own (Run.Params).
	Params map[string]routing.Params
	// Weights are the kind weights; nil means routing.DefaultWeights.
	Weights *cachemodel.Weights
	// Matcher, when not nil, makes a semantic matcher for each run.
	Matcher func() routing.Matcher
	// MatcherThreshold: see routing.EngineOptions. Default 0.5.
	MatcherThreshold float64
	// ReplicaNames and Budgets, when set, name the replicas and give each
	// its own budget (decision logs carry both); Replicas is then their
	// number.
	ReplicaNames []string
	Budgets      []int64
	// Reuse is every replica's engine capability (replica.Reuse): with
	// ReuseBlend, the engines reuse cached segments past the exact prefix
	// (an openai trace's blocks need segment keys: blockhash.Options.Segments).
	Reuse replica.Reuse
	// Roles, when set, is each replica's part in prefill/decode
	// disaggregation (replica.Role; one per replica). With a prefill
	// replica, each request is routed as the live router routes it
	// (router.Core.Place): a decode replica first, among the replicas
	// that decode; then, when that replica would compute at least
	// MinPrefillTokens of the prompt, a prefill replica among the
	// prefill replicas. That replica computes the prompt and keeps its
	// KV until the decode replica, once it admits the request as any
	// other, has pulled the blocks it did not hold: TransferLatency +
	// TransferPerToken × their tokens. The first token comes then; decode
	// follows as for any request. Logged requests (decision logs), flow
	// control and several routers are not replayed disaggregated.
	Roles []replica.Role
	// TransferLatency and TransferPerToken are a KV transfer's cost.
	// Defaults 1ms and 5µs: an 8B model's 128 KiB of KV per token
	// (Llama-3-8B: 32 layers × 8 KV heads × 128 × K and V × 2 bytes) over
	// about 25 GB/s of RDMA (NIXL).
	TransferLatency  time.Duration
	TransferPerToken time.Duration
	// MinPrefillTokens: a request whose decode replica would compute less
	// of its prompt than this goes to that replica alone (conditional
	// disaggregation, as router.PDOptions). 0: DefaultMinPrefillTokens;
	// negative: every request is disaggregated.
	MinPrefillTokens int

	fleet []engineModel // each replica's engine, set by defaults
}

// Defaults of Config.
const (
	DefaultReplicas        = 8
	DefaultBlockTokens     = 64
	DefaultMaxRunning      = 256
	DefaultBudgetTokens    = 1_000_000
	DefaultPrefillOverhead = 5 * time.Millisecond
	DefaultPrefillPerToken = 100 * time.Microsecond
	DefaultInterToken      = 20 * time.Millisecond
	// DefaultMinPrefillTokens is router.DefaultMinPrefillTokens.
	DefaultMinPrefillTokens = 256
	DefaultTransferLatency  = time.Millisecond
	DefaultTransferPerToken = 5 * time.Microsecond
)

// disaggregated reports whether some replica has role prefill.
func (m *Config) disaggregated() bool {
	for _, r := range m.Roles {
		if r.Prefills() {
			return true
		}
	}
	return false
}

// prefills reports whether replica r computes prompts for others.
func (m *Config) prefills(r int) bool { return r < len(m.Roles) && m.Roles[r].Prefills() }

// needsPrefill reports whether a request whose decode replica would
// compute uncached tokens of its prompt goes through a prefill replica.
func (m *Config) needsPrefill(uncached int) bool {
	min := cmp.Or(m.MinPrefillTokens, DefaultMinPrefillTokens)
	return min <= 0 || uncached >= min
}

func (m *Config) defaults() error {
	if len(m.ReplicaNames) > 0 {
		m.Replicas = len(m.ReplicaNames)
		if len(m.Budgets) != 0 && len(m.Budgets) != len(m.ReplicaNames) {
			return errors.New("replica budgets and names differ in number")
		}
	}
	m.BlockTokens = cmp.Or(m.BlockTokens, DefaultBlockTokens)
	m.MaxRunning = cmp.Or(m.MaxRunning, DefaultMaxRunning)
	m.BudgetTokens = cmp.Or(m.BudgetTokens, DefaultBudgetTokens)
	m.PrefillOverhead = cmp.Or(m.PrefillOverhead, DefaultPrefillOverhead)
	m.PrefillPerToken = cmp.Or(m.PrefillPerToken, DefaultPrefillPerToken)
	m.InterToken = cmp.Or(m.InterToken, DefaultInterToken)
	m.Eviction = cmp.Or(m.Eviction, eviction.Default)
	m.Speedup = cmp.Or(m.Speedup, 1)
	m.LoadHalfLife = cmp.Or(m.LoadHalfLife, replica.DefaultHalfLife)
	if err := m.resolveFleet(); err != nil {
		return err
	}
	if err := m.checkRanges(); err != nil {
		return err
	}
	if _, err := m.evictionPolicy(); err != nil {
		return err
	}
	if err := m.checkRoles(); err != nil {
		return err
	}
	return m.Reuse.Check()
}

// checkRanges checks the model's numbers once defaulted.
func (m *Config) checkRanges() error {
	switch {
	case m.Replicas < 1 || m.Replicas > 4096:
		return fmt.Errorf("replicas %d not in [1, 4096]", m.Replicas)
	case m.BudgetTokens < 0:
		return errors.New("budget tokens must not be negative")
	case m.MaxRunning < 1:
		return errors.New("max running must be positive")
	case m.PrefillOverhead < 0 || m.PrefillPerToken < 0 || m.InterToken < 0:
		return errors.New("model times must not be negative")
	case m.Speedup <= 0 || math.IsInf(m.Speedup, 0) || math.IsNaN(m.Speedup):
		return errors.New("speedup must be a positive number")
	case m.SpreadTies < 0 || m.SpreadTies > MaxSpreadTies:
		return fmt.Errorf("spread ties %v: want 0 to %v", m.SpreadTies, MaxSpreadTies)
	}
	return nil
}

// checkRoles checks Roles and sets the transfer's defaults when some
// replica prefills.
func (m *Config) checkRoles() error {
	if len(m.Roles) == 0 {
		return nil
	}
	if len(m.Roles) != m.Replicas {
		return fmt.Errorf("%d roles for %d replicas", len(m.Roles), m.Replicas)
	}
	decoders := 0
	for _, r := range m.Roles {
		if err := r.Check(); err != nil {
			return err
		}
		if r.Decodes() {
			decoders++
		}
	}
	if decoders == 0 {
		return errors.New("roles: no replica decodes")
	}
	m.TransferLatency = cmp.Or(m.TransferLatency, DefaultTransferLatency)
	m.TransferPerToken = cmp.Or(m.TransferPerToken, DefaultTransferPerToken)
	if m.TransferLatency < 0 || m.TransferPerToken < 0 {
		return errors.New("transfer times must not be negative")
	}
	return nil
}

// decider routes for a run: the engine for a policy, a shared cache for the
// references.
type decider interface {
	// decide routes request i arriving at now.
	decide(i int, now int64) (place, error)
	// prefillDone: request i's prefill ended at now, the engine having
	// found cached tokens of its prompt.
	prefillDone(i int, now int64, cached int)
	// transferred: disaggregated request i's KV reached its decode
	// replica at now, which sends its first token.
	transferred(i int, now int64)
	done(i int, now int64)
}

// place is where a request goes: rep decodes it and, unless pre is a
// replica (disaggregated), computes its prompt too; cached and blocks are
// the tokens and blocks the replica that computes the prompt had cached,
// as the router's picture predicted it when the run simulates the
// engines' caches apart.
type place struct {
	rep, pre       int
	cached, blocks int
}

// computes returns the replica that computes the prompt.
func (p place) computes() int {
	if p.pre >= 0 {
		return p.pre
	}
	return p.rep
}

// simReplica is one replica's queues.
type simReplica struct {
	running    int              // admitted: prefilling, waiting for prefill, or decoding
	kv         int64            // KV tokens the running requests' prompts hold: their distinct blocks
	peak       int64            // the most kv ever was
	held       map[uint64]int32 // running requests per prompt block (by hash) on this replica
	admitQ     []int            // waiting for a running slot and room in the KV cache
	prefillQ   []int            // admitted, waiting for the prefill server
	prefilling int              // request in prefill, or -1
	pulling    int              // admitted, their KV on its way from a prefill replica (Config.Roles)
	lent       int              // prefilled here, their KV held until their decode replica has it
	decoding   int
	computed   int64 // prefill tokens computed
}

type event struct {
	t    int64
	seq  int64
	kind int // evArrive, evPrefillDone, evFinish
	req  int
}

const (
	evArrive = iota
	evPrefillDone
	evFinish
	evDispatch // a request the router's queue held gets its turn
	evTransferDone
)

type events []event

func (e events) Len() int { return len(e) }
func (e events) Less(i, j int) bool {
	if e[i].t != e[j].t {
		return e[i].t < e[j].t
	}
	return e[i].seq < e[j].seq
}
func (e events) Swap(i, j int) { e[i], e[j] = e[j], e[i] }
func (e *events) Push(x any)   { *e = append(*e, x.(event)) }
func (e *events) Pop() any {
	old := *e
	x := old[len(old)-1]
	*e = old[:len(old)-1]
	return x
}

// buckets is how many time slices the load-over-time series has.
const buckets = 60

// sim is one run's discrete-event model.
type sim struct {
	m     *Config
	reqs  []Request
	d     decider
	reps  []simReplica
	q     events
	seq   int64
	span  int64 // last arrival, for bucketing
	res   *Result
	rep   []int // request → replica (its decode replica, disaggregated)
	pre   []int // request → its prefill replica, disaggregated; else -1
	cache []int // request → cached tokens on the replica that computed its prompt
	// engines, when set, are the engines' own caches (a picture mode):
	// cache then holds what they found, pred what the picture predicted.
	engines *engineCaches
	pred    []int
	// predBlocks and heldBlocks are, by request, the prompt blocks the
	// picture predicted cached on the replica computing its prompt, and
	// those its engine held when the request was routed (a picture mode).
	predBlocks, heldBlocks []int
	lostWaiting, notHeld   int64     // tokens: Prediction.LostWaitingTokens, NotHeldTokens
	ttft                   []float64 // request → time to first token: -arrival until its first token, then ns, then ms
	// kvWaited: request → whether it waited, first in its replica's
	// queue, for room in the KV cache (Result.KVWaits).
	kvWaited []bool
	pools    []*replica.Pool // the routers' replica pools (none for a reference), which observe the replicas' gauges
}

// serve has the engine of replica r schedule request i at now and counts
// the tokens and blocks it found cached.
func (s *sim) serve(i, r int, now int64) {
	tokens, blocks := s.engines.serve(s.pin(i, r), r, &s.reqs[i], now)
	s.missed(i, blocks)
	s.cache[i] = tokens
	s.res.CachedTokens += int64(tokens)
	s.res.HitBlocks += int64(blocks)
}

// missed sorts the prompt blocks the picture predicted for request i and
// its engine did not have, from found on, by whether the engine held them
// when the request was routed (Prediction.LostWaitingTokens,
// NotHeldTokens).
func (s *sim) missed(i, found int) {
	for j := found; j < s.predBlocks[i]; j++ {
		if j < s.heldBlocks[i] {
			s.lostWaiting += int64(s.reqs[i].Blocks[j].Tokens)
		} else {
			s.notHeld += int64(s.reqs[i].Blocks[j].Tokens)
		}
	}
}

// pin is the key of request i's blocks pinned in replica r's engine: i,
// or ^i on its prefill replica, where they stay pinned until its decode
// replica has them (disaggregated), while they are pinned there too.
func (s *sim) pin(i, r int) int {
	if s.pre[i] == r {
		return ^i
	}
	return i
}

func (s *sim) push(t int64, kind, req int) {
	s.seq++
	heap.Push(&s.q, event{t: t, seq: s.seq, kind: kind, req: req})
}

func (s *sim) observe(r int, now int64) {
	if len(s.pools) == 0 {
		return
	}
	st := &s.reps[r]
	running := int64(st.decoding)
	if st.prefilling >= 0 {
		running++
	}
	kv := 0.0
	if b := s.budget(r); b > 0 { // vllm:kv_cache_usage_perc: what the running requests hold
		kv = float64(st.kv) / float64(b)
	}
	// vLLM counts a request whose KV is on its way among the waiting.
	o := replica.Observed{Running: running, Waiting: int64(len(st.admitQ) + len(st.prefillQ) + st.pulling), KVUsage: kv}
	for _, p := range s.pools { // every router scrapes the replica alike
		p.Replicas()[r].Observe(o)
	}
}

func (s *sim) startPrefill(r int, now int64) {
	st := &s.reps[r]
	if st.prefilling >= 0 || len(st.prefillQ) == 0 {
		return
	}
	i := st.prefillQ[0]
	st.prefillQ = st.prefillQ[1:]
	st.prefilling = i
	if s.engines != nil {
		s.serve(i, r, now)
	}
	uncached := int64(s.reqs[i].Tokens - s.cache[i])
	st.computed += uncached
	b := 0
	if s.span > 0 {
		b = min(int(now*buckets/(s.span+1)), buckets-1)
	}
	s.res.LoadOverTime[b][r] += float64(uncached)
	s.push(now+s.m.fleet[r].prefill(uncached), evPrefillDone, i)
}

// admit queues request i on replica r at now, and runs what fits.
func (s *sim) admit(r, i int, now int64) {
	st := &s.reps[r]
	st.admitQ = append(st.admitQ, i)
	s.admitWaiting(r, now)
}

// dispatchFree offers the routers' queues (flow control) every free slot
// at now, as the live router's tick does every few milliseconds
// (router.Deferrals.Tick): a request given one is resumed at now.
func (s *sim) dispatchFree(now int64) {
	if e, ok := s.d.(*engineDecider); ok && e.core.Deferrals() != nil {
		*e.clock = now
		e.core.Deferrals().Tick()
	}
}

// budget returns replica r's KV cache in tokens: its class's, its own
// (Config.Budgets, a decision log's) or the config's for all.
func (s *sim) budget(r int) int64 { return s.m.fleet[r].budget }

// kvNeed is the KV tokens request i adds to replica r's running
// requests: its prompt blocks none of them holds. Output tokens are not
// counted, as vLLM's scheduler admits on the prompt's blocks and allocates
// the output's as it decodes.
func (s *sim) kvNeed(r, i int) int64 {
	st := &s.reps[r]
	var need int64
	for _, b := range s.reqs[i].Blocks {
		if st.held[b.Hash] == 0 {
			need += int64(b.Tokens)
		}
	}
	if len(s.reqs[i].Blocks) == 0 {
		need += int64(s.reqs[i].Tokens)
	}
	return need
}

// hold adds (delta 1) or removes (−1) request i's KV tokens on replica r.
func (s *sim) hold(r, i int, delta int32) {
	st := &s.reps[r]
	if st.held == nil {
		st.held = map[uint64]int32{}
	}
	var n int64
	if len(s.reqs[i].Blocks) == 0 {
		n += int64(s.reqs[i].Tokens)
	}
	for _, b := range s.reqs[i].Blocks {
		before := st.held[b.Hash]
		switch after := before + delta; {
		case after <= 0:
			delete(st.held, b.Hash)
			if before > 0 {
				n += int64(b.Tokens)
			}
		case before == 0:
			st.held[b.Hash] = after
			n += int64(b.Tokens)
		default:
			st.held[b.Hash] = after
		}
	}
	st.kv += int64(delta) * n
	st.peak = max(st.peak, st.kv)
}

// admitWaiting runs replica r's waiting requests, first come first
// served, while there is a running slot and room for each in the KV cache,
// as vLLM's scheduler admits a request only when its blocks fit: a
// replica's engine never holds more than BudgetTokens for its running
// requests, and a request waits (its wait counted in its TTFT) until
// they do. A request larger than the whole cache runs alone.
func (s *sim) admitWaiting(r int, now int64) {
	st := &s.reps[r]
	for len(st.admitQ) > 0 && st.running < s.m.fleet[r].maxRunning {
		i := st.admitQ[0]
		if b := s.budget(r); st.running+st.lent > 0 && b > 0 && st.kv+s.kvNeed(r, i) > b {
			if !s.kvWaited[i] {
				s.kvWaited[i] = true
				s.res.KVWaits++
			}
			return
		}
		st.admitQ = st.admitQ[1:]
		st.running++
		s.hold(r, i, 1)
		if s.pre[i] >= 0 && r == s.rep[i] {
			s.transfer(r, i, now)
			continue
		}
		st.prefillQ = append(st.prefillQ, i)
		s.startPrefill(r, now)
	}
}

// prefilled ends disaggregated request i's prefill on its prefill replica
// at now: the replica's running slot is free, but the request's KV stays
// held there, pinned in its engine and counted against its cache, until
// the transfer ends (as vLLM's NIXL connector frees a prefill's blocks
// once the decode replica has read them); the request waits to be
// admitted on its decode replica.
func (s *sim) prefilled(i int, now int64) {
	p := s.pre[i]
	st := &s.reps[p]
	st.prefilling = -1
	st.running--
	st.lent++
	s.res.Disaggregated++
	s.startPrefill(p, now)
	s.admitWaiting(p, now)
	s.admit(s.rep[i], i, now)
}

// transfer starts pulling disaggregated request i's KV to decode replica
// r, just admitted, at now: the blocks r's engine does not hold.
func (s *sim) transfer(r, i int, now int64) {
	held := s.cache[i] // a reference's one cache is every replica's
	if s.engines != nil {
		held, _ = s.engines.serve(i, r, &s.reqs[i], now)
	}
	s.reps[r].pulling++
	moved := int64(max(s.reqs[i].Tokens-held, 0))
	s.res.TransferTokens += moved
	s.push(now+int64(s.m.TransferLatency)+moved*int64(s.m.TransferPerToken), evTransferDone, i)
}

// run replays s.reqs and fills s.res; pools are the routers' replica
// pools (none for a reference), which observe the replicas' gauges.
func (s *sim) run(pools ...*replica.Pool) error {
	s.setUp(pools)
	for s.q.Len() > 0 {
		ev := heap.Pop(&s.q).(event)
		var err error
		switch ev.kind {
		case evArrive, evDispatch:
			err = s.arrive(ev)
		case evPrefillDone:
			s.prefillDone(ev.req, ev.t)
		case evTransferDone:
			s.transferDone(ev.req, ev.t)
		case evFinish:
			s.finish(ev.req, ev.t)
		}
		if err != nil {
			return err
		}
	}
	if e, ok := s.d.(*engineDecider); ok && e.core.Deferrals() != nil {
		if n, _ := e.core.Deferrals().Len(); n > 0 {
			return fmt.Errorf("%d requests left in the router's queue with no request running to free a replica", n)
		}
	}
	s.results()
	return nil
}

// setUp readies a run: the replicas' queues, the per-request records,
// every arrival as an event.
func (s *sim) setUp(pools []*replica.Pool) {
	s.pools = pools
	s.reps = make([]simReplica, s.m.Replicas)
	for r := range s.reps {
		s.reps[r].prefilling = -1
	}
	s.rep = make([]int, len(s.reqs))
	s.pre = make([]int, len(s.reqs))
	for i := range s.pre {
		s.pre[i] = -1
	}
	s.cache = make([]int, len(s.reqs))
	if s.engines != nil {
		s.pred = make([]int, len(s.reqs))
		s.predBlocks, s.heldBlocks = make([]int, len(s.reqs)), make([]int, len(s.reqs))
	}
	s.ttft = make([]float64, len(s.reqs))
	s.kvWaited = make([]bool, len(s.reqs))
	s.res.LoadOverTime = make([][]float64, buckets)
	for b := range s.res.LoadOverTime {
		s.res.LoadOverTime[b] = make([]float64, s.m.Replicas)
	}
	for i := range s.reqs {
		t := int64(float64(s.reqs[i].Arrival) / s.m.Speedup)
		s.span = max(s.span, t)
		s.push(t, evArrive, i)
	}
	if e, ok := s.d.(*engineDecider); ok {
		e.onTurn = func(i int) { s.push(*e.clock, evDispatch, i) }
	}
}

// arrive places request ev.req as it arrives, or as its turn comes in the
// router's queue (evDispatch), and sends it to its replica.
func (s *sim) arrive(ev event) error {
	i, now := ev.req, ev.t
	pl, err := s.d.decide(i, now)
	if ev.kind == evArrive {
		s.ttft[i] = float64(-now) // completed at prefill done; a wait in the router's queue counts
	}
	if errors.Is(err, errDeferred) {
		s.dispatchFree(now) // the wait it adds may make moving another worth it
		return nil
	}
	if err != nil {
		return fmt.Errorf("request %d: %w", i, err)
	}
	s.placed(i, pl)
	if lg := s.reqs[i].Logged; lg != nil {
		s.replayLogged(i, pl.rep, now, lg)
		return nil
	}
	s.admit(pl.computes(), i, now)
	s.observe(pl.computes(), now)
	return nil
}

// placed counts request i placed at pl.
func (s *sim) placed(i int, pl place) {
	s.rep[i], s.pre[i] = pl.rep, pl.pre
	if s.engines != nil {
		s.pred[i] = pl.cached // the engine's own lookup comes when it schedules the prefill
		s.predBlocks[i] = pl.blocks
		s.heldBlocks[i] = s.engines.held(pl.computes(), s.reqs[i].Blocks).Blocks
	} else {
		s.cache[i] = pl.cached
		s.res.CachedTokens += int64(pl.cached)
		s.res.HitBlocks += int64(pl.blocks)
	}
	s.res.Requests++
	s.res.PromptTokens += int64(s.reqs[i].Tokens)
	s.res.Blocks += int64(len(s.reqs[i].Blocks))
}

// replayLogged runs logged request i on replica r with its live timing:
// first byte and end.
func (s *sim) replayLogged(i, r int, now int64, lg *Logged) {
	if len(s.pools) > 0 && lg.Chosen != s.pools[0].Replicas()[r].Name {
		s.res.Changed++
	}
	if s.engines != nil {
		s.serve(i, r, now)
	}
	s.reps[r].computed += int64(s.reqs[i].Tokens - s.cache[i])
	s.reps[r].decoding++
	s.hold(r, i, 1) // it ran when it ran live: its KV counts in the replica's usage
	s.observe(r, now)
	s.push(now+lg.TTFTNs, evPrefillDone, i)
}

// prefillDone ends request i's prefill at now: a disaggregated request's
// KV starts its way to its decode replica, another decodes.
func (s *sim) prefillDone(i int, now int64) {
	r := s.rep[i]
	if s.pre[i] >= 0 {
		s.d.prefillDone(i, now, s.cache[i])
		s.prefilled(i, now)
		s.observe(s.pre[i], now)
		s.observe(r, now)
		return
	}
	s.ttft[i] += float64(now)
	s.d.prefillDone(i, now, s.cache[i])
	if lg := s.reqs[i].Logged; lg != nil {
		s.push(now-lg.TTFTNs+max(lg.DurationNs, lg.TTFTNs), evFinish, i)
		return
	}
	st := &s.reps[r]
	st.prefilling = -1
	st.decoding++
	s.push(now+s.decode(r, i), evFinish, i)
	s.startPrefill(r, now)
	s.observe(r, now)
}

// transferDone: disaggregated request i's decode replica has the prompt's
// KV at now, and sends its first token.
func (s *sim) transferDone(i int, now int64) {
	r, p := s.rep[i], s.pre[i]
	s.ttft[i] += float64(now)
	s.reps[r].pulling--
	s.reps[p].lent--
	if s.engines != nil {
		s.engines.finish(^i, p, &s.reqs[i], nil, now)
	}
	s.hold(p, i, -1)
	s.admitWaiting(p, now)
	s.reps[r].decoding++
	s.d.transferred(i, now)
	s.push(now+s.decode(r, i), evFinish, i)
	s.observe(p, now)
	s.observe(r, now)
}

// decode returns the time replica r takes to decode request i's output
// after its first token.
func (s *sim) decode(r, i int) int64 {
	return int64(s.reqs[i].Output) * int64(s.m.fleet[r].interToken)
}

// finish ends request i at now: its engine first, then the router hears.
func (s *sim) finish(i int, now int64) {
	r := s.rep[i]
	if s.engines != nil { // the engine ends the request before the router hears of it
		s.engines.finish(i, r, &s.reqs[i], outputBlocks(&s.reqs[i], i, s.m.BlockTokens), now)
	}
	s.d.done(i, now)
	st := &s.reps[r]
	st.decoding--
	s.hold(r, i, -1)
	if s.reqs[i].Logged != nil {
		s.observe(r, now)
		return
	}
	st.running--
	s.admitWaiting(r, now)
	s.observe(r, now)
	s.dispatchFree(now)
}

// results fills s.res from the run's records.
func (s *sim) results() {
	for i := range s.ttft {
		s.ttft[i] /= 1e6 // ms
	}
	var pool func(int) bool
	if s.m.disaggregated() {
		pool = s.m.prefills
	}
	s.res.finish(s.ttft, s.reps, pool, s.rep, s.pre, s.cache, s.reqs)
	for i, w := range s.kvWaited {
		s.res.rows[i].kvWaited = w
	}
	s.res.byClass(s.m)
	if s.engines != nil {
		s.res.predicted(s.pred, s.cache)
		s.res.Prediction.EngineEvictions = s.engines.evict
		s.res.Prediction.LostWaitingTokens, s.res.Prediction.NotHeldTokens = s.lostWaiting, s.notHeld
	}
}

// engineDecider routes through the live router's core (router.Core):
// each request is placed as the live router places it, its deferral in
// the router's queue (flow control) and its prefill decision
// (disaggregation) included, in virtual time.
type engineDecider struct {
	m     *Config
	reqs  []Request
	eng   *routing.Engine
	core  *router.Core
	pic   *routing.Picture
	pool  *replica.Pool
	clock *int64
	// ps holds each request's placement until it ends: its decision
	// (the decode replica's, disaggregated) and its prefill decision
	// until its prefill ends.
	ps []*router.Placement
	// picture is the run's picture mode ("" when the picture stands for
	// the engines' caches).
	picture string
	orphans int64 // events: stored blocks whose parent the picture had lost
	// cached is each request's cached prompt tokens, from its prefill's
	// end to its end.
	cached []int
	// deferred holds the requests the router's queue holds, by their
	// deferral; onTurn hears of each whose turn came
	// (router.CoreOptions.OnGrant), which the simulation resumes at once
	// (evDispatch).
	deferred map[*router.Deferral]int
	deferral map[int]*router.Deferral // the same, by request
	onTurn   func(i int)
}

// errDeferred is decide's answer for a request the router's queue holds.
var errDeferred = errors.New("replay: deferred in the router's queue")

// granted hears that deferral def's turn came (router.CoreOptions.OnGrant).
func (e *engineDecider) granted(def *router.Deferral) { e.onTurn(e.deferred[def]) }

func (e *engineDecider) decide(i int, now int64) (place, error) {
	*e.clock = now
	if e.picture == PictureEvents {
		e.pic.ExpirePending(now)
	}
	p, def, err := e.place(i)
	if def != nil {
		e.deferred[def], e.deferral[i] = i, def
		return place{}, errDeferred
	}
	if err != nil {
		return place{}, err
	}
	e.ps[i] = p
	c := p.Chosen()
	pl := place{rep: c.Replica.ID, pre: -1, cached: c.Match.Tokens + int(c.Reuse), blocks: c.Match.Blocks}
	if pre := p.Prefill; pre != nil {
		p.SetRemote() // its decode replica takes the prompt's KV from the prefill replica
		pc := pre.Chosen()
		pl.pre, pl.cached, pl.blocks = pc.Replica.ID, pc.Match.Tokens+int(pc.Reuse), pc.Match.Blocks
	}
	return pl, nil
}

// place places request i (router.Core.Begin), or resumes it if the
// router's queue deferred it and its turn came.
func (e *engineDecider) place(i int) (*router.Placement, *router.Deferral, error) {
	if def, ok := e.deferral[i]; ok {
		delete(e.deferred, def)
		delete(e.deferral, i)
		return e.core.Resume(def, nil)
	}
	req := &e.reqs[i]
	return e.core.Begin(router.CoreRequest{Input: routing.Request{Blocks: req.Blocks, Key: req.Key, Text: req.Text},
		Route: "replay", Disaggregate: e.m.disaggregated(), Immediate: req.Logged != nil})
}

func (e *engineDecider) prefillDone(i int, now int64, cached int) {
	*e.clock = now
	p := e.ps[i]
	if pre := p.Prefill; pre != nil { // its one token: the prefill request ends
		p.Prefill = nil
		e.core.FirstByte(pre)
		if e.picture == PictureFeedback {
			e.eng.Feedback(pre.Decision, pre.Chosen(), cached)
		}
		e.core.Finish(pre, e.outcome(i, cached, 1), nil)
		return
	}
	e.cached[i] = cached
	e.core.FirstByte(p.Routed)
	if e.picture == PictureFeedback {
		e.eng.Feedback(p.Decision, p.Served, cached)
	}
}

// outcome is request i's answer as a streamed vLLM answer reports it,
// cached of its prompt tokens found cached and output tokens generated:
// what the router's service-time model learns from (replica.LearnService).
func (e *engineDecider) outcome(i, cached, output int) router.Outcome {
	var prompt int64
	for _, b := range e.reqs[i].Blocks {
		prompt += int64(b.Tokens)
	}
	return router.Outcome{Status: 200, PromptTokens: prompt, CachedTokens: int64(cached), CachedReported: true,
		OutputTokens: int64(output), Streamed: true}
}

func (e *engineDecider) transferred(i int, now int64) {
	*e.clock = now
	e.core.FirstByte(e.ps[i].Routed)
}

// stored and removed make the engine decider the events mode's cacheSink:
// the engine's cache changes reach the picture as KV events would.
func (e *engineDecider) stored(rep int, parent uint64, hasParent bool, blocks []blockhash.Block, now int64) {
	if ok, _ := e.pic.Store(rep, parent, hasParent, blocks, false, now); !ok {
		e.orphans += int64(len(blocks)) // as kvsync.Applier counts them
	}
}

func (e *engineDecider) removed(rep int, key uint64) { e.pic.Remove(rep, key, false) }

func (e *engineDecider) done(i int, now int64) {
	*e.clock = now
	p := e.ps[i]
	e.ps[i] = nil
	served := p.Served.Replica.ID
	e.core.Finish(p.Routed, e.outcome(i, e.cached[i], e.reqs[i].Output), nil)
	if e.m.RecordReplies && e.reqs[i].Reply != nil {
		all := append(append([]blockhash.Block(nil), e.reqs[i].Blocks...), e.reqs[i].Reply...)
		e.pic.Replied(served, all, len(e.reqs[i].Blocks), time.Unix(0, now))
	}
}

// pooledDecider is a reference: one cache shared by every replica, each
// request sent to the replica whose prefill queue is shortest.
type pooledDecider struct {
	m     *Config
	reqs  []Request
	cache *cachemodel.Model
	s     *sim
}

// With prefill replicas (Config.Roles), the decode replica is the
// decoding one with the fewest requests admitted or waiting, and the
// prompt, unless the shared cache leaves less than MinPrefillTokens of it
// to compute, goes to the prefill replica whose prefill queue is shortest.
func (p *pooledDecider) decide(i int, now int64) (place, error) {
	req := &p.reqs[i]
	m := p.cache.Match(req.Blocks, nil, nil)[0]
	p.cache.Record(0, req.Blocks, now)
	pl := place{pre: -1, cached: m.Tokens, blocks: m.Blocks}
	if !p.m.disaggregated() {
		pl.rep = p.least(func(r int) bool { return true }, prefillWork)
		return pl, nil
	}
	pl.rep = p.least(func(r int) bool { return !p.m.prefills(r) }, func(st *simReplica) int64 { return int64(st.running + len(st.admitQ)) })
	if p.m.needsPrefill(req.Tokens - m.Tokens) {
		pl.pre = p.least(p.m.prefills, prefillWork)
	}
	return pl, nil
}

// least returns the replica of those ok with the least work.
func (p *pooledDecider) least(ok func(int) bool, work func(*simReplica) int64) int {
	best, bestWork := 0, int64(math.MaxInt64)
	for r := range p.s.reps {
		if w := work(&p.s.reps[r]); ok(r) && w < bestWork {
			best, bestWork = r, w
		}
	}
	return best
}

// prefillWork is a replica's requests waiting for or in prefill.
func prefillWork(st *simReplica) int64 {
	work := int64(len(st.admitQ) + len(st.prefillQ))
	if st.prefilling >= 0 {
		work++
	}
	return work
}

func (p *pooledDecider) prefillDone(int, int64, int) {}
func (p *pooledDecider) transferred(int, int64)      {}

func (p *pooledDecider) done(i int, now int64) {
	p.cache.Free(0, p.reqs[i].Blocks, now)
	if p.m.RecordReplies && p.reqs[i].Reply != nil {
		p.cache.Extend(0, append(append([]blockhash.Block(nil), p.reqs[i].Blocks...), p.reqs[i].Reply...), len(p.reqs[i].Blocks), now)
	}
}

// percentile returns the q-quantile (0..1) of sorted xs, nearest rank.
func percentile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func sortedCopy(xs []float64) []float64 {
	out := append([]float64(nil), xs...)
	sort.Float64s(out)
	return out
}

// evictionPolicy returns the factory of the model's eviction policy.
func (m *Config) evictionPolicy() (eviction.Factory, error) {
	return eviction.New(plugin.Spec{Type: m.Eviction, Params: m.EvictionParams})
}
