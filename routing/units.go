package routing

import (
	"maps"
	"math"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/semroute/semroute/blockhash"
)

// units learns, for each model, how many of the engine's tokens one of the
// splitter's estimated tokens is: the engine reports usage.prompt_tokens for
// a request whose prompt the splitter estimated, and the ratio of the two
// scales every later estimate for that model, so that tokens, budgets, load
// and the matched tokens the router reports are all in the engine's unit.
// The ratio also absorbs the chat template's tokens. A model never observed
// scales by 1.
//
// Tool schemas get a ratio of their own once the requests tell it apart:
// chat templates render them their own way (as JSON, in a system message,
// or, as llm-d's simulator does, not at all, pkg/tokenizer/tokenizer.go
// RenderMessages), so one ratio for the whole prompt would count a cached
// tools prefix at the prompt's rate. A least-squares fit of
// prompt_tokens ≈ a × tool tokens + b × other tokens, over the last 64 or so
// requests (weights decaying by 1/64 a request), gives a and b once at
// least 16 requests with tools were seen and the two are not collinear.
//
// The reports are the replicas' word, and a replica may lie (issue 30: one
// reporting tiny prompt_tokens made every block count as a sixteenth of its
// tokens against the budgets, so the pictures grew 16x past them). So each
// replica's reports are learned apart, and the model takes the median:
//   - a replica's ratio for the model starts at the model's and moves an
//     eighth of the way to each report's, in log space, the report's held
//     within [minRatio, maxRatio]: by a factor of at most 16^(1/8) ≈ 1.41
//     a report, about 20 reports from 1 to a bound;
//   - the model's ratio is the median of its replicas' (the geometric mean
//     of the middle two for an even count): one replica among three or
//     more cannot move it outside the others' range, one of two only
//     halfway (in log space);
//   - each replica has a fit of its own, its a and b held within bounds;
//     the model's a and b are the medians of its replicas' once more than
//     half of the replicas heard from have one (until then the ratio
//     serves).
//
// Safe for concurrent use.
type units struct {
	mu     sync.Mutex                       // serialises adding a model
	models atomic.Pointer[map[string]*unit] // copy-on-write
}

// unit is one model's learned ratios.
type unit struct {
	ratio atomic.Uint64 // float64 bits of the whole prompt's ratio: the median of per's
	fit   atomic.Pointer[scales]

	mu      sync.Mutex // serialises per and scratch
	per     []perUnit  // by replica id (mod maxTracked)
	scratch []float64  // for medians
}

// perUnit is what one replica's reports taught of a model. The zero value
// is a replica not heard from.
type perUnit struct {
	seen                    bool
	log                     float64 // the whole prompt's ratio, as its natural log
	n                       int     // requests with tools seen
	stt, sto, soo, stp, sop float64 // decayed sums of products of tool (t), other (o) and prompt (p) tokens
	fit                     scales  // the zero value until determined
}

// scales are engine tokens per estimated token, for tool schemas and for
// the rest of a prompt. The zero value scales by 1.
type scales struct{ tools, other float64 }

// of returns the scale of a block of kind k.
func (s scales) of(k blockhash.Kind) float64 {
	switch {
	case s == scales{}:
		return 1
	case k == blockhash.KindTools:
		return s.tools
	}
	return s.other
}

// Bounds of the learned ratio, and of the models learned: model names come
// from clients, so at most maxModels are kept. With the splitter's default
// estimate of 4 bytes a token, real tokenizers count from about a quarter
// of it (long runs of spaces or of one character, many bytes a token) to
// four times it (text a byte-level BPE falls back to bytes for, a token a
// byte); prose and code count from about 0.7 to 1.3. A replica reporting
// prompt_tokens out of that range cannot make each block count as less
// than a quarter, or more than four times, its estimated tokens against a
// budget.
const (
	minRatio  = 1.0 / 4
	maxRatio  = 4.0
	maxModels = 256
	// maxTracked bounds the replicas a model keeps ratios for (ids are
	// the smallest free, so as many as are in the pool at once); ids past
	// it share slots.
	maxTracked = 1024
	// fitDecay is the weight the fit's sums keep at each request, and
	// fitMin the requests with tools it needs.
	fitDecay = 63.0 / 64
	fitMin   = 16
)

// scale returns the ratio learned for model, or 1. It takes no lock.
func (u *units) scale(model string) float64 {
	if v := u.get(model); v != nil {
		return math.Float64frombits(v.ratio.Load())
	}
	return 1
}

// scales returns the ratios learned for model: the fit's where it is
// determined, else the whole prompt's for every block. It takes no lock.
func (u *units) scales(model string) scales {
	v := u.get(model)
	if v == nil {
		return scales{1, 1}
	}
	if f := v.fit.Load(); f != nil {
		return *f
	}
	r := math.Float64frombits(v.ratio.Load())
	return scales{r, r}
}

func (u *units) get(model string) *unit {
	if m := u.models.Load(); m != nil {
		return (*m)[model]
	}
	return nil
}

// observe learns from one request that replica (its id) served: estimated
// splitter tokens of its tool schemas and of the rest against the engine's
// reported prompt tokens.
func (u *units) observe(model string, replica int, tools, other float64, reported int) {
	estimated := tools + other
	if estimated <= 0 || reported <= 0 {
		return
	}
	v := u.get(model)
	if v == nil {
		if v = u.add(model); v == nil {
			return
		}
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	i := max(replica, 0) % maxTracked
	if i >= len(v.per) {
		v.per = append(v.per, make([]perUnit, i+1-len(v.per))...)
	}
	p := &v.per[i]
	if !p.seen {
		p.seen, p.log = true, math.Log(math.Float64frombits(v.ratio.Load()))
	}
	r := min(max(float64(reported)/estimated, minRatio), maxRatio)
	p.log += (math.Log(r) - p.log) / 8
	p.learn(tools, other, float64(reported))
	v.combine()
}

// forget drops what replica (its id) taught of every model: it left the
// pool, and a replica reusing its id starts from the model's ratio.
func (u *units) forget(replica int) {
	m := u.models.Load()
	if m == nil {
		return
	}
	i := max(replica, 0) % maxTracked
	for _, v := range *m {
		v.mu.Lock()
		if i < len(v.per) && v.per[i].seen {
			v.per[i] = perUnit{}
			v.combine()
		}
		v.mu.Unlock()
	}
}

// combine sets the model's ratio and fit from its replicas'; with none
// heard from, the ratio stays. v.mu must be held.
func (v *unit) combine() {
	seen, fitted := 0, 0
	for i := range v.per {
		if v.per[i].seen {
			seen++
		}
		if v.per[i].fit != (scales{}) {
			fitted++
		}
	}
	if seen == 0 {
		v.fit.Store(nil)
		return
	}
	ratio := math.Exp(v.median(func(p *perUnit) (float64, bool) { return p.log, p.seen }))
	v.ratio.Store(math.Float64bits(min(max(ratio, minRatio), maxRatio)))
	if 2*fitted <= seen {
		v.fit.Store(nil)
		return
	}
	v.fit.Store(&scales{
		tools: v.median(func(p *perUnit) (float64, bool) { return p.fit.tools, p.fit != scales{} }),
		other: v.median(func(p *perUnit) (float64, bool) { return p.fit.other, p.fit != scales{} }),
	})
}

// median returns the median of the values f gives of v's replicas (the
// mean of the middle two for an even count), over those it says have one;
// at least one must. v.mu must be held.
func (v *unit) median(f func(*perUnit) (float64, bool)) float64 {
	v.scratch = v.scratch[:0]
	for i := range v.per {
		if x, ok := f(&v.per[i]); ok {
			v.scratch = append(v.scratch, x)
		}
	}
	slices.Sort(v.scratch)
	n := len(v.scratch)
	return (v.scratch[(n-1)/2] + v.scratch[n/2]) / 2
}

// learn adds a request to the replica's fit and solves it once determined:
// t and o estimated tokens of its tool schemas and of the rest, r the
// prompt tokens its engine reported.
func (p *perUnit) learn(t, o, r float64) {
	if t > 0 {
		p.n++
	}
	if p.n == 0 {
		return // no tools yet: the whole prompt's ratio serves
	}
	p.stt = fitDecay*p.stt + t*t
	p.sto = fitDecay*p.sto + t*o
	p.soo = fitDecay*p.soo + o*o
	p.stp = fitDecay*p.stp + t*r
	p.sop = fitDecay*p.sop + o*r
	det := p.stt*p.soo - p.sto*p.sto
	if p.n < fitMin || det <= 1e-3*p.stt*p.soo {
		return // too few, or tools always in the same share: no telling apart
	}
	// Tools may count nothing (a template that renders none); each block
	// still counts at least one token (scaleTokens). Other is at least
	// minRatio, so the fit is never the zero value.
	p.fit = scales{
		tools: min(max((p.stp*p.soo-p.sop*p.sto)/det, 0), maxRatio),
		other: min(max((p.sop*p.stt-p.stp*p.sto)/det, minRatio), maxRatio),
	}
}

// add learns a model seen for the first time, with ratio 1, unless
// maxModels are known already; it returns the model's unit, nil past the
// cap.
func (u *units) add(model string) *unit {
	u.mu.Lock()
	defer u.mu.Unlock()
	old := u.models.Load()
	if old != nil {
		if v := (*old)[model]; v != nil {
			return v
		}
		if len(*old) >= maxModels {
			return nil
		}
	}
	next := map[string]*unit{}
	if old != nil {
		maps.Copy(next, *old)
	}
	v := &unit{}
	v.ratio.Store(math.Float64bits(1)) // the estimate's, until replicas report
	next[model] = v
	u.models.Store(&next)
	return v
}
