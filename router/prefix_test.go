package router

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/semroute/semroute/decisionlog"
)

// TestCorePrefixOutcomesCountedAndLogged: Finish counts each request's
// prompt tokens by prefix outcome in semroute_prefix_tokens_total and logs
// them in the decision's record. Round robin over two replicas sends one
// prompt to r0 (cold), r1 (routed away from r0) and r0 again (a hit).
func TestCorePrefixOutcomesCountedAndLogged(t *testing.T) {
	f := newFixture(t, 2, "round_robin")
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	log := &memLog{}
	c := newCore(t, f, CoreOptions{Log: log, Metrics: m})
	count := func(outcome string) float64 {
		return counterValue(m.prefixTokens.WithLabelValues("default", "round_robin", outcome))
	}
	for _, o := range []string{"hit", "cold", "routed_away", "routed_away_load", "evicted", "waited"} {
		if n := count(o); n != 0 {
			t.Fatalf("%s starts at %v", o, n)
		}
	}
	req := parseChat(t, "system", strings.Repeat("the shared system prompt ", 80), "user", "q")
	var prompts [3]int64
	for i, want := range []struct{ replica, outcome string }{{"r0", "cold"}, {"r1", "routed_away"}, {"r0", "hit"}} {
		rt, err := route(c, CoreRequest{Input: f.e.Prepare(req, "", false), Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		if got := rt.Served.Replica.Name; got != want.replica {
			t.Fatalf("request %d went to %s, not %s", i, got, want.replica)
		}
		cached := int64(0)
		if want.outcome == "hit" {
			cached = int64(rt.Served.Predicted())
		}
		prompts[i] = int64(rt.Tokens)
		before := count(want.outcome)
		c.Finish(rt, Outcome{Status: 200, PromptTokens: prompts[i], CachedTokens: cached, CachedReported: true}, nil)
		if got := count(want.outcome) - before; got <= 0 {
			t.Fatalf("request %d: %s grew by %v", i, want.outcome, got)
		}
	}
	if len(log.recs) != 3 {
		t.Fatalf("%d records", len(log.recs))
	}
	var total float64
	for _, o := range []string{"hit", "cold", "routed_away", "routed_away_load", "evicted", "waited"} {
		total += count(o)
	}
	if want := float64(prompts[0] + prompts[1] + prompts[2]); total != want {
		t.Fatalf("counted %v prompt tokens, the requests had %v", total, want)
	}
	for i, r := range log.recs {
		p := r.Prefix
		if p == nil || p.Hit+p.Cold+p.RoutedAway+p.RoutedAwayLoad+p.Evicted+p.Waited != r.Outcome.PromptTokens {
			t.Fatalf("record %d: prefix %+v, prompt %d", i, p, r.Outcome.PromptTokens)
		}
	}
	if p := log.recs[0].Prefix; *p != (decisionlog.Prefix{Cold: prompts[0]}) {
		t.Fatalf("the first request: %+v", p)
	}
	if p := log.recs[1].Prefix; p.RoutedAway == 0 || p.Hit != 0 {
		t.Fatalf("the second request: %+v", p)
	}
	if p := log.recs[2].Prefix; p.Hit == 0 || p.RoutedAway != 0 {
		t.Fatalf("the third request: %+v", p)
	}
	// Not answered OK: not classified, not counted.
	rt, err := route(c, CoreRequest{Input: f.e.Prepare(req, "", false), Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	c.Finish(rt, Outcome{Status: 502}, nil)
	if r := log.recs[3]; r.Prefix != nil {
		t.Fatalf("a failed request classified: %+v", r.Prefix)
	}
}
