package routing

import (
	"math"
	"sync"

	"github.com/semroute/semroute/cachemodel"
)

// counting learns, per event-driven replica, how much its engine counts of
// what the events picture can not confirm, in the cached tokens it reports
// (usage.prompt_tokens_details.cached_tokens):
//
//   - Past: vLLM and SGLang count the prompt's leading cached prefix only,
//     while llm-d-inference-sim counts every block of the prompt it holds,
//     wherever the chain breaks (its kv-cache helper looks each block up on
//     its own; its LRU evicts from the middle of chains): Match.Past.
//   - Pending: blocks routed to the replica whose store events have not
//     come yet (Match.Tokens past Match.Confirmed) are often cached by the
//     time the engine runs the request: the simulator stores a prompt's
//     blocks when it starts it and publishes its events in batches up to
//     a second later (pkg/kv-cache/kv_cache_sender.go); vLLM stores blocks
//     as it computes them, and a request routed behind another sharing its
//     prefix finds them or not as the two are scheduled.
//
// Neither is all or nothing on an engine that queues: a routed request's
// blocks are cached if it has started, and past blocks are held until the
// engine evicts them. So each is learned as a share, the ratio of decayed
// sums of the tokens the engine reported of it to the tokens it offered
// (a ratio estimator: the prediction it makes is unbiased in total). A
// reply that offers both splits what the engine reported beyond the
// confirmed prefix between them in proportion to what the shares learned
// so far expect. Sums decay by 1/64 a reply, so a replica that changes
// engine is relearned within about a hundred requests. Safe for concurrent
// use; the zero value is ready.
type counting struct {
	mu     sync.Mutex
	shares map[int]*shares // by replica id
}

// shares are a replica's decayed sums of pending and past tokens, offered
// and reported, in tokens.
type shares struct {
	pendingOffered, pendingReported float64
	pastOffered, pastReported       float64
}

// Until a replica's replies teach its shares they are read from priors:
// half of the pending tokens (whether a routed request has started when
// the next one runs is a coin toss until measured) and none of the past
// ones (the leading prefix only, as vLLM counts). The first reply that
// offers a kind seeds its sums with countingPrior replies of its size at
// the prior, which decay as any reply does. countingDecay is what the sums
// keep at each reply.
const (
	countingPrior = 4.0
	pendingPrior  = 0.5
	pastPrior     = 0.0
	countingDecay = 63.0 / 64
)

// reading is how much of each kind of unconfirmed tokens replica's engine
// is expected to report as cached: shares in [0, 1].
type reading struct{ pending, past float64 }

// read returns how replica id's engine counts, as learned.
func (c *counting) read(id int) reading {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.readLocked(id)
}

func (c *counting) readLocked(id int) reading {
	r := reading{pending: pendingPrior, past: pastPrior}
	if s := c.shares[id]; s != nil {
		if s.pendingOffered > 0 {
			r.pending = s.pendingReported / s.pendingOffered
		}
		if s.pastOffered > 0 {
			r.past = s.pastReported / s.pastOffered
		}
	}
	return r
}

// predict is the cached tokens an engine counting as r reports for a
// match m.
func (r reading) predict(m cachemodel.Match) int {
	return m.Confirmed + int(math.Round(r.pending*float64(m.Tokens-m.Confirmed)+r.past*float64(m.Past)))
}

// observe learns from one reply of replica id: m is the picture's match
// before the request, cached what the engine reported, block the engine's
// block size in tokens. A kind offered less than a block teaches nothing of
// it.
func (c *counting) observe(id int, m cachemodel.Match, cached, block int) {
	if block <= 0 {
		return
	}
	pending, past := float64(m.Tokens-m.Confirmed), float64(m.Past)
	askPending, askPast := pending >= float64(block), past >= float64(block)
	if !askPending && !askPast {
		return
	}
	if !askPending {
		pending = 0
	}
	if !askPast {
		past = 0
	}
	extra := min(max(float64(cached-m.Confirmed), 0), pending+past)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.shares == nil {
		c.shares = map[int]*shares{}
	}
	s := c.shares[id]
	if s == nil {
		s = &shares{}
		c.shares[id] = s
	}
	// Split extra between the kinds as the shares read now expect (the
	// priors, before any reply), each at most what it offered; a share
	// read as 0 still takes a little, so that it can be learned again.
	r := c.readLocked(id)
	wantPending, wantPast := pending*max(r.pending, 0.05), past*max(r.past, 0.05) // neither ruled out
	gotPending := 0.0
	if wantPending+wantPast > 0 {
		gotPending = extra * wantPending / (wantPending + wantPast)
	}
	gotPending = min(gotPending, pending)
	gotPast := min(extra-gotPending, past)
	gotPending = min(extra-gotPast, pending) // what past could not hold
	if askPending && s.pendingOffered == 0 {
		s.pendingOffered, s.pendingReported = countingPrior*pending, countingPrior*pending*pendingPrior
	}
	if askPast && s.pastOffered == 0 {
		s.pastOffered, s.pastReported = countingPrior*past, countingPrior*past*pastPrior
	}
	if askPending {
		s.pendingOffered = s.pendingOffered*countingDecay + pending
		s.pendingReported = s.pendingReported*countingDecay + gotPending
	}
	if askPast {
		s.pastOffered = s.pastOffered*countingDecay + past
		s.pastReported = s.pastReported*countingDecay + gotPast
	}
}

// forget drops replica id's shares (it left, or its engine restarted).
func (c *counting) forget(id int) {
	c.mu.Lock()
	delete(c.shares, id)
	c.mu.Unlock()
}
