// Package eviction holds the eviction policies of the cache model: which
// cached block a replica drops first when its token budget is exceeded.
//
// The cache model owns the blocks; a policy sees only the evictable ones (the
// leaves of one replica's cached tree) and keeps them in its own order. The
// model tells it what became evictable, what was touched and what was removed,
// and asks it for a victim. Time is passed in as int64 nanoseconds on the
// caller's clock (wall or virtual); no policy reads a clock.
//
// A Policy is not safe for concurrent use: the cache model serialises calls.
package eviction

import (
	"fmt"
	"math"
	"time"

	lru "github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/plugin"
)

// Info describes one cached block on one replica. Times are nanoseconds on
// the caller's clock.
type Info struct {
	Kind   blockhash.Kind
	Tokens int32 // estimated tokens, ≥ 1
	Depth  int32 // position in its chain; 0 is the first block
	// LastUsed is when the block was last inserted or hit.
	LastUsed int64
	// Inserted is when the block was first cached on this replica.
	Inserted int64
	// Freed is when a request that used the block last finished (0 if none
	// has): the moment an engine puts the block on its free queue.
	Freed int64
	// Hits counts the lookups that reused the block after its insertion.
	Hits int32
}

// Policy orders the evictable blocks of one replica.
type Policy interface {
	// Evictable adds key, which has just become a leaf (no cached child on
	// this replica), to the candidates for eviction.
	Evictable(key uint64, info Info)
	// Touched reports that key was hit at info.LastUsed (info.Hits has been
	// counted). It is called whether or not key is evictable; a policy
	// ignores keys it does not hold unless it keeps history.
	Touched(key uint64, info Info)
	// Removed drops key from the candidates: it gained a child or left the
	// cache. Unknown keys are ignored.
	Removed(key uint64)
	// Victim removes and returns the candidate to evict next; ok is false when
	// there is none.
	Victim() (key uint64, ok bool)
	// Len returns the number of candidates.
	Len() int
}

// FreeObserver is implemented by policies that order blocks by when the
// requests using them finished (vLLM's free queue).
type FreeObserver interface {
	// Freed reports that a request using key finished at info.Freed.
	Freed(key uint64, info Info)
}

// Admitter is implemented by policies that may refuse to cache a new block.
type Admitter interface {
	// Admit reports whether a new block may be cached on a replica that
	// holds used of budget tokens (budget > 0). A refused block is not
	// cached, nor is anything after it in its chain.
	Admit(info Info, used, budget int64) bool
}

// Evicted is implemented by policies that remember what they evicted.
type Evicted interface {
	// Evicted reports that key, last described by info, left the cache.
	Evicted(key uint64, info Info)
}

// Factory makes a fresh policy for one replica.
type Factory func() Policy

// none is the constructor of a policy that takes no parameters.
func none(f Factory) func(plugin.Params) (Factory, error) {
	return func(plugin.Params) (Factory, error) { return f, nil }
}

// policies are the registered eviction policies (registry).
var policies = registry()

// registry returns the eviction policies, by name: the one place they are
// registered. kind_weighted and kind_adaptive keep their older names as
// aliases.
func registry() *plugin.Registry[Factory] {
	return plugin.NewRegistry("eviction policy", "",
		plugin.Plugin[Factory]{Name: "fifo", New: none(NewFIFO)},
		plugin.Plugin[Factory]{Name: "kind_adaptive", Aliases: []string{"adaptive_semantic"}, Params: adaptiveSpec{}, New: newAdaptive},
		plugin.Plugin[Factory]{Name: "kind_weighted", Aliases: []string{"static_semantic"}, Params: staticSpec{}, New: newStatic},
		plugin.Plugin[Factory]{Name: "lfu", New: none(NewLFU)},
		plugin.Plugin[Factory]{Name: "lru", New: none(NewLRU)},
		plugin.Plugin[Factory]{Name: "size_lru", New: none(NewSizeLRU)},
		plugin.Plugin[Factory]{Name: "vllm", New: none(NewVLLM)},
	)
}

// Default is the eviction policy of the live router's picture.
const Default = "vllm"

// Names returns the registered policy names, sorted (registry registers
// them in that order).
func Names() []string { return policies.Names() }

// ParamNames returns the parameter names the named policy (or alias)
// takes.
func ParamNames(name string) []string {
	p, _ := policies.Lookup(name)
	return plugin.Names(p.Params)
}

// Lookup returns the factory registered under name, with default parameters.
func Lookup(name string) (Factory, error) { return New(plugin.Spec{Type: name}) }

// New returns the factory of the policy s names, with its parameters
// decoded and checked.
func New(s plugin.Spec) (Factory, error) { return policies.New(s) }

// staticSpec is kind_weighted's parameters as config gives them.
type staticSpec struct {
	// Weights by kind name (system, tools, ...); kinds not named keep
	// their default value.
	Weights      map[string]float64 `json:"weights"`
	SizeExponent float64            `json:"size_exponent"`
}

func (c staticSpec) params() (KindParams, error) {
	w := DefaultKindValues()
	for name, v := range c.Weights {
		k, err := blockhash.ParseKind(name)
		if err != nil {
			return KindParams{}, fmt.Errorf("weights: %w", err)
		}
		if !(v >= 0) {
			return KindParams{}, fmt.Errorf("weights.%s must be ≥ 0, not %v", name, v)
		}
		w[k] = v
	}
	if !(c.SizeExponent > 0 && c.SizeExponent <= 2) {
		return KindParams{}, fmt.Errorf("size_exponent must be in (0, 2], not %v", c.SizeExponent)
	}
	return KindParams{Weights: w, SizeExponent: c.SizeExponent}, nil
}

func newStatic(p plugin.Params) (Factory, error) {
	c := staticSpec{SizeExponent: 1}
	if err := p.Decode(&c); err != nil {
		return nil, err
	}
	kp, err := c.params()
	if err != nil {
		return nil, err
	}
	return func() Policy { return NewKindWeighted(kp) }, nil
}

// adaptiveSpec is kind_adaptive's parameters as config gives them.
type adaptiveSpec struct {
	staticSpec
	HitGain        float64         `json:"hit_gain"`
	RegretGain     float64         `json:"regret_gain"`
	WeightHalfLife plugin.Duration `json:"weight_half_life"`
	MinWeight      float64         `json:"min_weight"`
	MaxWeight      float64         `json:"max_weight"`
	Ghosts         int             `json:"ghosts"`
	AdmitBelow     float64         `json:"admit_below"`
}

func newAdaptive(p plugin.Params) (Factory, error) {
	c := adaptiveSpec{staticSpec: staticSpec{SizeExponent: 1}, HitGain: 0.01, RegretGain: 0.05, WeightHalfLife: plugin.Duration(time.Minute),
		MinWeight: 0.1, MaxWeight: 10, Ghosts: 65536, AdmitBelow: 0.25}
	if err := p.Decode(&c); err != nil {
		return nil, err
	}
	kp, err := c.params()
	if err != nil {
		return nil, err
	}
	switch {
	case !(c.HitGain > 0 && c.RegretGain > 0):
		return nil, fmt.Errorf("hit_gain and regret_gain must be > 0")
	case c.AdmitBelow == 0 || c.AdmitBelow != c.AdmitBelow:
		return nil, fmt.Errorf("admit_below must not be 0 (a negative value admits everything)")
	case !(c.MinWeight > 0 && c.MaxWeight >= c.MinWeight):
		return nil, fmt.Errorf("min_weight must be > 0 and max_weight ≥ min_weight")
	case c.WeightHalfLife <= 0:
		return nil, fmt.Errorf("weight_half_life must be positive")
	case c.Ghosts < 1 || c.Ghosts > 1<<24:
		return nil, fmt.Errorf("ghosts must be in [1, 16777216], not %d", c.Ghosts)
	}
	ap := AdaptiveParams{KindParams: kp, HitGain: c.HitGain, RegretGain: c.RegretGain, WeightHalfLife: time.Duration(c.WeightHalfLife),
		MinWeight: c.MinWeight, MaxWeight: c.MaxWeight, Ghosts: c.Ghosts, AdmitBelow: c.AdmitBelow}
	return func() Policy { return NewAdaptiveKind(ap) }, nil
}

// ordered is a Policy whose order is a function of each block's Info: the
// candidate with the lowest prio is the victim.
type ordered struct {
	h    prioHeap
	prio func(Info) prio
}

func newOrdered(f func(Info) prio) *ordered { return &ordered{h: newPrioHeap(), prio: f} }

func (p *ordered) Evictable(key uint64, info Info) { p.h.set(key, p.prio(info)) }
func (p *ordered) Touched(key uint64, info Info)   { p.h.update(key, p.prio(info)) }
func (p *ordered) Removed(key uint64)              { p.h.remove(key) }
func (p *ordered) Victim() (uint64, bool)          { return p.h.pop() }
func (p *ordered) Len() int                        { return p.h.Len() }

// NewFIFO evicts the leaf inserted first; among leaves inserted at one
// instant, the deepest first. Hits do not matter.
func NewFIFO() Policy {
	return newOrdered(func(i Info) prio { return prio{b: i.Inserted, c: -int64(i.Depth)} })
}

// NewLRU evicts the least recently used leaf; among leaves used at the same
// instant, the deepest first, so a request's tail goes before its head.
// Every operation is O(log n).
func NewLRU() Policy {
	return newOrdered(func(i Info) prio { return prio{b: i.LastUsed, c: -int64(i.Depth)} })
}

// NewLFU evicts the leaf with the fewest hits; ties go to the least recently
// used, then the deepest.
func NewLFU() Policy {
	return newOrdered(func(i Info) prio { return prio{a: float64(i.Hits), b: i.LastUsed, c: -int64(i.Depth)} })
}

// NewVLLM evicts in vLLM's order: the block least recently freed first (a
// block goes on vLLM's free queue when the last request using it finishes,
// and a request's blocks are freed tail first). A block in use by a request
// that has not finished counts as freed when it was last used, since vLLM
// would not evict it at all. Ref: vLLM v1 KVCacheManager / FreeKVCacheBlockQueue.
func NewVLLM() Policy {
	return &vllm{newOrdered(func(i Info) prio { return prio{b: max(i.LastUsed, i.Freed), c: -int64(i.Depth)} })}
}

type vllm struct{ *ordered }

func (p *vllm) Freed(key uint64, info Info) { p.h.update(key, p.prio(info)) }

// NewSizeLRU is size-aware LRU as GreedyDual-Size (Cao and Irani, 1997) with
// unit cost: a block's credit is H = L + 1/tokens, set when it is inserted or
// hit; the victim has the lowest H and L becomes its H. A block of many
// tokens holds little credit per token and goes sooner; L inflates so old
// credit loses to new, as recency does in LRU.
func NewSizeLRU() Policy { return &sizeLRU{h: newPrioHeap()} }

type sizeLRU struct {
	h prioHeap
	l float64
}

func (p *sizeLRU) prio(i Info) prio {
	return prio{a: p.l + 1/float64(max(i.Tokens, 1)), b: i.LastUsed, c: -int64(i.Depth)}
}
func (p *sizeLRU) Evictable(key uint64, info Info) { p.h.set(key, p.prio(info)) }
func (p *sizeLRU) Touched(key uint64, info Info)   { p.h.update(key, p.prio(info)) }
func (p *sizeLRU) Removed(key uint64)              { p.h.remove(key) }
func (p *sizeLRU) Len() int                        { return p.h.Len() }
func (p *sizeLRU) Victim() (uint64, bool) {
	it := p.h.min()
	if it == nil {
		return 0, false
	}
	p.l = it.p.a
	return p.h.pop()
}

// KindParams tune the semantic policies. Zero fields take the defaults.
type KindParams struct {
	// Weights is the value of a block per kind. Default: system and tools
	// 2, retrieved_context 1.5, code and tool_output 1.2, assistant and user
	// history 1, user_query 0.5, other 1.
	Weights *[blockhash.NumKinds]float64
	// SizeExponent α: value is divided by tokens^α. Default 1 (value per
	// token, with prefill time saved proportional to tokens).
	SizeExponent float64
}

// DefaultKindValues are the default per-kind block values of the semantic
// eviction policies.
func DefaultKindValues() *[blockhash.NumKinds]float64 {
	var w [blockhash.NumKinds]float64
	for k := range w {
		w[k] = 1
	}
	w[blockhash.KindSystem], w[blockhash.KindTools] = 2, 2
	w[blockhash.KindRetrievedContext] = 1.5
	w[blockhash.KindCode], w[blockhash.KindToolOutput] = 1.2, 1.2
	w[blockhash.KindUserQuery] = 0.5
	return &w
}

func (sp *KindParams) defaults() {
	if sp.Weights == nil {
		sp.Weights = DefaultKindValues()
	}
	if sp.SizeExponent == 0 {
		sp.SizeExponent = 1
	}
}

// staticValue is kind weight × ln(1 + hits) × prefill time saved ÷ tokens^α,
// with the time saved proportional to tokens.
func staticValue(w float64, i Info, alpha float64) float64 {
	t := float64(max(i.Tokens, 1))
	return w * math.Log1p(float64(i.Hits)) * t / math.Pow(t, alpha)
}

// NewKindWeighted evicts the leaf of lowest fixed value
//
//	value = weight[kind] × ln(1 + hits) × tokens ÷ tokens^α
//
// (prefill time saved is proportional to tokens); among equal values (for
// example every block never hit) the least recently used, then the deepest.
// The value never decays: a block once popular stays.
func NewKindWeighted(sp KindParams) Policy {
	sp.defaults()
	return newOrdered(func(i Info) prio {
		return prio{a: staticValue(sp.Weights[i.Kind], i, sp.SizeExponent), b: i.LastUsed, c: -int64(i.Depth)}
	})
}

// AdaptiveParams tune the adaptive semantic policy. Zero fields take the
// defaults.
type AdaptiveParams struct {
	KindParams
	// HitGain and RegretGain are added to a kind's weight on a hit and on a
	// regret (a block of that kind inserted again soon after it was
	// evicted). Defaults 0.01 and 0.05.
	HitGain, RegretGain float64
	// WeightHalfLife is how fast a learned weight decays back to its base
	// when its kind is idle; it is also the half-life of a block's value
	// while the block is idle. Default 60s.
	WeightHalfLife time.Duration
	// MinWeight and MaxWeight clamp learned weights. Defaults 0.1 and 10.
	MinWeight, MaxWeight float64
	// Ghosts is how many evicted keys are remembered to detect regret.
	// Default 65536.
	Ghosts int
	// AdmitBelow: when the replica is full, a new block whose kind weight is
	// below AdmitBelow × the mean weight is not admitted. Default 0.25; a
	// negative value admits everything.
	AdmitBelow float64
}

func (ap *AdaptiveParams) defaults() {
	ap.KindParams.defaults()
	def := func(v *float64, d float64) {
		if *v == 0 {
			*v = d
		}
	}
	def(&ap.HitGain, 0.01)
	def(&ap.RegretGain, 0.05)
	def(&ap.MinWeight, 0.1)
	def(&ap.MaxWeight, 10)
	def(&ap.AdmitBelow, 0.25)
	if ap.WeightHalfLife == 0 {
		ap.WeightHalfLife = time.Minute
	}
	if ap.Ghosts == 0 {
		ap.Ghosts = 65536
	}
}

// NewAdaptiveKind is the static semantic value with per-kind weights that
// learn online:
//
//   - a hit raises its kind's weight by HitGain, a regret (inserting a block
//     evicted recently) by RegretGain;
//   - an idle kind's weight decays back to its base with WeightHalfLife;
//   - weights are clamped to [MinWeight, MaxWeight];
//   - a block's value, (1 + ln(1 + hits)) × weight × tokens^(1−α), halves for
//     every WeightHalfLife it stays idle, so a once-popular block does not
//     stay forever. The order key LastUsed + (half-life / ln 2) × ln(value)
//     is that decayed value's order at any one instant, so the heap stays
//     valid as time passes;
//   - when the replica is full, blocks of kinds weighted below AdmitBelow ×
//     the mean weight are not admitted.
//
// A weight learned after a block was queued is used from its next touch.
func NewAdaptiveKind(ap AdaptiveParams) Policy {
	ap.defaults()
	p := &adaptive{ap: ap, h: newPrioHeap(), w: *ap.Weights}
	p.ghosts, _ = lru.NewLRU[uint64, blockhash.Kind](ap.Ghosts, nil) // Ghosts > 0
	return p
}

type adaptive struct {
	ap     AdaptiveParams
	h      prioHeap
	w      [blockhash.NumKinds]float64 // learned weights
	wAt    [blockhash.NumKinds]int64   // when each weight was last updated
	ghosts *lru.LRU[uint64, blockhash.Kind]
}

var _ interface {
	Policy
	Admitter
	Evicted
} = (*adaptive)(nil)

// weight returns kind k's weight decayed to now and records it.
func (p *adaptive) weight(k blockhash.Kind, now int64) float64 {
	base := p.ap.Weights[k]
	if dt := now - p.wAt[k]; dt > 0 && p.wAt[k] != 0 {
		p.w[k] = base + (p.w[k]-base)*math.Exp2(-float64(dt)/float64(p.ap.WeightHalfLife))
	}
	p.wAt[k] = max(p.wAt[k], now)
	return p.w[k]
}

func (p *adaptive) learn(k blockhash.Kind, gain float64, now int64) {
	p.w[k] = min(max(p.weight(k, now)+gain, p.ap.MinWeight), p.ap.MaxWeight)
}

func (p *adaptive) prio(i Info) prio {
	t := float64(max(i.Tokens, 1))
	v := (1 + math.Log1p(float64(i.Hits))) * p.weight(i.Kind, i.LastUsed) * t / math.Pow(t, p.ap.SizeExponent)
	tau := float64(p.ap.WeightHalfLife) / math.Ln2
	return prio{a: float64(i.LastUsed) + tau*math.Log(v), c: -int64(i.Depth)}
}

func (p *adaptive) Evictable(key uint64, info Info) {
	if k, ok := p.ghosts.Peek(key); ok {
		p.ghosts.Remove(key)
		p.learn(k, p.ap.RegretGain, info.LastUsed)
	}
	p.h.set(key, p.prio(info))
}

func (p *adaptive) Touched(key uint64, info Info) {
	p.learn(info.Kind, p.ap.HitGain, info.LastUsed)
	p.h.update(key, p.prio(info))
}

func (p *adaptive) Evicted(key uint64, info Info) { p.ghosts.Add(key, info.Kind) }
func (p *adaptive) Removed(key uint64)            { p.h.remove(key) }
func (p *adaptive) Victim() (uint64, bool)        { return p.h.pop() }
func (p *adaptive) Len() int                      { return p.h.Len() }

func (p *adaptive) Admit(info Info, used, budget int64) bool {
	if p.ap.AdmitBelow < 0 || used+int64(info.Tokens) <= budget {
		return true
	}
	mean := 0.0
	for k := range p.w {
		mean += p.weight(blockhash.Kind(k), info.LastUsed)
	}
	mean /= float64(len(p.w))
	return p.weight(info.Kind, info.LastUsed) >= p.ap.AdmitBelow*mean
}

// prioHeap is a min-heap of keys ordered by (a, b), with an index for
// updates and removals by key.
type prioHeap struct {
	items []*item
	index map[uint64]*item
	// free holds items popped or removed, for the next set to reuse: a
	// picture that records and evicts a 128K prompt's 2,048 blocks a
	// request otherwise allocates an item for each (a chain evicted leaf
	// first reuses one or two). At most maxFreeItems are kept (12 KiB).
	free []*item
	// hole is set when the root was popped and its place not yet filled:
	// items[0] is stale. Eviction pops a leaf and then, nearly always,
	// makes its parent a leaf; the parent goes into the hole and sinks
	// from there, often not at all, where a pop and a push would each
	// walk the heap's height. Every other operation settles the hole
	// first, as container/heap's Pop would have. The order is a strict
	// total one (ties go to the lower key), so the minimum, and so every
	// victim, is the same whatever the heap's layout.
	hole bool
}

const maxFreeItems = 256

// recycle keeps it for reuse, once nothing refers to it.
func (h *prioHeap) recycle(it *item) {
	if len(h.free) < maxFreeItems {
		*it = item{}
		h.free = append(h.free, it)
	}
}

// prio orders candidates: lowest a, then lowest b, then lowest c, then
// lowest key.
type prio struct {
	a    float64
	b, c int64
}

type item struct {
	key uint64
	p   prio
	pos int
}

func newPrioHeap() prioHeap { return prioHeap{index: make(map[uint64]*item)} }

func (h *prioHeap) Len() int {
	if h.hole {
		return len(h.items) - 1
	}
	return len(h.items)
}

// settle fills a popped root's hole with the last item, as container/heap's
// Pop does.
func (h *prioHeap) settle() {
	if !h.hole {
		return
	}
	h.hole = false
	n := len(h.items) - 1
	if n > 0 {
		h.items[0] = h.items[n]
		h.items[0].pos = 0
	}
	h.items[n] = nil
	h.items = h.items[:n]
	if n > 1 {
		h.down(0, n)
	}
}

// min returns the candidate with the lowest priority, or nil.
func (h *prioHeap) min() *item {
	h.settle()
	if len(h.items) == 0 {
		return nil
	}
	return h.items[0]
}
func (h *prioHeap) Less(i, j int) bool {
	x, y := h.items[i], h.items[j]
	switch {
	case x.p.a != y.p.a:
		return x.p.a < y.p.a
	case x.p.b != y.p.b:
		return x.p.b < y.p.b
	case x.p.c != y.p.c:
		return x.p.c < y.p.c
	}
	return x.key < y.key
}
func (h *prioHeap) Swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.items[i].pos, h.items[j].pos = i, j
}

// The heap's operations are container/heap's, step for step (so the
// order of victims, ties included, is the same), on the concrete type: no
// interface call per comparison and swap. Eviction runs them for every
// block a full picture records.

func (h *prioHeap) push(it *item) {
	it.pos = len(h.items)
	h.items = append(h.items, it)
	h.up(it.pos)
}

// removeAt takes the item at position i out of the heap.
func (h *prioHeap) removeAt(i int) *item {
	n := len(h.items) - 1
	if n != i {
		h.Swap(i, n)
		if !h.down(i, n) {
			h.up(i)
		}
	}
	it := h.items[n]
	h.items[n] = nil
	h.items = h.items[:n]
	return it
}

// fix restores the heap after the item at i changed priority.
func (h *prioHeap) fix(i int) {
	if !h.down(i, len(h.items)) {
		h.up(i)
	}
}

func (h *prioHeap) up(j int) {
	for {
		i := (j - 1) / 2 // parent
		if i == j || !h.Less(j, i) {
			break
		}
		h.Swap(i, j)
		j = i
	}
}

func (h *prioHeap) down(i0, n int) bool {
	i := i0
	for {
		j1 := 2*i + 1
		if j1 >= n || j1 < 0 { // j1 < 0 after int overflow
			break
		}
		j := j1 // left child
		if j2 := j1 + 1; j2 < n && h.Less(j2, j1) {
			j = j2 // right child
		}
		if !h.Less(j, i) {
			break
		}
		h.Swap(i, j)
		i = j
	}
	return i > i0
}

// set inserts key or moves it to the new priority.
func (h *prioHeap) set(key uint64, p prio) {
	if it, ok := h.index[key]; ok {
		h.settle()
		it.p = p
		h.fix(it.pos)
		return
	}
	var it *item
	if k := len(h.free); k > 0 {
		it, h.free = h.free[k-1], h.free[:k-1]
		it.key, it.p = key, p
	} else {
		it = &item{key: key, p: p}
	}
	h.index[key] = it
	if h.hole { // into the popped root's place, and down from there
		h.hole = false
		it.pos = 0
		h.items[0] = it
		h.down(0, len(h.items))
		return
	}
	h.push(it)
}

// update moves key to the new priority if it is present.
func (h *prioHeap) update(key uint64, p prio) {
	if it, ok := h.index[key]; ok {
		h.settle()
		it.p = p
		h.fix(it.pos)
	}
}

func (h *prioHeap) remove(key uint64) {
	if it, ok := h.index[key]; ok {
		h.settle()
		h.removeAt(it.pos)
		delete(h.index, key)
		h.recycle(it)
	}
}

// pop removes and returns the lowest key, leaving its place a hole.
func (h *prioHeap) pop() (uint64, bool) {
	it := h.min()
	if it == nil {
		return 0, false
	}
	key := it.key
	h.hole = true
	delete(h.index, key)
	h.recycle(it)
	return key, true
}
