package routing

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
)

// syncCounts is a Sync that counts what it hears.
type syncCounts struct{ committed, prefill, done int }

func (s *syncCounts) Committed(*Decision, *Candidate)                             { s.committed++ }
func (s *syncCounts) PrefillDone(*Decision, *Candidate)                           { s.prefill++ }
func (s *syncCounts) Done(*Decision, *Candidate)                                  { s.done++ }
func (s *syncCounts) Learned(*Decision, *replica.Replica, []blockhash.Block, int) {}
func (s *syncCounts) Ejected(*replica.Replica, time.Duration)                     {}

// TestLeaseTransitions is the lease's state table (Lease's doc): from
// every state, every step, what the lease holds after it, and that the
// fleet hears each change once whatever the order of the steps.
func TestLeaseTransitions(t *testing.T) {
	type holds struct {
		state    LeaseState
		inFlight int64
		pending  bool // the prefill's tokens still count as pending
		pinned   bool
	}
	reach := map[LeaseState][]string{
		LeaseIdle:    nil,
		LeasePrefill: {"commit"},
		LeaseDecode:  {"commit", "first"},
		LeaseDrained: {"commit", "engine"},
		LeaseEnded:   {"commit", "end"},
	}
	idle := holds{LeaseIdle, 0, false, false}
	prefill := holds{LeasePrefill, 1, true, true}
	decode := holds{LeaseDecode, 1, false, true}
	drained := holds{LeaseDrained, 1, false, false}
	ended := holds{LeaseEnded, 0, false, false}
	table := []struct {
		from LeaseState
		step string
		want holds
	}{
		{LeaseIdle, "first", idle}, {LeaseIdle, "engine", idle}, {LeaseIdle, "end", idle},
		{LeaseIdle, "commit", prefill},
		{LeasePrefill, "first", decode}, {LeasePrefill, "engine", drained}, {LeasePrefill, "end", ended},
		{LeaseDecode, "first", decode}, {LeaseDecode, "engine", drained}, {LeaseDecode, "end", ended},
		{LeaseDrained, "first", drained}, {LeaseDrained, "engine", drained}, {LeaseDrained, "end", ended},
		{LeaseEnded, "first", ended}, {LeaseEnded, "engine", ended}, {LeaseEnded, "end", ended},
		{LeaseEnded, "commit", prefill}, // a failover begins the lease again
	}
	prompt := parseChat(t, "system", strings.Repeat("a system prompt long enough for blocks. ", 40), "user", "question")
	for _, tc := range table {
		t.Run(fmt.Sprintf("%s/%s", tc.from, tc.step), func(t *testing.T) {
			f := newFixture(t, 1, "least_load")
			sc := &syncCounts{}
			f.e.SetSync(sc)
			in := f.e.Prepare(prompt, "s", false)
			drains := 0
			in.Policy, in.OnDrain = f.pol, func(*replica.Replica) { drains++ }
			d, err := f.e.Decide(in, false)
			if err != nil {
				t.Fatal(err)
			}
			l := d.Lease()
			wantDrains, committed := 0, false // the contract: once per commit, at EngineDone or End, whichever is first
			do := func(step string) {
				switch {
				case step == "commit":
					committed = true
				case (step == "engine" || step == "end") && committed:
					wantDrains, committed = wantDrains+1, false
				}
				f.now = f.now.Add(time.Millisecond)
				switch step {
				case "commit":
					f.e.Commit(d, d.Chosen())
				case "first":
					l.FirstToken(f.now)
				case "engine":
					l.EngineDone(f.now)
				case "end":
					l.End(f.now)
				}
			}
			for _, s := range reach[tc.from] {
				do(s)
			}
			if l.State() != tc.from {
				t.Fatalf("reached %s, want %s", l.State(), tc.from)
			}
			do(tc.step)
			r := d.Chosen().Replica
			load := r.Load(f.now)
			pinned, _ := l.Pinned()
			got := holds{l.State(), load.InFlight, load.PendingTokens > 0, pinned > 0}
			if got != tc.want {
				t.Errorf("holds %+v, want %+v", got, tc.want)
			}
			if sc.prefill > 1 || sc.done > 1 || sc.committed > 2 {
				t.Errorf("the fleet heard %+v: a change twice", *sc)
			}
			if tc.want.state == LeaseEnded && sc.done != 1 {
				t.Errorf("ended, and the fleet heard %d ends", sc.done)
			}
			if drains != wantDrains {
				t.Errorf("OnDrain called %d times, want %d", drains, wantDrains)
			}
		})
	}
}

// TestLeasePinsHoldAgainstEviction: while a lease holds its pins, the
// picture does not evict its blocks however much else is recorded; once
// the engine freed them, it may.
func TestLeasePinsHoldAgainstEviction(t *testing.T) {
	f := newFixture(t, 1, "least_load")
	f.e.Picture().SetBudget(0, 2_000)
	d, err := f.decide(parseChat(t, "system", strings.Repeat("the leased prompt's words. ", 120), "user", "q"), "s", true)
	if err != nil {
		t.Fatal(err)
	}
	l := d.Lease()
	n, tokens := l.Pinned()
	if n == 0 || n != len(d.Blocks) {
		t.Fatalf("pinned %d of %d blocks", n, len(d.Blocks))
	}
	flood := func(seed int) {
		for i := range 20 {
			f.now = f.now.Add(time.Millisecond)
			other := f.e.Prepare(parseChat(t, "user", fmt.Sprintf("%d other prompt %d %s", seed, i, strings.Repeat("x y z ", 60))), "o", false)
			f.e.Picture().Routed(0, other.Blocks, f.now)
		}
	}
	flood(1)
	if got := f.e.Picture().Match(d.Blocks)[0].Blocks; got != len(d.Blocks) {
		t.Fatalf("a pinned lease's prompt (%d tokens) kept %d of %d blocks under a flood", tokens, got, len(d.Blocks))
	}
	l.EngineDone(f.now)
	flood(2)
	if got := f.e.Picture().Match(d.Blocks)[0].Blocks; got == len(d.Blocks) {
		t.Fatalf("freed blocks were never evicted under a budget of 2,000 tokens")
	}
	l.End(f.now)
}

// TestPeerLease: a peer's request pins as this router's would and ends the
// same way; one recorded without pins frees through the picture's chain.
func TestPeerLease(t *testing.T) {
	f := newFixture(t, 1, "least_load")
	r := f.pool.Replicas()[0]
	blocks := f.e.Prepare(parseChat(t, "user", strings.Repeat("a peer's prompt. ", 80)), "p", false).Blocks
	for _, pin := range []bool{true, false} {
		l := f.e.PeerLease(r, blocks, replica.Work{Prefill: 100, Tokens: 500}, pin, f.now)
		if n, _ := l.Pinned(); (n > 0) != pin {
			t.Errorf("pin %v: %d blocks pinned", pin, n)
		}
		if got := r.Load(f.now); got.InFlight != 1 || got.PendingTokens != 100 {
			t.Errorf("pin %v: load %+v, want one request with 100 tokens pending", pin, got)
		}
		l.FirstToken(f.now)
		l.End(f.now)
		l.End(f.now)
		if got := r.Load(f.now); got.InFlight != 0 || got.ActiveTokens != 0 {
			t.Errorf("pin %v: load %+v after its end", pin, got)
		}
	}
	if got := f.e.Picture().Match(blocks)[0].Blocks; got != len(blocks) {
		t.Errorf("the peer's blocks: %d of %d in the picture", got, len(blocks))
	}
}

// TestDecisionSaturated: a decision says when every replica the request
// could use was saturated, its engine then queueing it.
func TestDecisionSaturated(t *testing.T) {
	f := newFixture(t, 2, "least_load")
	prompt := parseChat(t, "user", "hello")
	saturated := func() bool {
		d, err := f.decide(prompt, "s", false)
		if err != nil {
			t.Fatal(err)
		}
		return d.Saturated
	}
	rs := f.pool.Replicas()
	if saturated() {
		t.Fatal("idle replicas saturated")
	}
	rs[0].Observe(replica.Observed{Waiting: 2}) // its capacity unknown: the waiting gauge says it queues
	if saturated() {
		t.Fatal("one replica queueing: saturated, though the other has room")
	}
	rs[1].Observe(replica.Observed{KVUsage: 0.99})
	if !saturated() {
		t.Fatal("both replicas saturated, the decision says not")
	}
}

// TestFinish: Engine.Finish makes the steps of a request's end in one
// call: the lease ends (offering the slot once, unless EngineDone did),
// the engine's unit is learned and the picture corrected only from an OK
// answer of a replica that computed the prompt, and a reply is learned.
func TestFinish(t *testing.T) {
	prompt := func() *blockhash.Request {
		req := parseChat(t, "system", strings.Repeat("a system prompt long enough for blocks. ", 40), "user", "question")
		req.Model = "m"
		return req
	}
	for _, tc := range []struct {
		name        string
		u           Usage
		remote      bool
		engineDone  bool
		observe     bool // the unit moves
		trim, learn bool
	}{
		{name: "ok", u: Usage{OK: true, PromptTokens: 4000, CachedReported: true, Feedback: true}, observe: true, trim: true},
		{name: "feedback off", u: Usage{OK: true, PromptTokens: 4000, CachedReported: true}, observe: true},
		{name: "cached not reported", u: Usage{OK: true, PromptTokens: 4000, Feedback: true}, observe: true},
		{name: "not ok", u: Usage{PromptTokens: 4000, CachedReported: true, Feedback: true}},
		{name: "no prompt tokens", u: Usage{OK: true, CachedReported: true, Feedback: true}},
		{name: "remote decode", u: Usage{OK: true, PromptTokens: 4000, CachedReported: true, Feedback: true}, remote: true},
		{name: "reply", u: Usage{Reply: []byte(strings.Repeat("the assistant's answer. ", 20))}, learn: true},
		{name: "drained first", u: Usage{OK: true, PromptTokens: 4000}, engineDone: true, observe: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, 1, "least_load")
			r := f.pool.Replicas()[0]
			f.e.Picture().Routed(r.ID, f.e.Prepare(prompt(), "s", false).Blocks, f.now) // the prompt is cached: predicted > 0
			in := f.e.Prepare(prompt(), "s", false)
			drains := 0
			in.Policy, in.OnDrain = f.pol, func(got *replica.Replica) {
				if got != r {
					t.Errorf("drained %s", got.Name)
				}
				drains++
			}
			d, err := f.e.Decide(in, true)
			if err != nil {
				t.Fatal(err)
			}
			if tc.remote {
				d.Lease().Remote()
			}
			if tc.engineDone {
				d.Lease().EngineDone(f.now)
			}
			learned, trimmed := f.e.Finish(d, tc.u)
			if d.Lease().State() != LeaseEnded || r.Load(f.now).InFlight != 0 {
				t.Errorf("the lease is %s, %d in flight", d.Lease().State(), r.Load(f.now).InFlight)
			}
			if drains != 1 {
				t.Errorf("OnDrain called %d times", drains)
			}
			if moved := f.e.TokenScale("m") != 1; moved != tc.observe {
				t.Errorf("the unit moved: %v (scale %v)", moved, f.e.TokenScale("m"))
			}
			if (trimmed > 0) != tc.trim {
				t.Errorf("trimmed %d tokens", trimmed)
			}
			if (len(learned) > 0) != tc.learn {
				t.Errorf("learned %d blocks", len(learned))
			}
			if tc.learn {
				chain := append(slices.Clone(d.Blocks), learned...)
				if got := f.e.Picture().Match(chain)[r.ID].Blocks; got != len(chain) {
					t.Errorf("the reply's chain: %d of %d blocks in the picture", got, len(chain))
				}
			}
			f.e.Recycle(d)
		})
	}
}
