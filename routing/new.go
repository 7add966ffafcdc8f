package routing

import (
	"errors"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/eviction"
	"github.com/semroute/semroute/replica"
)

// Options assemble an Engine with the cache picture and the replica pool it
// routes over (New): the one constructor the router, replay and the tests
// share. Zero fields take the defaults stated.
type Options struct {
	// Replicas are the pool's first members, in order; more join through
	// Engine.AddReplica.
	Replicas []replica.Spec
	// DefaultBudget is the token budget of the cache picture of a replica
	// whose spec sets none (BudgetTokens 0). Zero means unlimited.
	DefaultBudget int64
	// OnDefaultBudget, if set, is called when a replica joins with
	// DefaultBudget, so that the assumption can be logged.
	OnDefaultBudget func(name string, tokens int64)
	// LoadHalfLife is the half-life of the pool's recent-work signal; zero
	// counts only work in flight.
	LoadHalfLife time.Duration
	// Eviction makes each replica's eviction policy in the cache picture.
	// Nil means LRU.
	Eviction eviction.Factory
	// Split sets how prompts are cut into blocks.
	Split blockhash.Options
	// Engine configures the engine. When Engine.Matcher is set, the cache
	// picture tells it of every eviction (Matcher.Forget).
	Engine EngineOptions
}

// New builds the splitter, the cache picture, the replica pool and the
// Engine over them.
func New(o Options) (*Engine, error) {
	split, err := blockhash.NewSplitter(o.Split)
	if err != nil {
		return nil, err
	}
	co := cachemodel.Options{Policy: o.Eviction}
	if o.Engine.Matcher != nil {
		co.OnEvict = o.Engine.Matcher.Forget
	}
	cache := cachemodel.New(co)
	var e *Engine
	join := func(s replica.Spec) (int, error) {
		budget := s.BudgetTokens
		if budget == 0 && o.DefaultBudget > 0 {
			budget = o.DefaultBudget
			if o.OnDefaultBudget != nil {
				o.OnDefaultBudget(s.Name, budget)
			}
		}
		id, err := cache.AddReplica(s.Name, budget)
		if err == nil && e != nil {
			e.forgetFeedback(id) // a reused id starts from its own budget
		}
		return id, err
	}
	pool, err := replica.NewPool(o.Replicas, replica.Options{HalfLife: o.LoadHalfLife}, join)
	if err != nil {
		return nil, err
	}
	e, err = newEngine(o.Engine, split, cache, pool)
	if err != nil {
		return nil, err
	}
	e.join = join
	return e, nil
}

// AddReplica adds a replica to the pool with an empty cache picture, under
// its budget or New's DefaultBudget. It needs an engine made by New.
func (e *Engine) AddReplica(s replica.Spec) (*replica.Replica, error) {
	if e.join == nil {
		return nil, errors.New("routing: AddReplica needs an engine made by New")
	}
	return e.pool.Add(s, e.join)
}
