package monitor

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/semroute/semroute/replica"
)

// engineRig is one replica whose /metrics and /health say what the test
// sets, and the restarts its monitor reported.
type engineRig struct {
	mu       sync.Mutex
	metrics  string
	healthy  bool
	restarts []Restart
	r        *replica.Replica
	m        *Monitor
}

func newEngineRig(t *testing.T, o Options) *engineRig {
	t.Helper()
	e := &engineRig{healthy: true}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		defer e.mu.Unlock()
		switch r.URL.Path {
		case "/health":
			if !e.healthy {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		case "/metrics":
			fmt.Fprint(w, e.metrics)
		}
	}))
	t.Cleanup(srv.Close)
	p, _ := replica.NewPool([]replica.Spec{{Name: "a", URL: srv.URL}}, replica.Options{}, func(replica.Spec) (int, error) { return 0, nil })
	e.r = p.Replicas()[0]
	o.OnEngineRestart = func(_ *replica.Replica, rs Restart) {
		e.mu.Lock()
		e.restarts = append(e.restarts, rs)
		e.mu.Unlock()
	}
	e.m = New(p, o)
	return e
}

func (e *engineRig) set(metrics string) {
	e.mu.Lock()
	e.metrics = metrics
	e.mu.Unlock()
}

func (e *engineRig) setHealthy(ok bool) {
	e.mu.Lock()
	e.healthy = ok
	e.mu.Unlock()
}

// scrape scrapes once and returns when it was sent, at the earliest.
func (e *engineRig) scrape() time.Time {
	at := time.Now()
	e.m.Scrape(context.Background(), e.r)
	return at
}

func (e *engineRig) seen() []Restart {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]Restart(nil), e.restarts...)
}

// simMetrics is llm-d's simulator's exposition (as it serves it): its
// gauges from the start, its counters once a request came.
func simMetrics(queries int) string {
	s := `# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="768"} 1
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0
`
	if queries > 0 {
		s += fmt.Sprintf("# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{model_name=\"m\"} %d\n", queries)
	}
	return s
}

// vllmProcess is a vLLM API server's exposition: its process's start,
// its cache config info, its counters.
func vllmProcess(start float64, blocks, queries int) string {
	return fmt.Sprintf(`# TYPE process_start_time_seconds gauge
process_start_time_seconds %g
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="%d"} 1
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} %d
`, start, blocks, queries)
}

// A restarted engine that exports its counters only once they count
// something (llm-d's simulator) is seen restarted before any request
// reaches it: its counters are gone from its metrics. Once, and with the
// time of the last scrape that saw the engine before.
func TestRestartSeenInTheMetricsWithoutTraffic(t *testing.T) {
	e := newEngineRig(t, Options{})
	e.set(simMetrics(0)) // a fresh engine: no counter yet
	e.scrape()
	e.set(simMetrics(500))
	e.scrape()
	e.set("") // an answer that is not the engine's metrics: no restart
	e.scrape()
	e.set(simMetrics(900))
	last := e.scrape()
	if n := len(e.seen()); n != 0 {
		t.Fatalf("%d restarts of an engine that did not restart", n)
	}
	e.set(simMetrics(0)) // restarted; no request came yet
	e.scrape()
	e.scrape()
	e.set(simMetrics(30)) // the first requests
	e.scrape()
	e.set(simMetrics(60))
	e.scrape()
	got := e.seen()
	if len(got) != 1 || !strings.Contains(got[0].Reason, "counters are gone") {
		t.Fatalf("restarts %+v, want one, its counters gone", got)
	}
	if got[0].Since.Before(last) || got[0].Since.After(time.Now()) {
		t.Fatalf("restart since %v; the last scrape of the old engine was sent at %v", got[0].Since, last)
	}
	if e.m.Restarts(e.r) != 1 {
		t.Fatalf("Restarts %d", e.m.Restarts(e.r))
	}
}

// A vLLM engine restarted between two scrapes whose counters passed the
// old ones meanwhile is seen restarted by its process's start time, or by
// its cache config info; one restart that shows in all of them at once is
// one restart.
func TestRestartSeenByStartTimeAndCacheConfig(t *testing.T) {
	for _, c := range []struct {
		name, want string
		next       string
	}{
		{"start time", "process_start_time_seconds", vllmProcess(2000, 1000, 99999)},
		{"cache config", "cache config info", vllmProcess(0, 1200, 99999)},
		{"all at once", "process_start_time_seconds", vllmProcess(2000, 1200, 3)},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEngineRig(t, Options{})
			e.set(vllmProcess(1000, 1000, 500))
			e.scrape()
			e.set(vllmProcess(1000, 1000, 700))
			last := e.scrape()
			if c.name == "cache config" {
				e.set(vllmProcess(0, 1000, 800)) // a scrape without the start time
				last = e.scrape()
			}
			e.set(c.next)
			e.scrape()
			e.scrape()
			got := e.seen()
			if len(got) != 1 || !strings.Contains(got[0].Reason, c.want) || got[0].Since.Before(last) {
				t.Fatalf("restarts %+v, want one by %s, since %v", got, c.want, last)
			}
		})
	}
}

// A truncated scrape, one without the engine's gauges, or one of another
// label order, is not a restart.
func TestNoRestartFromPartialScrapes(t *testing.T) {
	e := newEngineRig(t, Options{})
	e.set(vllmProcess(1000, 1000, 500))
	e.scrape()
	s, err := ParseMetrics(strings.NewReader(vllmProcess(1000, 1000, 500)))
	if err != nil {
		t.Fatal(err)
	}
	s.HasCounter = false
	e.m.apply(e.r, s, time.Now(), false) // cut at maxMetricsBytes before its counters
	e.set(`# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{num_gpu_blocks="1000",gpu_memory_utilization="0.9",engine="0",cache_dtype="auto",block_size="16"} 1
`)
	e.scrape()
	e.set(vllmProcess(1000, 1000, 600))
	e.scrape()
	if got := e.seen(); len(got) != 0 {
		t.Fatalf("restarts %+v", got)
	}
}

// A replica that comes back up is scraped at once: the restart of its
// engine is known before a request can be routed to it.
func TestReplicaBackUpIsScrapedAtOnce(t *testing.T) {
	e := newEngineRig(t, Options{ScrapeInterval: time.Hour})
	e.set(simMetrics(500))
	e.scrape()
	ctx := context.Background()
	e.setHealthy(false)
	e.m.Check(ctx, e.r)
	e.m.Check(ctx, e.r)
	if e.r.Available(time.Now()) {
		t.Fatal("two failed checks left the replica available")
	}
	e.set(simMetrics(0)) // a new engine
	e.setHealthy(true)
	e.m.Check(ctx, e.r)
	if len(e.seen()) != 0 {
		t.Fatal("scraped before the replica came back up")
	}
	e.m.Check(ctx, e.r)
	if !e.r.Available(time.Now()) || len(e.seen()) != 1 {
		t.Fatalf("available %v, restarts %+v: the replica came back up unscraped", e.r.Available(time.Now()), e.seen())
	}
}

// OnRestart, when OnEngineRestart is not set, is called for each restart.
func TestOnRestartWithoutOnEngineRestart(t *testing.T) {
	e := newEngineRig(t, Options{})
	var n int
	e.m.o.OnEngineRestart = nil
	e.m.o.OnRestart = func(*replica.Replica) { n++ }
	e.set(simMetrics(500))
	e.scrape()
	e.set(simMetrics(0))
	e.scrape()
	if n != 1 {
		t.Fatalf("OnRestart called %d times", n)
	}
}
