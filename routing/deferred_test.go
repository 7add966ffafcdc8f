package routing

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/replica"
)

// TestHeldWaitsForItsReplica: with Hold, a request whose best replica is
// saturated is held even though another has room; its prefill counts as
// that replica's pending work while it waits; and a slot elsewhere takes
// it only when what it would compute again there is less than the work
// queued ahead of it on its own replica, per slot.
func TestHeldWaitsForItsReplica(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	rs := f.pool.Replicas()
	doc := strings.Repeat("the shared document goes on ", 200)
	first, err := f.decide(parseChat(t, "system", doc, "user", "first"), "a", true)
	if err != nil || first.Chosen().Replica != rs[0] {
		t.Fatalf("the first: %v, %v", err, first)
	}
	first.Lease().FirstToken(f.e.Now())                     // its prefill is done: nothing queued ahead
	rs[0].Observe(replica.Observed{Running: 1, Waiting: 1}) // capacity 1: r0 is full
	if !rs[0].Saturated() || rs[1].Saturated() {
		t.Fatalf("saturated: r0 %v, r1 %v", rs[0].Saturated(), rs[1].Saturated())
	}
	in := f.e.Prepare(parseChat(t, "system", doc, "user", "second"), "b", false)
	in.Policy, in.Defer = f.pol, true
	d, err := f.e.Decide(in, true)
	if err != nil || !d.Deferred || d.Chosen().Replica != rs[0] {
		t.Fatalf("held %v for %s (%v): want held for r0, where its prefix is", d.Deferred, d.Chosen().Replica.Name, err)
	}
	if got := rs[0].Load(f.e.Now()).PendingTokens; got != 0 {
		t.Fatalf("r0's pending work before the wait: %v", got)
	}
	f.e.Wait(d, 0)
	wait := rs[0].Load(f.e.Now()).PendingTokens
	if want := d.Uncached(rs[0].ID); wait != want || want <= 0 {
		t.Fatalf("r0's pending work while the request waits: %v, want its uncached %v", wait, want)
	}
	// Moving to r1 computes the document again: more than the little
	// queued on r0. It waits.
	if c := f.e.DispatchCost(d, rs[1]); !math.IsInf(c, 1) {
		t.Fatalf("cost of moving to r1: %v, want +Inf", c)
	}
	if c := f.e.DispatchCost(d, rs[0]); c != 0 {
		t.Fatalf("cost on its own replica: %v", c)
	}
	// Much queued on r0 (a request whose long prompt r0 has not begun):
	// moving is worth it, at the cost of the prefix.
	var big replica.Work
	big.Prefill = 50000
	rs[0].Begin(&big, f.e.Now())
	if c, want := f.e.DispatchCost(d, rs[1]), d.Uncached(rs[1].ID)-d.Uncached(rs[0].ID); c != want || c <= 0 {
		t.Fatalf("cost of moving to r1 behind a long queue: %v, want %v", c, want)
	}
	rs[0].End(&big, f.e.Now())
	// Once the engines' timing is learned the wait is counted in time. r0
	// prefills 1,000 tokens a second and its requests hold a slot 0.1 s:
	// the document's second or so on r1 is not worth it.
	var short replica.Work
	short.Prefill = 1000
	rs[0].Begin(&short, f.e.Now())
	rs[0].PrefillDone(&short, f.e.Now().Add(time.Second))
	rs[0].End(&short, f.e.Now().Add(time.Second+100*time.Millisecond))
	if c := f.e.DispatchCost(d, rs[1]); !math.IsInf(c, 1) {
		t.Fatalf("cost of moving to r1 from a replica of short requests: %v", c)
	}
	// Its requests now hold their slot long (a 100 s answer): moving is
	// worth it at once, though no prefill is queued there.
	var long replica.Work
	long.Prefill = 1000
	rs[0].Begin(&long, f.e.Now())
	rs[0].PrefillDone(&long, f.e.Now().Add(time.Second))
	rs[0].End(&long, f.e.Now().Add(100*time.Second))
	if c := f.e.DispatchCost(d, rs[1]); math.IsInf(c, 1) || c <= 0 {
		t.Fatalf("cost of moving to r1 from a replica of long answers: %v", c)
	}
	f.e.Unwait(d)
	if got := rs[0].Load(f.e.Now()).PendingTokens; got != 0 || rs[0].Deferred(0) != 0 {
		t.Fatalf("r0 after the wait: pending %v, %d held", got, rs[0].Deferred(0))
	}
	f.e.Drop(d)
}
