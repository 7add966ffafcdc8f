package main

import (
	"runtime"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/mod/module"

	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/monitor"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/router"
	"github.com/semroute/semroute/routing"
)

// replicaCollector exports every replica's state when scraped, so replicas
// that leave the pool leave the metrics too.
type replicaCollector struct {
	pool *replica.Pool
	pic  *routing.Picture
}

var (
	descHealthy   = prometheus.NewDesc("semroute_replica_healthy", "1 if the replica passes its health checks and is not ejected.", []string{"replica"}, nil)
	descDraining  = prometheus.NewDesc("semroute_replica_draining", "1 if the replica is draining.", []string{"replica"}, nil)
	descInFlight  = prometheus.NewDesc("semroute_replica_in_flight", "Requests in flight on the replica: this router's and, in a fleet, its peers'.", []string{"replica"}, nil)
	descPending   = prometheus.NewDesc("semroute_replica_pending_prefill_tokens", "Estimated prefill tokens in flight on the replica (this router's and its peers').", []string{"replica"}, nil)
	descRunning   = prometheus.NewDesc("semroute_replica_running", "Running requests the replica reported (vllm:num_requests_running).", []string{"replica"}, nil)
	descWaiting   = prometheus.NewDesc("semroute_replica_waiting", "Waiting requests the replica reported (vllm:num_requests_waiting).", []string{"replica"}, nil)
	descKVUsage   = prometheus.NewDesc("semroute_replica_kv_cache_usage_ratio", "KV cache usage the replica reported, 0 to 1.", []string{"replica"}, nil)
	descBlocks    = prometheus.NewDesc("semroute_replica_tracked_blocks", "Blocks in the router's picture of the replica's cache.", []string{"replica"}, nil)
	descTokens    = prometheus.NewDesc("semroute_replica_tracked_tokens", "Tokens in the router's picture of the replica's cache.", []string{"replica"}, nil)
	descBudget    = prometheus.NewDesc("semroute_replica_budget_tokens", "The replica's KV cache budget in tokens: configured, reported by the replica, or else cache.default_budget_tokens.", []string{"replica"}, nil)
	descEvictions = prometheus.NewDesc("semroute_replica_evictions_total", "Blocks evicted from the router's picture of the replica's cache.", []string{"replica"}, nil)
	descCapacity  = prometheus.NewDesc("semroute_replica_capacity_requests", "Requests the replica runs before its engine queues the next: replicas[].max_running, else learned from what it reports running while requests wait; 0 while unknown.", []string{"replica"}, nil)
	descService   = prometheus.NewDesc("semroute_replica_service_seconds", "The replica's service-time model, learned from its answers (package servicetime), by parameter: overhead, prefill_per_token, ahead_per_token, decode_per_token, decode_per_token_per_sequence (seconds an output token costs for each sequence running), run (a mean request's seconds on a slot), wait_per_queued (seconds a request waits for each one queued ahead; 0 until one waited) and kv_wait (seconds a request waits for KV room). The fleet's median serves a replica until it learned from 16 answers.", []string{"replica", "param"}, nil)
	descSamples   = prometheus.NewDesc("semroute_replica_service_samples", "Answers the replica's service-time model learned from.", []string{"replica"}, nil)
	descSaturated = prometheus.NewDesc("semroute_replica_saturated", "1 while the replica's engine would queue the next request: its requests in flight reach its capacity, it reports requests waiting, or its KV cache is 98% full.", []string{"replica"}, nil)
)

func (c replicaCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descHealthy, descDraining, descInFlight, descPending, descRunning, descWaiting, descKVUsage, descBlocks, descTokens, descBudget, descEvictions, descCapacity, descSaturated, descService, descSamples} {
		ch <- d
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func (c replicaCollector) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	for _, r := range c.pool.Replicas() {
		l := r.Load(now)
		st, _ := c.pic.Stats(r.ID)
		g := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, r.Name)
		}
		g(descHealthy, b2f(r.Healthy(now)))
		g(descDraining, b2f(r.Draining()))
		g(descInFlight, float64(l.InFlight))
		g(descPending, l.PendingTokens)
		g(descRunning, float64(l.Running))
		g(descWaiting, float64(l.Waiting))
		g(descKVUsage, l.KVUsage)
		g(descBlocks, float64(st.Blocks))
		g(descTokens, float64(st.Tokens))
		g(descBudget, float64(st.Budget))
		g(descCapacity, float64(r.Capacity()))
		g(descSaturated, b2f(r.Saturated()))
		ch <- prometheus.MustNewConstMetric(descEvictions, prometheus.CounterValue, float64(st.Evictions), r.Name)
		p, _ := r.Service()
		for _, kv := range []struct {
			name string
			v    float64
		}{{"overhead", p.Overhead}, {"prefill_per_token", p.PerToken}, {"ahead_per_token", p.PerAhead},
			{"decode_per_token", p.PerOutput}, {"decode_per_token_per_sequence", p.PerOutputBatch}, {"run", p.Run},
			{"wait_per_queued", p.WaitPer}, {"kv_wait", p.KVWait}} {
			ch <- prometheus.MustNewConstMetric(descService, prometheus.GaugeValue, kv.v, r.Name, kv.name)
		}
		g(descSamples, float64(p.Samples))
	}
}

// buildInfo returns the version, the VCS commit and the Go version.
func buildInfo() (ver, commit, goVersion string) {
	bi, _ := debug.ReadBuildInfo()
	ver, commit = stamp(version, commitFlag, bi)
	return ver, commit, runtime.Version()
}

// stamp picks the version and commit to report. What -ldflags set (make
// build, make image, the Dockerfile) wins; without it, what the Go toolchain
// recorded in bi: the main module's version (`go install
// github.com/semroute/semroute/cmd/router@v1.2.3` records v1.2.3, a build in
// a checkout its tag or pseudo-version; "(devel)" is no version) and the
// commit from vcs.revision (a build in a checkout), else from the
// pseudo-version (`go install ...@<commit>` records no vcs.* settings).
// bi may be nil (a binary built without module support).
func stamp(ldVersion, ldCommit string, bi *debug.BuildInfo) (ver, commit string) {
	ver, commit = ldVersion, ldCommit
	if bi != nil {
		if (ver == "" || ver == "dev") && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			ver = bi.Main.Version
		}
		if commit == "" {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" {
					commit = s.Value
				}
			}
		}
		if commit == "" && module.IsPseudoVersion(bi.Main.Version) {
			commit, _ = module.PseudoVersionRev(bi.Main.Version)
		}
	}
	if ver == "" {
		ver = "dev"
	}
	if commit == "" {
		commit = "unknown"
	}
	return ver, commit
}

// registerOps registers the process-level metrics: replicas, the decision
// log and build info.
func registerOps(reg *prometheus.Registry, pool *replica.Pool, pic *routing.Picture, dl *decisionlog.Writer, core *router.Core) {
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "semroute_grpc_unreleased_decisions",
		Help: "gRPC Route decisions awaiting Release (capped by grpc.max_unreleased_decisions)."},
		func() float64 { n, _ := core.Unreleased().Len(); return float64(n) }))
	reg.MustRegister(replicaCollector{pool, pic})
	reg.MustRegister(queueCollector{core})
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "semroute_queue_bytes",
		Help: "Bytes of the bodies waiting in the router's queue."},
		func() float64 { _, b := core.Deferrals().Len(); return float64(b) }))
	ver, commit, gov := buildInfo()
	bi := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "semroute_build_info", Help: "1, labelled with the build's version, commit and Go version."},
		[]string{"version", "commit", "goversion"})
	bi.WithLabelValues(ver, commit, gov).Set(1)
	reg.MustRegister(bi)
	// Every decision logged ends up in exactly one of written, dropped and
	// failed (see decisionlog.Writer), once the writer has caught up.
	written, dropped, failed := func() float64 { return 0 }, func() float64 { return 0 }, func() float64 { return 0 }
	if dl != nil {
		written = func() float64 { return float64(dl.Written()) }
		dropped = func() float64 { return float64(dl.Dropped()) }
		failed = func() float64 { return float64(dl.Failed()) }
	}
	reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "semroute_decision_log_lines_written_total", Help: "Decision log lines written whole to the file."}, written),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "semroute_decision_log_lines_dropped_total", Help: "Decision log lines dropped because the buffer was full."}, dropped),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "semroute_decision_log_lines_failed_total", Help: "Decision log lines that could not be encoded or written (write errors, no open file)."}, failed),
	)
}

// restartCollector exports the engine restarts seen, per replica, by
// where they were seen first or at all: a scrape of the engine's metrics
// (process_start_time_seconds, vllm:cache_config_info, counters that went
// back or vanished) or its KV events (a sequence that started over or
// passed the old engine's). One restart seen by both counts in each.
type restartCollector struct {
	pool   *replica.Pool
	mon    *monitor.Monitor
	events *followers
}

var descRestarts = prometheus.NewDesc("semroute_engine_restarts_total",
	"Engine restarts seen, by source: scrape (its metrics showed a new engine) or events (its KV events did); a replica's picture is cleared once a restart, whichever sees it first.",
	[]string{"replica", "source"}, nil)

func (restartCollector) Describe(ch chan<- *prometheus.Desc) { ch <- descRestarts }

func (c restartCollector) Collect(ch chan<- prometheus.Metric) {
	for _, r := range c.pool.Replicas() {
		var events uint64
		if f := c.events.follower(r.ID); f != nil {
			events = f.Stats().Subscriber.Restarts
		}
		ch <- prometheus.MustNewConstMetric(descRestarts, prometheus.CounterValue, float64(c.mon.Restarts(r)), r.Name, "scrape")
		ch <- prometheus.MustNewConstMetric(descRestarts, prometheus.CounterValue, float64(events), r.Name, "events")
	}
}

var (
	descQueueRequests = prometheus.NewDesc("semroute_queue_requests",
		"Requests waiting in the router's queue (flow control), by priority: their best replica is saturated, or its free slots are kept for higher priorities.", []string{"priority"}, nil)
	descQueueFlows = prometheus.NewDesc("semroute_queue_flows",
		"Flows (fairness ids, else tenants, else users) with requests waiting in the router's queue. Not labelled by flow: their number is the clients'; the decision log records each request's wait and tenant.", nil, nil)
)

// queueCollector reports the router's queue by priority at each scrape;
// priority 0 is always reported, so a fresh scrape shows the family.
type queueCollector struct{ core *router.Core }

func (queueCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descQueueRequests
	ch <- descQueueFlows
}

func (c queueCollector) Collect(ch chan<- prometheus.Metric) {
	by, flows := c.core.Deferrals().Bands()
	if _, ok := by[0]; !ok {
		ch <- prometheus.MustNewConstMetric(descQueueRequests, prometheus.GaugeValue, 0, "0")
	}
	for p, n := range by {
		ch <- prometheus.MustNewConstMetric(descQueueRequests, prometheus.GaugeValue, float64(n), strconv.Itoa(p))
	}
	ch <- prometheus.MustNewConstMetric(descQueueFlows, prometheus.GaugeValue, float64(flows))
}
