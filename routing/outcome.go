package routing

import "cmp"

// PrefixOutcome is what became of a prompt token's prefix caching: found
// cached where the request ran, or why not. Every prompt token of a
// finished request is given exactly one (PrefixOutcomes), so that an
// operator can tell a cold workload from tokens the routing lost.
type PrefixOutcome uint8

// The outcomes, in the order PrefixOutcomes' ledger gives them tokens
// (see PrefixOutcomes for the rule of each).
const (
	// PrefixHit: the engine found them cached (or, without its report,
	// the router predicted them on the replica that served).
	PrefixHit PrefixOutcome = iota
	// PrefixEvicted: predicted cached on the serving replica, not found
	// by its engine, the request not having waited for KV room.
	PrefixEvicted
	// PrefixWaited: predicted cached on the serving replica, not found
	// by its engine, the request having waited for KV room (its replica
	// short of KV, or the request held in the router's queue).
	PrefixWaited
	// PrefixRoutedAwayLoad: another candidate held them, and the
	// decision says it was the more loaded or slower.
	PrefixRoutedAwayLoad
	// PrefixRoutedAway: another candidate held them, and the decision
	// says nothing of load (a cache-blind policy's turn, a tie, a
	// failover).
	PrefixRoutedAway
	// PrefixCold: no candidate held them.
	PrefixCold
	// NumPrefixOutcomes is the number of outcomes.
	NumPrefixOutcomes
)

var prefixOutcomeNames = [NumPrefixOutcomes]string{"hit", "evicted", "waited", "routed_away_load", "routed_away", "cold"}

// String returns the outcome's name as metrics and the decision log spell
// it: "hit", "evicted", "waited", "routed_away_load", "routed_away",
// "cold".
func (o PrefixOutcome) String() string {
	if o < NumPrefixOutcomes {
		return prefixOutcomeNames[o]
	}
	return "unknown"
}

// PrefixTokens are a request's prompt tokens by outcome, indexed by
// PrefixOutcome. The zero value is a request not classified.
type PrefixTokens [NumPrefixOutcomes]int64

// Sum returns the tokens classified: the prompt's, or 0.
func (p *PrefixTokens) Sum() int64 {
	var n int64
	for _, v := range p {
		n += v
	}
	return n
}

// PrefixOutcomes classifies the prompt tokens of decision d's request,
// served by candidate served (one of d's, or the one a failover moved it
// to) and answered with usage u, by outcome; queued says it waited in the
// router's queue (flow control) before it was placed, and block is the
// block size in the decision's tokens (Engine.Splitter's BlockTokens: a
// precise decision's own engine block is used instead; 0 counts every
// difference). The outcomes sum to the prompt's tokens: u.PromptTokens
// when the engine reported them, else d.Tokens (the estimate, in the
// engine's unit as learned). A request not answered OK, or without a
// prompt (no blocks: a pass-through), is not classified: the zero value.
//
// A candidate's hold is the cached tokens its engine was expected to
// report (Candidate.Predicted), at most the prompt. With P the prompt's
// tokens, S the serving replica's hold and B the longest hold of the other
// candidates, each token goes to the first outcome of this ledger that
// has room for it:
//
//	hit         = the cached tokens the engine reported (at most P), else S
//	shortfall   = S − hit when the engine reported, if at least a block:
//	              waited if the request waited for KV room
//	              (served.State.KVShort, the policy's reason "kv" on it,
//	              queued, or d.Deferred), else evicted
//	routed away = B − (hit + shortfall), if at least a block
//	cold        = the rest: P − max(hit + shortfall, B)
//
// A difference under a block is cold, not lost: an engine caches whole
// blocks only, and computes at least the prompt's last token (vLLM caps a
// hit at the prompt's tokens less one, in whole blocks), so the tail of a
// prefix that ends inside a block is computed wherever the request goes,
// while the router's hold counts it (Engine.Feedback ignores such a
// difference too).
//
// A request that waited for KV room sat while its engine freed blocks: the
// prefix it was predicted to find was evicted to make that room, or its
// blocks, routed there with an earlier request still waiting for room
// themselves, were not stored yet; either way the wait, not the picture,
// explains the shortfall, so it is waited rather than evicted.
//
// So a token the engine found is a hit wherever else it was held; one the
// router predicted where the request ran but the engine did not find is
// lost there (evicted, or waited), not routed away, even if another
// replica held it too; one only another candidate held was routed away;
// and one no candidate held is cold. A blending engine's reuse past the
// prefix counts as hit when reported, and is not credited to other
// candidates.
//
// Routed away is routed_away_load when the decision says the holder lost
// on load: the holder (the other candidate with the longest hold, the best
// ranked of those that tie: lowest Tier, then Score) was short of KV room
// where the serving replica was not, or had more requests to wait for
// (State.Queued), or a longer predicted time to first token (TTFT, both
// predicted), or the policy's reason on it names load ("spill", "kv",
// "queue", "load"). Otherwise it is routed_away: a cache-blind policy's
// turn or draw, a tie left to the rendezvous hash, a prefix copy's cost,
// or a failover off the holder.
//
// It allocates nothing; O(candidates).
func PrefixOutcomes(d *Decision, served *Candidate, u Usage, queued bool, block int) PrefixTokens {
	var out PrefixTokens
	if d == nil || served == nil || !u.OK || len(d.Blocks) == 0 {
		return out
	}
	prompt := u.PromptTokens
	if prompt <= 0 {
		prompt = int64(d.Tokens)
	}
	if prompt <= 0 {
		return out
	}
	blk := max(int64(cmp.Or(d.blockTokens, block)), 1)
	hold := func(c *Candidate) int64 { return min(max(int64(c.Predicted()), 0), prompt) }
	s := hold(served)
	hit := s
	if u.CachedReported {
		hit = min(max(u.CachedTokens, 0), prompt)
	}
	out[PrefixHit] = hit
	covered := hit
	if short := s - hit; short >= blk {
		covered = s
		out[lostWhere(d, served, queued)] = short
	}
	holder, best := holderOf(d, served, hold)
	if away := best - covered; away >= blk {
		if lostOnLoad(holder, served) {
			out[PrefixRoutedAwayLoad] = away
		} else {
			out[PrefixRoutedAway] = away
		}
		covered = best
	}
	out[PrefixCold] = prompt - covered
	return out
}

// lostWhere says where tokens predicted on served and not found went:
// PrefixWaited when the request waited for room (the router's queue, a
// deferred decision, no KV room on served), else PrefixEvicted.
func lostWhere(d *Decision, served *Candidate, queued bool) PrefixOutcome {
	if queued || d.Deferred || served.State.KVShort || served.Reason == reasonNoRoom {
		return PrefixWaited
	}
	return PrefixEvicted
}

// holderOf returns the candidate of d other than served with the longest
// hold, the best ranked of those that tie, and its hold; nil and 0 when no
// other candidate holds any.
func holderOf(d *Decision, served *Candidate, hold func(*Candidate) int64) (*Candidate, int64) {
	cands := d.Candidates
	if len(cands) == 0 {
		cands = d.Ranked
	}
	var holder *Candidate
	best := int64(0)
	for i := range cands {
		c := &cands[i]
		if c.Replica == served.Replica {
			continue
		}
		h := hold(c)
		if h > best || (h == best && holder != nil && rankedBefore(c, holder)) {
			holder, best = c, h
		}
	}
	return holder, best
}

// rankedBefore reports whether a ranks before b on the decision's numbers
// (Tier, then Score); the rendezvous tie-break is not repeated.
func rankedBefore(a, b *Candidate) bool {
	if a.Tier != b.Tier {
		return a.Tier < b.Tier
	}
	return a.Score < b.Score
}

// lostOnLoad reports whether the decision says holder h lost to served
// s on load (PrefixOutcomes).
func lostOnLoad(h, s *Candidate) bool {
	switch h.Reason {
	case reasonSpill, reasonNoRoom, "queue", "load":
		return true
	}
	return (h.State.KVShort && !s.State.KVShort) || h.State.Queued > s.State.Queued ||
		(h.TTFT > 0 && s.TTFT > 0 && h.TTFT > s.TTFT)
}
