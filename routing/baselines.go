package routing

import (
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"

	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2"
)

// The baselines below are ports of other routers' formulas, so that replay
// can compare semroute's own policy with them on the same trace and replica
// model. Each reads only the View and Candidates: the cache picture they
// consult is semroute's (an exact mirror in replay), not their own
// approximate trees, so they differ from the originals only in the formula.

// seededRand is a math/rand/v2 generator safe for concurrent use. A zero seed
// draws one at random.
type seededRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func newSeededRand(seed uint64) *seededRand {
	if seed == 0 {
		seed = rand.Uint64()
	}
	return &seededRand{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

func (s *seededRand) float() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Float64()
}

func (s *seededRand) intn(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.IntN(n)
}

// byInFlight ranks c by requests in flight, then by pending prefill tokens.
func byInFlight(c *Candidate) {
	c.Tier, c.Score = c.Load.InFlight, c.Load.PendingTokens
}

// PowerOfTwo samples two candidates at random and prefers the one with fewer
// requests in flight (Mitzenmacher, "The Power of Two Choices in Randomized
// Load Balancing", 2001; SGLang router's power_of_two). The two sampled score
// by load; every other candidate ranks after both.
type PowerOfTwo struct{ rng *seededRand }

// Name implements Policy.
func (*PowerOfTwo) Name() string { return "power_of_two" }

// Score implements Policy.
func (p *PowerOfTwo) Score(_ *View, cands []Candidate) {
	a := p.rng.intn(len(cands))
	b := a
	if len(cands) > 1 {
		b = (a + 1 + p.rng.intn(len(cands)-1)) % len(cands)
	}
	for i := range cands {
		cands[i].Tier, cands[i].Reason = math.MaxInt64, "not sampled"
	}
	for _, i := range []int{a, b} {
		byInFlight(&cands[i])
		cands[i].Reason = "sampled"
	}
}

// ConsistentHashParams are consistent_hash's parameters.
type ConsistentHashParams struct {
	// VirtualNodes per replica on the ring. Default 160.
	VirtualNodes int `json:"virtual_nodes"`
}

// ConsistentHash maps the session key onto a hash ring with VirtualNodes
// points per replica and takes the first replica clockwise (Karger et al.,
// 1997; SGLang router's consistent_hash, 160 virtual nodes by default). The
// other replicas rank in the order the walk meets them, so a failed replica's
// sessions move to its ring successor. It ignores load and cache.
type ConsistentHash struct {
	VirtualNodes int

	mu   sync.Mutex
	sig  string
	ring []ringPoint
}

type ringPoint struct {
	h    uint64
	name string
}

// Name implements Policy.
func (*ConsistentHash) Name() string { return "consistent_hash" }

func (p *ConsistentHash) ringFor(cands []Candidate) []ringPoint {
	var sb strings.Builder
	for i := range cands {
		sb.WriteString(cands[i].Replica.Name)
		sb.WriteByte(0)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if sig := sb.String(); sig != p.sig {
		p.ring = p.ring[:0]
		for i := range cands {
			for v := 0; v < p.VirtualNodes; v++ {
				p.ring = append(p.ring, ringPoint{rendezvous(uint64(v), cands[i].Replica.Name), cands[i].Replica.Name})
			}
		}
		sort.Slice(p.ring, func(i, j int) bool { return p.ring[i].h < p.ring[j].h })
		p.sig = sig
	}
	return p.ring
}

// Score implements Policy.
func (p *ConsistentHash) Score(in *View, cands []Candidate) {
	ring := p.ringFor(cands)
	key := xxhash.Sum64(binaryKey(in.Key))
	start := sort.Search(len(ring), func(i int) bool { return ring[i].h >= key })
	order := make(map[string]int, len(cands))
	for i := 0; i < len(ring) && len(order) < len(cands); i++ {
		n := ring[(start+i)%len(ring)].name
		if _, seen := order[n]; !seen {
			order[n] = len(order)
		}
	}
	for i := range cands {
		cands[i].Score, cands[i].Reason = float64(order[cands[i].Replica.Name]), "ring"
	}
}

func binaryKey(k uint64) []byte {
	b := make([]byte, 8)
	for i := range b {
		b[i] = byte(k >> (8 * i))
	}
	return b
}

// SGLangParams are the SGLang router's cache_aware parameters.
type SGLangParams struct {
	// CacheThreshold: route to the best match only if matched ÷ prompt
	// exceeds it. Default 0.3.
	CacheThreshold float64 `json:"cache_threshold"`
	// BalanceAbsThreshold and BalanceRelThreshold: the system is imbalanced
	// when max − min load > abs and max > rel × min. Defaults 64 and 1.5.
	BalanceAbsThreshold float64 `json:"balance_abs_threshold"`
	BalanceRelThreshold float64 `json:"balance_rel_threshold"`
}

// SGLang ports SGLang router's cache_aware policy
// (sgl-project/sglang, sgl-router/src/policies/cache_aware.rs; defaults
// from its command line: cache_threshold 0.3, balance_abs_threshold 64,
// balance_rel_threshold 1.5). Load is requests in flight:
//
//   - if max − min load > abs and max > rel × min: the least-loaded replica;
//   - else if the best prefix match ÷ the prompt > CacheThreshold: the
//     replica with the best match;
//   - else the replica whose tree is smallest (most free cache).
//
// The original matches characters in its own approximate radix tree; this
// port matches tokens in semroute's picture. Ties, which the original breaks
// by iteration order, are broken by rendezvous hashing.
type SGLang struct{ p SGLangParams }

// Name implements Policy.
func (*SGLang) Name() string { return "sglang" }

// Score implements Policy.
func (p *SGLang) Score(in *View, cands []Candidate) {
	lo, hi := math.Inf(1), math.Inf(-1)
	best := 0
	for i := range cands {
		l := float64(cands[i].Load.InFlight)
		lo, hi = min(lo, l), max(hi, l)
		if cands[i].Match.Tokens > cands[best].Match.Tokens {
			best = i
		}
	}
	imbalanced := hi-lo > p.p.BalanceAbsThreshold && hi > p.p.BalanceRelThreshold*lo
	rate := 0.0
	if in.Tokens > 0 {
		rate = float64(cands[best].Match.Tokens) / float64(in.Tokens)
	}
	for i := range cands {
		c := &cands[i]
		switch {
		case imbalanced:
			c.Score, c.Reason = float64(c.Load.InFlight), "shortest queue"
		case rate > p.p.CacheThreshold:
			// Best match first; the rest by match, for failover.
			c.Score, c.Reason = float64(cands[best].Match.Tokens-c.Match.Tokens), "cache match"
		default:
			c.Score, c.Reason = float64(c.CacheTokens), "smallest tree"
		}
	}
}

// DynamoParams are NVIDIA Dynamo KV router's parameters.
type DynamoParams struct {
	// OverlapWeight multiplies prefill blocks. Default 1.
	OverlapWeight float64 `json:"overlap_weight"`
	// Temperature > 0 samples from softmax(−normalized cost / T); 0 (the
	// default) takes the lowest cost.
	Temperature float64 `json:"temperature"`
}

// Dynamo ports NVIDIA Dynamo's KV router cost (ai-dynamo/dynamo,
// docs/router/kv_cache_routing.md "Cost Calculation"; defaults
// --kv-overlap-score-weight 1, --router-temperature 0):
//
//	cost = OverlapWeight × prefill_blocks + decode_blocks
//
// prefill_blocks = (prefill tokens pending on the worker + this request's
// uncached tokens) ÷ block size; decode_blocks = blocks held by the worker's
// active sequences + this request's uncached blocks (its cached prefix is
// already among the active or cached blocks). Lowest cost wins; with a
// temperature, costs are min-max normalised and sampled by softmax.
type Dynamo struct {
	p   DynamoParams
	rng *seededRand
}

// Name implements Policy.
func (*Dynamo) Name() string { return "dynamo" }

// Score implements Policy.
func (p *Dynamo) Score(in *View, cands []Candidate) {
	bs := float64(max(in.BlockTokens, 1))
	lo, hi := math.Inf(1), math.Inf(-1)
	for i := range cands {
		c := &cands[i]
		uncached := float64(in.Tokens - c.Match.Tokens)
		prefill := (c.Load.PendingTokens + uncached) / bs
		decode := c.Load.ActiveTokens/bs + uncached/bs
		c.Score, c.Reason = p.p.OverlapWeight*prefill+decode, "cost"
		lo, hi = min(lo, c.Score), max(hi, c.Score)
	}
	if p.p.Temperature <= 0 || hi == lo {
		return
	}
	// Softmax sampling: the sampled candidate ranks first, the rest by cost.
	weights := make([]float64, len(cands))
	sum := 0.0
	for i := range cands {
		weights[i] = math.Exp(-(cands[i].Score - lo) / (hi - lo) / p.p.Temperature)
		sum += weights[i]
	}
	x := p.rng.float() * sum
	for i := range cands {
		if x -= weights[i]; x <= 0 || i == len(cands)-1 {
			cands[i].Score, cands[i].Reason = lo-1, "sampled"
			return
		}
	}
}

// LLMDParams are the weights of llm-d's default scheduling profile.
type LLMDParams struct {
	// Weights of the prefix-cache, queue and kv-cache-utilization scorers.
	// Defaults 3, 2, 2.
	PrefixWeight float64 `json:"prefix_weight"`
	QueueWeight  float64 `json:"queue_weight"`
	KVWeight     float64 `json:"kv_weight"`
}

// LLMD ports llm-d's inference scheduler default profile (the
// InferencePool chart's default-plugins.yaml: queue-scorer 2,
// kv-cache-utilization-scorer 2, prefix-cache-scorer 3, max-score-picker).
// Each scorer gives a value in [0,1] and the replica with the highest
// weighted sum wins:
//
//   - prefix-cache: matched blocks ÷ the request's blocks;
//   - queue: (max waiting − waiting) ÷ (max − min waiting), 1 when all equal;
//   - kv-cache-utilization: 1 − KV cache usage.
//
// Waiting and KV usage are the replica's reported gauges. The picker's
// random tie-break is replaced by rendezvous hashing.
type LLMD struct{ p LLMDParams }

// Name implements Policy.
func (*LLMD) Name() string { return "llmd" }

// Score implements Policy.
func (p *LLMD) Score(in *View, cands []Candidate) {
	lo, hi := int64(math.MaxInt64), int64(math.MinInt64)
	for i := range cands {
		w := cands[i].Load.Waiting
		lo, hi = min(lo, w), max(hi, w)
	}
	for i := range cands {
		c := &cands[i]
		prefix := 0.0
		if n := len(in.Blocks); n > 0 {
			prefix = float64(c.Match.Blocks) / float64(n)
		}
		queue := 1.0
		if hi > lo {
			queue = float64(hi-c.Load.Waiting) / float64(hi-lo)
		}
		kv := 1 - min(max(c.Load.KVUsage, 0), 1)
		c.Score, c.Reason = -(p.p.PrefixWeight*prefix + p.p.QueueWeight*queue + p.p.KVWeight*kv), "weighted scorers"
	}
}

// AIBrixParams are AIBrix prefix-cache routing's parameters.
type AIBrixParams struct {
	// ImbalanceCount: when max − min running requests exceeds it, route to
	// the least running. Default 16.
	ImbalanceCount float64 `json:"imbalance_count"`
	// StdDevFactor k: a matching replica is taken only if its running
	// requests are at most mean + k·σ. Default 2.
	StdDevFactor float64 `json:"std_dev_factor"`
}

// AIBrix ports AIBrix's prefix-cache-aware routing (vllm-project/aibrix,
// pkg/plugins/gateway/algorithms/README.md "Prefix Cache Aware";
// AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT 16,
// AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR 2):
//
//   - if max − min running requests > ImbalanceCount: the least running;
//   - else, among replicas with a prefix match, by match share descending
//     then running ascending, the first whose running ≤ mean + k·σ;
//   - else the least running.
//
// Running is the replica's reported vllm:num_requests_running when it has
// one, else the router's in-flight count.
type AIBrix struct{ p AIBrixParams }

// Name implements Policy.
func (*AIBrix) Name() string { return "aibrix" }

func running(l *Candidate) float64 {
	if l.Load.Running > 0 {
		return float64(l.Load.Running)
	}
	return float64(l.Load.InFlight)
}

// Score implements Policy.
func (p *AIBrix) Score(_ *View, cands []Candidate) {
	lo, hi, sum, sq := math.Inf(1), math.Inf(-1), 0.0, 0.0
	for i := range cands {
		r := running(&cands[i])
		lo, hi, sum, sq = min(lo, r), max(hi, r), sum+r, sq+r*r
	}
	n := float64(len(cands))
	mean := sum / n
	limit := mean + p.p.StdDevFactor*math.Sqrt(max(sq/n-mean*mean, 0))
	chosen := -1
	if hi-lo <= p.p.ImbalanceCount {
		for i := range cands {
			c := &cands[i]
			if c.Match.Blocks == 0 || running(c) > limit {
				continue
			}
			if chosen < 0 || c.Match.Blocks > cands[chosen].Match.Blocks ||
				(c.Match.Blocks == cands[chosen].Match.Blocks && running(c) < running(&cands[chosen])) {
				chosen = i
			}
		}
	}
	for i := range cands {
		c := &cands[i]
		c.Score, c.Reason = 1+running(c), "least running"
		if i == chosen {
			c.Score, c.Reason = 0, "prefix match"
		}
	}
}

// SemanticKVParams tune the SemanticKV score.
type SemanticKVParams struct {
	// SessionBonusTokens is added for the replica that served the session's
	// previous request. Default 512.
	SessionBonusTokens float64 `json:"session_bonus_tokens"`
	// LoadWeight multiplies pending prefill tokens. Default 1.
	LoadWeight float64 `json:"load_weight"`
	// Sessions bounds the session → replica memory. Default 65536.
	Sessions int `json:"sessions"`
}

// SemanticKV is the router score of SemanticKV as this project's issue
// describes it (no public implementation was found to port):
//
//	score = Σ kind weight × matched tokens + session bonus − LoadWeight × pending prefill tokens
//
// highest wins. The session bonus goes to the replica that served the
// session's previous request; the memory of sessions is an LRU of Sessions
// entries. The constants are this project's choice.
type SemanticKV struct {
	p        SemanticKVParams
	sessions *lru.Cache[uint64, string]
}

var _ Observer = (*SemanticKV)(nil)

// Name implements Policy.
func (*SemanticKV) Name() string { return "semantickv" }

// Score implements Policy.
func (p *SemanticKV) Score(in *View, cands []Candidate) {
	last, _ := p.sessions.Get(in.Key)
	for i := range cands {
		c := &cands[i]
		s := c.Match.Weighted - p.p.LoadWeight*c.Load.PendingTokens
		c.Reason = "score"
		if c.Replica.Name == last {
			s += p.p.SessionBonusTokens
			c.Reason = "session"
		}
		c.Score = -s
	}
}

// Chosen implements Observer: it remembers the session's replica.
func (p *SemanticKV) Chosen(in *View, c *Candidate) { p.sessions.Add(in.Key, c.Replica.Name) }
