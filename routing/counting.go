package routing

import "sync"

// counting learns, per event-driven replica, how its engine counts the
// cached tokens it reports (usage.prompt_tokens_details.cached_tokens):
// vLLM and SGLang count the prompt's leading cached prefix only, while
// llm-d-inference-sim counts every block of the prompt it holds, wherever
// the chain breaks (its kv-cache helper looks each block up on its own;
// its LRU evicts from the middle of chains). Both are read from the same
// events picture: Match.Confirmed is the prefix and Match.Past the blocks
// held past it. Each reply where the two differ by a block or more is a
// vote for the reading closer to what the engine reported; votes decay
// by 1/64 per vote, so a replica behind the same URL that changes engine
// is relearned within about a hundred requests. Safe for concurrent use;
// the zero value is ready.
type counting struct {
	mu    sync.Mutex
	votes map[int]*votes // by replica id
}

// votes are a replica's decayed votes, in requests.
type votes struct{ prefix, anywhere float64 }

// countingMin is the votes the anywhere reading needs, and countingLead
// how many times the prefix reading's, before the replica counts anywhere.
const (
	countingMin   = 8
	countingLead  = 3
	countingDecay = 63.0 / 64
)

// anywhere reports whether replica id's engine counts held blocks past
// the prefix as cached.
func (c *counting) anywhere(id int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	v := c.votes[id]
	return v != nil && v.anywhere >= countingMin && v.anywhere > countingLead*v.prefix
}

// observe votes for replica id from one reply: prefix and past are the
// tokens the picture held before the request (Match.Confirmed, Match.Past),
// cached what the engine reported, block the engine's block size in
// tokens.
func (c *counting) observe(id, prefix, past, cached, block int) {
	if past < block || block <= 0 {
		return // the readings agree
	}
	dp, da := abs(cached-prefix), abs(cached-prefix-past)
	if dp == da {
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
	v.prefix *= countingDecay
	v.anywhere *= countingDecay
	if da < dp {
		v.anywhere++
	} else {
		v.prefix++
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
