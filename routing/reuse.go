package routing

import (
	"cmp"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/semroute/semroute/plugin"
	"github.com/semroute/semroute/replica"
)

// Reuse is how the router credits what a replica's engine reuses of a
// prompt's KV past the exact prefix. Each replica has one, made when it
// joins from its replica.Reuse by the mode registered under
// replica.Reuse.Mode (ReuseModes, with replica.Reuse.Spec's parameters): prefix (nothing past the prefix, vLLM
// and SGLang), blend (cached segments anywhere in the prompt, CacheBlend)
// and donor (a similar earlier prompt's KV, SGLang's
// SemanticPrefixProvider). The engine asks it at each step of a decision
// and never branches on the mode itself.
type Reuse interface {
	// Mode is the name the mode is registered under.
	Mode() string
	// credit returns the tokens past c.Match the engine is expected to
	// reuse, from the decision's lookup (blend: what the replica's
	// segments hold beyond the match, less the recompute share).
	credit(c *Candidate, sc *scratch) float64
	// donor returns the tokens credited for a donor of sim similarity
	// whose prompt had tokens tokens, and false if the engine would not
	// take it; only modes that reuse donors take any.
	donor(c *Candidate, promptTokens, tokens int, sim float64) (float64, bool)
	// committed records d's blocks on c's replica in the picture the mode
	// keeps of its own, if any (blend: the replica's segments).
	committed(p *Picture, d *Decision, c *Candidate, now int64)
	// predicted returns the cached tokens the engine is expected to report
	// for c, and whether only fewer than that measure the picture (a donor
	// engine reports whatever its own provider found besides).
	predicted(c *Candidate) (tokens int64, onlyFewer bool)
	// needs reports what the engine must have for the mode: the blending
	// replicas' segment picture (New's Blending), a donor index
	// (EngineOptions.Matcher).
	needs() (segments, matcher bool)
}

// reuseModes are the registered reuse modes (reuseRegistry).
var reuseModes = reuseRegistry()

// reuseRegistry returns the reuse modes, by name: the one place they are
// registered. Each is made from a replica's replica.Reuse as a plugin spec
// (replica.Reuse.Spec).
func reuseRegistry() *plugin.Registry[Reuse] {
	return plugin.NewRegistry("reuse mode", "",
		plugin.Plugin[Reuse]{Name: replica.ReusePrefix, New: func(plugin.Params) (Reuse, error) { return prefixReuse{}, nil }},
		plugin.Plugin[Reuse]{Name: replica.ReuseBlend, Params: blendParams{}, New: func(p plugin.Params) (Reuse, error) {
			c, err := plugin.DecodeOver(p, blendParams{Recompute: replica.DefaultRecompute}, func(c *blendParams) error {
				if !(c.Recompute >= 0 && c.Recompute < 1) {
					return fmt.Errorf("recompute must be in [0, 1), not %v", c.Recompute)
				}
				return nil
			})
			return blendReuse{share: 1 - cmp.Or(c.Recompute, replica.DefaultRecompute)}, err
		}},
		plugin.Plugin[Reuse]{Name: replica.ReuseDonor, Params: donorParams{}, New: func(p plugin.Params) (Reuse, error) {
			c, err := plugin.DecodeOver(p, donorParams{MinSimilarity: replica.DefaultMinSimilarity}, func(c *donorParams) error {
				if !(c.MinSimilarity >= 0 && c.MinSimilarity <= 1) {
					return fmt.Errorf("min_similarity must be in [0, 1], not %v", c.MinSimilarity)
				}
				return nil
			})
			return donorReuse{min: cmp.Or(c.MinSimilarity, replica.DefaultMinSimilarity)}, err
		}},
	)
}

// blendParams are blend's parameters (replica.Reuse's).
type blendParams struct {
	// Recompute is the share of a blended segment's tokens the engine
	// computes again, in [0, 1); 0: replica.DefaultRecompute.
	Recompute float64 `json:"recompute"`
}

// donorParams are donor's parameters (replica.Reuse's).
type donorParams struct {
	// MinSimilarity is the least similarity of a donor the engine reuses,
	// in [0, 1]; 0: replica.DefaultMinSimilarity.
	MinSimilarity float64 `json:"min_similarity"`
}

// ReuseModes lists the registered reuse modes, in registration order.
func ReuseModes() []string { return reuseModes.Names() }

// newReuse returns the Reuse of a replica spec's mode ("" is prefix).
func newReuse(u replica.Reuse) (Reuse, error) {
	r, err := reuseModes.New(u.Spec())
	if err != nil {
		return nil, fmt.Errorf("routing: %w", err)
	}
	return r, nil
}

// reuseNeeds reports whether any of specs needs the segment picture and a
// donor index (a spec whose mode is unknown needs neither: New refuses it
// at its join).
func reuseNeeds(specs []replica.Spec) (segments, matcher bool) {
	for _, s := range specs {
		if u, err := newReuse(s.Reuse); err == nil {
			seg, mat := u.needs()
			segments, matcher = segments || seg, matcher || mat
		}
	}
	return segments, matcher
}

// reuses is each replica's Reuse by id, copy-on-write: replicas join
// rarely, decisions read it at every candidate (a decision reads one
// snapshot, reuseSet).
type reuses struct{ p atomic.Pointer[reuseSet] }

// reuseSet is one snapshot of reuses: by replica id, and whether any
// needs the donor index or credits from the segment picture.
type reuseSet struct {
	by              []Reuse
	donors, credits bool
}

// load returns the current snapshot (empty before any replica joined).
func (r *reuses) load() *reuseSet {
	if s := r.p.Load(); s != nil {
		return s
	}
	return &reuseSet{}
}

// of returns replica id's Reuse (prefix if unknown).
func (s *reuseSet) of(id int) Reuse {
	if id < len(s.by) && s.by[id] != nil {
		return s.by[id]
	}
	return prefixReuse{}
}

// of returns replica id's Reuse in the current snapshot.
func (r *reuses) of(id int) Reuse { return r.load().of(id) }

// set makes u replica id's Reuse. Callers serialise (the pool's join).
func (r *reuses) set(id int, u Reuse) {
	s := &reuseSet{by: slices.Clone(r.load().by)}
	for len(s.by) <= id {
		s.by = append(s.by, nil)
	}
	s.by[id] = u
	for _, x := range s.by {
		if x != nil {
			segments, matcher := x.needs()
			s.donors, s.credits = s.donors || matcher, s.credits || segments
		}
	}
	r.p.Store(s)
}

// prefixReuse: the engine reuses the exact prefix alone.
type prefixReuse struct{}

func (prefixReuse) Mode() string                                        { return replica.ReusePrefix }
func (prefixReuse) credit(*Candidate, *scratch) float64                 { return 0 }
func (prefixReuse) donor(*Candidate, int, int, float64) (float64, bool) { return 0, false }
func (prefixReuse) committed(*Picture, *Decision, *Candidate, int64)    {}
func (prefixReuse) predicted(c *Candidate) (int64, bool)                { return int64(c.Match.Tokens), false }
func (prefixReuse) needs() (segments, matcher bool)                     { return false, false }

// blendReuse: the engine also reuses the segments it holds anywhere in
// the prompt, computing 1 − share of their tokens again.
type blendReuse struct{ share float64 }

func (blendReuse) Mode() string                    { return replica.ReuseBlend }
func (blendReuse) needs() (segments, matcher bool) { return true, false }
func (b blendReuse) credit(c *Candidate, sc *scratch) float64 {
	if id := c.Replica.ID; id < len(sc.beyond) {
		return sc.beyond[id] * b.share
	}
	return 0
}
func (blendReuse) donor(*Candidate, int, int, float64) (float64, bool) { return 0, false }
func (blendReuse) committed(p *Picture, d *Decision, c *Candidate, now int64) {
	p.recordSegments(c.Replica.ID, d.Blocks, now)
}

// A blending engine reports what it reused too.
func (blendReuse) predicted(c *Candidate) (int64, bool) {
	return int64(c.Match.Tokens) + int64(c.Reuse), false
}

// donorReuse: when the exact prefix falls short, the engine also reuses
// what it holds of a donor at least min similar.
type donorReuse struct{ min float64 }

func (donorReuse) Mode() string                                     { return replica.ReuseDonor }
func (donorReuse) needs() (segments, matcher bool)                  { return false, true }
func (donorReuse) credit(*Candidate, *scratch) float64              { return 0 }
func (donorReuse) committed(*Picture, *Decision, *Candidate, int64) {}

// donor credits the donor's tokens past the exact match, up to the
// prompt's, times the similarity: the engine reuses what it holds of the
// donor in place of the prompt's own prefix (SGLang PR 20806: the donor's
// tokens are looked up in the prefix cache), and the similarity discounts a
// donor the engine's own provider may rank otherwise.
func (r donorReuse) donor(c *Candidate, promptTokens, tokens int, sim float64) (float64, bool) {
	if sim < r.min {
		return 0, false
	}
	return sim * float64(max(min(tokens, promptTokens)-c.Match.Tokens, 0)), true
}

// A donor engine reports at least its exact prefix, and whatever its own
// provider found besides: only fewer than the prefix measures the picture.
func (donorReuse) predicted(c *Candidate) (int64, bool) { return int64(c.Match.Tokens), true }
