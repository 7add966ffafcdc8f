package routing

import (
	"maps"
	"math"
	"sync"
	"sync/atomic"
)

// units learns, for each model, how many of the engine's tokens one of the
// splitter's estimated tokens is: the engine reports usage.prompt_tokens for
// a request whose prompt the splitter estimated, and the ratio of the two
// (an exponentially weighted average, weight 1/8) scales every later
// estimate for that model, so that tokens, budgets, load and the matched
// tokens the router reports are all in the engine's unit. The ratio also
// absorbs the chat template's tokens. A model never observed scales by 1.
// Safe for concurrent use.
type units struct {
	mu     sync.Mutex                                // serialises adding a model
	models atomic.Pointer[map[string]*atomic.Uint64] // copy-on-write: float64 bits of each ratio
}

// Bounds of the learned ratio, and of the models learned: model names come
// from clients, so at most maxModels are kept.
const (
	minRatio  = 1.0 / 16
	maxRatio  = 16.0
	maxModels = 256
)

// scale returns the ratio learned for model, or 1. It takes no lock.
func (u *units) scale(model string) float64 {
	if m := u.models.Load(); m != nil {
		if v := (*m)[model]; v != nil {
			return math.Float64frombits(v.Load())
		}
	}
	return 1
}

// observe learns from one request: estimated splitter tokens against the
// engine's reported prompt tokens.
func (u *units) observe(model string, estimated float64, reported int) {
	if estimated <= 0 || reported <= 0 {
		return
	}
	r := min(max(float64(reported)/estimated, minRatio), maxRatio)
	var v *atomic.Uint64
	if m := u.models.Load(); m != nil {
		v = (*m)[model]
	}
	if v == nil {
		u.add(model, r)
		return
	}
	for {
		old := v.Load()
		avg := math.Float64frombits(old)
		if v.CompareAndSwap(old, math.Float64bits(avg+(r-avg)/8)) {
			return
		}
	}
}

// add learns a model seen for the first time, with ratio r, unless
// maxModels are known already.
func (u *units) add(model string, r float64) {
	u.mu.Lock()
	defer u.mu.Unlock()
	old := u.models.Load()
	if old != nil && ((*old)[model] != nil || len(*old) >= maxModels) {
		return
	}
	next := map[string]*atomic.Uint64{}
	if old != nil {
		maps.Copy(next, *old)
	}
	v := &atomic.Uint64{}
	v.Store(math.Float64bits(r)) // the first observation sets it
	next[model] = v
	u.models.Store(&next)
}
