// Package flow is the router's own queue: the requests that wait while
// every replica they could use is saturated, dispatched one at a time as
// replicas free, by priority first, fairly between flows within a
// priority, and within a flow to the waiting request that gains most from
// the replica that freed (a bounded look-ahead, never past the oldest
// request's age bound). It bounds what it holds by requests, bytes and
// time, and sheds lower priorities first; a sheddable request (negative
// priority, as in the Gateway API Inference Extension's objectives) is
// never queued.
//
// Fairness follows the virtual token counter of "Fairness in Serving Large
// Language Models" (Sheng et al., OSDI 2024, as AIBrix applies it): each
// flow counts the tokens dispatched for it, and the flow with waiting
// requests and the smallest count goes next; a flow that starts waiting is
// lifted to the smallest count of the flows waiting, so that it cannot
// claim the service it did not ask for while idle.
package flow

import (
	"container/list"
	"context"
	"errors"
	"sync"
	"time"
)

// Errors a waiting request ends with, other than its context's.
var (
	// ErrSheddable: the request's priority is negative; it is not queued.
	ErrSheddable = errors.New("flow: a sheddable request is not queued while every replica is saturated")
	// ErrFull: the queue is at its bound of requests or bytes and holds
	// nothing of a lower priority to shed instead.
	ErrFull = errors.New("flow: the queue is full")
	// ErrShed: the request was queued, then shed for one of a higher
	// priority.
	ErrShed = errors.New("flow: shed for a request of a higher priority")
	// ErrExpired: the request waited its TTL.
	ErrExpired = errors.New("flow: waited longer than the queue's TTL")
)

// Defaults of Options: llm-d's flow control's (60 s, 5,000 requests).
const (
	DefaultTTL         = 60 * time.Second
	DefaultMaxRequests = 5000
	DefaultMaxBytes    = 1 << 30
	DefaultLookAhead   = 8
	DefaultAgeBound    = 2 * time.Second
)

// Options bound a Queue. Zero fields take the defaults.
type Options struct {
	MaxRequests int
	MaxBytes    int64
	// TTL is the longest a request waits.
	TTL time.Duration
	// LookAhead is how many of a flow's oldest requests Dispatch compares
	// by cost; AgeBound the wait past which a flow's oldest goes first,
	// whatever its cost.
	LookAhead int
	AgeBound  time.Duration
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// OnLost, if set, is called when a request Dispatch took had already
	// left (its context ended at the same moment): the slot it was given
	// is free again, and the caller should dispatch once more.
	OnLost func()
}

// Item is a request that waits: its priority (higher first), its flow
// (fairness within a priority), its body's bytes (the bound), its tokens
// (what its flow is charged when it is dispatched) and the caller's value,
// which Dispatch's cost reads.
type Item struct {
	Priority int
	Flow     string
	Bytes    int64
	Tokens   int64
	Value    any
}

// Ticket is a queued request's place: Wait until it is dispatched.
type Ticket struct {
	Item
	enqueued time.Time
	done     chan error // buffered: the one verdict
	q        *Queue
	el       *list.Element // in its flow's list; nil once out
	f        *flowState
}

// Enqueued returns when the request was queued.
func (t *Ticket) Enqueued() time.Time { return t.enqueued }

type flowState struct {
	key     string
	band    *band
	waiting *list.List // of *Ticket, oldest first
	served  float64    // tokens dispatched (the virtual token counter)
}

type band struct {
	priority int
	flows    map[string]*flowState
	n        int // tickets waiting
}

// Queue is the router's queue. Safe for concurrent use.
type Queue struct {
	o Options

	mu    sync.Mutex
	bands map[int]*band
	n     int
	bytes int64
}

// New returns an empty Queue.
func New(o Options) *Queue {
	if o.MaxRequests <= 0 {
		o.MaxRequests = DefaultMaxRequests
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultMaxBytes
	}
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	if o.LookAhead <= 0 {
		o.LookAhead = DefaultLookAhead
	}
	if o.AgeBound <= 0 {
		o.AgeBound = DefaultAgeBound
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Queue{o: o, bands: map[int]*band{}}
}

// Len returns the requests and bytes waiting.
func (q *Queue) Len() (requests int, bytes int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n, q.bytes
}

// Enqueue queues it, shedding queued requests of a lower priority (the
// newest of the lowest first) when the queue is at its bounds, or refuses
// it: ErrSheddable for a negative priority, ErrFull when nothing lower can
// make room.
func (q *Queue) Enqueue(it Item) (*Ticket, error) {
	if it.Priority < 0 {
		return nil, ErrSheddable
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	for q.n+1 > q.o.MaxRequests || q.bytes+it.Bytes > q.o.MaxBytes {
		if it.Bytes > q.o.MaxBytes || !q.shedBelow(it.Priority) {
			return nil, ErrFull
		}
	}
	b := q.bands[it.Priority]
	if b == nil {
		b = &band{priority: it.Priority, flows: map[string]*flowState{}}
		q.bands[it.Priority] = b
	}
	f := b.flows[it.Flow]
	if f == nil {
		f = &flowState{key: it.Flow, band: b, waiting: list.New()}
		b.flows[it.Flow] = f
	}
	if f.waiting.Len() == 0 { // starts waiting: no credit for the time it did not ask
		m, _ := b.minServed(f)
		f.served = max(f.served, m)
	}
	t := &Ticket{Item: it, enqueued: q.o.Now(), done: make(chan error, 1), q: q, f: f}
	t.el = f.waiting.PushBack(t)
	b.n++
	q.n++
	q.bytes += it.Bytes
	return t, nil
}

// minServed returns the smallest count of the band's flows waiting, but
// f, and whether any waits.
func (b *band) minServed(f *flowState) (m float64, any bool) {
	for _, g := range b.flows {
		if g == f || g.waiting.Len() == 0 {
			continue
		}
		if !any || g.served < m {
			m, any = g.served, true
		}
	}
	return m, any
}

// forgettable reports whether idle flow f may be forgotten: no flow of its
// band waits (the contention it was counted in is over), or the waiting
// ones have caught up with it (it would be lifted to their count anyway).
func (b *band) forgettable(f *flowState) bool {
	if f.waiting.Len() > 0 {
		return false
	}
	m, any := b.minServed(f)
	return !any || f.served <= m
}

// shedBelow sheds the newest request of the lowest priority below p, and
// reports whether there was one. q.mu is held.
func (q *Queue) shedBelow(p int) bool {
	var low *band
	for _, b := range q.bands {
		if b.n > 0 && b.priority < p && (low == nil || b.priority < low.priority) {
			low = b
		}
	}
	if low == nil {
		return false
	}
	var newest *Ticket
	for _, f := range low.flows {
		if e := f.waiting.Back(); e != nil {
			if t := e.Value.(*Ticket); newest == nil || t.enqueued.After(newest.enqueued) {
				newest = t
			}
		}
	}
	q.remove(newest, ErrShed)
	return true
}

// remove takes t out with verdict err (nil: dispatched). q.mu is held.
func (q *Queue) remove(t *Ticket, err error) {
	if t.el == nil {
		return
	}
	t.f.waiting.Remove(t.el)
	t.el = nil
	t.f.band.n--
	q.n--
	q.bytes -= t.Bytes
	if t.f.band.forgettable(t.f) {
		delete(t.f.band.flows, t.f.key)
	}
	t.done <- err
}

// Wait blocks until t is dispatched (nil), shed or expired (ErrShed,
// ErrExpired), or ctx ends (its error; t leaves the queue, and a dispatch
// that came at the same moment is handed back through Options.OnLost).
func (t *Ticket) Wait(ctx context.Context) error {
	select {
	case err := <-t.done: // a verdict already given goes first
		return err
	default:
	}
	select {
	case err := <-t.done:
		return err
	case <-ctx.Done():
	}
	t.q.mu.Lock()
	t.q.remove(t, ctx.Err()) // out, unless a verdict came first
	t.q.mu.Unlock()
	if err := <-t.done; err == nil && t.q.o.OnLost != nil {
		t.q.o.OnLost() // dispatched as it left: the slot is free again
	}
	return ctx.Err()
}

// Dispatch takes the next request for a replica that has freed and
// reports whether there was one: the highest priority waiting, within it
// the flow served least, within that flow the request of least cost
// among its LookAhead oldest, unless its oldest has waited AgeBound. cost
// reads an Item's Value (the same unit as routing's: the prefill tokens it
// would compute there); nil takes the oldest.
func (q *Queue) Dispatch(cost func(Item) float64) (*Ticket, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	var top *band
	for _, b := range q.bands {
		if b.n > 0 && (top == nil || b.priority > top.priority) {
			top = b
		}
	}
	if top == nil {
		return nil, false
	}
	f := top.leastServed()
	t := q.cheapest(f, cost)
	f.served += float64(max(t.Tokens, 1))
	q.remove(t, nil)
	return t, true
}

// leastServed returns the band's waiting flow of the least count (by key
// among equals).
func (b *band) leastServed() *flowState {
	var f *flowState
	for _, g := range b.flows {
		if g.waiting.Len() > 0 && (f == nil || g.served < f.served || g.served == f.served && g.key < f.key) {
			f = g
		}
	}
	return f
}

// cheapest returns the request of least cost among f's LookAhead oldest,
// or its oldest when it has waited AgeBound or cost is nil.
func (q *Queue) cheapest(f *flowState, cost func(Item) float64) *Ticket {
	t := f.waiting.Front().Value.(*Ticket)
	if cost == nil || q.o.Now().Sub(t.enqueued) >= q.o.AgeBound {
		return t
	}
	best, i := cost(t.Item), 1
	for e := f.waiting.Front().Next(); e != nil && i < q.o.LookAhead; e, i = e.Next(), i+1 {
		if c := cost(e.Value.(*Ticket).Item); c < best {
			t, best = e.Value.(*Ticket), c
		}
	}
	return t
}

// Expire ends the requests that have waited the TTL with ErrExpired and
// returns how many; it also forgets idle flows whose count the waiting
// ones have caught up with, and empty priorities. Call it periodically.
func (q *Queue) Expire() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	now, n := q.o.Now(), 0
	for p, b := range q.bands {
		for k, f := range b.flows {
			if b.forgettable(f) {
				delete(b.flows, k)
				continue
			}
			for e := f.waiting.Front(); e != nil; { // oldest first: the rest are younger
				t := e.Value.(*Ticket)
				if now.Sub(t.enqueued) < q.o.TTL {
					break
				}
				e = e.Next()
				q.remove(t, ErrExpired)
				n++
			}
		}
		if b.n == 0 && len(b.flows) == 0 {
			delete(q.bands, p)
		}
	}
	return n
}
