package routing

import (
	"maps"
	"math"
	"sync"
	"sync/atomic"

	"github.com/semroute/semroute/blockhash"
)

// units learns, for each model, how many of the engine's tokens one of the
// splitter's estimated tokens is: the engine reports usage.prompt_tokens for
// a request whose prompt the splitter estimated, and the ratio of the two
// (an exponentially weighted average, weight 1/8) scales every later
// estimate for that model, so that tokens, budgets, load and the matched
// tokens the router reports are all in the engine's unit. The ratio also
// absorbs the chat template's tokens. A model never observed scales by 1.
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
// Safe for concurrent use.
type units struct {
	mu     sync.Mutex                       // serialises adding a model
	models atomic.Pointer[map[string]*unit] // copy-on-write
}

// unit is one model's learned ratios.
type unit struct {
	ratio atomic.Uint64 // float64 bits of the whole prompt's ratio
	fit   atomic.Pointer[scales]

	mu                      sync.Mutex // serialises the fit's sums
	n                       int        // requests with tools seen
	stt, sto, soo, stp, sop float64    // decayed sums of products of tool (t), other (o) and prompt (p) tokens
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
// from clients, so at most maxModels are kept. Real tokenizers count
// between about a third and three times the splitter's estimate (dense
// prose to one token per byte); a replica reporting prompt_tokens out of
// that range cannot make each block count as less than a quarter, or more
// than four times, its estimated tokens against a budget.
const (
	minRatio  = 1.0 / 4
	maxRatio  = 4.0
	maxModels = 256
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

// observe learns from one request: estimated splitter tokens of its tool
// schemas and of the rest against the engine's reported prompt tokens.
func (u *units) observe(model string, tools, other float64, reported int) {
	estimated := tools + other
	if estimated <= 0 || reported <= 0 {
		return
	}
	r := min(max(float64(reported)/estimated, minRatio), maxRatio)
	v := u.get(model)
	if v == nil {
		if v = u.add(model, r); v == nil {
			return
		}
	} else {
		for {
			old := v.ratio.Load()
			avg := math.Float64frombits(old)
			if v.ratio.CompareAndSwap(old, math.Float64bits(avg+(r-avg)/8)) {
				break
			}
		}
	}
	v.learn(tools, other, float64(reported))
}

// learn adds a request to the fit and solves it once determined.
func (v *unit) learn(t, o, p float64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if t > 0 {
		v.n++
	}
	if v.n == 0 {
		return // no tools yet: the whole prompt's ratio serves
	}
	v.stt = fitDecay*v.stt + t*t
	v.sto = fitDecay*v.sto + t*o
	v.soo = fitDecay*v.soo + o*o
	v.stp = fitDecay*v.stp + t*p
	v.sop = fitDecay*v.sop + o*p
	det := v.stt*v.soo - v.sto*v.sto
	if v.n < fitMin || det <= 1e-3*v.stt*v.soo {
		return // too few, or tools always in the same share: no telling apart
	}
	// Tools may count nothing (a template that renders none); each block
	// still counts at least one token (scaleTokens).
	v.fit.Store(&scales{
		tools: min(max((v.stp*v.soo-v.sop*v.sto)/det, 0), maxRatio),
		other: min(max((v.sop*v.stt-v.stp*v.sto)/det, minRatio), maxRatio),
	})
}

// add learns a model seen for the first time, with ratio r, unless
// maxModels are known already; it returns the model's unit, nil past the
// cap.
func (u *units) add(model string, r float64) *unit {
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
	v.ratio.Store(math.Float64bits(r)) // the first observation sets it
	next[model] = v
	u.models.Store(&next)
	return v
}
