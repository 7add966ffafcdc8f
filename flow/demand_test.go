package flow

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

// A request gives way to every higher priority's arrivals on the replica
// they went to; the rate is what a steady stream keeps, and a stream that
// just started is not taken for a slow one.
func TestDemandYieldsTo(t *testing.T) {
	d := NewDemand(10 * time.Second)
	t0 := time.Unix(1000, 0)
	var now time.Time
	// 60 s: priority 10 at 2/s on replica 1; priority 5 at 1/s on
	// replicas 0 and 1 in turn; priority 0 at 20/s on replica 0.
	for i := 0; i < 1200; i++ {
		now = t0.Add(time.Duration(i) * 50 * time.Millisecond)
		d.Arrive(0, 0, now)
		if i%10 == 0 {
			d.Arrive(10, 1, now)
		}
		if i%20 == 0 {
			d.Arrive(5, i/20%2, now)
		}
	}
	d.Begin(10, 1, now)
	d.Begin(5, 0, now)
	d.Begin(0, 0, now)
	near := func(got, want float64) bool { return math.Abs(got-want) <= 0.1*want }
	if y := d.YieldsTo(10, now); y != nil {
		t.Errorf("the top priority gives way to %+v, want none", y)
	}
	if y := d.YieldsTo(5, now); len(y) != 1 || !near(y[1].Rate, 2) || y[1].InFlight != 1 {
		t.Errorf("priority 5 gives way to %+v, want 2/s and 1 in flight on replica 1", y)
	}
	if y := d.YieldsTo(0, now); len(y) != 2 || !near(y[0].Rate, 0.5) || y[0].InFlight != 1 || !near(y[1].Rate, 2.5) || y[1].InFlight != 1 {
		t.Errorf("priority 0 gives way to %+v, want 0.5/s and 1 on replica 0, 2.5/s and 1 on replica 1", y)
	}
	for p, want := range map[int]bool{10: true, 5: true, 0: false} {
		if got := d.Protected(p, now); got != want {
			t.Errorf("priority %d protected: %v, want %v", p, got, want)
		}
	}
	// A priority that started a second ago at 3 requests is not taken
	// for a slow one.
	d.Arrive(7, 1, now.Add(-time.Second))
	d.Arrive(7, 1, now.Add(-time.Second/2))
	d.Arrive(7, 1, now)
	if y := d.YieldsTo(5, now); !near(y[1].Rate, 5) {
		t.Errorf("with a priority new at 3 requests in a second, priority 5 gives way to %+v, want 2 + about 3 on replica 1", y)
	}
	// Minutes later everything is forgotten but what is in flight.
	d.End(10, 1)
	d.End(5, 0)
	later := now.Add(3 * time.Minute)
	if y := d.YieldsTo(0, later); y != nil {
		t.Errorf("after 3 minutes of silence priority 0 still gives way to %+v", y)
	}
	if len(d.counts) != 1 {
		t.Errorf("%d counts remembered after 3 minutes of silence, want priority 0's in flight", len(d.counts))
	}
	d.End(0, 0)
	d.End(0, 0) // one End too many changes nothing
	d.YieldsTo(0, later)
	if len(d.counts) != 0 {
		t.Errorf("%d counts remembered after the last request ended", len(d.counts))
	}
}

// Priorities and replicas past MaxDemandKeys are not counted: memory is
// bounded whatever the priorities.
func TestDemandBounded(t *testing.T) {
	d := NewDemand(time.Second)
	now := time.Unix(1000, 0)
	for i := 0; i < MaxDemandKeys+100; i++ {
		d.Arrive(i, 0, now)
		d.Begin(i, 1, now)
	}
	if len(d.counts) > MaxDemandKeys {
		t.Fatalf("%d counts, bound %d", len(d.counts), MaxDemandKeys)
	}
}

// scanDemand is Demand as it was before its idle heap: the counts alone,
// forgotten by a scan of them all. TestDemandForgetsAsTheScanDid checks
// Demand against it.
type scanDemand struct {
	half   time.Duration
	max    int
	counts map[demandKey]*demandRate
}

func (d *scanDemand) get(k demandKey, now time.Time) *demandRate {
	r := d.counts[k]
	if r == nil {
		if len(d.counts) >= d.max {
			d.forget(now)
		}
		if len(d.counts) >= d.max {
			return nil
		}
		r = &demandRate{at: now, since: now}
		d.counts[k] = r
	}
	return r
}

func (d *scanDemand) forget(now time.Time) {
	for k, r := range d.counts {
		if r.decayed(now, d.half) < forgetBelow && r.inFlight == 0 {
			delete(d.counts, k)
		}
	}
}

// Demand keeps, refuses and forgets the same counts as the scan of them
// all did, whatever the order of arrivals, begins, ends and views, with
// the clock going back at times and at the bound most of the time.
func TestDemandForgetsAsTheScanDid(t *testing.T) {
	const half, keys = time.Second, 12
	rng := rand.New(rand.NewPCG(1, 2))
	d := NewDemand(half)
	d.max = keys
	ref := &scanDemand{half: half, max: keys, counts: map[demandKey]*demandRate{}}
	now := time.Unix(1000, 0)
	for i := range 100000 {
		switch rng.IntN(10) {
		case 0:
			now = now.Add(-time.Duration(rng.IntN(int(time.Second))))
		case 1, 2:
			now = now.Add(time.Duration(rng.ExpFloat64() * float64(2*time.Second)))
		}
		p, home := rng.IntN(5), rng.IntN(4)
		k := demandKey{p, home}
		switch rng.IntN(6) {
		case 0, 1:
			d.Arrive(p, home, now)
			if r := ref.get(k, now); r != nil {
				if dt := now.Sub(r.at); dt > 0 {
					r.requests *= math.Exp2(-float64(dt) / float64(half))
					r.at = now
				}
				r.requests++
			}
		case 2:
			d.Begin(p, home, now)
			if r := ref.get(k, now); r != nil {
				r.inFlight++
			}
		case 3, 4:
			d.End(p, home)
			if r := ref.counts[k]; r != nil && r.inFlight > 0 {
				r.inFlight--
			}
		case 5:
			d.View(p, now)
			ref.forget(now)
		}
		if len(d.counts) != len(ref.counts) || len(d.idle) > len(d.counts) {
			t.Fatalf("op %d: %d counts (%d idle), want %d", i, len(d.counts), len(d.idle), len(ref.counts))
		}
		for k, w := range ref.counts {
			g := d.counts[k]
			if g == nil || g.requests != w.requests || !g.at.Equal(w.at) || !g.since.Equal(w.since) || g.inFlight != w.inFlight {
				t.Fatalf("op %d: count %v is %+v, want %+v", i, k, g, w)
			}
			if g.inFlight == 0 && (g.index < 0 || d.idle[g.index] != g) {
				t.Fatalf("op %d: idle count %v not in the heap", i, k)
			}
		}
	}
}

// A count is forgotten, at the bound, from the first nanosecond its
// count has decayed away, not one later (forgettableFrom's margin), and
// not one sooner.
func TestDemandForgetsOnTime(t *testing.T) {
	for _, half := range []time.Duration{time.Millisecond, time.Second, 10 * time.Second, 1000 * time.Hour} {
		for _, n := range []int{1, 3, 1000} {
			d := NewDemand(half)
			d.max = 1
			t0 := time.Unix(1000, 0)
			for range n {
				d.Arrive(0, 0, t0)
			}
			r := d.counts[demandKey{0, 0}]
			// The first time its count is below forgetBelow, to the nanosecond.
			lo, hi := time.Duration(0), time.Duration(1<<62)
			for lo < hi {
				if mid := lo + (hi-lo)/2; r.decayed(t0.Add(mid), half) < forgetBelow {
					hi = mid
				} else {
					lo = mid + 1
				}
			}
			gone := t0.Add(lo)
			d.Arrive(1, 0, gone.Add(-time.Nanosecond))
			if len(d.counts) != 1 || d.counts[demandKey{0, 0}] == nil {
				t.Fatalf("half-life %v, %d requests: a new key got in a nanosecond before the count decayed away", half, n)
			}
			d.Arrive(1, 0, gone)
			if len(d.counts) != 1 || d.counts[demandKey{1, 0}] == nil {
				t.Fatalf("half-life %v, %d requests: a new key refused once the count decayed away (%v)", half, n, lo)
			}
		}
	}
}

// BenchmarkDemandBound: at the bound, every count live, each new pair is
// refused (TestDemandBounded's pairs past the bound).
func BenchmarkDemandBound(b *testing.B) {
	d := NewDemand(time.Second)
	now := time.Unix(1000, 0)
	for i := range MaxDemandKeys {
		d.Arrive(i, 0, now)
	}
	i := MaxDemandKeys
	for b.Loop() {
		d.Arrive(i, 0, now)
		i++
	}
}

// BenchmarkDemandTurnover: a new pair every millisecond, each counted once
// and forgotten about 6.6 s (6,600 pairs) later: at the bound, most new
// pairs are refused and one gets in as the oldest decays away.
func BenchmarkDemandTurnover(b *testing.B) {
	d := NewDemand(time.Second)
	now := time.Unix(1000, 0)
	for i := 0; b.Loop(); i++ {
		d.Arrive(i, 0, now)
		now = now.Add(time.Millisecond)
	}
}

// BenchmarkDemandSteady: the router's usual load, a few priorities on a
// few replicas, each request counted in, begun and ended.
func BenchmarkDemandSteady(b *testing.B) {
	d := NewDemand(0)
	now := time.Unix(1000, 0)
	for i := 0; b.Loop(); i++ {
		p, home := i%4, i/4%8
		d.Arrive(p, home, now)
		d.Begin(p, home, now)
		d.End(p, home)
		now = now.Add(time.Millisecond)
	}
}
