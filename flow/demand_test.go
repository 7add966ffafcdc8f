package flow

import (
	"math"
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
