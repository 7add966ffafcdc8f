package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/configs"
)

// startRouterResolving is startRouterYAML with DNS answered by res.
func startRouterResolving(t testing.TB, yaml string, res *srvResolver) *tpRouter {
	t.Helper()
	cfg, err := configs.LoadBytes(configs.NewViper(), []byte("listen: 127.0.0.1:0\n"+yaml))
	if err != nil {
		t.Fatalf("config: %v\n%s", err, yaml)
	}
	lb := &syncBuffer{}
	a, err := build(cfg, newLogger(cfg.Log, lb))
	if err != nil {
		t.Fatal(err)
	}
	a.resolver = res
	r, err := a.start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.stop(time.Second) })
	return &tpRouter{app: a, run: r, url: r.http.URL(), log: lb}
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
	reps := startThirdParty(t, tpOptions{n: 4, events: true, sharedPort: true, ownHosts: true})
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
