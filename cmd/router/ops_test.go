package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"

	"github.com/prometheus/client_golang/prometheus"

	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/kvevents"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/semroute/semroute/cluster"
)

func TestTracingExportsSpansAndPropagatesTraceparent(t *testing.T) {
	var mu sync.Mutex
	var spans []string
	traceIDs := map[string]bool{}
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var req collectorpb.ExportTraceServiceRequest
		if err := proto.Unmarshal(b, &req); err != nil {
			t.Errorf("collector: %v", err)
			return
		}
		mu.Lock()
		defer mu.Unlock()
		for _, rs := range req.GetResourceSpans() {
			for _, ss := range rs.GetScopeSpans() {
				for _, sp := range ss.GetSpans() {
					spans = append(spans, sp.GetName())
					traceIDs[fmt.Sprintf("%x", sp.GetTraceId())] = true
				}
			}
		}
	}))
	defer collector.Close()
	sims := startSims(t, 1, fastSim)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("tracing: {otlp_endpoint: %q}\nreplicas:\n  - {name: s, url: %q}\n", collector.URL, sims[0].URL))
	r := serveConfig(t, cfg)
	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	code, _, err := postURL(r.http.URL(), chat([2]string{"user", "traced"}), map[string]string{"traceparent": "00-" + traceID + "-00f067aa0ba902b7-01"})
	if err != nil || code != 200 {
		t.Fatal(code, err)
	}
	tp := sims[0].LastTraceparent()
	if !strings.HasPrefix(tp, "00-"+traceID+"-") || strings.Contains(tp, "00f067aa0ba902b7") {
		t.Fatalf("replica saw traceparent %q: want the same trace, a child span", tp)
	}
	if err := r.stop(5e9); err != nil { // flushes the exporter
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	got := strings.Join(spans, ",")
	if !strings.Contains(got, "semroute.route") || !strings.Contains(got, "semroute.upstream") || !traceIDs[traceID] {
		t.Fatalf("exported spans %s in traces %v", got, traceIDs)
	}
}

func TestTraceparentPassesThroughWithTracingOff(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	if code, _, err := postURL(d.router.URL(), chat([2]string{"user", "x"}), map[string]string{"traceparent": tp}); err != nil || code != 200 {
		t.Fatal(code, err)
	}
	saw := 0
	for _, s := range d.sims {
		switch got := s.LastTraceparent(); got {
		case "":
		case tp:
			saw++
		default:
			t.Fatalf("replica saw %q, want %q unchanged", got, tp)
		}
	}
	if saw != 1 {
		t.Fatalf("%d replicas saw the traceparent, want 1", saw)
	}
}

type srvResolver struct {
	mu  sync.Mutex
	srv []*net.SRV
}

func (r *srvResolver) set(ports ...int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.srv = nil
	for _, p := range ports {
		r.srv = append(r.srv, &net.SRV{Target: "127.0.0.1.", Port: uint16(p)})
	}
}

// setHosts makes the SRV records targets, host:port each.
func (r *srvResolver) setHosts(targets ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.srv = nil
	for _, hp := range targets {
		h, p, _ := net.SplitHostPort(hp)
		n, _ := strconv.Atoi(p)
		r.srv = append(r.srv, &net.SRV{Target: h + ".", Port: uint16(n)})
	}
}

func (r *srvResolver) LookupHost(context.Context, string) ([]string, error) {
	return nil, errors.New("A lookups unused")
}
func (r *srvResolver) LookupSRV(context.Context, string, string, string) (string, []*net.SRV, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return "", append([]*net.SRV(nil), r.srv...), nil
}

func port(t *testing.T, u string) int {
	p, err := strconv.Atoi(u[strings.LastIndex(u, ":")+1:])
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDNSDiscoveryFollowsReplicas(t *testing.T) {
	sims := startSims(t, 3, fastSim)
	res := &srvResolver{}
	res.set(port(t, sims[0].URL), port(t, sims[1].URL))
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, "routing: {policy: round_robin}\ndiscovery: {dns_name: _http._tcp.vllm.test, srv: true, interval: 50ms}\nreplicas: []\n")
	r := serveConfigWith(t, cfg, func(a *app) { a.resolver = res })
	// served returns which replicas (by port) answer 20 requests; until the
	// first resolution the router has none, and answers 503.
	served := func() map[int]bool {
		out := map[int]bool{}
		for i := 0; i < 20; i++ {
			code, rep, err := postURL(r.http.URL(), chat([2]string{"user", fmt.Sprint(i)}), nil)
			if code == http.StatusServiceUnavailable {
				continue
			}
			if err != nil || code != 200 {
				t.Fatalf("%d %v", code, err)
			}
			out[port(t, rep)] = true
		}
		return out
	}
	waitFor := func(want ...int) {
		t.Helper()
		testwait.Value(t, fmt.Sprint("served by exactly ", want), func() (map[int]bool, bool) {
			got := served()
			ok := len(got) == len(want)
			for _, p := range want {
				ok = ok && got[p]
			}
			return got, ok
		})
	}
	waitFor(port(t, sims[0].URL), port(t, sims[1].URL))
	res.set(port(t, sims[1].URL), port(t, sims[2].URL)) // sim 0 leaves, sim 2 appears
	waitFor(port(t, sims[1].URL), port(t, sims[2].URL))
}

var metricName = regexp.MustCompile(`\bsemroute_[a-z_]+`)

// docMetrics returns the metric names in the metrics table of
// docs/metrics.md.
func docMetrics(t *testing.T) map[string]bool {
	b, err := os.ReadFile("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "| `semroute_") {
			out[strings.Trim(strings.Fields(line)[1], "`")] = true
		}
	}
	if len(out) < 20 {
		t.Fatalf("found only %d metrics in the table of docs/metrics.md", len(out))
	}
	return out
}

// needsTraffic are the series the deploy files query that exist only once
// a request or an event names their labels (a model, a priority, a peer).
var needsTraffic = map[string]bool{
	"semroute_requests_total": true, // by status code and model: a request's
}

// onlyWithKeys are the metrics whose labels are an API keys file's
// tenants: TestAPIKeysAtTheRouter checks them.
var onlyWithKeys = map[string]bool{"semroute_tenant_requests_total": true}

func TestMetricsTableIsExportedAndDeployUsesIt(t *testing.T) {
	table := docMetrics(t)
	events := fastSim // replica b publishes KV events: their families too
	events.KVEvents = &kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv-events"}
	sims := append(startSims(t, 1, fastSim), startSims(t, 1, events)...)
	pub, replay := sims[1].KVEventsEndpoints()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "router.yaml")
	ns, err := cluster.Serve("127.0.0.1", -1, fleetAccount) // a fleet of one: the fleet's metrics too
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.Shutdown)
	body := fmt.Sprintf("decision_log: {path: %q}\nhealth: {scrape_interval: 50ms}\ncluster: {urls: [%q], id: ops, user: fleet, password: fleet-test-password}\nreplicas:\n  - {name: a, url: %q}\n  - {name: b, url: %q, kv_events: {endpoint: %q, replay_endpoint: %q, topic: kv-events}}\n",
		filepath.Join(dir, "d.jsonl"), ns.ClientURL(), sims[0].URL, sims[1].URL, pub, replay)
	writeConfig(t, cfg, body)
	r := serveConfig(t, cfg)
	// Before any request: what the alerts and the dashboard query has a
	// series already, so that a rate is 0 rather than no data and an
	// alert on a counter's first increase can fire.
	fresh := map[string]bool{}
	for _, line := range strings.Split(scrapeURL(t, r.http.URL()), "\n") {
		if m := metricName.FindString(line); m != "" && !strings.HasPrefix(line, "#") {
			fresh[m] = true
		}
	}
	for _, f := range []string{"../../deploy/grafana/semroute-dashboard.json", "../../deploy/prometheus/alerts.yaml"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range metricName.FindAllString(string(b), -1) {
			if !fresh[m] && !needsTraffic[m] {
				t.Errorf("%s queries %s, which a fresh router does not export", f, m)
			}
		}
	}
	for i := 0; i < 20; i++ {
		if code, _, err := postURL(r.http.URL(), chat([2]string{"system", text("metric prompt", 300)}, [2]string{"user", fmt.Sprint(i)}), nil); err != nil || code != 200 {
			t.Fatal(code, err)
		}
	}
	sims[0].Close() // retries and upstream errors
	for i := 0; i < 10; i++ {
		if code, _, err := postURL(r.http.URL(), chat([2]string{"system", text("metric prompt", 300)}, [2]string{"user", fmt.Sprint("after ", i)}), nil); err != nil || code != 200 {
			t.Fatal(code, err)
		}
	}
	writeConfig(t, cfg, body+"# touched\n") // a reload
	var scraped string
	testwait.Until(t, "the reload counted", func() bool {
		scraped = scrapeURL(t, r.http.URL())
		return strings.Contains(scraped, "semroute_config_reloads_total")
	})
	exported := map[string]bool{}
	for _, line := range strings.Split(scraped, "\n") {
		if m := metricName.FindString(line); m != "" && !strings.HasPrefix(line, "#") {
			exported[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_sum"), "_count")] = true
		}
	}
	for name := range table {
		if !exported[name] && !onlyWithKeys[name] {
			t.Errorf("docs/metrics.md lists %s, not in /metrics after traffic", name)
		}
	}
	for name := range exported {
		if !table[name] {
			t.Errorf("exported metric %s missing from the table of docs/metrics.md", name)
		}
	}
	for _, f := range []string{"../../deploy/grafana/semroute-dashboard.json", "../../deploy/prometheus/alerts.yaml"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		used := metricName.FindAllString(string(b), -1)
		if len(used) == 0 {
			t.Fatalf("%s uses no semroute metric", f)
		}
		for _, m := range used {
			base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_sum"), "_count")
			if !table[base] {
				t.Errorf("%s queries %s, which the router does not export", f, m)
			}
		}
	}
}

// Every family the router's own collectors describe is in the table of
// docs/metrics.md, whether or not this machine's traffic would make it appear (the
// KV events' families need an engine that publishes them).
func TestEveryDescribedFamilyIsInTheMetricsTable(t *testing.T) {
	table := docMetrics(t)
	ch := make(chan *prometheus.Desc, 256)
	for _, c := range []prometheus.Collector{&followers{}, agreementMetrics{}, fleetMetrics{}, replicaCollector{}, queueCollector{}} {
		c.Describe(ch)
	}
	close(ch)
	fq := regexp.MustCompile(`fqName: "([a-z_:]+)"`)
	n := 0
	for d := range ch {
		m := fq.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("no name in %s", d)
		}
		n++
		if !table[m[1]] {
			t.Errorf("%s is described but not in the metrics table of docs/metrics.md", m[1])
		}
	}
	if n < 30 {
		t.Fatalf("only %d families described", n)
	}
}
