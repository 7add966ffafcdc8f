package monitor

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/replica"
)

const vllmMetrics = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 7
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",enable_prefix_caching="True"} 1
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m"} %d
`

func TestMonitorScrapesChecksAndDetectsRestart(t *testing.T) {
	var queries atomic.Int64
	queries.Store(500)
	var healthy atomic.Bool
	healthy.Store(true)
	var checks atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			checks.Add(1)
			if !healthy.Load() {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		case "/metrics":
			fmt.Fprintf(w, vllmMetrics, queries.Load())
		}
	}))
	defer srv.Close()
	p, _ := replica.NewPool([]replica.Spec{{Name: "a", URL: srv.URL}}, replica.Options{}, func(replica.Spec) (int, error) { return 0, nil })
	r := p.Replicas()[0]
	var budget atomic.Int64
	var restarts atomic.Int32
	m := New(p, Options{
		OnBudget:  func(_ *replica.Replica, b int64) { budget.Store(b) },
		OnRestart: func(*replica.Replica) { restarts.Add(1) },
	})
	ctx := context.Background()
	m.Scrape(ctx, r)
	l := r.Load(time.Now())
	if l.Running != 3 || l.Waiting != 7 || l.KVUsage != 0.25 || r.Budget() != 16000 || budget.Load() != 16000 {
		t.Fatalf("scraped %+v, budget %d", l.Observed, r.Budget())
	}
	queries.Store(900)
	m.Scrape(ctx, r)
	if restarts.Load() != 0 {
		t.Fatal("a growing counter read as a restart")
	}
	queries.Store(10)
	m.Scrape(ctx, r)
	if restarts.Load() != 1 {
		t.Fatal("a counter that went back was not read as a restart")
	}
	healthy.Store(false)
	m.Check(ctx, r)
	m.Check(ctx, r)
	if r.Available(time.Now()) {
		t.Fatal("two failed checks left the replica available")
	}
	healthy.Store(true)
	m.Check(ctx, r)
	m.Check(ctx, r)
	if !r.Available(time.Now()) {
		t.Fatal("two good checks did not bring it back")
	}
	// Run stops with its context.
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	before := checks.Load()
	go func() {
		New(p, Options{CheckInterval: time.Millisecond, ScrapeInterval: time.Millisecond}).Run(rctx)
		close(done)
	}()
	testwait.Until(t, "Run's checks", func() bool { return checks.Load() >= before+2 })
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not stop")
	}
}

func TestParseMetricsErrors(t *testing.T) {
	if _, err := ParseMetrics(strings.NewReader("vllm:num_requests_running{ not valid")); err == nil {
		t.Fatal("garbage in a family the router reads parsed")
	}
	s, err := ParseMetrics(strings.NewReader("other_metric 1\nnot { valid\n"))
	if err != nil || s.HasRunning || s.HasCounter || s.Blocks != 0 {
		t.Fatalf("%+v %v", s, err)
	}
}

// TestParseMetricsHostile: what a broken or hostile replica exports costs a
// linear scan, and values no replica can have are left out.
func TestParseMetricsHostile(t *testing.T) {
	var b strings.Builder
	for i := range 200000 { // many families the router does not read
		fmt.Fprintf(&b, "f%d 1\n", i)
	}
	b.WriteString("vllm:num_requests_running{model_name=\"m\"} NaN\n")
	b.WriteString("vllm:num_requests_waiting{model_name=\"m\"} -1e308\n")
	b.WriteString("vllm:kv_cache_usage_perc{model_name=\"m\"} 7\n")
	b.WriteString(strings.Repeat("x", 200<<10) + " 1\n") // an over-long line
	b.WriteString(`vllm:cache_config_info{block_size="16",num_gpu_blocks="9223372036854775807"} 1` + "\n")
	s, err := ParseMetrics(strings.NewReader(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	if s.HasRunning || s.HasWaiting || s.KVUsage != 1 {
		t.Fatalf("junk values kept: %+v", s)
	}
	p, _ := replica.NewPool([]replica.Spec{{Name: "a", URL: "http://a"}}, replica.Options{}, func(replica.Spec) (int, error) { return 0, nil })
	m := New(p, Options{})
	m.apply(p.Replicas()[0], s, time.Now(), true)
	if got := p.Replicas()[0].Budget(); got != DefaultMaxBudget {
		t.Fatalf("an overflowing reported budget became %d, want the bound %d", got, DefaultMaxBudget)
	}
}

// A replica that reports 2^40 tokens of KV cache (num_gpu_blocks ×
// block_size) gets the configured bound, said and counted, so that its
// picture cannot grow past it; one within the bound gets what it reports.
func TestReportedBudgetIsBounded(t *testing.T) {
	p, _ := replica.NewPool([]replica.Spec{{Name: "a", URL: "http://a"}, {Name: "b", URL: "http://b"}}, replica.Options{},
		func(replica.Spec) (int, error) { return 0, nil })
	var set, clamped []int64
	var logs strings.Builder
	m := New(p, Options{MaxBudget: 1 << 22, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		OnBudget:        func(_ *replica.Replica, b int64) { set = append(set, b) },
		OnBudgetClamped: func(_ *replica.Replica, reported, b int64) { clamped = append(clamped, reported, b) },
	})
	for i, blocks := range []int64{1 << 36, 1000} {
		s, err := ParseMetrics(strings.NewReader(fmt.Sprintf("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"%d\"} 1\n", blocks)))
		if err != nil {
			t.Fatal(err)
		}
		m.apply(p.Replicas()[i], s, time.Now(), true)
	}
	if a, b := p.Replicas()[0].Budget(), p.Replicas()[1].Budget(); a != 1<<22 || b != 16000 {
		t.Fatalf("budgets %d and %d, want the bound 4194304 and 16000", a, b)
	}
	if len(set) != 2 || set[0] != 1<<22 || len(clamped) != 2 || clamped[0] != 1<<40 || clamped[1] != 1<<22 {
		t.Fatalf("told the picture %v, clamped %v", set, clamped)
	}
	if !strings.Contains(logs.String(), "replica=a") || !strings.Contains(logs.String(), "reported_tokens=1099511627776") {
		t.Fatalf("the clamp was not logged:\n%s", logs.String())
	}
}

func FuzzParseMetrics(f *testing.F) {
	f.Add([]byte(fmt.Sprintf(vllmMetrics, 5)))
	f.Add([]byte("vllm:num_requests_running NaN\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = ParseMetrics(strings.NewReader(string(b))) // must not panic
	})
}

// The adapters come from the latest sample of vllm:lora_requests_info (the
// largest value: a timestamp), names comma-separated with or without
// spaces; /v1/models's entries with a parent are the adapters.
func TestParseLoRAAndModels(t *testing.T) {
	s, err := ParseMetrics(strings.NewReader(`# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1700000000.5
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql, chat",waiting_lora_adapters="math"} 1700000009.25
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1700000001
`))
	if err != nil || !s.LoRA || strings.Join(s.LoRARunning, "|") != "sql|chat" || strings.Join(s.LoRAWaiting, "|") != "math" || s.MaxLoRA != 2 {
		t.Fatalf("%+v %v", s, err)
	}
	served, adapters, err := ParseModels(strings.NewReader(`{"object":"list","data":[
		{"id":"base","root":"/m","parent":null},{"id":"sql","root":"/a","parent":"base"},{"id":""}]}`))
	if err != nil || strings.Join(served, ",") != "base,sql" || strings.Join(adapters, ",") != "sql" {
		t.Fatalf("%v %v %v", served, adapters, err)
	}
	// Without a list the models stay unknown (an error), not none.
	for _, bad := range []string{`{"data":`, `{}`, `null`, `{"data":null}`, `{"object":"list"}`, `{"error":{"message":"x"}}`, `[]`} {
		if _, _, err := ParseModels(strings.NewReader(bad)); err == nil {
			t.Fatalf("%s parsed as a model list", bad)
		}
	}
	// A huge list is read up to the cap only.
	var b strings.Builder
	b.WriteString(`{"data":[`)
	for i := 0; i < 100000; i++ {
		fmt.Fprintf(&b, `{"id":"m%d"},`, i)
	}
	b.WriteString(`{}]}`)
	if served, _, err := ParseModels(strings.NewReader(b.String())); err == nil {
		t.Fatalf("a list of 100,000 read as %d models: past the cap the models must stay unknown", len(served))
	}
	// A NaN sample is not the latest.
	s, _ = ParseMetrics(strings.NewReader(`# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="stale",waiting_lora_adapters=""} NaN
vllm:lora_requests_info{max_lora="1",running_lora_adapters="now",waiting_lora_adapters=""} 1700000000
`))
	if strings.Join(s.LoRARunning, ",") != "now" {
		t.Fatalf("NaN first: running %v", s.LoRARunning)
	}
}

// RefreshAllModels reads every replica's models, at most once a second
// however often it is asked.
func TestRefreshAllModelsPaced(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			hits.Add(1)
			fmt.Fprint(w, `{"data":[{"id":"m"}]}`)
		}
	}))
	defer srv.Close()
	p, err := replica.NewPool([]replica.Spec{{Name: "a", URL: srv.URL}, {Name: "b", URL: srv.URL}}, replica.Options{}, func(replica.Spec) (int, error) { return 0, nil })
	if err != nil {
		t.Fatal(err)
	}
	m := New(p, Options{})
	for i := 0; i < 50; i++ {
		m.RefreshAllModels(context.Background())
	}
	if n := hits.Load(); n != 2 {
		t.Fatalf("%d model reads for 50 refreshes of 2 replicas, want 2", n)
	}
	if ms := p.Replicas()[0].Models(); ms == nil || !ms.Serves("m") {
		t.Fatalf("models not recorded: %+v", ms)
	}
}

// A scrape that is still out when the next tick comes is not overlapped:
// the newer answer would land first and the older one after it, setting
// the replica back (here its counter, which would read as a restart that
// clears its cache picture).
func TestScrapesOfAReplicaDoNotOverlap(t *testing.T) {
	var hits atomic.Int64
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			return
		}
		n := hits.Add(1)
		if n == 1 { // the slow first scrape, of the older state
			arrived <- struct{}{}
			<-release
			fmt.Fprintf(w, vllmMetrics, 900)
			return
		}
		fmt.Fprintf(w, vllmMetrics, 1000)
	}))
	defer srv.Close()
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	defer free() // before srv.Close, which waits for the handler
	p, _ := replica.NewPool([]replica.Spec{{Name: "a", URL: srv.URL}}, replica.Options{}, func(replica.Spec) (int, error) { return 0, nil })
	r := p.Replicas()[0]
	var restarts atomic.Int32
	m := New(p, Options{CheckTimeout: 10 * time.Second, OnRestart: func(*replica.Replica) { restarts.Add(1) }})
	ctx := context.Background()
	first := make(chan struct{})
	go func() { m.Scrape(ctx, r); close(first) }()
	<-arrived
	m.Scrape(ctx, r) // the next tick, while the first is out
	if n := hits.Load(); n != 1 {
		t.Fatalf("a second scrape went out while the first was: %d reads", n)
	}
	free()
	<-first
	m.Scrape(ctx, r)
	if n := hits.Load(); n != 2 || restarts.Load() != 0 {
		t.Fatalf("%d reads, %d restarts; want 2 reads and no restart", n, restarts.Load())
	}
}
