package simreplica

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/valyala/fastjson"

	"github.com/semroute/semroute/blockhash"
)

// readPriority returns the body's top-level priority, an integer, 0 when
// absent or null, as vLLM's request models read it (priority: int = 0 in
// the chat, completion and responses requests of
// vllm/entrypoints/openai/*/protocol.py). The Messages API's request has
// no priority (vllm/entrypoints/anthropic/protocol.py,
// AnthropicMessagesRequest): its requests are all 0.
func readPriority(body []byte, ep blockhash.Endpoint) (int, error) {
	if ep == blockhash.Messages {
		return 0, nil
	}
	p := flagParsers.Get()
	defer flagParsers.Put(p)
	v, err := p.ParseBytes(body)
	if err != nil {
		return 0, nil // parsed already: not reached
	}
	x := v.Get("priority")
	if x == nil || x.Type() == fastjson.TypeNull {
		return 0, nil
	}
	n, err := x.Int()
	if err != nil || x.Type() != fastjson.TypeNumber {
		return 0, fmt.Errorf("priority: must be an integer, not %s", x)
	}
	return n, nil
}

// prioritized is one completion request's life under the priority
// scheduler (Options.Scheduling priority): its seq, the admission it
// computes under, and the pins of its prompt's blocks while it runs. Its
// methods are called from the request's goroutine alone.
type prioritized struct {
	s     *Server
	c     *completion
	q     *seq
	a     *admission // the admission it runs under; nil before the first
	unpin func()     // unpins the prompt's blocks; nil when none are pinned
	// looked says the prompt was looked up and counted (the first
	// admission); stored that Blend's or Donor's store has it.
	looked, stored bool
}

// completePrioritized answers c, a completion request read and
// tokenized, under the priority scheduler: it waits in the queue by its
// priority, computes its prompt when admitted, and generates its answer,
// computing it all again each time it is preempted.
func (s *Server) completePrioritized(ctx context.Context, w http.ResponseWriter, r *http.Request, c *completion) {
	run := &prioritized{s: s, c: c, q: &seq{priority: c.priority, lora: c.m.lora}}
	s.prio.arrive(run.q, max(len(c.sc.ids), 1))
	defer run.end()
	if !run.compute(ctx, 0) {
		s.cancelled.Add(1)
		return
	}
	s.promptTotal.Add(int64(c.tokens)) // once its first token is out, as complete counts it
	g := s.newGeneration(r, c)
	g.run = run
	if !g.answer(ctx, w, c) {
		s.cancelled.Add(1)
		return
	}
	s.genTotal.Add(int64(c.out))
	s.completed.Add(1)
}

// end takes the request out of the scheduler and unpins its blocks.
func (p *prioritized) end() {
	p.release()
	p.s.prio.leave(p.q)
}

// release unpins the prompt's blocks, if pinned: they stay cached, and
// evictable, as vLLM frees a preempted request's blocks.
func (p *prioritized) release() {
	if p.unpin != nil {
		p.unpin()
		p.unpin = nil
	}
}

// compute waits for the request's admission and computes its sequence:
// the prompt and its first i output tokens, which gives token i (i = 0:
// the first admission; i > 0: again after a preemption at token i),
// again after each preemption meanwhile. It reports false when ctx ended.
func (p *prioritized) compute(ctx context.Context, i int) bool {
	s, c := p.s, p.c
	for {
		p.release()
		a, ok := s.prio.resume(ctx, p.q)
		if !ok {
			return false
		}
		p.a = a
		if !p.sleep(ctx, p.prefillTime(i)) {
			if ctx.Err() != nil {
				return false
			}
			continue // preempted while computing: lost
		}
		p.unpin = s.store(c.keys, c.sc.ids, c.m)
		if !p.stored {
			p.stored = true
			if s.blend != nil {
				s.blend.put(c.sc.spans)
			}
			if s.donor != nil {
				s.donor.put(c.sample, c.m.loraID, c.keys)
			}
		}
		if s.prio.prefilled(a) && p.sleep(ctx, s.o.Overhead) {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
	}
}

// prefillTime returns the time the request's admission computes for: at
// the first, the prompt the caches do not hold (looked up and counted
// then, as complete does), or its transfer from a prefill replica; after
// a preemption, the prompt the prefix cache no longer holds and the i
// output tokens out so far, computed here whatever the request's
// kv_transfer_params. vLLM's preempted requests do not count in the
// prefix cache's queries and hits.
func (p *prioritized) prefillTime(i int) time.Duration {
	s, c := p.s, p.c
	if !p.looked {
		p.looked = true
		s.lookupPrompt(c)
		if c.fl.remotePrefill {
			s.transfers.Add(1)
			return s.o.TransferLatency + time.Duration(c.tokens-c.cached)*s.o.TransferPerToken
		}
		return time.Duration(c.tokens-c.cached-c.reused) * s.o.PrefillPerToken
	}
	cached := s.heldFrom(c.keys) * s.o.BlockSize
	if cached >= c.tokens+i { // at least the last token is computed
		cached = (c.tokens + i - 1) / s.o.BlockSize * s.o.BlockSize
	}
	return time.Duration(c.tokens+i-cached) * s.o.PrefillPerToken
}

// next waits for output token i (i ≥ 1): it takes the block the token
// needs, preempting others (or itself), and the InterToken it takes;
// preempted, it computes the sequence again (compute), which gives token
// i. It reports false when ctx ended.
func (p *prioritized) next(ctx context.Context, i int) bool {
	if p.s.prio.grow(p.a, p.c.tokens+i) && p.sleep(ctx, p.s.o.InterToken) {
		return true
	}
	if ctx.Err() != nil {
		return false
	}
	return p.compute(ctx, i)
}

// sleep waits d, or until ctx ends or the request's admission is
// preempted; it reports whether d passed.
func (p *prioritized) sleep(ctx context.Context, d time.Duration) bool {
	return sleepUnless(ctx, d, p.a.stop)
}

// decodeAll waits for output tokens 1 to out-1, as a whole answer does:
// InterToken each, and under the priority scheduler one at a time, each
// taking its block.
func (g *generation) decodeAll(ctx context.Context) bool {
	if g.run == nil {
		return sleep(ctx, time.Duration(g.out-1)*g.s.o.InterToken)
	}
	for i := 1; i < g.out; i++ {
		if !g.run.next(ctx, i) {
			return false
		}
	}
	return true
}

// decodeNext waits for output token i (i ≥ 1) of a streamed answer.
func (g *generation) decodeNext(ctx context.Context, i int) bool {
	if g.run == nil {
		return sleep(ctx, g.s.o.InterToken)
	}
	return g.run.next(ctx, i)
}
