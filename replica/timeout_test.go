package replica

import (
	"testing"
	"time"
)

// Issue 43, item 7: a replica that times out on bounds set from the
// requests' own work (a prefill's) is ejected by the third timeout in a
// row at the lowest traffic, from one client, where as many strikes
// would not eject it; a success between starts the count again;
// Ejection.Timeouts sets the count.
func TestTimeoutsEjectAtLowTraffic(t *testing.T) {
	a, b, e, now := twoReplicas()
	for i := range 3 {
		if d := b.Strike(now, e, 7); d != 0 {
			t.Fatalf("strike %d of one client at low traffic ejected for %v", i+1, d)
		}
	}
	if !b.Available(now) {
		t.Fatal("strikes of one client at low traffic ejected the replica")
	}

	for round := range 3 {
		if timedOut(a, now, e) != 0 || timedOut(a, now, e) != 0 {
			t.Fatalf("round %d: two timeouts ejected", round)
		}
		a.Succeeded(now, e)
	}
	if !a.Available(now) {
		t.Fatal("timeouts with successes between ejected the replica")
	}
	timedOut(a, now, e)
	timedOut(a, now, e)
	d := timedOut(a, now, e)
	if d != DefaultEjectBase || a.Available(now) || !a.Usable(now) {
		t.Fatalf("the third timeout in a row: cool-down %v, available %v, usable %v", d, a.Available(now), a.Usable(now))
	}
	if timedOut(a, now.Add(time.Second), e) != 0 {
		t.Fatal("a timeout during the cool-down extended it")
	}
	if d := timedOut(b, now, Ejection{Timeouts: 1}); d == 0 {
		t.Fatal("Timeouts 1: one timeout did not eject")
	}
}

// timedOut is how a timeout is recorded: counted, then struck.
func timedOut(r *Replica, now time.Time, e Ejection) time.Duration {
	r.TimedOut()
	return r.Strike(now, e, 7)
}

// Back from an ejection for timeouts, a replica takes one request at a
// time (a circuit breaker's half-open state) until it answers; one more
// timeout ejects it again, for twice as long; once it answered, it takes
// any number again, and three timeouts in a row to eject.
func TestTimedOutReplicaTriedOneAtATime(t *testing.T) {
	a, _, e, now := twoReplicas()
	for range 3 {
		timedOut(a, now, e)
	}
	back := now.Add(DefaultEjectBase)
	if a.Available(now) || !a.Available(back) {
		t.Fatal("not out for its cool-down, or not back after it")
	}
	w := &Work{Prefill: 100, Tokens: 100}
	a.Begin(w, back)
	if a.Available(back) || !a.Usable(back) || !a.Healthy(back) {
		t.Fatalf("with its one trial in flight: available %v, usable %v, healthy %v", a.Available(back), a.Usable(back), a.Healthy(back))
	}
	a.End(w, back)
	if !a.Available(back) {
		t.Fatal("not available once its trial ended")
	}
	if d := timedOut(a, back, e); d != 2*DefaultEjectBase {
		t.Fatalf("back from its cool-down, the first timeout ejected for %v, want %v", d, 2*DefaultEjectBase)
	}
	later := back.Add(2 * DefaultEjectBase)
	a.Succeeded(later, e)
	a.Begin(w, later)
	if !a.Available(later) {
		t.Fatal("once it answered, a request in flight makes it unavailable")
	}
	a.End(w, later)
	if timedOut(a, later, e) != 0 || timedOut(a, later, e) != 0 || timedOut(a, later, e) == 0 {
		t.Fatal("after an answer, it takes three timeouts in a row again")
	}
}
