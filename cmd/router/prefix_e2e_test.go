package main

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/internal/testwait"
)

// prefixOutcomes returns semroute_prefix_tokens_total in scraped, summed
// over arms and policies, by outcome.
func prefixOutcomes(t *testing.T, scraped string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, line := range strings.Split(scraped, "\n") {
		if !strings.HasPrefix(line, "semroute_prefix_tokens_total{") {
			continue
		}
		labels, value, ok := strings.Cut(strings.TrimPrefix(line, "semroute_prefix_tokens_total{"), "} ")
		if !ok {
			t.Fatalf("unreadable sample %q", line)
		}
		_, outcome, ok := strings.Cut(labels, `outcome="`)
		if !ok {
			t.Fatalf("no outcome in %q", line)
		}
		outcome, _, _ = strings.Cut(outcome, `"`)
		v, err := strconv.ParseFloat(value, 64)
		if err != nil {
			t.Fatalf("%s: %v", line, err)
		}
		out[outcome] += v
	}
	return out
}

// TestPrefixOutcomesE2E: the router in front of two simulated replicas,
// round robin, gets one prompt three times. The first finds it nowhere
// (cold), the second goes to the other replica while the first holds it
// (routed away), the third comes back to the first, whose engine reports
// it cached (hit). Each shows in semroute_prefix_tokens_total on /metrics,
// and each decision-log record's prefix outcomes sum to its prompt tokens.
func TestPrefixOutcomesE2E(t *testing.T) {
	logPath := filepath.Join(t.TempDir(), "decisions.jsonl")
	d := startTestDemo(t, demoOptions{sim: fastSim, replicas: 2, policy: "round_robin", decisionLog: logPath})
	base := d.router.URL()
	all := []string{"hit", "cold", "routed_away", "routed_away_load", "evicted", "waited"}
	fresh := prefixOutcomes(t, scrapeURL(t, base))
	for _, o := range all {
		if v, ok := fresh[o]; !ok || v != 0 {
			t.Fatalf("a fresh router's %s is %v (exported: %v), not 0", o, v, ok)
		}
	}
	body := chat([2]string{"system", text("prefix outcomes", 400)}, [2]string{"user", "the same question"})
	var served []string
	prev := fresh
	for i, want := range []string{"cold", "routed_away", "hit"} {
		r := post(t, d, "/v1/chat/completions", body, nil)
		mustOK(t, r)
		served = append(served, r.replica)
		// The router counts a request when it finishes it, which may be
		// just after the client has read the answer.
		now := testwait.Value(t, fmt.Sprintf("request %d counted as %s", i, want), func() (map[string]float64, bool) {
			m := prefixOutcomes(t, scrapeURL(t, base))
			return m, m[want] > prev[want]
		})
		if want == "hit" && r.cached == 0 {
			t.Fatalf("the third request's engine reported nothing cached: %+v", r)
		}
		for _, o := range []string{"hit", "cold", "routed_away"} {
			if o != want && o != "cold" && now[o] != prev[o] { // cold: the prompt's tail past the cached blocks
				t.Errorf("request %d (%s) also grew %s: %v → %v", i, want, o, prev[o], now[o])
			}
		}
		prev = now
	}
	if served[0] == served[1] || served[2] != served[0] {
		t.Fatalf("round robin served %v, want a, b, a", served)
	}
	var recs []*decisionlog.Record
	testwait.Until(t, "three decisions logged", func() bool {
		recs = readDecisions(t, logPath)
		return len(recs) == 3
	})
	var prompt int64
	for i, r := range recs {
		p := r.Prefix
		if p == nil || p.Hit+p.Cold+p.RoutedAway+p.RoutedAwayLoad+p.Evicted+p.Waited != r.Outcome.PromptTokens {
			t.Fatalf("record %d: prefix %+v, prompt tokens %d", i, p, r.Outcome.PromptTokens)
		}
		prompt += r.Outcome.PromptTokens
	}
	total := 0.0
	for _, o := range all {
		total += prev[o]
	}
	if total != float64(prompt) {
		t.Fatalf("counted %v tokens by outcome, the engines reported %d prompt tokens", total, prompt)
	}
	if p := recs[0].Prefix; p.Cold != recs[0].Outcome.PromptTokens {
		t.Errorf("the first request: %+v", p)
	}
	if p := recs[1].Prefix; p.RoutedAway == 0 || p.Hit != 0 {
		t.Errorf("the second request: %+v", p)
	}
	if p := recs[2].Prefix; p.Hit != recs[2].Outcome.CachedTokens || p.Hit == 0 {
		t.Errorf("the third request: %+v, engine reported %d cached", p, recs[2].Outcome.CachedTokens)
	}
	for _, o := range []string{"evicted", "waited", "routed_away_load"} { // round robin's turns, one request at a time
		if prev[o] != 0 {
			t.Errorf("%s counted %v tokens", o, prev[o])
		}
	}
	t.Logf("by outcome: %v; records: %+v %+v %+v", prev, *recs[0].Prefix, *recs[1].Prefix, *recs[2].Prefix)
}
