package simreplica

import (
	"container/heap"
	"context"
	"fmt"
	"sync"
)

// Scheduling policies (Options.Scheduling): vLLM's --scheduling-policy.
const (
	// SchedulingFCFS serves requests in arrival order and ignores a
	// body's priority, as vLLM's V1 engine does under its default policy
	// (its V0 engine refused a priority other than 0 with 400, and the
	// OpenAI server's protocol.py still documents that refusal, but
	// vllm/v1/engine/async_llm.py does not check it: vLLM issue #22997).
	SchedulingFCFS = "fcfs"
	// SchedulingPriority serves waiting requests in the order of their
	// body's priority, then of arrival, and preempts the running request
	// of the lowest priority when the KV cache runs out: see
	// priorityScheduler.
	SchedulingPriority = "priority"
)

// checkScheduling reports a policy that is not one of the Scheduling
// policies ("" is SchedulingFCFS).
func checkScheduling(p string) error {
	switch p {
	case "", SchedulingFCFS, SchedulingPriority:
		return nil
	}
	return fmt.Errorf("simreplica: scheduling %q is not %s or %s", p, SchedulingFCFS, SchedulingPriority)
}

// priorityScheduler is the engine's scheduler under vLLM's
// --scheduling-policy priority, as vllm/v1/core/sched/scheduler.py
// (Scheduler.schedule, _preempt_request; read at vllm-project/vllm@00024d31)
// and request_queue.py (PriorityRequestQueue, a heap of (priority,
// arrival_time)) do it:
//
//   - Waiting requests are ordered by (priority, arrival): the lower
//     priority value first (the body's "priority", default 0), then the
//     earlier arrival. A preempted request waits again under its own
//     priority and arrival.
//   - The head of the queue is admitted, and runs, when fewer than
//     maxRunning requests run (--max-num-seqs), the KV cache has free the
//     blocks of its tokens, and (this replica's simplification of a step's
//     token budget, see prefillQueue) no other prefill is being computed.
//     A head that does not fit stops admission: no request behind it
//     passes it, as vLLM's waiting loop breaks.
//   - A running request that needs a block for its next token when none
//     is free preempts the running request with the largest (priority,
//     arrival) — the least important, latest — possibly itself, until the
//     block fits: the victim's blocks are freed and it waits again, to
//     recompute its prompt and the tokens it had generated when it is
//     admitted again (vLLM resets num_computed_tokens to 0; its prefix
//     cache may still hold the prompt).
//
// A request holds the blocks of its tokens (prompt and output so far,
// BlockSize a block, Options.NumBlocks in all), counted for it alone: vLLM
// counts a prefix shared by running requests once. Time is continuous, not
// stepped: a preemption does not hold back admissions for the rest of a
// step as vLLM's does.
//
// A request is a seq: arrive puts it in the queue, resume waits for its
// admission and returns the admission it runs under, prefilled ends its
// prefill turn, grow takes the blocks of its next token, and leave ends
// it however it is. The zero value is not ready: use newPriorityScheduler.
// Safe for concurrent use.
type priorityScheduler struct {
	mu         sync.Mutex
	maxRunning int
	blockSize  int
	free       int64      // blocks no running request holds
	waiting    seqQueue   // by (priority, arrival)
	running    []*seq     // in order of admission
	prefiller  *admission // the admission whose prefill is being computed; nil: none
	arrivals   uint64     // arrivals so far: the next arrival's order

	// onMove, if set, hears a request move between waiting and running
	// (wait and run are +1, -1 or 0: the changes of each count); onHold
	// the change of blocks held by running requests. Both are called with
	// the scheduler locked, in the order of the changes: they must not
	// call back into it.
	onMove func(q *seq, wait, run int)
	onHold func(blocks int64)
	// trace, if set, hears every admission and preemption, as onMove
	// does (tests).
	trace func(ev string, q *seq)
}

// newPriorityScheduler returns a scheduler of maxRunning running requests
// and a KV cache of numBlocks blocks of blockSize tokens.
func newPriorityScheduler(maxRunning, numBlocks, blockSize int) *priorityScheduler {
	return &priorityScheduler{maxRunning: maxRunning, blockSize: blockSize, free: int64(numBlocks)}
}

// seq is one request in the scheduler: vLLM's Request as its Scheduler
// sees it. Its fields are the scheduler's, under its lock, but for those
// set before arrive.
type seq struct {
	priority int    // lower is sooner
	lora     string // its adapter, for onMove ("": the base model)
	arrival  uint64 // order of arrival, set by arrive
	tokens   int    // the tokens it holds blocks for: prompt and output so far
	blocks   int64  // blocks held while running
	state    seqState
	index    int        // in waiting, while waiting
	cur      *admission // the admission it runs under; nil while not running
	// admitted is closed when it is admitted, and replaced when it waits
	// again.
	admitted chan struct{}
}

type seqState uint8

const (
	seqIdle    seqState = iota // not arrived, or left
	seqWaiting                 // in the queue
	seqRunning                 // admitted
)

// admission is one stretch of a seq's running, from its admission to its
// preemption or end. stop is closed when it is preempted.
type admission struct {
	q    *seq
	stop chan struct{}
}

// before reports whether q goes before o in the waiting queue.
func (q *seq) before(o *seq) bool {
	if q.priority != o.priority {
		return q.priority < o.priority
	}
	return q.arrival < o.arrival
}

// seqQueue is a heap of seqs by (priority, arrival) (container/heap).
type seqQueue []*seq

func (h seqQueue) Len() int           { return len(h) }
func (h seqQueue) Less(i, j int) bool { return h[i].before(h[j]) }
func (h seqQueue) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *seqQueue) Push(x any) { q := x.(*seq); q.index = len(*h); *h = append(*h, q) }
func (h *seqQueue) Pop() any {
	old := *h
	q := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	q.index = -1
	return q
}

// blocksOf returns the blocks that hold tokens tokens.
func (p *priorityScheduler) blocksOf(tokens int) int64 {
	return int64((tokens + p.blockSize - 1) / p.blockSize)
}

// arrive puts q, new, in the waiting queue, holding the blocks of tokens
// tokens once admitted, and admits what can be. O(log n).
func (p *priorityScheduler) arrive(q *seq, tokens int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	q.arrival, q.tokens = p.arrivals, tokens
	p.arrivals++
	p.waitLocked(q)
	p.scheduleLocked()
}

// waitLocked puts q in the waiting queue.
func (p *priorityScheduler) waitLocked(q *seq) {
	q.state, q.cur, q.admitted = seqWaiting, nil, make(chan struct{})
	heap.Push(&p.waiting, q)
	p.move(q, 1, 0)
}

// scheduleLocked admits the head of the waiting queue while it fits.
func (p *priorityScheduler) scheduleLocked() {
	for p.waiting.Len() > 0 && p.prefiller == nil && len(p.running) < p.maxRunning {
		q := p.waiting[0]
		need := p.blocksOf(q.tokens)
		if need > p.free {
			return // vLLM's break: nothing behind the head passes it
		}
		heap.Pop(&p.waiting)
		q.state, q.blocks = seqRunning, need
		p.take(need)
		q.cur = &admission{q: q, stop: make(chan struct{})}
		p.prefiller = q.cur
		p.running = append(p.running, q)
		close(q.admitted)
		p.move(q, -1, 1)
		if p.trace != nil {
			p.trace("admit", q)
		}
	}
}

// resume waits until q is running and returns the admission it runs
// under; ok is false when ctx ended first. A request arrived, or
// preempted, calls it to be admitted (again).
func (p *priorityScheduler) resume(ctx context.Context, q *seq) (a *admission, ok bool) {
	for {
		p.mu.Lock()
		if q.state == seqRunning {
			a = q.cur
			p.mu.Unlock()
			return a, true
		}
		ch := q.admitted
		p.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, false
		}
	}
}

// prefilled ends a's prefill turn, letting the next request in; it
// reports false when a was preempted (its prefill is lost).
func (p *priorityScheduler) prefilled(a *admission) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if a.q.cur != a {
		return false
	}
	if p.prefiller == a {
		p.prefiller = nil
		p.scheduleLocked()
	}
	return true
}

// grow makes a's request hold the blocks of tokens tokens, preempting
// running requests, the least important first, until they fit. It
// reports false when a was preempted, now or before. O(running) a
// preemption.
func (p *priorityScheduler) grow(a *admission, tokens int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	q := a.q
	if q.cur != a {
		return false
	}
	q.tokens = tokens
	need := p.blocksOf(tokens) - q.blocks
	preempted := false
	for need > p.free {
		v := p.victimLocked()
		p.preemptLocked(v)
		preempted = true
		if v == q {
			p.scheduleLocked()
			return false
		}
	}
	if need > 0 {
		q.blocks += need
		p.take(need)
	}
	if preempted {
		p.scheduleLocked()
	}
	return true
}

// victimLocked returns the running request with the largest (priority,
// arrival): vLLM's max(self.running, key=lambda r: (r.priority,
// r.arrival_time)).
func (p *priorityScheduler) victimLocked() *seq {
	v := p.running[0]
	for _, q := range p.running[1:] {
		if v.before(q) {
			v = q
		}
	}
	return v
}

// preemptLocked frees q's blocks and puts it back in the waiting queue
// (vLLM's _preempt_request).
func (p *priorityScheduler) preemptLocked(q *seq) {
	p.stopLocked(q)
	p.waitLocked(q)
	if p.trace != nil {
		p.trace("preempt", q)
	}
}

// stopLocked takes q, running, out of the running requests, freeing its
// blocks and its prefill turn, and closes its admission's stop.
func (p *priorityScheduler) stopLocked(q *seq) {
	for i, r := range p.running {
		if r == q {
			p.running = append(p.running[:i], p.running[i+1:]...)
			break
		}
	}
	p.take(-q.blocks)
	q.blocks = 0
	if p.prefiller == q.cur {
		p.prefiller = nil
	}
	close(q.cur.stop)
	q.state, q.cur = seqIdle, nil
	p.move(q, 0, -1)
}

// leave ends q, waiting, running or already gone, and admits what can be.
func (p *priorityScheduler) leave(q *seq) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch q.state {
	case seqWaiting:
		heap.Remove(&p.waiting, q.index)
		q.state = seqIdle
		p.move(q, -1, 0)
	case seqRunning:
		p.stopLocked(q)
	default:
		return
	}
	p.scheduleLocked()
}

func (p *priorityScheduler) take(blocks int64) {
	p.free -= blocks
	if p.onHold != nil && blocks != 0 {
		p.onHold(blocks)
	}
}

func (p *priorityScheduler) move(q *seq, wait, run int) {
	if p.onMove != nil {
		p.onMove(q, wait, run)
	}
}
