package routing

import (
	"cmp"
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
	// Split sets how prompts are cut into blocks. Split.Segments is set
	// when a replica blends (replica.ReuseBlend).
	Split blockhash.Options
	// BlendKinds are the block kinds a blending replica is credited for
	// holding beyond the exact prefix (cachemodel.Segments). Nil:
	// retrieved_context and tool_output, the segments that recur across
	// prompts in other places.
	BlendKinds []blockhash.Kind
	// Blending prepares the segment picture although no replica of
	// Replicas blends: set it when replicas that blend will be added
	// (AddReplica refuses them otherwise).
	Blending bool
	// Engine configures the engine. When Engine.Matcher is set, the cache
	// picture tells it of every eviction (Matcher.Forget).
	Engine EngineOptions
}

// New builds the splitter, the cache picture, the replica pool and the
// Engine over them.
func New(o Options) (*Engine, error) {
	needSegs, needMatcher := reuseNeeds(o.Replicas)
	if o.Engine.Matcher == nil && needMatcher {
		return nil, errDonorNeedsMatcher
	}
	var segs *cachemodel.Segments
	if o.Blending || needSegs {
		kinds := o.BlendKinds
		if kinds == nil {
			kinds = []blockhash.Kind{blockhash.KindRetrievedContext, blockhash.KindToolOutput}
		}
		segs = cachemodel.NewSegments(o.Eviction, kinds)
		o.Split.Segments = true
	}
	split, err := blockhash.NewSplitter(o.Split)
	if err != nil {
		return nil, err
	}
	co := cachemodel.Options{Policy: o.Eviction}
	if o.Engine.Matcher != nil {
		co.OnEvict = o.Engine.Matcher.Forget
	}
	j := &joiner{o: &o, pic: newPicture(cachemodel.New(co), segs, o.Engine.SharedActive), reuses: new(reuses)}
	pool, err := replica.NewPool(o.Replicas, replica.Options{HalfLife: o.LoadHalfLife}, j.join)
	if err != nil {
		return nil, err
	}
	e, err := newEngine(o.Engine, split, j.pic, pool)
	if err != nil {
		return nil, err
	}
	e.join, e.reuses, j.e = j.join, j.reuses, e
	return e, nil
}

// joiner gives a joining replica its pictures and its Reuse (the pool's
// join, replica.NewPool).
type joiner struct {
	o      *Options
	pic    *Picture
	reuses *reuses
	e      *Engine // nil while New builds the pool
}

func (j *joiner) join(s replica.Spec) (int, error) {
	u, err := newReuse(s.Reuse)
	if err != nil {
		return 0, err
	}
	budget := s.BudgetTokens
	if budget == 0 && j.o.DefaultBudget > 0 {
		budget = j.o.DefaultBudget
		if j.o.OnDefaultBudget != nil {
			j.o.OnDefaultBudget(s.Name, budget)
		}
	}
	id, err := j.pic.addReplica(s.Name, budget)
	if err != nil {
		return id, err
	}
	if j.e != nil {
		j.e.forgetFeedback(id) // a reused id starts from its own budget
	}
	j.reuses.set(id, u)
	segments, _ := u.needs()
	j.pic.setSegments(id, segments, cmp.Or(s.Reuse.BudgetTokens, budget))
	return id, nil
}

var errDonorNeedsMatcher = errors.New("routing: a replica that reuses donors needs EngineOptions.Matcher, the donor index")

// AddReplica adds a replica to the pool with an empty cache picture, under
// its budget or New's DefaultBudget. It needs an engine made by New.
func (e *Engine) AddReplica(s replica.Spec) (*replica.Replica, error) {
	if e.join == nil {
		return nil, errors.New("routing: AddReplica needs an engine made by New")
	}
	segments, matcher := reuseNeeds([]replica.Spec{s})
	if segments && !e.pic.blending() {
		return nil, errors.New("routing: a blending replica joins only a pool that had one from the start (its prompts' segment keys are computed from then on)")
	}
	if matcher && e.o.Matcher == nil {
		return nil, errDonorNeedsMatcher
	}
	return e.pool.Add(s, e.join)
}

// DropPicture forgets replica id's pictures and what its reports taught of
// token units (it left the pool and nothing is in flight on it), so that a
// replica reusing its id starts clean.
func (e *Engine) DropPicture(id int) {
	e.pic.drop(id)
	e.units.forget(id)
}
