package replica

import (
	"github.com/semroute/semroute/servicetime"
)

// State returns what a request of tokens prompt tokens and priority would
// meet were it sent to the replica now, for its service-time model
// (servicetime.Params.TTFT):
//   - Ahead: the prefill tokens sent there and not yet prefilled, and
//     those the router's queue holds for it;
//   - Slots: its Capacity, or the sequences its engine reports running
//     while it queues;
//   - Queued: the requests that must finish before a slot frees for it:
//     when its Capacity is known, the requests in flight its engine has
//     not finished (this router's and its fleet peers') and the slots
//     kept, past the capacity, plus one; else, while its engine reports
//     requests waiting, those plus one; and the requests of priority or
//     higher the router's queue holds for it;
//   - on an engine that schedules by priority (Spec.Scheduling), a request
//     of priority above 0 waits only for the next slot, before the
//     requests waiting there, and not for the prefill the router's queue
//     holds for it;
//   - KVShort: its KV cache is full as Saturated reads it, or the tokens do
//     not fit what its engine reports free (1 − vllm:kv_cache_usage_perc
//     of its budget).
func (r *Replica) State(tokens int64, priority int) servicetime.State {
	s := servicetime.State{Ahead: float64(r.pending.Load() + r.waiting.Load())}
	o := r.observed.Load()
	if c := r.Capacity(); c > 0 {
		s.Slots = float64(c)
		s.Queued = float64(max(r.engaged.Load()+r.reserved.Load()-c+1, 0))
	} else if o != nil && o.Waiting > 0 {
		s.Queued, s.Slots = float64(o.Waiting+1), float64(o.Running)
	}
	if r.Scheduling.Prioritized() && priority > 0 && s.Queued > 0 {
		// Its engine serves it before the waiting requests of lower
		// priority, the default's (router priority 0) included: it waits
		// for the next slot only, and their prefill does not hold it up.
		s.Queued, s.Ahead = 1, float64(r.pending.Load())
	}
	if r.waiting.Load() > 0 {
		s.Queued += float64(r.Deferred(priority))
	}
	s.KVShort = r.ShortOfRoom(tokens)
	return s
}

// ShortOfRoom reports whether tokens do not fit in the KV cache the
// replica's engine has free now (1 − vllm:kv_cache_usage_perc of its
// budget), or the cache is full as Saturated reads it: its engine would
// not admit a request needing that much room at once. False while the
// budget or the usage is unknown.
func (r *Replica) ShortOfRoom(tokens int64) bool {
	if r.kvFull() {
		return true
	}
	o := r.observed.Load()
	b := r.budget.Load()
	return b > 0 && o != nil && o.KVUsage > 0 && float64(tokens) > (1-o.KVUsage)*float64(b)
}

// Service returns the replica's service-time parameters as last learned
// (LearnService), and whether any answer taught them: false means they are
// the prior, and a caller may prefer its fleet's (servicetime.Median). It
// takes no lock.
func (r *Replica) Service() (servicetime.Params, bool) {
	if p := r.params.Load(); p != nil {
		return *p, true
	}
	return servicetime.Prior(), false
}

// LearnService teaches the replica's service-time model what w, begun
// there and ended, took: uncached prompt tokens its engine computed,
// output tokens it generated, and, when streamed, its first token's time
// apart from its end. A request whose prompt another replica computed
// (Remote), or whose end was not seen, teaches nothing.
func (r *Replica) LearnService(w *Work, uncached float64, output int64, streamed bool) {
	if w.remote || w.start == 0 || w.end <= w.start {
		return
	}
	s := servicetime.Sample{Uncached: uncached, Ahead: w.at.Ahead, Batch: float64(w.batch), Output: int(output),
		Queued: w.at.Queued, KVShort: w.at.KVShort, Slots: w.at.Slots, Total: float64(w.end-w.start) / 1e9, Predicted: w.Predicted}
	if streamed && w.first > w.start && w.first <= w.end {
		s.TTFT = float64(w.first-w.start) / 1e9
	}
	r.service.Observe(s)
	p := r.service.Params()
	r.params.Store(&p)
}
