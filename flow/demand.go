package flow

import (
	"container/heap"
	"math"
	"sync"
	"time"
)

// Demand counts the recent arrivals of each priority at each replica,
// decayed with a half-life, and the requests of each in flight there, to
// say what traffic a request gives way to: every higher priority's.
//
// The router's queue (Queue) orders what waits; Demand decides which
// slots a lower priority may not take while a higher one arrives. Engines
// run a request to its end once they start it, so a request of higher
// priority that arrives when a flood holds every slot waits for one to
// free: keeping a few slots for it is the non-preemptive answer, trunk
// reservation in the telephone networks' terms (Ott and Krishnan,
// "State-dependent routing of telephone traffic and the use of separable
// routing schemes", 1985). Counting by replica lets the caller keep them
// where that traffic goes, so its prefixes stay in those engines' caches.
//
// Within a priority nothing is kept: fairness between flows is the
// Queue's order alone (measured: keeping slots for a quiet flow cost the
// flooding one a third of its share and barely helped the quiet one; see
// BENCHMARKS.md). Safe for concurrent use.
type Demand struct {
	half time.Duration
	max  int // MaxDemandKeys; less in tests

	mu     sync.Mutex
	counts map[demandKey]*demandRate
	idle   dueHeap // by due: every count with nothing in flight, and those begun since forget last saw them
}

// MaxDemandKeys bounds the priority and replica pairs Demand counts; past
// it new pairs are not counted (priorities come from config, so only a
// misconfiguration reaches it).
const MaxDemandKeys = 4096

// DefaultDemandHalfLife is the half-life of Demand's counts: long enough
// to span several requests of a light priority, short enough to forget it
// a few seconds after it stops.
const DefaultDemandHalfLife = 10 * time.Second

type demandKey struct {
	priority int
	home     int // the replica the requests went to, or were held for
}

// demandRate is a key's decayed arrivals (as of at), since when it has
// been counted, and its requests in flight.
type demandRate struct {
	requests  float64
	at, since time.Time
	inFlight  int64

	key demandKey
	// due is a time before which the count has not decayed away: never
	// later than the first time it has, so that forget, looking at the
	// idle counts due, misses none. Arrive only puts that time off, so
	// it leaves due early, and Begin and End do not change it; forget
	// sets it anew when it finds an idle count due that it cannot forget.
	due   time.Time
	index int // its place in Demand.idle; -1 when forget found something in flight, until End ends it
}

// NewDemand returns an empty Demand whose counts halve every half (zero:
// DefaultDemandHalfLife).
func NewDemand(half time.Duration) *Demand {
	if half <= 0 {
		half = DefaultDemandHalfLife
	}
	return &Demand{half: half, max: MaxDemandKeys, counts: map[demandKey]*demandRate{}}
}

// get returns k's count, made if absent and there is room; nil if not.
// d.mu is held.
func (d *Demand) get(k demandKey, now time.Time) *demandRate {
	r := d.counts[k]
	if r == nil {
		if len(d.counts) >= d.max {
			d.forget(now)
		}
		if len(d.counts) >= d.max {
			return nil
		}
		r = &demandRate{at: now, since: now, key: k} // due at once: looked at by the next forget
		d.counts[k] = r
		heap.Push(&d.idle, r)
	}
	return r
}

// Arrive counts a request of priority whose best replica is home (a
// replica's ID).
func (d *Demand) Arrive(priority, home int, now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if r := d.get(demandKey{priority, home}, now); r != nil {
		if dt := now.Sub(r.at); dt > 0 {
			r.requests *= math.Exp2(-float64(dt) / float64(d.half))
			r.at = now
		}
		r.requests++
	}
}

// Begin counts a request of priority in flight on replica home (decided
// and sent); End counts it out: call End once for each Begin, with the
// same home.
func (d *Demand) Begin(priority, home int, now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if r := d.get(demandKey{priority, home}, now); r != nil {
		r.inFlight++
	}
}

// End undoes Begin.
func (d *Demand) End(priority, home int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if r := d.counts[demandKey{priority, home}]; r != nil && r.inFlight > 0 {
		r.inFlight--
		if r.inFlight == 0 && r.index < 0 { // forget found it busy: it may be forgotten again
			heap.Push(&d.idle, r)
		}
	}
}

// forgetBelow is the decayed request count under which a key is
// forgotten: it has not had a request for about seven half-lives.
const forgetBelow = 0.01

// forget drops the keys whose counts have decayed away and that have
// nothing in flight. It looks only at the idle counts due (demandRate.due):
// each one it keeps is due again no sooner than its count can decay away,
// or leaves the heap while something is in flight, so that a count costs
// it O(log n) at most once per Arrive or Begin, and a Demand at its bound
// with no count due refuses a new key in O(1). d.mu is held.
func (d *Demand) forget(now time.Time) {
	for len(d.idle) > 0 && !d.idle[0].due.After(now) {
		r := d.idle[0]
		switch {
		case r.inFlight > 0: // End puts it back
			heap.Pop(&d.idle)
		case r.decayed(now, d.half) < forgetBelow:
			heap.Pop(&d.idle)
			delete(d.counts, r.key)
		default:
			r.due = r.forgettableFrom(d.half)
			if !r.due.After(now) { // rounding: not forgettable yet, but nearly
				r.due = now.Add(time.Nanosecond)
			}
			heap.Fix(&d.idle, 0)
		}
	}
}

// forgettableFrom returns a time before which r's count has not decayed
// below forgetBelow: the time it does, a billionth and a microsecond early
// against rounding; the zero time if it has already.
func (r *demandRate) forgettableFrom(half time.Duration) time.Time {
	if !(r.requests >= forgetBelow) {
		return time.Time{}
	}
	after := float64(half)*math.Log2(r.requests/forgetBelow)*(1-1e-9) - float64(time.Microsecond)
	return r.at.Add(time.Duration(min(max(after, 0), 1<<62)))
}

// dueHeap is a heap of counts, the earliest due first.
type dueHeap []*demandRate

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h dueHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}

func (h *dueHeap) Push(x any) {
	r := x.(*demandRate)
	r.index = len(*h)
	*h = append(*h, r)
}

func (h *dueHeap) Pop() any {
	old := *h
	r := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	r.index = -1
	return r
}

// decayed returns r's count at now.
func (r *demandRate) decayed(now time.Time, half time.Duration) float64 {
	return r.requests * math.Exp2(-float64(max(now.Sub(r.at), 0))/float64(half))
}

// rate returns r's arrivals per second at now: the count a steady rate λ
// keeps after t of it is λ·h/ln2·(1−2^(−t/h)), so a priority that started
// arriving t ago is not taken for a slow one. t is at least a second.
func (r *demandRate) rate(now time.Time, half time.Duration) float64 {
	t := max(now.Sub(r.since), time.Second)
	return r.decayed(now, half) * math.Ln2 / half.Seconds() / (1 - math.Exp2(-float64(t)/float64(half)))
}

// Yielded is the traffic a request gives way to on one replica: the
// rate, in requests per second, of its arrivals whose best replica it
// was, and its requests in flight there.
type Yielded struct {
	Rate     float64
	InFlight int64
}

// YieldsTo returns what a request of priority gives way to, by replica
// ID: the traffic of every higher priority. Nil: nothing.
func (d *Demand) YieldsTo(priority int, now time.Time) map[int]Yielded {
	y, _ := d.View(priority, now)
	return y
}

// Protected reports whether some traffic gives way to a request of
// priority (YieldsTo): a lower priority arrives.
func (d *Demand) Protected(priority int, now time.Time) bool {
	_, p := d.View(priority, now)
	return p
}

// View returns YieldsTo and Protected at once, in one pass over the
// counts.
func (d *Demand) View(priority int, now time.Time) (yields map[int]Yielded, protected bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.forget(now)
	for k, r := range d.counts {
		switch {
		case k.priority > priority:
			if yields == nil {
				yields = map[int]Yielded{}
			}
			v := yields[k.home]
			v.Rate += r.rate(now, d.half)
			v.InFlight += r.inFlight
			yields[k.home] = v
		case k.priority < priority:
			protected = true
		}
	}
	return yields, protected
}
