package routing

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/replica"
)

// teach has replica r serve n requests of uncached prompt tokens and output
// tokens, alone, each taking ttft seconds to its first token and total
// to its end, and learn them (replica.Replica.LearnService).
func teach(r *replica.Replica, now time.Time, n int, uncached, output int64, ttft, total float64) {
	for range n {
		w := replica.Work{Prefill: uncached, Tokens: uncached}
		r.Begin(&w, now)
		r.PrefillDone(&w, now.Add(time.Duration(ttft*1e9)))
		r.End(&w, now.Add(time.Duration(total*1e9)))
		r.LearnService(&w, float64(uncached), output, true)
	}
}

// TestHeldWaitsForItsReplica: with Hold, a request whose best replica is
// saturated is held even though another has room, when waiting there is
// predicted sooner than computing its prefix again elsewhere; its prefill
// counts as that replica's pending work while it waits; and a slot
// elsewhere takes it only when its first token would come sooner there,
// its cost then its time there over its wait at home.
func TestHeldWaitsForItsReplica(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	rs := f.pool.Replicas()
	// Both engines prefill 5,000 tokens a second and answer in 0.25 s.
	for i := range 2 {
		teach(rs[i], f.e.Now(), 8, 500, 10, 0.1, 0.15)
		teach(rs[i], f.e.Now(), 8, 1500, 10, 0.3, 0.35)
	}
	doc := strings.Repeat("the shared document goes on ", 200)
	first, err := f.decide(parseChat(t, "system", doc, "user", "first"), "a", true)
	if err != nil {
		t.Fatal(err)
	}
	home, other := first.Chosen().Replica, rs[0]
	if home == rs[0] {
		other = rs[1]
	}
	first.Lease().FirstToken(f.e.Now())                    // its prefill is done: nothing queued ahead
	home.Observe(replica.Observed{Running: 1, Waiting: 1}) // capacity 1: home is full
	if !home.Saturated() || other.Saturated() {
		t.Fatalf("saturated: home %v, other %v", home.Saturated(), other.Saturated())
	}
	in := f.e.Prepare(parseChat(t, "system", doc, "user", "second"), "b", false)
	in.Policy, in.Defer = f.pol, true
	d, err := f.e.Decide(in, true)
	if err != nil || !d.Deferred || d.Chosen().Replica != home {
		t.Fatalf("held %v for %s (%v): want held for %s, where its prefix is", d.Deferred, d.Chosen().Replica.Name, err, home.Name)
	}
	if got := home.Load(f.e.Now()).PendingTokens; got != 0 {
		t.Fatalf("home's pending work before the wait: %v", got)
	}
	f.e.Wait(d, 0)
	wait := home.Load(f.e.Now()).PendingTokens
	if want := d.Uncached(home.ID); wait != want || want <= 0 {
		t.Fatalf("home's pending work while the request waits: %v, want its uncached %v", wait, want)
	}
	// Moving computes the document again: longer than the one short
	// request ahead of it at home. It waits.
	if c := f.e.DispatchCost(d, other); !math.IsInf(c, 1) {
		t.Fatalf("cost of moving: %v, want +Inf", c)
	}
	if c := f.e.DispatchCost(d, home); c != 0 {
		t.Fatalf("cost on its own replica: %v", c)
	}
	// Much queued at home (a long prompt it has not begun): moving is
	// worth it, at the cost of the prefix.
	big := replica.Work{Prefill: 50000}
	home.Begin(&big, f.e.Now())
	if c := f.e.DispatchCost(d, other); !(c > 0 && c < 0.2) { // 50,000 tokens ahead at home: seconds saved
		t.Fatalf("cost of moving behind a long queue: %v, want a fifth of the wait at most", c)
	}
	home.End(&big, f.e.Now())
	if c := f.e.DispatchCost(d, other); !math.IsInf(c, 1) {
		t.Fatalf("cost of moving once the long prompt left: %v", c)
	}
	f.e.Unwait(d)
	if got := home.Load(f.e.Now()).PendingTokens; got != 0 || home.Deferred(0) != 0 {
		t.Fatalf("home after the wait: pending %v, %d held", got, home.Deferred(0))
	}
	f.e.Drop(d)
}
