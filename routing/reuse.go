package routing

import (
	"fmt"
	"slices"
	"sort"
	"sync/atomic"

	"github.com/semroute/semroute/replica"
)

// Reuse is how the router credits what a replica's engine reuses of a
// prompt's KV past the exact prefix. Each replica has one, made when it
// joins from its replica.Reuse by the mode registered under
// replica.Reuse.Mode (ReuseModes): prefix (nothing past the prefix, vLLM
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
}

// reuseModes are the registered modes, by name: a constructor from the
// replica's spec and what the engine must have for it.
var reuseModes = map[string]struct {
	make     func(replica.Reuse) Reuse
	segments bool // the blending replicas' segment picture (New's Blending)
	matcher  bool // a donor index (EngineOptions.Matcher)
}{
	replica.ReusePrefix: {make: func(replica.Reuse) Reuse { return prefixReuse{} }},
	replica.ReuseBlend:  {make: func(u replica.Reuse) Reuse { return blendReuse{share: u.Share()} }, segments: true},
	replica.ReuseDonor:  {make: func(u replica.Reuse) Reuse { return donorReuse{min: u.Similarity()} }, matcher: true},
}

// ReuseModes lists the registered reuse modes, sorted.
func ReuseModes() []string {
	out := make([]string, 0, len(reuseModes))
	for m := range reuseModes {
		out = append(out, m)
	}
	sort.Strings(out)
	return out
}

// newReuse returns the Reuse of a replica spec's mode ("" is prefix).
func newReuse(u replica.Reuse) (Reuse, error) {
	m, ok := reuseModes[modeOf(u)]
	if !ok {
		return nil, fmt.Errorf("routing: unknown reuse mode %q (have %v)", u.Mode, ReuseModes())
	}
	return m.make(u), nil
}

func modeOf(u replica.Reuse) string {
	if u.Mode == "" {
		return replica.ReusePrefix
	}
	return u.Mode
}

// reuseNeeds reports whether any of specs needs the segment picture and a
// donor index.
func reuseNeeds(specs []replica.Spec) (segments, matcher bool) {
	for _, s := range specs {
		m := reuseModes[modeOf(s.Reuse)]
		segments, matcher = segments || m.segments, matcher || m.matcher
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
			m := reuseModes[x.Mode()]
			s.donors, s.credits = s.donors || m.matcher, s.credits || m.segments
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

// blendReuse: the engine also reuses the segments it holds anywhere in
// the prompt, computing 1 − share of their tokens again.
type blendReuse struct{ share float64 }

func (blendReuse) Mode() string { return replica.ReuseBlend }
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
