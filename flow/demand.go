package flow

import (
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

	mu     sync.Mutex
	counts map[demandKey]*demandRate
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
}

// NewDemand returns an empty Demand whose counts halve every half (zero:
// DefaultDemandHalfLife).
func NewDemand(half time.Duration) *Demand {
	if half <= 0 {
		half = DefaultDemandHalfLife
	}
	return &Demand{half: half, counts: map[demandKey]*demandRate{}}
}

// get returns k's count, made if absent and there is room; nil if not.
// d.mu is held.
func (d *Demand) get(k demandKey, now time.Time) *demandRate {
	r := d.counts[k]
	if r == nil {
		if len(d.counts) >= MaxDemandKeys {
			d.forget(now)
		}
		if len(d.counts) >= MaxDemandKeys {
			return nil
		}
		r = &demandRate{at: now, since: now}
		d.counts[k] = r
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
	}
}

// forgetBelow is the decayed request count under which a key is
// forgotten: it has not had a request for about seven half-lives.
const forgetBelow = 0.01

// forget drops the keys whose counts have decayed away and that have
// nothing in flight. d.mu is held.
func (d *Demand) forget(now time.Time) {
	for k, r := range d.counts {
		if r.decayed(now, d.half) < forgetBelow && r.inFlight == 0 {
			delete(d.counts, k)
		}
	}
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
