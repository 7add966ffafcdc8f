package cluster

import (
	"testing"
	"time"

	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// A peer's request in flight is pinned in this router's picture, as the
// peer's own picture pins it: a local prompt that overfills the replica
// does not evict it until the peer says it is done, or is forgotten (a
// gap in its records), after which the next record evicts it.
func TestPeerRequestsPinned(t *testing.T) {
	e, err := routing.New(routing.Options{Replicas: []replica.Spec{{Name: "a", URL: "http://a.test", BudgetTokens: 16 * 64}}})
	if err != nil {
		t.Fatal(err)
	}
	f, err := New(testOptions("nats://127.0.0.1:1", "me"), e)
	if err != nil {
		t.Fatal(err)
	}
	r, _ := e.Pool().Get("a")
	batch := peerBatch
	apply := func(b []byte) {
		f.amu.Lock()
		f.applyBatch(b, "")
		f.amu.Unlock()
	}
	theirs := prompt(e, 1, 6).Blocks // under half of what the budget holds: peers may pin half
	route := func(req uint64) []byte {
		b := appendStr(appendUv([]byte{recRoute}, req), "a")
		return appendChain(appendUv(appendUv(b, 50), 100), theirs, 0)
	}
	done := func(req uint64) []byte { return appendUv([]byte{recDone}, req) }
	held := func() int { return e.Picture().Match(theirs)[r.ID].Blocks }
	ours := func(seed uint64) { e.Picture().Routed(r.ID, prompt(e, seed, 12).Blocks, time.Now()) }

	apply(batch(1, route(1)))
	ours(100) // 24 blocks in a budget of 16: only ours can go
	if got := held(); got != len(theirs) {
		t.Fatalf("the peer's running prompt holds %d of %d blocks after ours overfilled the picture", got, len(theirs))
	}
	if st, _ := e.Picture().Stats(r.ID); st.Tokens > st.Budget {
		t.Fatalf("the picture holds %d tokens, its budget %d", st.Tokens, st.Budget)
	}
	apply(batch(2, done(1)))
	ours(101)
	ours(102)
	if got := held(); got == len(theirs) {
		t.Fatal("the peer's prompt, done, was never evicted")
	}

	apply(batch(3, route(2))) // in flight again, then its records are lost
	apply(batch(5, route(3)))
	apply(batch(6, done(3)))
	ours(103)
	ours(104)
	if got := held(); got == len(theirs) {
		t.Fatal("the peer's prompt, forgotten after a gap, was never evicted")
	}
	f.amu.Lock()
	defer f.amu.Unlock()
	if p := f.peers[peerKey{"peer", 1}]; p == nil || p.keys != 0 || len(p.flight) != 0 {
		t.Fatalf("the peer's flights and pinned keys were not all given back: %+v", p)
	}
}
