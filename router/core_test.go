package router

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/routing"
)

type memLog struct {
	mu   sync.Mutex
	recs []*decisionlog.Record
}

func (m *memLog) Log(r *decisionlog.Record) {
	m.mu.Lock()
	m.recs = append(m.recs, r)
	m.mu.Unlock()
}

func newCore(t *testing.T, f *fixture, o CoreOptions) *Core {
	t.Helper()
	o.Engine = f.e
	if o.Arms == nil {
		o.Arms = f.arms()
	}
	c, err := NewCore(o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestCoreLogsFinishedDecisions(t *testing.T) {
	f := newFixture(t, 3, "semantic")
	log := &memLog{}
	c := newCore(t, f, CoreOptions{Log: log})
	req := parseChat(t, "system", strings.Repeat("policy text ", 100), "user", "q")
	rt, err := route(c, CoreRequest{Input: f.e.Prepare(req, "alice", true), Model: "m", Session: "alice", Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	if rt.ID == "" || rt.Arm.Name != "default" {
		t.Fatalf("routed %+v", rt)
	}
	f.now = f.now.Add(30 * time.Millisecond)
	c.FirstByte(rt)
	c.FirstByte(rt) // only the first counts
	f.now = f.now.Add(70 * time.Millisecond)
	blocks := len(rt.Blocks) // Finish gives the block list back
	c.Finish(rt, Outcome{Status: 200, PromptTokens: 310, OutputTokens: 4, CachedTokens: 0}, []byte("the reply"))
	if len(log.recs) != 1 {
		t.Fatalf("%d records", len(log.recs))
	}
	r := log.recs[0]
	o := r.Outcome
	if r.ID != rt.ID || r.Policy != "semantic" || r.Session == "alice" || !strings.HasPrefix(r.Session, "h:") ||
		!strings.HasPrefix(r.Tenant, "h:") || len(r.Blocks) != blocks || blocks == 0 || len(r.Candidates) != 3 ||
		len(r.Replicas) != 3 || len(r.Budgets) != 3 || r.Chosen != rt.Chosen().Replica.Name || r.Text != nil {
		t.Fatalf("record %+v", r)
	}
	if o.TTFTNs != 30e6 || o.DurationNs != 100e6 || o.Replica != r.Chosen || len(o.ReplyBlocks) != 1 || o.PromptTokens != 310 {
		t.Fatalf("outcome %+v", o)
	}
	if l := rt.Served.Replica.Load(f.now); l.InFlight != 0 {
		t.Fatalf("load after finish: %+v", l)
	}
	// Raw ids and prompts when asked.
	c2 := newCore(t, f, CoreOptions{Log: log, RawIDs: true, LogPrompts: true})
	rt2, _ := route(c2, CoreRequest{Input: f.e.Prepare(req, "alice", true), Session: "alice"})
	c2.Finish(rt2, Outcome{}, nil)
	if r := log.recs[1]; r.Session != "alice" || len(r.Text) != 2 {
		t.Fatalf("raw record %+v", r)
	}
}

func TestCoreHoldReleaseExpire(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	log := &memLog{}
	c := newCore(t, f, CoreOptions{Log: log, Unreleased: limits.Unreleased{ReleaseAfter: time.Minute}})
	// One Prepare per Route: a decision owns its input's pooled blocks and
	// gives them back when it is finished.
	in := func() routing.Request { return f.e.Prepare(parseChat(t, "user", "x"), "", false) }
	a, _ := route(c, CoreRequest{Input: in()})
	b, _ := route(c, CoreRequest{Input: in()})
	c.unreleased.Add(a)
	c.unreleased.Add(b)
	if err := c.unreleased.Release(a.ID, Outcome{Status: 200}); err != nil {
		t.Fatal(err)
	}
	if err := c.unreleased.Release(a.ID, Outcome{}); err != ErrUnknownDecision {
		t.Fatalf("second release: %v", err)
	}
	if n := c.unreleased.Expire(f.now.Add(30 * time.Second)); n != 0 {
		t.Fatalf("expired %d too early", n)
	}
	if n := c.unreleased.Expire(f.now.Add(time.Minute)); n != 1 || func() int { n, _ := c.unreleased.Len(); return n }() != 0 {
		t.Fatalf("expired %d", n)
	}
	if last := log.recs[len(log.recs)-1]; last.Outcome.Error == "" {
		t.Fatalf("expired record %+v", last.Outcome)
	}
	dry, _ := route(c, CoreRequest{Input: in(), DryRun: true})
	if dry.ID != "" {
		t.Fatal("a dry run got an id")
	}
}

func TestArmsValidateAndSplit(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	rr, _ := routing.NewPolicy(routing.PolicySpec{Type: "round_robin"})
	if _, err := NewCore(CoreOptions{Engine: f.e, Arms: []Arm{{Name: "a", Policy: rr, Weight: 1}, {Name: "a", Policy: rr, Weight: 1}}}); err == nil {
		t.Fatal("duplicate arm accepted")
	}
	if _, err := NewCore(CoreOptions{Engine: f.e, Arms: []Arm{{Name: "a", Policy: rr}}}); err == nil {
		t.Fatal("zero weight accepted")
	}
	c := newCore(t, f, CoreOptions{Arms: []Arm{{Name: "x", Policy: rr, Weight: 1}, {Name: "y", Policy: f.pol, Weight: 1}}, Salt: "s"})
	byTenant := c.PickArm("", "acme", 1)
	if c.PickArm("", "acme", 2) != byTenant {
		t.Fatal("tenant assignment not sticky")
	}
	other := newCore(t, f, CoreOptions{Arms: c.Arms(), Salt: "another"})
	moved := 0
	for i := 0; i < 200; i++ {
		s := strings.Repeat("s", i%7) + string(rune('a'+i%26)) + string(rune('A'+i/26))
		if c.PickArm(s, "", 0).Name != other.PickArm(s, "", 0).Name {
			moved++
		}
	}
	if moved < 50 {
		t.Fatalf("a new salt moved only %d of 200 sessions", moved)
	}
	in := f.e.Prepare(parseChat(t, "user", "x"), "sess", false)
	rt, _ := route(c, CoreRequest{Input: in, Session: "sess"})
	if rt.Policy != rt.Arm.Policy.Name() {
		t.Fatalf("decided by %s in arm %s (%s)", rt.Policy, rt.Arm.Name, rt.Arm.Policy.Name())
	}
}

// Every Core lifecycle (Finish, Failover then Finish, Hold then Release,
// Hold then expiry by cap or timeout, EngineDone before Finish) ends with
// nothing pinned: once all are over, one more record brings every
// replica's picture down to its budget. (Written by a helper attacking the
// pins.)
func TestCoreLifecyclesLeaveNoPins(t *testing.T) {
	const budget = 300
	f := newFixtureBudget(t, 3, "semantic", budget)
	c := newCore(t, f, CoreOptions{Unreleased: limits.Unreleased{Max: 5, ReleaseAfter: time.Minute}})
	rng := rand.New(rand.NewPCG(1, 1))
	var ids []string
	for i := 0; i < 300; i++ {
		req := parseChat(t, "system", strings.Repeat(fmt.Sprint("sys", i%40, " "), 200), "user", fmt.Sprint("q", i))
		rt, err := route(c, CoreRequest{Input: f.e.Prepare(req, fmt.Sprint("s", i), false), Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		switch rng.IntN(5) {
		case 0:
			c.Finish(rt, Outcome{Status: 200}, []byte("reply "+fmt.Sprint(i)))
		case 1:
			for n := 1; c.Failover(rt, n); n++ {
			}
			c.Finish(rt, Outcome{Status: 502}, nil)
		case 2:
			c.EngineDone(rt)
			c.EngineDone(rt) // twice: the second does nothing
			c.Finish(rt, Outcome{Status: 200}, []byte("reply "+fmt.Sprint(i)))
		default:
			c.unreleased.Add(rt)
			ids = append(ids, rt.ID)
			if rng.IntN(2) == 0 {
				_ = c.unreleased.Release(ids[rng.IntN(len(ids))], Outcome{Status: 200})
			}
		}
		f.now = f.now.Add(time.Second)
	}
	f.now = f.now.Add(time.Hour)
	c.unreleased.Expire(f.now)
	if n, _ := c.unreleased.Len(); n != 0 {
		t.Fatalf("%d still held", n)
	}
	for id := 0; id < 3; id++ {
		f.e.Picture().Routed(id, f.e.Prepare(parseChat(t, "user", "last"), "z", false).Blocks, f.now)
		if st, _ := f.e.Picture().Stats(id); st.Tokens > budget {
			t.Errorf("replica %d: %d tokens over a budget of %d with nothing in flight", id, st.Tokens, budget)
		}
	}
}

// EngineDone (the replica's answer ended, the client still reading) lets
// the picture evict the prompt before Finish: a slow client does not hold
// the engine's blocks in the picture.
func TestEngineDoneUnpinsBeforeFinish(t *testing.T) {
	f := newFixtureBudget(t, 1, "semantic", 2000)
	c := newCore(t, f, CoreOptions{})
	route := func(text string) *Routed {
		rt, err := route(c, CoreRequest{Input: f.e.Prepare(parseChat(t, "user", text), "", false), Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		return rt
	}
	slow := route(strings.Repeat("a slow client's prompt. ", 300))
	blocks := append([]blockhash.Block(nil), slow.Blocks...)
	c.EngineDone(slow)
	f.now = f.now.Add(time.Second)
	next := route(strings.Repeat("another prompt entirely. ", 400)) // more than the budget alone
	if got := f.e.Picture().Match(blocks)[0].Blocks; got != 0 {
		t.Fatalf("the first prompt, its answer ended, holds %d blocks after a second prompt filled the picture: still pinned", got)
	}
	c.Finish(slow, Outcome{Status: 200}, nil)
	c.Finish(next, Outcome{Status: 200}, nil)
}
