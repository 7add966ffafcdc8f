package replica

import (
	"fmt"
	"testing"
	"time"
)

func TestFailDoublesAndForgives(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a"}}, Options{}, ids())
	r := p.Replicas()[0]
	e := Ejection{Base: time.Second, Max: 5 * time.Second, Forgive: 10 * time.Second}
	t0 := time.Unix(1000, 0)
	var got []time.Duration
	now := t0
	for i := 0; i < 5; i++ {
		d := r.Fail(now, e)
		got = append(got, d)
		if r.Available(now) || !r.Available(now.Add(d)) {
			t.Fatalf("ejection %d: availability wrong around its %v cool-down", i, d)
		}
		if r.Fail(now.Add(d/2), e) != 0 {
			t.Fatal("a failure during the cool-down extended it")
		}
		now = now.Add(d) // fails again right after readmission
	}
	if fmt.Sprint(got) != "[1s 2s 4s 5s 5s]" {
		t.Fatalf("cool-downs %v", got)
	}
	if d := r.Fail(now.Add(time.Minute), e); d != time.Second {
		t.Fatalf("after a quiet minute the cool-down is %v, want the base", d)
	}
}

func TestCheckedFallRiseAndDrain(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a"}}, Options{}, ids())
	r := p.Replicas()[0]
	now := time.Now()
	seq := []struct {
		ok        bool
		available bool
	}{{false, true}, {false, false}, {true, false}, {false, false}, {true, false}, {true, true}}
	for i, s := range seq {
		r.Checked(s.ok, 2, 2)
		if r.Available(now) != s.available {
			t.Fatalf("step %d: available %v, want %v", i, r.Available(now), s.available)
		}
	}
	r.Drain()
	if r.Available(now) || !r.Healthy(now) || !r.Draining() {
		t.Fatal("a draining replica must be healthy and unavailable")
	}
}

func TestPoolAddRemove(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a"}}, Options{}, ids())
	join := func(Spec) (int, error) { return 7, nil }
	before := p.Replicas()
	r, err := p.Add(Spec{Name: "b", URL: "http://b", BudgetTokens: 5}, join)
	if err != nil || r.ID != 7 || r.Budget() != 5 || len(p.Replicas()) != 2 {
		t.Fatalf("Add: %+v, %v", r, err)
	}
	if len(before) != 1 {
		t.Fatal("Add changed an earlier snapshot")
	}
	if _, err := p.Add(Spec{Name: "b", URL: "http://b"}, join); err == nil {
		t.Fatal("duplicate accepted")
	}
	if _, err := p.Add(Spec{Name: "c", URL: "bad"}, join); err == nil {
		t.Fatal("bad url accepted")
	}
	if x, ok := p.Remove("a"); !ok || x.Name != "a" || len(p.Replicas()) != 1 {
		t.Fatal("Remove failed")
	}
	if _, ok := p.Remove("zz"); ok {
		t.Fatal("removed a stranger")
	}
}

// A soft failure (a 500, a timeout) ejects only when it is the
// Consecutive-th in a row: a success between starts the count again.
func TestStrikesEjectOnlyInARow(t *testing.T) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a"}}, Options{}, ids())
	r := p.Replicas()[0]
	e := Ejection{Consecutive: 3, MinVolume: 1, MinSources: 1}
	now := time.Unix(1000, 0)
	for round := 0; round < 3; round++ {
		if r.Strike(now, e, 0) != 0 || r.Strike(now, e, 0) != 0 {
			t.Fatalf("round %d: two strikes ejected", round)
		}
		r.Succeeded(now, e)
	}
	if !r.Available(now) {
		t.Fatal("strikes with successes between ejected the replica")
	}
	r.Strike(now, e, 0)
	r.Strike(now, e, 0)
	if d := r.Strike(now, e, 0); d != DefaultEjectBase || r.Available(now) {
		t.Fatalf("the third strike in a row: cool-down %v, available %v", d, r.Available(now))
	}
	if !r.Usable(now) {
		t.Fatal("a replica ejected by strikes that passes its checks is not usable")
	}
	r.Fail(now, e) // a hard failure during the cool-down
	if r.Usable(now) {
		t.Fatal("a replica that refused a connection while out for strikes is usable")
	}
	if d := r.Strike(now.Add(DefaultEjectBase), e, 0); d != 0 {
		t.Fatalf("the count started again after the ejection, yet one strike ejected for %v", d)
	}
}

// twoReplicas returns the two replicas of a fresh pool, the default
// ejection and a start time, for the strike tests.
func twoReplicas() (a, b *Replica, e Ejection, now time.Time) {
	p, _ := NewPool([]Spec{{Name: "a", URL: "http://a"}, {Name: "b", URL: "http://b"}}, Options{}, ids())
	return p.Replicas()[0], p.Replicas()[1], Ejection{}, time.Unix(1000, 0)
}

// Attack 10 of issue 30: a dozen requests in a row that make a replica
// answer 500, at low traffic, do not eject it, whatever clients sent them:
// the defaults want 20 answers in the last interval or two, half of them
// failed, as Envoy's failure_percentage. A replica failing most of a real
// volume, to several clients, is ejected.
func TestStrikesNeedVolumeAndShare(t *testing.T) {
	a, b, e, now := twoReplicas()
	for i := range 12 {
		if d := a.Strike(now.Add(time.Duration(i)*time.Second), e, uint64(i)); d != 0 {
			t.Fatalf("strike %d of a dozen at low traffic ejected for %v", i+1, d)
		}
	}
	for i := range 10 {
		b.Succeeded(now.Add(time.Duration(i)*time.Millisecond), e)
	}
	for i := range 10 {
		d := b.Strike(now.Add(time.Duration(10+i)*time.Millisecond), e, uint64(i%3))
		if i < 9 && d != 0 {
			t.Fatalf("strike %d (of %d answers, %d%% failed) ejected", i+1, 11+i, 100*(i+1)/(11+i))
		}
		if i == 9 && d == 0 {
			t.Fatal("10 of 20 recent answers failed, 10 in a row, and the replica stayed in")
		}
	}
	// Old evidence expires: two intervals later the volume starts again.
	later := now.Add(3 * DefaultEjectWindow)
	for i := range 6 {
		if d := b.Strike(later.Add(time.Duration(i)*time.Millisecond), e, uint64(i)); d != 0 {
			t.Fatalf("strike %d after the window moved on ejected", i+1)
		}
	}
}

// Attack 10 of issue 30, at volume: one client sending 30 requests in a
// row that make a replica answer 500 (every answer the replica gave in the
// interval, all failed, all in a row) does not eject it, nor do clients
// whose address is not known (source 0, one source); a failure from a
// second client is the evidence that the replica, not one client's
// requests, is failing, and ejects it.
func TestStrikesNeedSeveralSources(t *testing.T) {
	a, b, e, now := twoReplicas()
	for i := range 30 {
		at := now.Add(time.Duration(i) * time.Millisecond)
		if d := a.Strike(at, e, 7); d != 0 {
			t.Fatalf("strike %d in a row from one client ejected for %v", i+1, d)
		}
		if d := b.Strike(at, e, 0); d != 0 {
			t.Fatalf("strike %d in a row from unknown clients ejected for %v", i+1, d)
		}
	}
	if !a.Available(now) || !b.Available(now) {
		t.Fatal("one client's failures ejected a replica")
	}
	at := now.Add(31 * time.Millisecond)
	if d := a.Strike(at, e, 8); d != DefaultEjectBase || a.Available(at) {
		t.Fatalf("a second client's failure: cool-down %v, available %v", d, a.Available(at))
	}
	if d := b.Strike(at, e, 8); d != DefaultEjectBase {
		t.Fatalf("a known client's failure after unknown ones: cool-down %v", d)
	}
}
