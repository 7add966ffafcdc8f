package routing

import (
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
	mu     sync.Mutex
	models map[string]*atomic.Uint64 // float64 bits of the ratio
	n      atomic.Int32              // len(models), read without the lock
}

// Bounds of the learned ratio, and of the models learned: model names come
// from clients, so at most maxModels are kept.
const (
	minRatio  = 1.0 / 16
	maxRatio  = 16.0
	maxModels = 256
)

// scale returns the ratio learned for model, or 1.
func (u *units) scale(model string) float64 {
	if u.n.Load() == 0 {
		return 1
	}
	u.mu.Lock()
	v := u.models[model]
	u.mu.Unlock()
	if v == nil {
		return 1
	}
	return math.Float64frombits(v.Load())
}

// observe learns from one request: estimated splitter tokens against the
// engine's reported prompt tokens.
func (u *units) observe(model string, estimated float64, reported int) {
	if estimated <= 0 || reported <= 0 {
		return
	}
	r := min(max(float64(reported)/estimated, minRatio), maxRatio)
	u.mu.Lock()
	v := u.models[model]
	if v == nil {
		if len(u.models) >= maxModels {
			u.mu.Unlock()
			return
		}
		if u.models == nil {
			u.models = map[string]*atomic.Uint64{}
		}
		v = &atomic.Uint64{}
		v.Store(math.Float64bits(r)) // the first observation sets it
		u.models[model] = v
		u.n.Store(int32(len(u.models)))
		u.mu.Unlock()
		return
	}
	u.mu.Unlock()
	for {
		old := v.Load()
		avg := math.Float64frombits(old)
		if v.CompareAndSwap(old, math.Float64bits(avg+(r-avg)/8)) {
			return
		}
	}
}
