package simreplica

import (
	"context"
	"slices"
	"sync"
)

// prefillQueue serializes prefills in arrival order, a simplification of
// an engine's scheduler: a replica computes one prompt's uncached tokens at
// a time (vLLM's steps share max_num_batched_tokens among the prefills they
// hold, so what one replica computes per second is bounded however many
// requests it runs; short prompts that share a step finish together there,
// one after the other here), and a request that waits behind another finds
// that one's blocks cached when its turn comes. The zero value is an idle
// queue; it is safe for concurrent use.
type prefillQueue struct {
	mu   sync.Mutex
	busy bool
	q    []chan struct{} // waiters in arrival order; closed when it is their turn
}

// acquire waits for the prefill turn; it reports false, holding nothing,
// if ctx ends first.
func (p *prefillQueue) acquire(ctx context.Context) bool {
	p.mu.Lock()
	if !p.busy {
		p.busy = true
		p.mu.Unlock()
		return true
	}
	ch := make(chan struct{})
	p.q = append(p.q, ch)
	p.mu.Unlock()
	select {
	case <-ch:
		return true
	case <-ctx.Done():
	}
	p.mu.Lock()
	if i := slices.Index(p.q, ch); i >= 0 {
		p.q = slices.Delete(p.q, i, i+1)
		p.mu.Unlock()
		return false
	}
	p.mu.Unlock()
	p.release() // the turn came as ctx ended: pass it on
	return false
}

// release ends the holder's turn and hands it to the next waiter.
func (p *prefillQueue) release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.q) == 0 {
		p.busy = false
		return
	}
	close(p.q[0])
	p.q = p.q[1:]
}
