package main

import (
	"fmt"
	"strings"
	"testing"
)

// startRouterResolving is startRouterYAML with DNS answered by res.
func startRouterResolving(t testing.TB, yaml string, res *srvResolver) *tpRouter {
	t.Helper()
	return startRouterWith(t, yaml, func(a *app) { a.resolver = res })
}

// TestThirdPartyDiscoveredEvents: replicas found in DNS (SRV records) keep
// their pictures from their engines' KV events with nothing said of each
// one: discovery.kv_events.listen is one address every third-party engine
// dials, each told apart by llm-d's topic of its address, and
// replay_endpoint a template of each engine's replay socket. Every
// replica's events are followed, stored blocks counted, none an orphan,
// and the router's predicted cached tokens are within 2% of what the
// engines report.
func TestThirdPartyDiscoveredEvents(t *testing.T) {
	// Each engine on an address of its own, as pods are: its replay socket
	// on the same port of every host, which one template names.
	reps := startThirdParty(t, tpOptions{n: 4, events: true, sharedPort: true, ownHosts: true, deferred: true})
	res := &srvResolver{}
	names := make([]string, len(reps))
	for i, rep := range reps {
		names[i] = strings.TrimPrefix(rep.url, "http://")
	}
	res.setHosts(names...)
	r := startRouterResolving(t, fmt.Sprintf(`log: {level: warn}
discovery:
  dns_name: _http._tcp.vllm.test
  srv: true
  interval: 100ms
  kv_events: {listen: %q, replay_endpoint: "tcp://{host}:%s"}
`, reps[0].listen, reps[0].replay[strings.LastIndex(reps[0].replay, ":")+1:]), res)
	launchThirdParty(t, reps)
	waitBudgets(t, r, len(reps), 768*16)
	run := sendTruth(r.url, tpWork(160), 8, nil)
	ev := r.app.events.stats()
	ratio := float64(run.predicted) / float64(max(run.cached, 1))
	t.Logf("hit ratio %.3f, predicted ÷ reported %.4f, errors %d; events %+v", run.hitRatio(), ratio, run.errors, ev)
	if run.errors > 0 {
		t.Fatalf("%d requests failed: %s\n%s", run.errors, run.firstErr, r.log.String())
	}
	for _, n := range names {
		if m := metric(t, r.url, "semroute_kv_events_blocks_total", `event="stored",replica="`+n+`"`); m <= 0 {
			t.Errorf("%s: %v blocks stored from its events", n, m)
		}
	}
	if ev.Stored == 0 || ev.Orphans > 0 {
		t.Fatalf("events: %d blocks stored, %d orphans\n%s", ev.Stored, ev.Orphans, r.log.String())
	}
	if ratio < 0.98 || ratio > 1.02 {
		t.Fatalf("predicted ÷ reported cached tokens %.4f, want within 2%%", ratio)
	}
}

// TestThirdPartyDataParallelRanks: llm-d's simulator serves
// --data-parallel-size 4 as vLLM with external load balancing does: rank k
// on HTTP port P+k, its KV events dialled to the router's port L+k, its
// batches carrying data_parallel_rank k. Each rank is a replica of its own
// (kv_events.data_parallel_rank k); every rank's events are followed, and
// predictions agree with what the ranks report.
func TestThirdPartyDataParallelRanks(t *testing.T) {
	const ranks = 4
	reps := startThirdParty(t, tpOptions{n: 1, events: true, ranks: ranks, deferred: true})
	lp, rp := port(t, reps[0].listen), port(t, reps[0].replay)
	var b strings.Builder
	b.WriteString("log: {level: warn}\nreplicas:\n")
	for k := range ranks {
		fmt.Fprintf(&b, "  - name: rank-%d\n    url: http://127.0.0.1:%d\n    kv_events: {listen: \"tcp://127.0.0.1:%d\", replay_endpoint: \"tcp://127.0.0.1:%d\", data_parallel_rank: %d}\n",
			k, reps[0].port+k, lp+k, rp+k, k)
	}
	r := startRouterYAML(t, b.String())
	launchThirdParty(t, reps)
	waitBudgets(t, r, ranks, 768*16)
	run := sendTruth(r.url, tpWork(160), 8, nil)
	ratio := float64(run.predicted) / float64(max(run.cached, 1))
	t.Logf("hit ratio %.3f, predicted ÷ reported %.4f, errors %d; events %+v", run.hitRatio(), ratio, run.errors, r.app.events.stats())
	if run.errors > 0 {
		t.Fatalf("%d requests failed: %s", run.errors, run.firstErr)
	}
	for k := range ranks {
		t.Logf("rank %d: stored %v orphans %v batches %v", k, metric(t, r.url, "semroute_kv_events_blocks_total", fmt.Sprintf(`event="stored",replica="rank-%d"`, k)),
			metric(t, r.url, "semroute_kv_events_blocks_total", fmt.Sprintf(`event="orphan",replica="rank-%d"`, k)), metric(t, r.url, "semroute_kv_events_batches_total", fmt.Sprintf(`replica="rank-%d"`, k)))
		if m := metric(t, r.url, "semroute_kv_events_blocks_total", fmt.Sprintf(`event="stored",replica="rank-%d"`, k)); m <= 0 {
			t.Errorf("rank %d: %v blocks stored from its events", k, m)
		}
	}
	if ratio < 0.95 || ratio > 1.05 {
		t.Fatalf("predicted ÷ reported cached tokens %.4f, want within 5%%", ratio)
	}
}
