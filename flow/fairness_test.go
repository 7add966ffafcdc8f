package flow

import (
	"fmt"
	"testing"
)

// TestTiesGoToTheOldestWaiting: a flow waiting when new flows start
// waiting (each lifted to its count: a tie) goes before them, whatever
// the flows' names: ties between flows go to the one whose oldest request
// arrived first. A new flow arrives with every slot that frees, as the
// hostile test of issue 43 sent them; the waiting one takes the first slot.
func TestTiesGoToTheOldestWaiting(t *testing.T) {
	for _, names := range []struct{ victim, fresh string }{
		{"zzz-victim", "0-fresh-%d"},
		{"0-victim", "zzz-fresh-%d"},
		{"", "fresh-%d"},
	} {
		q := New[any, any](Options[any]{})
		enqueue(t, q, 0, names.victim, "victim")
		for i := range 20 {
			enqueue(t, q, 0, fmt.Sprintf(names.fresh, i), fmt.Sprint("fresh", i))
			tk, ok := q.Dispatch(-1, nil, nil)
			if !ok {
				t.Fatalf("%q: nothing dispatched", names.victim)
			}
			if i == 0 && tk.Value != "victim" {
				t.Fatalf("flow %q waited first, but the first slot went to %v", names.victim, tk.Value)
			}
		}
	}
}

// TestNewFlowsCannotStarveAWaitingFlow: a flow with many requests waiting
// while k other requests wait too, each under a fairness id of its own,
// one more coming as each of them is served (new ids are free to make).
// Each new flow is lifted to the band's virtual time, which every dispatch
// advances: the waiting flow is served its share, one dispatch in k+1 once
// the k first are through, never more than 2k dispatches apart. (Lifted
// only to the least count waiting, the new flows took every slot: each
// was lifted to the one before it, which had not been served yet.)
func TestNewFlowsCannotStarveAWaitingFlow(t *testing.T) {
	for _, k := range []int{1, 2, 3, 5, 8} {
		q := New[any, any](Options[any]{})
		for i := range 200 {
			enqueue(t, q, 0, "victim", fmt.Sprint("victim", i))
		}
		ids := 0
		fresh := func() {
			enqueue(t, q, 0, fmt.Sprint("sybil-", ids), "sybil")
			ids++
		}
		for range k {
			fresh()
		}
		const dispatches = 100
		served, since := 0, 0
		for i := range dispatches {
			tk, ok := q.Dispatch(-1, nil, nil)
			if !ok {
				t.Fatalf("k=%d: nothing dispatched", k)
			}
			if tk.Value == "sybil" {
				fresh()
				if since++; since > 2*k {
					t.Fatalf("k=%d: %d dispatches since the waiting flow's last (dispatch %d)", k, since, i)
				}
				continue
			}
			served, since = served+1, 0
		}
		if want := dispatches/(k+1) - 1; served < want {
			t.Fatalf("k=%d: the waiting flow got %d of %d dispatches, want at least %d", k, served, dispatches, want)
		}
	}
}
