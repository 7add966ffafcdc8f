package router

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// TestCoreQueuesWhileSaturated: with flow control on, a request that every
// replica would queue waits in the router, unrecorded, until a request's
// end frees a slot; then it is decided and sent. Below saturation nothing
// waits. Past the queue's bound a request is refused with a QueueError.
func TestCoreQueuesWhileSaturated(t *testing.T) {
	f := newFixture(t, 1, "semantic")
	fo := &flow.Options[*replica.Replica]{MaxRequests: 1}
	c, err := NewCore(CoreOptions{Engine: f.e, Arms: f.arms(), Flow: fo})
	if err != nil {
		t.Fatal(err)
	}
	route := func(text string) (*Routed, error) {
		in := f.e.Prepare(parseChat(t, "user", text), "", false)
		return route(c, CoreRequest{Input: in, Route: "chat", Ctx: context.Background(), Flow: "a"})
	}
	rep := f.e.Pool().Replicas()[0]
	first, err := route("first")
	if err != nil || first.Queued != 0 {
		t.Fatalf("below saturation: %v, queued %v", err, first.Queued)
	}
	rep.Observe(replica.Observed{Running: 1, Waiting: 1}) // its engine queues: capacity 1, saturated
	if !rep.Saturated() {
		t.Fatal("the replica is not saturated")
	}
	type result struct {
		rt  *Routed
		err error
	}
	done := make(chan result, 1)
	go func() {
		rt, err := route("second")
		done <- result{rt, err}
	}()
	waitQueued(t, c, 1) // the second waits in the queue
	if got := rep.Load(time.Now()).InFlight; got != 1 {
		t.Fatalf("%d in flight: the waiting request was sent", got)
	}
	if _, err := route("third"); !errors.As(err, new(*QueueError)) || !errors.Is(err, flow.ErrFull) {
		t.Fatalf("a request past the queue's bound: %v", err)
	}
	f.now = f.now.Add(time.Second)
	c.EngineDone(first) // the engine finished the first: its slot goes to the second
	r := <-done
	if r.err != nil || r.rt.Queued != time.Second {
		t.Fatalf("the waiting request: %v, queued %v", r.err, r.rt.Queued)
	}
	if got := rep.Load(time.Now()).InFlight; got != 2 { // the first's client still reads
		t.Fatalf("%d in flight after the dispatch", got)
	}
	c.Finish(first, Outcome{Status: 200}, nil)
	c.Finish(r.rt, Outcome{Status: 200}, nil)
	if got := rep.Load(time.Now()).InFlight; got != 0 {
		t.Fatalf("%d in flight at the end", got)
	}
}

// TestCoreQueueWaitEndsWithTheClient: a client that leaves while its
// request waits leaves the queue, and nothing of it was recorded.
func TestCoreQueueWaitEndsWithTheClient(t *testing.T) {
	f := newFixture(t, 1, "semantic")
	fo := &flow.Options[*replica.Replica]{}
	c, _ := NewCore(CoreOptions{Engine: f.e, Arms: f.arms(), Flow: fo})
	f.e.Pool().Replicas()[0].Observe(replica.Observed{Waiting: 9}) // capacity unknown: the gauge says it queues
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		in := f.e.Prepare(parseChat(t, "user", "waits"), "", false)
		_, err := route(c, CoreRequest{Input: in, Route: "chat", Ctx: ctx})
		errc <- err
	}()
	waitQueued(t, c, 1)
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("a client that left: %v", err)
	}
	if n, _ := c.q.Len(); n != 0 {
		t.Fatalf("%d still queued", n)
	}
	if st, _ := f.e.Picture().Stats(0); st.Blocks != 0 {
		t.Fatalf("the waiting request was recorded: %d blocks", st.Blocks)
	}
}

// waitQueued waits until c's queue holds n requests.
func waitQueued(t *testing.T, c *Core, n int) {
	t.Helper()
	testwait.Value(t, fmt.Sprint(n, " requests queued"), func() (int, bool) {
		got, _ := c.q.Len()
		return got, got == n
	})
}

// TestHTTPFlowControl: over HTTP, a request past the queue's bound is
// answered 429 with Retry-After; one that waited says how long in
// X-Semroute-Queue-Ms.
func TestHTTPFlowControl(t *testing.T) {
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`)
	}))
	defer up.Close()
	e, err := routing.New(routing.Options{Replicas: []replica.Spec{{Name: "r0", URL: up.URL, MaxRunning: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	rr, _ := routing.NewPolicy(routing.PolicySpec{Type: "round_robin"})
	fo := &flow.Options[*replica.Replica]{MaxRequests: 1}
	core, _ := NewCore(CoreOptions{Engine: e, Arms: []Arm{{Name: "default", Policy: rr, Weight: 1}}, Flow: fo})
	srv, _ := NewServer(ServerOptions{Core: core, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	ts := httptest.NewServer(srv)
	defer ts.Close()
	type answer struct {
		code    int
		queueMs string
		err     error
	}
	post := func(out chan<- answer) {
		resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
		if err != nil {
			out <- answer{err: err}
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		out <- answer{code: resp.StatusCode, queueMs: resp.Header.Get(HeaderQueueMs)}
	}
	first, second := make(chan answer, 1), make(chan answer, 1)
	go post(first)
	testwait.Until(t, "the first request at the replica, in its one slot", func() bool {
		return e.Pool().Replicas()[0].Load(time.Now()).InFlight == 1
	})
	go post(second)
	waitQueued(t, core, 1)
	resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("past the queue's bound: %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	close(release)
	if a := <-first; a.err != nil || a.code != 200 || a.queueMs != "" {
		t.Fatalf("the first: %+v", a)
	}
	if a := <-second; a.err != nil || a.code != 200 || a.queueMs == "" {
		t.Fatalf("the second, which waited: %+v", a)
	}
}

// TestPlacement: a request's priority comes from its objective header
// (either spelling) through the configured map; its flow from its
// fairness header, else its tenant, else its body's user.
func TestPlacement(t *testing.T) {
	prios := map[string]int{"interactive": 10, "best-effort": -1}
	for _, tc := range []struct {
		headers      map[string]string
		tenant, user string
		prio         int
		flow         string
	}{
		{map[string]string{"X-Gateway-Inference-Objective": "interactive"}, "t", "u", 10, "t"},
		{map[string]string{"X-Llm-D-Inference-Objective": "best-effort", "X-Llm-D-Inference-Fairness-Id": "f"}, "t", "u", -1, "f"},
		{map[string]string{"X-Gateway-Inference-Objective": "unknown"}, "", "u", 0, "u"},
		{nil, "", "", 0, ""},
	} {
		h := http.Header{}
		for k, v := range tc.headers {
			h.Set(k, v)
		}
		if p, f := placement(prios, h.Get, tc.tenant, tc.user); p != tc.prio || f != tc.flow {
			t.Errorf("%v: priority %d, flow %q; want %d, %q", tc.headers, p, f, tc.prio, tc.flow)
		}
	}
}

// TestCoreHoldsForThePrefixReplica: with flow control, a request whose
// prefix replica is full waits for it rather than computing the prefix
// again on a replica with room, unless enough work is queued there; the
// slot its replica frees is kept for it, so that a request arriving at
// that moment does not take it.
func TestCoreHoldsForThePrefixReplica(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	c, _ := NewCore(CoreOptions{Engine: f.e, Arms: f.arms(), Flow: &flow.Options[*replica.Replica]{}})
	rs := f.e.Pool().Replicas()
	teachFast(rs, f.now) // a request ahead takes less than the document elsewhere
	doc := strings.Repeat("the shared document goes on ", 200)
	route := func(ctx context.Context, user string) (*Routed, error) {
		in := f.e.Prepare(parseChat(t, "system", doc, "user", user), "", false)
		return route(c, CoreRequest{Input: in, Route: "chat", Ctx: ctx})
	}
	first, err := route(context.Background(), "first")
	if err != nil {
		t.Fatal(err)
	}
	home := first.Served.Replica
	c.FirstByte(first)
	home.Observe(replica.Observed{Running: 1, Waiting: 1}) // it runs one at a time: full
	done := make(chan *Routed, 1)
	go func() {
		rt, err := route(context.Background(), "second")
		if err != nil {
			t.Error(err)
		}
		done <- rt
	}()
	waitQueued(t, c, 1)
	c.q.Tick() // the other is free, but moving costs the document
	if n, _ := c.q.Len(); n != 1 {
		t.Fatal("the request moved and computed its prefix again")
	}
	f.now = f.now.Add(time.Second)
	c.EngineDone(first)
	if !home.Saturated() {
		t.Fatal("the freed slot was not kept for the waiting request")
	}
	second := <-done
	if second.Served.Replica != home || second.Queued != time.Second {
		t.Fatalf("the second went to %s after %v", second.Served.Replica.Name, second.Queued)
	}
	c.Finish(first, Outcome{Status: 200}, nil)
	c.Finish(second, Outcome{Status: 200}, nil)
	for _, r := range rs {
		if l := r.Load(time.Now()); l.InFlight != 0 || l.PendingTokens != 0 || r.Saturated() {
			t.Fatalf("%s at the end: %+v, saturated %v", r.Name, l, r.Saturated())
		}
	}
}

// While a higher priority arrives at a replica, a lower one leaves free
// there the slots kept for it (CoreOptions.Reserve) less those it fills:
// it waits in the router's queue though a slot is free, the higher one
// takes that slot at once, and the lower one goes when more than that is
// free.
func TestCoreReservesForHigherPriority(t *testing.T) {
	f := newFixture(t, 1, "semantic")
	c, _ := NewCore(CoreOptions{Engine: f.e, Arms: f.arms(), Flow: &flow.Options[*replica.Replica]{}, Reserve: 2})
	r := f.e.Pool().Replicas()[0]
	r.Observe(replica.Observed{Running: 3, Waiting: 1}) // it runs three at a time
	route := func(priority int, user string) (*Routed, error) {
		in := f.e.Prepare(parseChat(t, "user", user), "", false)
		return route(c, CoreRequest{Input: in, Route: "chat", Priority: priority, Ctx: context.Background()})
	}
	mustRoute := func(priority int, user string) *Routed {
		t.Helper()
		rt, err := route(priority, user)
		if err != nil {
			t.Fatal(err)
		}
		if rt.Queued != 0 {
			t.Fatalf("%s waited %v in the router's queue", user, rt.Queued)
		}
		return rt
	}
	free := func() int64 { n, _ := r.Free(); return n }
	ui1 := mustRoute(10, "interactive one") // 2 kept, 1 filled: 1 more kept
	b1 := mustRoute(0, "batch one")
	done := make(chan *Routed, 1)
	go func() {
		rt, err := route(0, "batch two")
		if err != nil {
			t.Error(err)
		}
		done <- rt
	}()
	waitQueued(t, c, 1) // the last slot is kept for the interactive traffic
	if free() != 1 {
		t.Fatalf("%d slots free, want the one kept", free())
	}
	ui2 := mustRoute(10, "interactive two")
	c.Finish(ui1, Outcome{Status: 200}, nil) // 2 kept, 1 filled (ui2): its slot stays free
	if n, _ := c.q.Len(); n != 1 || free() != 1 {
		t.Fatalf("a freed slot kept for the interactive traffic went to the batch tenant: %d queued, %d free", n, free())
	}
	f.now = f.now.Add(time.Second)
	c.Finish(b1, Outcome{Status: 200}, nil)
	b2 := <-done
	if b2 == nil || b2.Queued != time.Second {
		t.Fatal("the batch request did not wait for a second free slot")
	}
	for _, rt := range []*Routed{ui2, b2} {
		c.Finish(rt, Outcome{Status: 200}, nil)
	}
	if l := r.Load(time.Now()); l.InFlight != 0 || l.PendingTokens != 0 || r.Saturated() {
		t.Fatalf("at the end: %+v, saturated %v", l, r.Saturated())
	}
	if y := c.q.demand.YieldsTo(0, f.now); y[r.ID].Rate <= 0 || y[r.ID].InFlight != 0 {
		t.Fatalf("after the end the batch tenant gives way to %+v, want a rate and none in flight", y)
	}
}

// TestQueueRefusesAtOnceWhatWouldWaitPastItsDeadline: the router's queue
// predicts each request's wait from the replicas' service times (a slot
// frees every run ÷ capacity seconds); a request that would wait past the
// queue's TTL, or past its own deadline, is answered at once with
// ErrTooLate and a Retry-After of the seconds until it would not, while
// those that fit wait.
func TestQueueRefusesAtOnceWhatWouldWaitPastItsDeadline(t *testing.T) {
	f := newFixture(t, 1, "semantic")
	c, _ := NewCore(CoreOptions{Engine: f.e, Arms: f.arms(), Flow: &flow.Options[*replica.Replica]{TTL: 2 * time.Second}})
	r := f.e.Pool().Replicas()[0]
	teachFast(f.e.Pool().Replicas(), f.now)
	r.Observe(replica.Observed{Running: 1, Waiting: 1}) // it runs one at a time
	p := f.e.Service(r)
	rate := p.Rate(1) // requests a second
	if rate < 2 || rate > 8 {
		t.Fatalf("a replica of quarter-second answers finishes %.2f a second", rate)
	}
	place := func(ctx context.Context, user string, deadline time.Duration) (*Routed, error) {
		in := f.e.Prepare(parseChat(t, "user", user), "", false)
		return route(c, CoreRequest{Input: in, Route: "chat", Ctx: ctx, Deadline: deadline})
	}
	first, err := place(context.Background(), "first", 0)
	if err != nil {
		t.Fatal(err)
	}
	// The k-th request queued waits (k+1) ÷ rate: those within 2 s wait.
	fit := int(math.Ceil(2*rate)) - 1
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := range fit {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := place(ctx, fmt.Sprint("waits ", i), 0); !errors.Is(err, context.Canceled) {
				t.Errorf("a request that fits its TTL: %v", err)
			}
		}()
		waitQueued(t, c, i+1)
	}
	_, err = place(context.Background(), "too late", 0)
	var qe *QueueError
	if !errors.As(err, &qe) || !errors.Is(err, ErrTooLate) || qe.RetryAfter < time.Second {
		t.Fatalf("past the TTL: %v", err)
	}
	// With a deadline of its own below its wait, one is refused at once
	// though it fits the TTL.
	if _, err := place(context.Background(), "in a hurry", time.Duration(float64(fit-1)/rate*float64(time.Second))); !errors.Is(err, ErrTooLate) {
		t.Fatalf("past its own deadline: %v", err)
	}
	if n, _ := c.q.Len(); n != fit {
		t.Fatalf("%d queued, want %d", n, fit)
	}
	cancel()
	wg.Wait()
	c.Finish(first, Outcome{Status: 200}, nil)
}

// TestObjectiveTTFTTarget: a request's objective header names its TTFT
// target (CoreOptions.TTFTTargets), its deadline in the router's queue.
func TestObjectiveTTFTTarget(t *testing.T) {
	f := newFixture(t, 1, "semantic")
	c, _ := NewCore(CoreOptions{Engine: f.e, Arms: f.arms(), TTFTTargets: map[string]time.Duration{"chat": 1500 * time.Millisecond}})
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	for objective, want := range map[string]time.Duration{"chat": 1500 * time.Millisecond, "batch": 0, "": 0} {
		h := http.Header{}
		if objective != "" {
			h.Set("X-Gateway-Inference-Objective", objective)
		}
		lim := limits.Request{}.WithDefaults()
		ad, err := c.Admit(Arrival{Body: body, ContentType: "application/json", Header: h.Get, Route: "chat"}, &lim)
		if err != nil {
			t.Fatal(err)
		}
		if ad.Deadline != want {
			t.Errorf("objective %q: deadline %v, want %v", objective, ad.Deadline, want)
		}
		ad.Recycle()
	}
}

// TestQueueLearnsItsPace: waits longer than predicted raise the queue's
// correction toward their ratio, shorter ones lower it, within bounds.
func TestQueueLearnsItsPace(t *testing.T) {
	f := newFixture(t, 1, "semantic")
	w := newDeferrals(f.e, flow.Options[*replica.Replica]{}, 0, nil)
	factor := func() float64 {
		if c := w.correction(0).Load(); c != 0 {
			return math.Float64frombits(c)
		}
		return 1
	}
	for range 100 {
		w.learnWait(0, time.Duration(float64(time.Second)*factor()), 4*time.Second) // a prediction made with the factor
	}
	if got := factor(); math.Abs(got-4) > 0.05 {
		t.Fatalf("after waits 4× the prediction: %.3f", got)
	}
	for range 200 {
		w.learnWait(0, time.Duration(float64(time.Second)*factor()), time.Second/100)
	}
	if got := factor(); got != 0.25 {
		t.Fatalf("after waits a hundredth of it: %.3f, want the floor 0.25", got)
	}
	w.learnWait(0, time.Millisecond, time.Hour) // too short to say anything
	if got := factor(); got != 0.25 {
		t.Fatalf("a 1 ms prediction moved it: %.3f", got)
	}
	if w.correction(10).Load() != 0 {
		t.Fatal("another priority's waits moved priority 10's")
	}
}
