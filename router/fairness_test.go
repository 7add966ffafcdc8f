package router

import (
	"fmt"
	"net/http"
	"testing"
)

// TestRouterTiesGoToTheOldestWaiting: over sockets, a flow waiting in the
// router's queue when others start waiting (each lifted to its count)
// takes the next slot, whatever the names of their fairness ids (issue
// 43: "zzz-victim" waited its TTL behind a stream of new ids); the rest go
// in the order they came.
func TestRouterTiesGoToTheOldestWaiting(t *testing.T) {
	h := newHeldRouter(t, nil, nil)
	fairness := func(id string) map[string]string { return map[string]string{"X-Gateway-Inference-Fairness-Id": id} }
	codes := []<-chan int{h.post("first", fairness("first"))}
	<-h.arrived // the replica's one slot: saturated from now
	codes = append(codes, h.post("victim", fairness("zzz-victim")))
	waitQueued(t, h.core, 1)
	for i := range 3 {
		codes = append(codes, h.post(fmt.Sprint("fresh", i), fairness(fmt.Sprint("0-fresh-", i))))
		waitQueued(t, h.core, 2+i)
	}
	for i, want := range []string{"victim", "fresh0", "fresh1", "fresh2"} {
		if got := h.next(); got != want {
			t.Fatalf("slot %d went to %q, want %q", i, got, want)
		}
	}
	h.release <- struct{}{}
	for _, code := range codes {
		if c := <-code; c != http.StatusOK {
			t.Fatalf("a request answered %d", c)
		}
	}
}
