package flow

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
)

// clock is a settable clock.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func enqueue(t *testing.T, q *Queue[any, any], p int, flow string, v any) *Ticket[any, any] {
	t.Helper()
	tk, err := q.Enqueue(Item[any]{Priority: p, Flow: flow, Bytes: 10, Tokens: 100, Value: v})
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// order dispatches everything and returns the values in dispatch order.
func order(q *Queue[any, any], cost func(*Ticket[any, any]) float64) string {
	var out []string
	for {
		tk, ok := q.Dispatch(-1, cost, nil)
		if !ok {
			return strings.Join(out, " ")
		}
		out = append(out, fmt.Sprint(tk.Value))
	}
}

func TestPriorityFirstThenFairness(t *testing.T) {
	c := &clock{t: time.Unix(0, 0)}
	q := New[any, any](Options[any]{Now: c.now})
	for i := range 4 {
		enqueue(t, q, 0, "flood", fmt.Sprint("f", i))
	}
	enqueue(t, q, 0, "quiet", "q0")
	enqueue(t, q, 5, "interactive", "i0")
	enqueue(t, q, 0, "quiet", "q1")
	// The interactive priority first; then the flows served least take
	// turns (ties to the flow whose oldest request came first), the flood's
	// rest after the quiet flow is done.
	if got := order(q, nil); got != "i0 f0 q0 f1 q1 f2 f3" {
		t.Fatalf("dispatched %s", got)
	}
	if n, b := q.Len(); n != 0 || b != 0 {
		t.Fatalf("left %d requests, %d bytes", n, b)
	}
}

// A flow that starts waiting is lifted to the least count waiting: it
// does not get the service it did not ask for while it was idle.
func TestIdleFlowIsLifted(t *testing.T) {
	q := New[any, any](Options[any]{})
	for i := range 3 {
		enqueue(t, q, 0, "a", fmt.Sprint("a", i))
	}
	q.Dispatch(-1, nil, nil)
	q.Dispatch(-1, nil, nil) // a has been served 200 tokens
	enqueue(t, q, 0, "b", "b0")
	enqueue(t, q, 0, "b", "b1")
	enqueue(t, q, 0, "b", "b2")
	// b starts at a's count: they alternate, rather than b taking three.
	if got := order(q, nil); got != "a2 b0 b1 b2" && got != "b0 a2 b1 b2" {
		t.Fatalf("dispatched %s", got)
	}
}

// Within a flow the cheapest of the LookAhead oldest goes, among those
// queued within AgeBound of the oldest, however long all have waited.
func TestLookAheadAndAgeBound(t *testing.T) {
	c := &clock{t: time.Unix(0, 0)}
	q := New[any, any](Options[any]{Now: c.now, LookAhead: 3, AgeBound: time.Second})
	for i, cost := range []float64{50, 40, 10, 0} {
		enqueue(t, q, 0, "f", fmt.Sprintf("r%d:%v", i, cost))
	}
	c.t = c.t.Add(2 * time.Second)
	enqueue(t, q, 0, "f", "late:0")
	cost := func(it *Ticket[any, any]) float64 {
		var v float64
		fmt.Sscanf(strings.Split(it.Value.(string), ":")[1], "%g", &v)
		return v
	}
	c.t = c.t.Add(time.Minute) // everyone has waited long: the choice is the same
	if tk, _ := q.Dispatch(-1, cost, nil); tk.Value != "r2:10" {
		t.Fatalf("took %v, want the cheapest of the three oldest", tk.Value)
	}
	if tk, _ := q.Dispatch(-1, cost, nil); tk.Value != "r3:0" {
		t.Fatalf("took %v, want the cheapest of the three oldest", tk.Value)
	}
	// "late" is cheapest, but 2 s younger than r0: r0 goes first.
	if tk, _ := q.Dispatch(-1, cost, nil); tk.Value != "r1:40" {
		t.Fatalf("took %v, want r1, which late may not pass", tk.Value)
	}
	if tk, _ := q.Dispatch(-1, cost, nil); tk.Value != "r0:50" {
		t.Fatalf("took %v, want r0, which late may not pass", tk.Value)
	}
}

// A slot that frees on a home goes to the oldest request waiting for it,
// in the flow's turn, however far back it is, unless an older one costs
// less there; a flow with none waiting there lends the slot to its
// cheapest request of finite cost, or to none.
func TestHomes(t *testing.T) {
	q := New[any, any](Options[any]{LookAhead: 2})
	put := func(home int, v string) {
		if _, err := q.Enqueue(Item[any]{Flow: "f", Home: home, Tokens: 1, Value: v}); err != nil {
			t.Fatal(err)
		}
	}
	put(0, "a0")
	put(0, "b0")
	put(0, "c0")
	put(1, "d1")
	// never lends: a request costs nothing on its home, and moving costs
	// more than it saves.
	never := func(slot int) func(*Ticket[any, any]) float64 {
		return func(it *Ticket[any, any]) float64 {
			if it.Home == slot {
				return 0
			}
			return math.Inf(1)
		}
	}
	if tk, _ := q.Dispatch(1, never(1), nil); tk == nil || tk.Value != "d1" {
		t.Fatalf("home 1's slot went to %v, want d1, behind three others", tk)
	}
	put(1, "g1")
	kept := func(*Ticket[any, any]) float64 { return math.Inf(1) } // kept for traffic they give way to
	if tk, ok := q.Dispatch(1, kept, nil); ok {
		t.Fatalf("home 1's slot went to %v, which may not take it", tk.Value)
	}
	q.Dispatch(1, never(1), nil) // g1
	if tk, ok := q.Dispatch(1, never(1), nil); ok {
		t.Fatalf("home 1's slot went to %v, which waits for home 0 at infinite cost", tk.Value)
	}
	cheapB := func(it *Ticket[any, any]) float64 {
		if it.Value == "b0" {
			return 1
		}
		return 5
	}
	if tk, _ := q.Dispatch(1, cheapB, nil); tk == nil || tk.Value != "b0" {
		t.Fatalf("home 1's slot lent to %v, want b0, the cheapest of the two oldest", tk)
	}
	if tk, _ := q.Dispatch(0, never(0), nil); tk == nil || tk.Value != "a0" {
		t.Fatalf("home 0's slot went to %v, want a0", tk)
	}
	if n, _ := q.Len(); n != 1 {
		t.Fatalf("%d left, want c0 alone", n)
	}
	// A request waiting elsewhere that the picture now says computes less
	// on home 1 than its own request would goes first.
	q.Dispatch(0, never(0), nil) // c0
	put(1, "e1")
	put(0, "f0")
	betterHere := func(it *Ticket[any, any]) float64 {
		if it.Value == "f0" {
			return -3
		}
		return 0
	}
	if tk, _ := q.Dispatch(1, betterHere, nil); tk == nil || tk.Value != "f0" {
		t.Fatalf("home 1's slot went to %v, want f0, cheaper there than e1", tk)
	}
	if tk, _ := q.Dispatch(1, betterHere, nil); tk == nil || tk.Value != "e1" {
		t.Fatalf("home 1's slot went to %v, want e1", tk)
	}
}

func TestBoundsShedLowerPrioritiesFirst(t *testing.T) {
	c := &clock{t: time.Unix(0, 0)}
	q := New[any, any](Options[any]{Now: c.now, MaxRequests: 3})
	low0 := enqueue(t, q, 0, "batch", "low0")
	c.t = c.t.Add(time.Millisecond)
	low1 := enqueue(t, q, 0, "batch", "low1")
	enqueue(t, q, 1, "x", "mid")
	if _, err := q.Enqueue(Item[any]{Priority: 0, Flow: "batch"}); !errors.Is(err, ErrFull) {
		t.Fatalf("a fourth request of the lowest priority: %v, want ErrFull", err)
	}
	enqueue(t, q, 2, "y", "high") // sheds low1, the newest of the lowest
	if err := low1.Wait(context.Background()); !errors.Is(err, ErrShed) {
		t.Fatalf("the shed request's wait: %v", err)
	}
	if _, err := q.Enqueue(Item[any]{Priority: -1}); !errors.Is(err, ErrSheddable) {
		t.Fatalf("a sheddable request: %v", err)
	}
	if _, err := q.Enqueue(Item[any]{Priority: 9, Bytes: DefaultMaxBytes + 1}); !errors.Is(err, ErrFull) {
		t.Fatalf("a request larger than the byte bound: %v", err)
	}
	if got := order(q, nil); got != "high mid low0" {
		t.Fatalf("dispatched %s", got)
	}
	if err := low0.Wait(context.Background()); err != nil {
		t.Fatalf("a dispatched request's wait: %v", err)
	}
}

func TestTTLAndCancel(t *testing.T) {
	c := &clock{t: time.Unix(0, 0)}
	lost := 0
	q := New[any, any](Options[any]{Now: c.now, TTL: time.Minute, OnLost: func(any) { lost++ }})
	old := enqueue(t, q, 0, "f", "old")
	c.t = c.t.Add(30 * time.Second)
	young := enqueue(t, q, 0, "f", "young")
	c.t = c.t.Add(31 * time.Second)
	if n := q.Expire(); n != 1 {
		t.Fatalf("expired %d, want 1", n)
	}
	if err := old.Wait(context.Background()); !errors.Is(err, ErrExpired) {
		t.Fatalf("the expired request's wait: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := young.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("a canceled wait: %v", err)
	}
	if n, _ := q.Len(); n != 0 || lost != 0 {
		t.Fatalf("%d left, %d lost", n, lost)
	}
	// A request dispatched before its waiter looked is dispatched, its
	// context ended or not.
	raced := enqueue(t, q, 0, "f", "raced")
	q.Dispatch(-1, nil, nil)
	if err := raced.Wait(ctx); err != nil || lost != 0 {
		t.Fatalf("a dispatched request whose context had ended: %v, lost %d", err, lost)
	}
}

// TestFlowsAreForgotten: idle flows whose count the waiting ones reached
// are forgotten, so that a queue of many flows does not keep them all.
func TestFlowsAreForgotten(t *testing.T) {
	q := New[any, any](Options[any]{})
	for i := range 1000 {
		enqueue(t, q, 0, fmt.Sprint("user", i), i)
		q.Dispatch(-1, nil, nil)
	}
	q.Expire()
	if n := len(q.bands); n != 0 {
		t.Fatalf("%d priorities kept with nothing waiting", n)
	}
}

// TestConcurrentWaiters: waiters that leave, waiters dispatched and a
// dispatcher racing them: every request ends once, and every slot given
// to a waiter that had left comes back through OnLost.
func TestConcurrentWaiters(t *testing.T) {
	var lost, served grants
	q := New[any, any](Options[any]{OnLost: lost.add})
	const n = 400
	results := make(chan error, n)
	for i := range n {
		tk := enqueue(t, q, i%3, fmt.Sprint("flow", i%7), i)
		ctx, cancel := context.WithCancel(context.Background())
		if i%4 == 0 {
			cancel()
		}
		go func() {
			defer cancel()
			err := tk.Wait(ctx)
			if err == nil {
				served.add(tk.Grant())
			}
			results <- err
		}()
	}
	dispatched := 0
	for {
		if _, ok := q.Dispatch(-1, nil, dispatched); !ok {
			break
		}
		dispatched++
	}
	ok, canceled := 0, 0
	for range n {
		switch err := <-results; {
		case err == nil:
			ok++
		case errors.Is(err, context.Canceled):
			canceled++
		default:
			t.Fatalf("a waiter ended with %v", err)
		}
	}
	if left, _ := q.Len(); left != 0 || ok+canceled != n || dispatched != ok+lost.get() {
		t.Fatalf("left %d; %d dispatched = %d waiters served + %d lost? %d canceled", left, dispatched, ok, lost.get(), canceled)
	}
	for g := range dispatched { // every slot given reached a waiter or came back, once
		if served.got[g]+lost.got[g] != 1 {
			t.Fatalf("grant %d: served %d times, handed back %d times", g, served.got[g], lost.got[g])
		}
	}
}

// grants collects the grants of slots handed back, each once.
type grants struct {
	mu  sync.Mutex
	got map[any]int
}

func (g *grants) add(grant any) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.got == nil {
		g.got = map[any]int{}
	}
	g.got[grant]++
}

func (g *grants) get() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.got)
}

// TestAheadByFairTurns: a request waits behind every request of a higher
// priority and, in its own, behind at most one more than its own flow has
// waiting from each flow: a light flow's request is near the front however
// much another flow has queued.
func TestAheadByFairTurns(t *testing.T) {
	q := New[int, int](Options[int]{MaxRequests: 1000, MaxBytes: 1 << 30, TTL: time.Hour})
	add := func(p int, flow string, n int) {
		for range n {
			if _, err := q.Enqueue(Item[int]{Priority: p, Flow: flow, Bytes: 1, Tokens: 1}); err != nil {
				t.Fatal(err)
			}
		}
	}
	add(0, "flood", 100)
	add(0, "quiet", 2)
	add(10, "vip", 3)
	for _, tc := range []struct {
		p    int
		flow string
		want int
	}{
		{0, "quiet", 3 + 3 + 2},   // the vip's 3; 3 of the flood's; its own 2
		{0, "new", 3 + 1 + 1},     // a flow not waiting: one of each
		{0, "flood", 3 + 100 + 2}, // the flood waits behind all of it
		{10, "vip", 3},
		{20, "any", 0},
	} {
		if got := q.Ahead(tc.p, tc.flow); got != tc.want {
			t.Errorf("priority %d, flow %s: %d ahead, want %d", tc.p, tc.flow, got, tc.want)
		}
	}
}
