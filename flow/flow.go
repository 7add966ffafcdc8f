// Package flow is the router's own queue: the requests that wait while
// every replica they could use is saturated, dispatched one at a time as
// replicas free, by priority first, fairly between flows within a
// priority, and within a flow to the waiting request that gains most from
// the replica that freed (a bounded look-ahead, passing a request only
// with requests at most an age bound younger). It bounds what it holds by requests, bytes and
// time, and sheds lower priorities first; a sheddable request (negative
// priority, as in the Gateway API Inference Extension's objectives) is
// never queued.
//
// Fairness follows the virtual token counter of "Fairness in Serving Large
// Language Models" (Sheng et al., OSDI 2024, as AIBrix applies it): each
// flow counts the tokens dispatched for it, and the flow with waiting
// requests and the smallest count goes next; among equal counts, the flow
// whose oldest waiting request arrived first (never the flow's name). A
// flow that starts waiting is lifted to the priority's virtual time, and
// to the smallest count of the flows waiting, so that it cannot claim the
// service it did not ask for while idle. The virtual time advances with
// every dispatch by its tokens divided by the flows waiting then (the share
// each would have had, as in start-time fair queuing's system virtual
// time): so a stream of new flows, each lifted to it, cannot hold the
// smallest count below a waiting flow's for ever, and a waiting flow is
// served within a bounded number of dispatches however many new flows
// arrive.
package flow

import (
	"cmp"
	"container/list"
	"context"
	"errors"
	"math"
	"slices"
	"sync"
	"time"
)

// Errors a waiting request ends with, other than its context's.
var (
	// ErrSheddable: the request's priority is negative; it is not queued.
	ErrSheddable = errors.New("flow: a sheddable request is not queued")
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
	DefaultLookAhead   = 32
	DefaultAgeBound    = 2 * time.Second
)

// Options bound a Queue. Zero fields take the defaults.
type Options[G any] struct {
	MaxRequests int
	MaxBytes    int64
	// TTL is the longest a request waits.
	TTL time.Duration
	// LookAhead is how many of a flow's oldest requests Dispatch compares
	// by cost; AgeBound how much younger than the oldest a request may be
	// and still go before it (the longest a request is delayed by the
	// cheaper ones queued after it, per request ahead of it).
	LookAhead int
	AgeBound  time.Duration
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// OnLost, if set, is called with Dispatch's grant when a request
	// Dispatch took had already left (its context ended at the same
	// moment): the slot it was given is free again, and the caller should
	// dispatch once more.
	OnLost func(grant G)
}

// Item is a request that waits: its priority (higher first), its flow
// (fairness within a priority), its home (the slot it waits for: a
// replica's ID, as in that engine's own queue), its body's bytes (the
// bound), its tokens (what its flow is charged when it is dispatched) and
// the caller's value, which Dispatch's cost reads.
type Item[V any] struct {
	Priority int
	Flow     string
	Home     int
	Bytes    int64
	Tokens   int64
	Value    V
}

// Ticket is a queued request's place: Wait until it is dispatched.
type Ticket[V, G any] struct {
	Item[V]
	enqueued time.Time
	seq      uint64     // arrival order in its Queue: ties between flows
	grant    G          // Dispatch's, set before the verdict
	done     chan error // buffered: the one verdict
	q        *Queue[V, G]
	el       *list.Element // in its flow's list; nil once out
	homeEl   *list.Element // in its flow's list for its home
	f        *flowState[V, G]
}

// Enqueued returns when the request was queued.
func (t *Ticket[V, G]) Enqueued() time.Time { return t.enqueued }

// Waited returns how long the request has waited, by the queue's clock.
func (t *Ticket[V, G]) Waited() time.Duration { return t.q.o.Now().Sub(t.enqueued) }

// Grant returns what Dispatch gave the request with its turn (the slot
// kept for it); read it after Wait returned nil.
func (t *Ticket[V, G]) Grant() G { return t.grant }

type flowState[V, G any] struct {
	key     string
	band    *band[V, G]
	waiting *list.List         // of *Ticket[V, G], oldest first
	homes   map[int]*list.List // the same, by home
	served  float64            // tokens dispatched (the virtual token counter)
}

// oldest returns the arrival number of f's oldest waiting request; f waits.
func (f *flowState[V, G]) oldest() uint64 { return f.waiting.Front().Value.(*Ticket[V, G]).seq }

type band[V, G any] struct {
	priority int
	flows    map[string]*flowState[V, G]
	n        int // tickets waiting
	// vtime is the band's virtual time, in tokens: the sum over its
	// dispatches of each one's tokens divided by the flows waiting at that
	// moment (the dispatched one's included). It never decreases; a flow
	// that starts waiting is lifted to it.
	vtime float64
}

// Queue is the router's queue. Safe for concurrent use.
type Queue[V, G any] struct {
	o Options[G]

	mu    sync.Mutex
	bands map[int]*band[V, G]
	n     int
	bytes int64
	gen   uint64 // changes with every request queued or gone (Generation)
	seq   uint64 // the next request's arrival number (Ticket.seq)
}

// Generation returns a number that changes whenever a request is queued
// or leaves the queue: a caller whose offer nobody took may skip offering
// again until it changes.
func (q *Queue[V, G]) Generation() uint64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.gen
}

// New returns an empty Queue.
func New[V, G any](o Options[G]) *Queue[V, G] {
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
	return &Queue[V, G]{o: o, bands: map[int]*band[V, G]{}}
}

// Len returns the requests and bytes waiting.
func (q *Queue[V, G]) Len() (requests int, bytes int64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n, q.bytes
}

// Bands returns the requests waiting at each priority and the flows
// waiting (at any priority).
func (q *Queue[V, G]) Bands() (requests map[int]int, flows int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	requests = make(map[int]int, len(q.bands))
	for p, b := range q.bands {
		requests[p] = b.n
		for _, f := range b.flows {
			if f.waiting.Len() > 0 {
				flows++
			}
		}
	}
	return requests, flows
}

// Ahead returns how many waiting requests a request of priority and flow
// queued now would wait behind, as the queue serves them: every one of a
// higher priority, and in its own priority, flows taking turns, from each
// flow at most one more than its own flow has waiting (fair queueing's
// order: a flow that sends little waits behind few, however much another
// floods).
func (q *Queue[V, G]) Ahead(priority int, flow string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := 0
	for p, b := range q.bands {
		switch {
		case p > priority:
			n += b.n
		case p == priority:
			mine := 0
			if f := b.flows[flow]; f != nil {
				mine = f.waiting.Len()
			}
			for _, f := range b.flows {
				n += min(f.waiting.Len(), mine+1)
			}
		}
	}
	return n
}

// Enqueue queues it, shedding queued requests of a lower priority (the
// newest of the lowest first) when the queue is at its bounds, or refuses
// it: ErrSheddable for a negative priority, ErrFull when nothing lower can
// make room.
func (q *Queue[V, G]) Enqueue(it Item[V]) (*Ticket[V, G], error) {
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
	f := q.flowOf(it)
	if f.waiting.Len() == 0 { // starts waiting: no credit for the time it did not ask
		m, _ := f.band.minServed(f)
		f.served = max(f.served, m, f.band.vtime)
	}
	t := &Ticket[V, G]{Item: it, enqueued: q.o.Now(), seq: q.seq, done: make(chan error, 1), q: q, f: f}
	q.seq++
	t.el = f.waiting.PushBack(t)
	h := f.homes[it.Home]
	if h == nil {
		h = list.New()
		f.homes[it.Home] = h
	}
	t.homeEl = h.PushBack(t)
	f.band.n++
	q.n++
	q.bytes += it.Bytes
	q.gen++
	return t, nil
}

// flowOf returns it's flow at its priority, made if new. q.mu is held.
func (q *Queue[V, G]) flowOf(it Item[V]) *flowState[V, G] {
	b := q.bands[it.Priority]
	if b == nil {
		b = &band[V, G]{priority: it.Priority, flows: map[string]*flowState[V, G]{}}
		q.bands[it.Priority] = b
	}
	f := b.flows[it.Flow]
	if f == nil {
		f = &flowState[V, G]{key: it.Flow, band: b, waiting: list.New(), homes: map[int]*list.List{}}
		b.flows[it.Flow] = f
	}
	return f
}

// minServed returns the smallest count of the band's flows waiting, but
// f, and whether any waits.
func (b *band[V, G]) minServed(f *flowState[V, G]) (m float64, any bool) {
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
// ones or the band's virtual time have caught up with it (it would be
// lifted to their count anyway).
func (b *band[V, G]) forgettable(f *flowState[V, G]) bool {
	if f.waiting.Len() > 0 {
		return false
	}
	m, any := b.minServed(f)
	return !any || f.served <= max(m, b.vtime)
}

// shedBelow sheds the newest request of the lowest priority below p, and
// reports whether there was one. q.mu is held.
func (q *Queue[V, G]) shedBelow(p int) bool {
	var low *band[V, G]
	for _, b := range q.bands {
		if b.n > 0 && b.priority < p && (low == nil || b.priority < low.priority) {
			low = b
		}
	}
	if low == nil {
		return false
	}
	var newest *Ticket[V, G]
	for _, f := range low.flows {
		if e := f.waiting.Back(); e != nil {
			if t := e.Value.(*Ticket[V, G]); newest == nil || t.enqueued.After(newest.enqueued) {
				newest = t
			}
		}
	}
	q.remove(newest, ErrShed)
	return true
}

// remove takes t out with verdict err (nil: dispatched). q.mu is held.
func (q *Queue[V, G]) remove(t *Ticket[V, G], err error) {
	if t.el == nil {
		return
	}
	t.f.waiting.Remove(t.el)
	t.el = nil
	if h := t.f.homes[t.Home]; h != nil {
		h.Remove(t.homeEl)
		if h.Len() == 0 {
			delete(t.f.homes, t.Home)
		}
	}
	t.f.band.n--
	q.n--
	q.bytes -= t.Bytes
	q.gen++
	if t.f.band.forgettable(t.f) {
		delete(t.f.band.flows, t.f.key)
	}
	t.done <- err
}

// Wait blocks until t is dispatched (nil), shed or expired (ErrShed,
// ErrExpired), or ctx ends (its error; t leaves the queue, and a dispatch
// that came at the same moment is handed back through Options.OnLost).
func (t *Ticket[V, G]) Wait(ctx context.Context) error {
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
		t.q.o.OnLost(t.grant) // dispatched as it left: the slot is free again
	}
	return ctx.Err()
}

// Dispatch takes the next request for a slot that freed on home and
// reports whether there was one: the highest priority waiting, within it
// the flow served least (of equals, the one whose oldest request waiting
// arrived first), and within that flow its oldest request waiting
// for home, as in that engine's own queue, unless one of its LookAhead
// oldest queued within AgeBound of its oldest costs less there (it gains
// more time there: the picture now has more of its prefix on home than
// where it waits, or its own home's queue is longer); a flow with none
// waiting for home gives the slot to the cheapest of those (taking it
// from the home it waits for). cost reads a waiting request (its Item's
// Value, how long it has waited) and returns what sending it to home
// costs against waiting for its own home, in the caller's unit (the
// router's: its time to first token there over at home, below 1 a gain;
// 0 for a request whose home this is); an infinite cost means the
// request may not take this slot (it is better off waiting for its own
// home, or the slot is kept for traffic it gives way to), and the next
// flow, then the next priority, is looked at; nil takes the oldest. The request's
// Ticket.Grant returns grant.
func (q *Queue[V, G]) Dispatch(home int, cost func(*Ticket[V, G]) float64, grant G) (*Ticket[V, G], bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	bands := make([]*band[V, G], 0, len(q.bands))
	for _, b := range q.bands {
		if b.n > 0 {
			bands = append(bands, b)
		}
	}
	slices.SortFunc(bands, func(a, b *band[V, G]) int { return cmp.Compare(b.priority, a.priority) })
	budget := 2 * q.o.LookAhead // costs computed at most, whatever the flows
	for _, b := range bands {
		fs := b.byServed()
		for _, f := range fs {
			if t := q.pick(f, home, cost, &budget); t != nil {
				tokens := float64(max(t.Tokens, 1))
				f.served += tokens
				b.vtime += tokens / float64(len(fs))
				t.grant = grant
				q.remove(t, nil)
				return t, true
			}
		}
	}
	return nil, false
}

// pick returns flow f's request for a slot on home: the least cost of its
// oldest request waiting for home (which costs nothing, or what the
// picture now says it would save there) and of those cheapest finds, the
// home's first among equals; nil when none has a finite cost.
func (q *Queue[V, G]) pick(f *flowState[V, G], home int, cost func(*Ticket[V, G]) float64, budget *int) *Ticket[V, G] {
	var own *Ticket[V, G]
	ownCost := math.Inf(1)
	if h := f.homes[home]; h != nil {
		own = h.Front().Value.(*Ticket[V, G])
		if cost == nil {
			return own
		}
		if ownCost = cost(own); math.IsInf(ownCost, 1) {
			own = nil // it may not take this slot (a reservation it gives way to)
		}
	}
	var lent *Ticket[V, G]
	lentCost := math.Inf(1)
	if *budget > 0 {
		lent, lentCost = q.cheapest(f, cost, budget)
	}
	switch {
	case own == nil:
		return lent
	case lent == nil || lent.Home == home || ownCost <= lentCost:
		return own
	}
	return lent
}

// byServed returns the band's waiting flows, least served first; among
// equals, the flow whose oldest waiting request arrived first, so that
// neither a flow's name nor the flows that start waiting after it (lifted
// to its count) can keep it waiting.
func (b *band[V, G]) byServed() []*flowState[V, G] {
	fs := make([]*flowState[V, G], 0, len(b.flows))
	for _, g := range b.flows {
		if g.waiting.Len() > 0 {
			fs = append(fs, g)
		}
	}
	slices.SortFunc(fs, func(f, g *flowState[V, G]) int {
		return cmp.Or(cmp.Compare(f.served, g.served), cmp.Compare(f.oldest(), g.oldest()))
	})
	return fs
}

// cheapest returns the request of least finite cost among f's LookAhead
// oldest that were queued within AgeBound of its oldest (the first of
// equals) and its cost, nil if none has a finite cost, or its oldest
// when cost is nil; each cost computed takes one from budget. So a request
// is passed over only by requests at most AgeBound younger than itself, or
// while it waits for its own replica.
func (q *Queue[V, G]) cheapest(f *flowState[V, G], cost func(*Ticket[V, G]) float64, budget *int) (*Ticket[V, G], float64) {
	first := f.waiting.Front().Value.(*Ticket[V, G])
	if cost == nil {
		return first, 0
	}
	until := first.enqueued.Add(q.o.AgeBound)
	var t *Ticket[V, G]
	best, i := math.Inf(1), 0
	for e := f.waiting.Front(); e != nil && i < q.o.LookAhead && *budget > 0; e, i = e.Next(), i+1 {
		u := e.Value.(*Ticket[V, G])
		if u.enqueued.After(until) {
			break
		}
		*budget--
		if c := cost(u); c < best {
			t, best = u, c
		}
	}
	return t, best
}

// Expire ends the requests that have waited the TTL with ErrExpired and
// returns how many; it also forgets idle flows whose count the waiting
// ones have caught up with, and empty priorities. Call it periodically.
func (q *Queue[V, G]) Expire() int {
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
				t := e.Value.(*Ticket[V, G])
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
