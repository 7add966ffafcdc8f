package routing

import (
	"sync"

	"github.com/semroute/semroute/cachemodel"
)

// counting learns, per event-driven replica, how its engine counts the
// cached tokens it reports (usage.prompt_tokens_details.cached_tokens),
// on two questions the events picture can answer both ways:
//
//   - Past: vLLM and SGLang count the prompt's leading cached prefix only,
//     while llm-d-inference-sim counts every block of the prompt it holds,
//     wherever the chain breaks (its kv-cache helper looks each block up on
//     its own; its LRU evicts from the middle of chains): Match.Past.
//   - Pending: blocks routed to the replica whose store events have not
//     come yet (Match.Tokens past Match.Confirmed) are often cached by the
//     time the engine runs the request (the simulator stores a prompt's
//     blocks when it starts it; vLLM when it computes them), and the
//     events that say so are batched behind them.
//
// Each reply is a vote, on each question where the two readings differ by
// a block or more, for the answer of the reading (of the four) closest to
// what the engine reported; votes decay by 1/64 per vote, so a replica
// that changes engine is relearned within about a hundred requests. Safe
// for concurrent use; the zero value is ready.
type counting struct {
	mu    sync.Mutex
	votes map[int]*votes // by replica id
}

// votes are a replica's decayed votes, in requests: against and for
// counting Match.Past, and Match.Tokens rather than Match.Confirmed.
type votes struct{ prefix, anywhere, confirmed, pending float64 }

// countingMin is the votes a yes needs, and countingLead how many times
// the no's, before the replica is read that way.
const (
	countingMin   = 8
	countingLead  = 3
	countingDecay = 63.0 / 64
)

// reading is how replica id's engine is expected to count.
type reading struct{ past, pending bool }

// read returns how replica id's engine counts, as learned.
func (c *counting) read(id int) reading {
	c.mu.Lock()
	defer c.mu.Unlock()
	v := c.votes[id]
	if v == nil {
		return reading{}
	}
	return reading{
		past:    v.anywhere >= countingMin && v.anywhere > countingLead*v.prefix,
		pending: v.pending >= countingMin && v.pending > countingLead*v.confirmed,
	}
}

// anywhere reports whether replica id's engine counts held blocks past
// the prefix as cached.
func (c *counting) anywhere(id int) bool { return c.read(id).past }

// predict is the cached tokens replica id's engine is expected to report
// for a match m.
func (c *counting) predict(id int, m cachemodel.Match) int { return c.read(id).predict(m) }

// predict is the cached tokens an engine counting as r reports for a
// match m.
func (r reading) predict(m cachemodel.Match) int {
	n := m.Confirmed
	if r.pending {
		n = m.Tokens
	}
	if r.past {
		n += m.Past
	}
	return n
}

// observe votes for replica id from one reply: m is the picture's match
// before the request, cached what the engine reported, block the
// engine's block size in tokens.
func (c *counting) observe(id int, m cachemodel.Match, cached, block int) {
	if block <= 0 {
		return
	}
	askPast, askPending := m.Past >= block, m.Tokens-m.Confirmed >= block
	if !askPast && !askPending {
		return // the readings agree
	}
	best, tie, bestDist := reading{}, false, -1
	for _, r := range []reading{{}, {past: true}, {pending: true}, {past: true, pending: true}} {
		switch d := abs(cached - r.predict(m)); {
		case bestDist < 0 || d < bestDist:
			best, tie, bestDist = r, false, d
		case d == bestDist && r != best:
			tie = tie || (askPast && r.past != best.past) || (askPending && r.pending != best.pending)
		}
	}
	if tie {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.votes == nil {
		c.votes = map[int]*votes{}
	}
	v := c.votes[id]
	if v == nil {
		v = &votes{}
		c.votes[id] = v
	}
	if askPast {
		v.prefix *= countingDecay
		v.anywhere *= countingDecay
		if best.past {
			v.anywhere++
		} else {
			v.prefix++
		}
	}
	if askPending {
		v.confirmed *= countingDecay
		v.pending *= countingDecay
		if best.pending {
			v.pending++
		} else {
			v.confirmed++
		}
	}
}

// forget drops replica id's votes (it left, or its engine restarted).
func (c *counting) forget(id int) {
	c.mu.Lock()
	delete(c.votes, id)
	c.mu.Unlock()
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}
