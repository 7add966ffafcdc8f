package replica

import (
	"math"
	"strings"
	"testing"
	"time"
)

func ids() func(Spec) (int, error) {
	n := 0
	return func(Spec) (int, error) { n++; return n - 1, nil }
}

func TestNewPoolValidates(t *testing.T) {
	cases := []struct {
		name  string
		specs []Spec
		err   string
	}{
		{"no name", []Spec{{URL: "http://a"}}, "replicas[0]: name is required"},
		{"bad scheme", []Spec{{Name: "a", URL: "ftp://a"}}, "replicas[0]: url"},
		{"no host", []Spec{{Name: "a", URL: "http://"}}, "replicas[0]: url"},
		{"duplicate", []Spec{{Name: "a", URL: "http://a"}, {Name: "a", URL: "http://b"}}, "replicas[1]: duplicate name"},
		{"negative budget", []Spec{{Name: "a", URL: "http://a", BudgetTokens: -1}}, "budget_tokens"},
		{"nan weight", []Spec{{Name: "a", URL: "http://a", Weight: math.NaN()}}, "weight"},
		{"unknown scheduling", []Spec{{Name: "a", URL: "http://a", Scheduling: "lifo"}}, `scheduling "lifo" is not fcfs or priority`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewPool(tc.specs, Options{}, ids())
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.err)
			}
		})
	}
	p, err := NewPool([]Spec{{Name: "a", URL: "http://a:1", Scheduling: "fcfs"}, {Name: "b", URL: "https://b", Weight: 2, Scheduling: SchedulingPriority}}, Options{}, ids())
	if err != nil {
		t.Fatal(err)
	}
	if a, _ := p.Get("a"); a.Scheduling != SchedulingFCFS {
		t.Fatalf("scheduling fcfs is %q, want SchedulingFCFS", a.Scheduling)
	}
	if b, _ := p.Get("b"); !b.Scheduling.Prioritized() {
		t.Fatalf("scheduling priority is %q", b.Scheduling)
	}
	if b, ok := p.Get("b"); !ok || b.ID != 1 || b.Weight != 2 {
		t.Fatalf("Get(b) = %+v, %v", b, ok)
	}
	if a, _ := p.Get("a"); a.Weight != 1 {
		t.Fatalf("default weight %v, want 1", a.Weight)
	}
	if _, ok := p.Get("c"); ok {
		t.Fatal("Get found a stranger")
	}
}

func TestLoadAccounting(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a", Weight: 2}}, Options{HalfLife: time.Second}, ids())
	r := p.Replicas()[0]
	t0 := time.Unix(100, 0)
	a, b := &Work{Prefill: 400, Tokens: 1000}, &Work{Prefill: 200, Tokens: 200}
	r.Begin(a, t0)
	r.Begin(b, t0)
	if l := r.Load(t0); l.InFlight != 2 || l.PendingTokens != 300 || l.ActiveTokens != 600 || l.RecentTokens != 0 {
		t.Fatalf("in flight: %+v (weight 2 halves tokens)", l)
	}
	r.PrefillDone(a, t0)
	if l := r.Load(t0); l.InFlight != 2 || l.PendingTokens != 100 || l.RecentTokens != 200 {
		t.Fatalf("after a's prefill: %+v", l)
	}
	r.End(a, t0)
	r.End(b, t0.Add(time.Second))
	// 400 decayed one half-life, plus 200: 400; halved by the weight: 200.
	if l := r.Load(t0.Add(time.Second)); l.InFlight != 0 || l.PendingTokens != 0 || l.ActiveTokens != 0 || math.Abs(l.RecentTokens-200) > 1e-9 {
		t.Fatalf("after: %+v", l)
	}
	if l := r.Load(t0.Add(3 * time.Second)); math.Abs(l.RecentTokens-50) > 1e-9 {
		t.Fatalf("two half-lives later: %+v", l)
	}
}

func TestObserved(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a"}}, Options{}, ids())
	r := p.Replicas()[0]
	if l := r.Load(time.Now()); l.Observed != (Observed{}) {
		t.Fatalf("unobserved replica reports %+v", l.Observed)
	}
	r.Observe(Observed{Running: 3, Waiting: 2, KVUsage: 0.5})
	if l := r.Load(time.Now()); l.Running != 3 || l.Waiting != 2 || l.KVUsage != 0.5 {
		t.Fatalf("observed %+v", l.Observed)
	}
}

// TestSaturated: a replica is saturated when its engine would queue the
// next request: its requests in flight reach its capacity (configured, or
// learned from a report of requests waiting beside requests running), or it
// reports requests waiting, or its KV cache is full.
func TestSaturated(t *testing.T) {
	p, err := NewPool([]Spec{{Name: "set", URL: "http://a", MaxRunning: 2}, {Name: "learned", URL: "http://b"}}, Options{}, ids())
	if err != nil {
		t.Fatal(err)
	}
	set, learned := p.Replicas()[0], p.Replicas()[1]
	var w [3]Work
	steps := []struct {
		name    string
		do      func()
		set     bool
		learned bool
		capL    int64
	}{
		{"idle", func() {}, false, false, 0},
		{"one in flight each", func() { set.Begin(&w[0], time.Now()); learned.Begin(&w[1], time.Now()) }, false, false, 0},
		{"two in flight on set: its capacity", func() { set.Begin(&w[2], time.Now()) }, true, false, 0},
		{"learned reports 1 running, 3 waiting", func() { learned.Observe(Observed{Running: 1, Waiting: 3}) }, true, true, 1},
		{"learned's queue drains: one in flight, capacity 1", func() { learned.Observe(Observed{Running: 1}) }, true, true, 1},
		{"learned's request ends", func() { learned.End(&w[1], time.Now()) }, true, false, 1},
		{"learned's KV cache is full", func() { learned.Observe(Observed{KVUsage: 0.99}) }, true, true, 1},
		{"set's requests end", func() { set.End(&w[0], time.Now()); set.End(&w[2], time.Now()) }, false, true, 1},
		// The gauge is as old as the last scrape: a request that finished
		// since freed blocks it cannot show.
		{"a request ends on learned after the report", func() { learned.Begin(&w[1], time.Now()); learned.End(&w[1], time.Now()) }, false, false, 1},
		{"learned reports 3 running, 1 waiting", func() { learned.Observe(Observed{Running: 3, Waiting: 1}) }, false, false, 3},
		// The most seen: a router that keeps the engine from queueing sees
		// smaller counts, never larger ones.
		{"then 2 running, 1 waiting", func() { learned.Observe(Observed{Running: 2, Waiting: 1}) }, false, false, 3},
	}
	for _, s := range steps {
		s.do()
		if set.Saturated() != s.set || learned.Saturated() != s.learned || learned.Capacity() != s.capL || set.Capacity() != 2 {
			t.Errorf("%s: saturated %v and %v, capacities %d and %d", s.name, set.Saturated(), learned.Saturated(), set.Capacity(), learned.Capacity())
		}
	}
	if _, err := NewPool([]Spec{{Name: "bad", URL: "http://c", MaxRunning: -1}}, Options{}, ids()); err == nil {
		t.Error("a negative max_running was accepted")
	}
}

// TestSaturatedByTheRoutersOwnCounts: with its capacity known, a replica
// is saturated by the requests its engine has not finished, not by a
// waiting gauge as old as the last scrape; a request the engine finished
// (Drained) frees its slot while its client still reads.
func TestSaturatedByTheRoutersOwnCounts(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a", MaxRunning: 1}}, Options{}, ids())
	r := p.Replicas()[0]
	r.Observe(Observed{Running: 1, Waiting: 5}) // an old scrape
	if r.Saturated() {
		t.Fatal("saturated by a stale waiting gauge with nothing in flight")
	}
	var w Work
	r.Begin(&w, time.Now())
	if !r.Saturated() {
		t.Fatal("not saturated with its one slot taken")
	}
	r.Drained(&w, time.Now())
	r.Drained(&w, time.Now())
	if r.Saturated() || r.Load(time.Now()).InFlight != 1 {
		t.Fatalf("after the engine finished: saturated %v, in flight %d", r.Saturated(), r.Load(time.Now()).InFlight)
	}
	r.End(&w, time.Now())
	if r.engaged.Load() != 0 || r.Load(time.Now()).InFlight != 0 {
		t.Fatalf("after the end: engaged %d, in flight %d", r.engaged.Load(), r.Load(time.Now()).InFlight)
	}
}

// TestReserveAndWait: a slot kept for a request the router's queue
// dispatched counts toward saturation until it is given back, and the
// prefill of requests held for a replica counts as its pending work; a
// request waits behind those held of its priority or higher.
func TestReserveAndWait(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a", MaxRunning: 1, Weight: 2}}, Options{}, ids())
	r := p.Replicas()[0]
	r.Reserve()
	if !r.Saturated() {
		t.Fatal("its one slot kept, the replica is not saturated")
	}
	var w Work
	r.Begin(&w, time.Now()) // the request it was kept for is sent
	r.Unreserve()
	if !r.Saturated() || r.reserved.Load() != 0 {
		t.Fatalf("sent: saturated %v, reserved %d", r.Saturated(), r.reserved.Load())
	}
	r.End(&w, time.Now())
	r.Wait(300, 0)
	r.Wait(100, 10)
	if got := r.Load(time.Now()).PendingTokens; got != 200 { // per unit of weight
		t.Fatalf("pending %v with 400 tokens held for it at weight 2", got)
	}
	if r.Deferred(0) != 2 || r.Deferred(10) != 1 || r.Deferred(11) != 0 {
		t.Fatalf("held at or above 0, 10, 11: %d, %d, %d", r.Deferred(0), r.Deferred(10), r.Deferred(11))
	}
	r.Unwait(100, 10)
	r.Unwait(300, 0)
	if got := r.Load(time.Now()).PendingTokens; got != 0 || r.Saturated() {
		t.Fatalf("pending %v, saturated %v after the held request left", got, r.Saturated())
	}
}

// TestLearnService: a replica's service-time model learns from the
// requests it served, timed by Begin, PrefillDone and Drained, with the
// state each met when sent; a request whose prompt another replica
// computed, or that was never drained, teaches nothing.
func TestLearnService(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a", MaxRunning: 1}}, Options{}, ids())
	r := p.Replicas()[0]
	if _, ok := r.Service(); ok {
		t.Fatal("learned before any request")
	}
	t0 := time.Unix(100, 0)
	a, b := &Work{Prefill: 1000, Tokens: 1000}, &Work{Prefill: 3000, Tokens: 3000}
	r.Begin(a, t0)
	r.Begin(b, t0) // behind a: one slot
	if a.at.Queued != 0 || b.at.Queued != 1 || b.at.Ahead != 1000 || b.batch != 2 {
		t.Fatalf("states at sending: %+v, %+v (batch %d)", a.at, b.at, b.batch)
	}
	r.PrefillDone(a, t0.Add(time.Second))
	r.Drained(a, t0.Add(2*time.Second))
	r.LearnService(b, 3000, 10, true) // not drained yet: nothing
	if _, ok := r.Service(); ok {
		t.Fatal("learned from a request not drained")
	}
	r.LearnService(a, 1000, 10, true)
	got, ok := r.Service()
	if !ok || got.Samples != 1 {
		t.Fatalf("after one answer: %+v, %v", got, ok)
	}
	c := &Work{Prefill: 10, Tokens: 10}
	r.Begin(c, t0)
	r.Remote(c)
	r.End(c, t0.Add(time.Second))
	r.LearnService(c, 10, 1, true)
	if got, _ := r.Service(); got.Samples != 1 {
		t.Fatalf("a remote prefill taught the model: %d samples", got.Samples)
	}
}
