package router

import (
	"fmt"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/internal/benchdata"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// fixture is an engine over replicas r0, r1, … with a clock the test sets.
type fixture struct {
	e   *routing.Engine
	pol routing.Policy
	now time.Time
}

func newFixture(t testing.TB, replicas int, policy string) *fixture {
	t.Helper()
	return newFixtureBudget(t, replicas, policy, 0)
}

// newFixtureBudget is newFixture with each replica's picture holding at
// most budget tokens (0: no bound).
func newFixtureBudget(t testing.TB, replicas int, policy string, budget int64) *fixture {
	t.Helper()
	f := &fixture{now: time.Unix(1000, 0)}
	specs := make([]replica.Spec, replicas)
	for i := range specs {
		specs[i] = replica.Spec{Name: fmt.Sprint("r", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 9000+i), BudgetTokens: budget}
	}
	pol, err := routing.NewPolicy(routing.PolicySpec{Type: policy})
	if err != nil {
		t.Fatal(err)
	}
	f.e, err = routing.New(routing.Options{Replicas: specs, LoadHalfLife: 10 * time.Second,
		Engine: routing.EngineOptions{Now: func() time.Time { return f.now }}})
	if err != nil {
		t.Fatal(err)
	}
	f.pol = pol
	return f
}

// arms is one arm, "default", running the fixture's policy.
func (f *fixture) arms() []Arm { return []Arm{{Name: "default", Policy: f.pol, Weight: 1}} }

// parseChat parses a chat of role, content pairs.
func parseChat(t testing.TB, msgs ...string) *blockhash.Request {
	return benchdata.ParseChat(t, msgs...)
}

// route places cr (Core.Place) and returns its decision, for the tests
// that route one request and look at its decision only.
func route(c *Core, cr CoreRequest) (*Routed, error) {
	p, err := c.Place(cr)
	if err != nil {
		return nil, err
	}
	return p.Routed, nil
}

// teachFast has each of rs serve 16 requests alone, 500 and 1,500 uncached
// tokens at 5,000 a second and 10 output tokens in 50 ms, so that their
// service-time models (replica.Replica.LearnService) say they answer in
// a quarter of a second, not the prior's seconds.
func teachFast(rs []*replica.Replica, now time.Time) {
	for _, r := range rs {
		teach(r, now, 200*time.Microsecond)
	}
}

// teach has r serve 16 requests alone, 500 and 1,500 uncached tokens at
// perToken each and 10 output tokens in 50 ms, and learn them.
func teach(r *replica.Replica, now time.Time, perToken time.Duration) {
	for i := range 16 {
		uncached := int64(500 + 1000*(i%2))
		ttft := time.Duration(uncached) * perToken
		w := replica.Work{Prefill: uncached, Tokens: uncached}
		r.Begin(&w, now)
		r.PrefillDone(&w, now.Add(ttft))
		r.End(&w, now.Add(ttft+50*time.Millisecond))
		r.LearnService(&w, float64(uncached), 10, true)
	}
}
