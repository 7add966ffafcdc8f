package monitor

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/semroute/semroute/replica"
)

// Options configure a Monitor. Zero fields take the defaults.
type Options struct {
	// Client sends the checks and scrapes. Nil means a client of its own.
	Client *http.Client
	// Authorization, if set, is sent with every request to a replica (a
	// replica that wants a key, as vLLM's --api-key, on its /v1 routes).
	Authorization string
	// CheckInterval, CheckTimeout: GET /health on every replica. Defaults
	// 2s and 1s. Fall failures in a row mark a replica down, Rise successes
	// mark it up; defaults 2 and 2.
	CheckInterval, CheckTimeout time.Duration
	Fall, Rise                  int
	// ScrapeInterval: GET /metrics on every replica; 0 means 5s, negative
	// turns scraping off.
	ScrapeInterval time.Duration
	// OnBudget is called when a replica without a budget reports
	// vllm:cache_config_info; the budget is num_gpu_blocks × block_size,
	// at most MaxBudget.
	OnBudget func(r *replica.Replica, tokens int64)
	// MaxBudget bounds a reported budget, in tokens: a replica reporting
	// more is given MaxBudget, with a warning and OnBudgetClamped, so
	// that no replica can make its cache picture (memory in this
	// process) as large as it likes. Default DefaultMaxBudget.
	MaxBudget       int64
	OnBudgetClamped func(r *replica.Replica, reported, clamped int64)
	// OnEngineRestart is called once for each restart of a replica's
	// engine its scrapes show (its cache is empty): its
	// process_start_time_seconds changed, its cache config info (vLLM's
	// or SGLang's) changed, or its counters went back, or are gone from
	// its metrics (llm-d's simulator exports them from its first request
	// on). Restart says when it happened after and what showed it.
	OnEngineRestart func(r *replica.Replica, rs Restart)
	// OnRestart, if OnEngineRestart is nil, is called in its place.
	OnRestart func(r *replica.Replica)
	// OnChange is called when an active check changes a replica's state.
	OnChange func(r *replica.Replica, up bool)
	// OnAdapters is called with the LoRA adapters a replica's /v1/models
	// lists, each time they are read.
	OnAdapters func(r *replica.Replica, adapters []string)
	Logger     *slog.Logger
}

// Monitor runs active health checks and metric scrapes against a pool's
// replicas. Run it in one goroutine; it stops when its context ends.
type Monitor struct {
	pool *replica.Pool
	o    Options

	mu   sync.Mutex
	last map[*replica.Replica]engineSeen // what the scrapes saw of each engine, for restarts
	// refreshingAll and lastRefreshAll pace RefreshAllModels.
	refreshingAll  bool
	lastRefreshAll time.Time

	out sync.Map // probe → true while that read of that replica is out
}

// probe names one kind of read of one replica. At most one of each is out
// at a time: answers that landed out of order would set a replica's
// state back (a stale "no adapter running", a counter that went back and
// read as a restart that clears its cache picture). A tick that finds
// the last read still out skips it, as Prometheus skips a scrape.
type probe struct {
	r    *replica.Replica
	kind uint8 // probeCheck, probeScrape, probeModels
}

const (
	probeCheck uint8 = iota
	probeScrape
	probeModels
)

// claim marks the read kind of r out, or reports false when it already
// is; the caller releases it when the read ends.
func (m *Monitor) claim(r *replica.Replica, kind uint8) bool {
	_, busy := m.out.LoadOrStore(probe{r, kind}, true)
	return !busy
}

func (m *Monitor) release(r *replica.Replica, kind uint8) { m.out.Delete(probe{r, kind}) }

// New returns a monitor of p.
// Defaults of Options.
const (
	DefaultCheckInterval  = 2 * time.Second
	DefaultCheckTimeout   = time.Second
	DefaultFall           = 2
	DefaultRise           = 2
	DefaultScrapeInterval = 5 * time.Second
)

// DefaultMaxBudget is Options.MaxBudget's default: 8,388,608 (2^23)
// tokens, above the KV cache of one engine of the common models on the
// largest GPUs. Llama-3.1-70B (80 layers, 8 KV heads of 128: 160 KiB a
// token in fp8) on 8 × H200 (141 GB) holds about 5.7 M tokens;
// Llama-3.1-8B on one H200 about 0.9 M (1.7 M in fp8). A sub-billion
// model alone on such a GPU may hold more (Qwen2.5-0.5B, 12 KiB a token:
// about 10 M): raise cache.max_budget_tokens for it, as the warning says.
// A replica held to the bound has a picture that forgets blocks its engine
// still holds, which costs predicted hits, not correctness. At the bound,
// with blocks of 16 tokens, a picture holds 524,288 blocks, about 37 MB of
// this process's heap (four times that if the replica's reports shrink the
// token unit to its bound, routing/units.go).
const DefaultMaxBudget = 1 << 23

func New(p *replica.Pool, o Options) *Monitor {
	if o.Client == nil {
		o.Client = &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
	}
	o.CheckInterval = cmp.Or(max(o.CheckInterval, 0), DefaultCheckInterval)
	o.CheckTimeout = cmp.Or(max(o.CheckTimeout, 0), DefaultCheckTimeout)
	o.Fall = cmp.Or(max(o.Fall, 0), DefaultFall)
	o.Rise = cmp.Or(max(o.Rise, 0), DefaultRise)
	o.ScrapeInterval = cmp.Or(o.ScrapeInterval, DefaultScrapeInterval)
	o.MaxBudget = cmp.Or(max(o.MaxBudget, 0), DefaultMaxBudget)
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return &Monitor{pool: p, o: o, last: map[*replica.Replica]engineSeen{}}
}

// Run checks and scrapes until ctx ends, then waits for the requests in
// flight.
func (m *Monitor) Run(ctx context.Context) {
	check := time.NewTicker(m.o.CheckInterval)
	defer check.Stop()
	var scrape <-chan time.Time
	if m.o.ScrapeInterval > 0 {
		t := time.NewTicker(m.o.ScrapeInterval)
		defer t.Stop()
		scrape = t.C
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	each := func(f func(context.Context, *replica.Replica)) {
		for _, r := range m.pool.Replicas() {
			wg.Add(1)
			go func() { defer wg.Done(); f(ctx, r) }()
		}
	}
	each(m.Check)
	if scrape != nil {
		each(m.Scrape)
		each(m.RefreshModels)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-check.C:
			each(m.Check)
		case <-scrape:
			each(m.Scrape)
			each(m.RefreshModels)
		}
	}
}

// Check runs one active health check of r, unless the last one is still
// out. A replica that comes back up is scraped at once (when scrapes are
// on): it may be a new engine, whose restart its metrics show before any
// request reaches it.
func (m *Monitor) Check(ctx context.Context, r *replica.Replica) {
	if m.check(ctx, r) && m.o.ScrapeInterval > 0 {
		m.Scrape(ctx, r)
	}
}

// check is Check's health check; it reports whether r came back up.
func (m *Monitor) check(ctx context.Context, r *replica.Replica) bool {
	if !m.claim(r, probeCheck) {
		return false
	}
	defer m.release(r, probeCheck)
	ctx, cancel := context.WithTimeout(ctx, m.o.CheckTimeout)
	defer cancel()
	ok := false
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.URL.JoinPath("/health").String(), nil)
	if err == nil {
		if resp, err := m.o.Client.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
			ok = resp.StatusCode == http.StatusOK
		}
	}
	if ctx.Err() != nil && !ok && parentDone(ctx) {
		return false // shutting down: not the replica's fault
	}
	if !r.Checked(ok, m.o.Fall, m.o.Rise) {
		return false
	}
	m.o.Logger.Info("replica health changed", "replica", r.Name, "up", ok)
	if m.o.OnChange != nil {
		m.o.OnChange(r, ok)
	}
	return ok
}

func parentDone(ctx context.Context) bool {
	return ctx.Err() != nil && context.Cause(ctx) == context.Canceled
}

// vLLM's metric names, and the older name of the KV usage gauge.
const (
	metricRunning     = "vllm:num_requests_running"
	metricWaiting     = "vllm:num_requests_waiting"
	metricKVUsage     = "vllm:kv_cache_usage_perc"
	metricGPUKVUsage  = "vllm:gpu_cache_usage_perc"
	metricCacheConfig = "vllm:cache_config_info"
	metricQueries     = "vllm:prefix_cache_queries"
	metricPrompt      = "vllm:prompt_tokens"
	metricLoRA        = "vllm:lora_requests_info"
	// metricStart is the engine process's start, exported by Prometheus
	// clients' process collectors (vLLM's API server, through
	// prometheus_client, when it runs one process).
	metricStart = "process_start_time_seconds"
)

// SGLang's names for the same gauges (sglang/srt/metrics/collector.py),
// read when a replica exports no vLLM one: its running and queued
// requests, the fraction of its KV tokens in use, its cache's pages
// (sglang:cache_config_info{page_size, num_pages}; from v0.5.11 also
// sglang:max_total_num_tokens), and its prompt tokens, whose fall says it
// restarted.
const (
	sglangRunning     = "sglang:num_running_reqs"
	sglangWaiting     = "sglang:num_queue_reqs"
	sglangKVUsage     = "sglang:token_usage"
	sglangCacheConfig = "sglang:cache_config_info"
	sglangMaxTokens   = "sglang:max_total_num_tokens"
	sglangPrompt      = "sglang:prompt_tokens"
)

// Scrape reads r's /metrics once and records its load gauges; it may learn
// its budget and detect a restart. It does nothing while the last scrape
// of r is still out.
func (m *Monitor) Scrape(ctx context.Context, r *replica.Replica) {
	if !m.claim(r, probeScrape) {
		return
	}
	defer m.release(r, probeScrape)
	ctx, cancel := context.WithTimeout(ctx, m.o.CheckTimeout)
	defer cancel()
	sent := time.Now()
	body, ok := m.get(ctx, r, "/metrics", maxMetricsBytes)
	if !ok {
		return
	}
	defer body.Close()
	counted := &countingReader{r: body}
	engine := ""
	if dp := r.DataParallel; dp.On() {
		engine = strconv.Itoa(dp.Rank)
	}
	fams, err := ParseEngineMetrics(counted, engine)
	if err != nil {
		m.o.Logger.Warn("replica metrics unreadable", "replica", r.Name, "err", err)
		return
	}
	m.apply(r, fams, sent, counted.n < maxMetricsBytes)
}

// maxMetricsBytes bounds the /metrics read of a scrape: 8 MiB.
const maxMetricsBytes = 8 << 20

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// get sends GET path to r and returns the body of a 200 answer, read up to
// limit bytes; false when there is none (the caller keeps what it knew).
func (m *Monitor) get(ctx context.Context, r *replica.Replica, path string, limit int64) (io.ReadCloser, bool) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.URL.JoinPath(path).String(), nil)
	if err != nil {
		return nil, false
	}
	if m.o.Authorization != "" {
		req.Header.Set("Authorization", m.o.Authorization)
	}
	resp, err := m.o.Client.Do(req)
	if err != nil {
		return nil, false
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, false
	}
	return &limitedBody{io.LimitReader(resp.Body, limit), resp.Body}, true
}

// limitedBody reads a response body up to a limit; Close reads what is
// left of it (within the limit) so that the connection is kept for reuse.
type limitedBody struct {
	io.Reader
	body io.ReadCloser
}

func (b *limitedBody) Close() error {
	_, _ = io.Copy(io.Discard, b.Reader)
	return b.body.Close()
}

// Scraped are the values a scrape found; a missing metric is NaN-free zero
// with its Has flag false.
type Scraped struct {
	replica.Observed
	HasRunning, HasWaiting, HasKV bool
	// Blocks and BlockSize come from vllm:cache_config_info.
	Blocks, BlockSize int64
	// Counter is a monotonic counter (prefix-cache queries, else prompt
	// tokens) used to detect restarts; HasCounter says whether one was found.
	Counter    float64
	HasCounter bool
	// StartTime is the engine process's process_start_time_seconds; 0
	// when it exports none.
	StartTime float64
	// Config is a hash of every label of the engine's cache config info
	// (vllm:cache_config_info, else sglang:cache_config_info), set once
	// when the engine starts; 0 when it exports none.
	Config uint64
	// LoRA says vllm:lora_requests_info was found: its latest sample (the
	// largest value, a timestamp) gives the adapters running and waiting
	// and max_lora.
	LoRA                     bool
	LoRARunning, LoRAWaiting []string
	MaxLoRA                  int
}

// wanted are the metric families the router reads; a scrape parses only
// their lines.
var wanted = map[string]bool{
	metricRunning: true, metricWaiting: true, metricKVUsage: true, metricGPUKVUsage: true, metricCacheConfig: true,
	metricQueries: true, metricQueries + "_total": true, metricPrompt: true, metricPrompt + "_total": true,
	metricLoRA:    true,
	sglangRunning: true, sglangWaiting: true, sglangKVUsage: true, sglangCacheConfig: true, sglangMaxTokens: true,
	sglangPrompt: true, sglangPrompt + "_total": true,
	metricStart: true,
}

// maxMetricLine bounds one exposition line the router keeps: 64 KiB.
const maxMetricLine = 64 << 10

// filterMetrics returns the lines of rd that belong to the wanted families
// (samples, and their # HELP and # TYPE lines), at most maxMetricLine bytes
// each: whatever else a replica exports costs one linear scan, not a parse.
func filterMetrics(rd io.Reader) ([]byte, error) {
	var out []byte
	br := bufio.NewReaderSize(rd, 64<<10)
	for {
		line, err := br.ReadSlice('\n')
		long := errors.Is(err, bufio.ErrBufferFull)
		if long { // a line longer than the buffer: skip it whole
			for errors.Is(err, bufio.ErrBufferFull) {
				_, err = br.ReadSlice('\n')
			}
		} else if len(line) <= maxMetricLine && wanted[metricName(line)] {
			out = append(out, line...)
			if len(line) > 0 && line[len(line)-1] != '\n' {
				out = append(out, '\n')
			}
		}
		if err == io.EOF {
			return out, nil
		}
		if err != nil && !long {
			return out, err
		}
	}
}

// metricName returns the family a text exposition line is about: the name
// after "# HELP " or "# TYPE ", else the sample's name up to '{' or a space.
func metricName(line []byte) string {
	if rest, ok := bytes.CutPrefix(line, []byte("# HELP ")); ok {
		line = rest
	} else if rest, ok := bytes.CutPrefix(line, []byte("# TYPE ")); ok {
		line = rest
	} else if len(line) > 0 && line[0] == '#' {
		return ""
	}
	if i := bytes.IndexAny(line, "{ \t\n"); i >= 0 {
		line = line[:i]
	}
	return string(line)
}

// ParseMetrics parses a Prometheus text exposition into what the router
// reads from a vLLM replica. Only the families it reads are parsed; values
// that cannot be a replica's (negative, NaN, infinite) are left out.
func ParseMetrics(rd io.Reader) (Scraped, error) { return ParseEngineMetrics(rd, "") }

// ParseEngineMetrics is ParseMetrics of one data-parallel rank's engine:
// of the samples labelled engine (vLLM labels each rank's with its index),
// only those of engine are read; "" reads them all.
func ParseEngineMetrics(rd io.Reader, engine string) (Scraped, error) {
	var out Scraped
	kept, err := filterMetrics(rd)
	if err != nil {
		return out, fmt.Errorf("read metrics: %w", err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(kept))
	if err != nil {
		return out, fmt.Errorf("parse metrics: %w", err)
	}
	fs := families(fams)
	if engine != "" {
		fs.onlyEngine(engine)
	}
	fs.load(&out)
	fs.cacheConfig(&out)
	fs.lora(&out)
	fs.identity(&out)
	return out, nil
}

// families are the parsed families of one exposition, by name.
type families map[string]*dto.MetricFamily

// onlyEngine drops the samples labelled with an engine other than engine.
func (fs families) onlyEngine(engine string) {
	for _, f := range fs {
		f.Metric = slices.DeleteFunc(f.Metric, func(m *dto.Metric) bool {
			for _, l := range m.GetLabel() {
				if l.GetName() == "engine" {
					return l.GetValue() != engine
				}
			}
			return false
		})
	}
}

// sum adds up the samples of family name (or name_total), if they can be a
// replica's.
func (fs families) sum(name string) (float64, bool) {
	f, ok := fs[name]
	if !ok {
		f, ok = fs[name+"_total"]
	}
	if !ok || len(f.GetMetric()) == 0 {
		return 0, false
	}
	total := 0.0
	for _, mm := range f.GetMetric() {
		total += value(mm)
	}
	if math.IsNaN(total) || math.IsInf(total, 0) || total < 0 || total > 1e15 {
		return 0, false
	}
	return total, true
}

// either is vLLM's family's sum, else SGLang's.
func (fs families) either(vllm, sglang string) (float64, bool) {
	if v, ok := fs.sum(vllm); ok {
		return v, true
	}
	return fs.sum(sglang)
}

// load reads the load gauges: running, waiting, KV usage.
func (fs families) load(out *Scraped) {
	if v, ok := fs.either(metricRunning, sglangRunning); ok {
		out.Running, out.HasRunning = int64(v), true
	}
	if v, ok := fs.either(metricWaiting, sglangWaiting); ok {
		out.Waiting, out.HasWaiting = int64(v), true
	}
	if v, ok := fs.sum(metricKVUsage); ok {
		out.KVUsage, out.HasKV = min(v, 1), true
	} else if v, ok := fs.either(metricGPUKVUsage, sglangKVUsage); ok {
		out.KVUsage, out.HasKV = min(v, 1), true
	}
}

// cacheConfig reads the cache's blocks and their size.
func (fs families) cacheConfig(out *Scraped) {
	read := func(name, blocks, size string) {
		f, ok := fs[name]
		if !ok || len(f.GetMetric()) == 0 {
			return
		}
		for _, l := range f.GetMetric()[0].GetLabel() {
			v, _ := strconv.ParseInt(l.GetValue(), 10, 64)
			switch l.GetName() {
			case blocks:
				out.Blocks = max(v, 0)
			case size:
				out.BlockSize = max(v, 0)
			}
		}
	}
	read(metricCacheConfig, "num_gpu_blocks", "block_size")
	if out.Blocks == 0 {
		read(sglangCacheConfig, "num_pages", "page_size")
	}
	if v, ok := fs.sum(sglangMaxTokens); ok && out.Blocks == 0 && v >= 1 { // tokens: blocks of one
		out.Blocks, out.BlockSize = int64(v), 1
	}
}

// lora reads the latest sample of vllm:lora_requests_info.
func (fs families) lora(out *Scraped) {
	f, ok := fs[metricLoRA]
	if !ok || len(f.GetMetric()) == 0 {
		return
	}
	var latest *dto.Metric
	for _, mm := range f.GetMetric() {
		v := value(mm)
		if math.IsNaN(v) || math.IsInf(v, 0) {
			continue // not a time: it would never be passed
		}
		if latest == nil || v > value(latest) {
			latest = mm
		}
	}
	out.LoRA = latest != nil
	for _, l := range latest.GetLabel() { // nil-safe: none
		switch l.GetName() {
		case "running_lora_adapters":
			out.LoRARunning = adapterList(l.GetValue())
		case "waiting_lora_adapters":
			out.LoRAWaiting = adapterList(l.GetValue())
		case "max_lora":
			out.MaxLoRA, _ = strconv.Atoi(l.GetValue())
			out.MaxLoRA = max(out.MaxLoRA, 0)
		}
	}
}

// identity reads what tells one engine process from the next: its
// counter, its start time, its cache config info.
func (fs families) identity(out *Scraped) {
	if v, ok := fs.sum(metricQueries); ok {
		out.Counter, out.HasCounter = v, true
	} else if v, ok := fs.either(metricPrompt, sglangPrompt); ok {
		out.Counter, out.HasCounter = v, true
	}
	if f := fs[metricStart]; len(f.GetMetric()) > 0 {
		if v := value(f.GetMetric()[0]); v > 0 && !math.IsInf(v, 0) {
			out.StartTime = v
		}
	}
	out.Config = fs.labelsHash(metricCacheConfig)
	if out.Config == 0 {
		out.Config = fs.labelsHash(sglangCacheConfig)
	}
}

// labelsHash hashes every label of every sample of family name, in an
// order of their own; 0 when it has none.
func (fs families) labelsHash(name string) uint64 {
	f := fs[name]
	if len(f.GetMetric()) == 0 {
		return 0
	}
	samples := make([]string, 0, len(f.GetMetric()))
	for _, mm := range f.GetMetric() {
		labels := make([]string, 0, len(mm.GetLabel()))
		for _, l := range mm.GetLabel() {
			labels = append(labels, l.GetName()+"="+strconv.Quote(l.GetValue()))
		}
		slices.Sort(labels)
		samples = append(samples, strings.Join(labels, ","))
	}
	slices.Sort(samples)
	return max(xxhash.Sum64String(strings.Join(samples, "\n")), 1)
}

// maxAdapters bounds the adapters read from one label or one /v1/models.
const maxAdapters = 1024

// adapterList splits a comma-separated adapter list ("a,b", or "a, b" as
// the protocol's example writes it), at most maxAdapters names.
func adapterList(s string) []string {
	var out []string
	for _, a := range strings.Split(s, ",") {
		if a = strings.TrimSpace(a); a != "" && len(out) < maxAdapters {
			out = append(out, a)
		}
	}
	return out
}

func value(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	}
	return 0
}

// apply records what a scrape sent at sent found; whole says the body was
// read to its end (not cut at maxMetricsBytes).
func (m *Monitor) apply(r *replica.Replica, s Scraped, sent time.Time, whole bool) {
	r.Observe(s.Observed)
	if s.LoRA {
		r.SetLoRA(s.LoRARunning, s.LoRAWaiting, s.MaxLoRA)
	}
	m.learnBudget(r, s)
	m.noticeRestart(r, s, sent, whole)
}

// learnBudget sets the budget of a replica without one from its cache's
// size, bounded by MaxBudget.
func (m *Monitor) learnBudget(r *replica.Replica, s Scraped) {
	if r.Budget() != 0 || s.Blocks <= 0 || s.BlockSize <= 0 {
		return
	}
	budget := m.o.MaxBudget
	if s.Blocks <= m.o.MaxBudget/s.BlockSize {
		budget = s.Blocks * s.BlockSize
	} else {
		reported := int64(math.MaxInt64)
		if s.Blocks <= math.MaxInt64/s.BlockSize {
			reported = s.Blocks * s.BlockSize
		}
		m.o.Logger.Warn("replica reports a KV cache larger than cache.max_budget_tokens; its picture is held to that",
			"replica", r.Name, "reported_tokens", reported, "budget_tokens", budget)
		if m.o.OnBudgetClamped != nil {
			m.o.OnBudgetClamped(r, reported, budget)
		}
	}
	r.SetBudget(budget)
	if m.o.OnBudget != nil {
		m.o.OnBudget(r, budget)
	}
}

// Restart is a restart of a replica's engine that a scrape showed.
type Restart struct {
	// Since is when the last scrape that saw the engine before the
	// restart was sent: the restart happened after it.
	Since time.Time
	// Reason says what showed it.
	Reason string
}

// engineSeen is what the scrapes saw of a replica's engine that tells one
// engine process from the next; a zero field was not seen.
type engineSeen struct {
	at         time.Time // when the last scrape that told the engine apart was sent
	start      float64   // process_start_time_seconds
	config     uint64    // Scraped.Config
	counter    float64   // Scraped.Counter
	hasCounter bool
	restarts   uint64 // restarts seen
}

// noticeRestart compares what the scrape sent at sent saw of r's engine
// with what the scrapes before it saw, and reports a restart, once.
func (m *Monitor) noticeRestart(r *replica.Replica, s Scraped, sent time.Time, whole bool) {
	// A scrape of the engine's own gauges, read whole, without the
	// counter the last one had: the counter is gone, as a restarted
	// engine's that exports counters once they count something.
	engine := whole && (s.HasRunning || s.HasWaiting || s.HasKV)
	m.mu.Lock()
	prev := m.last[r]
	next, why := prev.after(s, sent, engine)
	m.last[r] = next
	m.mu.Unlock()
	if why == "" {
		return
	}
	m.o.Logger.Warn("replica's engine restarted, as its metrics show", "replica", r.Name, "reason", why)
	switch {
	case m.o.OnEngineRestart != nil:
		m.o.OnEngineRestart(r, Restart{Since: prev.at, Reason: "engine restarted: " + why})
	case m.o.OnRestart != nil:
		m.o.OnRestart(r)
	}
}

// after returns what is known of the engine after a scrape sent at sent
// that found s, and what shows a restart since e ("" when nothing does).
// engine says the scrape had the engine's own gauges and was read whole.
// A scrape without a field keeps what was known of it.
func (e engineSeen) after(s Scraped, sent time.Time, engine bool) (engineSeen, string) {
	why := restartReason(e, s, engine)
	if why != "" {
		e = engineSeen{restarts: e.restarts + 1}
	}
	if why != "" || e.at.IsZero() || s.StartTime > 0 || s.HasCounter {
		e.at = sent // this scrape would have shown a restart before it
	}
	if s.StartTime > 0 {
		e.start = s.StartTime
	}
	if s.Config != 0 {
		e.config = s.Config
	}
	if s.HasCounter {
		e.counter, e.hasCounter = s.Counter, true
	}
	return e, why
}

// restartReason says what shows the engine a scrape saw is not the one
// seen before (prev); "" when nothing does. engine says the scrape had the
// engine's own gauges and was read whole.
func restartReason(prev engineSeen, s Scraped, engine bool) string {
	switch {
	case prev.start > 0 && s.StartTime > 0 && s.StartTime != prev.start:
		return "its process_start_time_seconds changed"
	case prev.config != 0 && s.Config != 0 && s.Config != prev.config:
		return "its cache config info changed"
	case prev.hasCounter && s.HasCounter && s.Counter < prev.counter:
		return "its counters went back"
	case prev.hasCounter && !s.HasCounter && engine:
		return "its counters are gone"
	}
	return ""
}

// Restarts returns the restarts of r's engine its scrapes showed.
func (m *Monitor) Restarts(r *replica.Replica) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.last[r].restarts
}

// RefreshModels reads r's GET /v1/models once and records the models it
// serves, and which are LoRA adapters (an entry with a parent, as vLLM
// lists them). A replica that does not answer keeps what was known.
func (m *Monitor) RefreshModels(ctx context.Context, r *replica.Replica) {
	if !m.claim(r, probeModels) {
		return
	}
	defer m.release(r, probeModels)
	ctx, cancel := context.WithTimeout(ctx, m.o.CheckTimeout)
	defer cancel()
	body, ok := m.get(ctx, r, "/v1/models", 1<<20)
	if !ok {
		return
	}
	defer body.Close()
	served, adapters, err := ParseModels(body)
	if err != nil {
		m.o.Logger.Warn("replica models unreadable", "replica", r.Name, "err", err)
		return
	}
	r.SetServed(served, adapters)
	if m.o.OnAdapters != nil && len(adapters) > 0 {
		m.o.OnAdapters(r, adapters)
	}
}

// RefreshAllModels reads every replica's /v1/models now, and returns when
// all have answered or ctx ends: a request naming a model no replica lists
// may name an adapter loaded since the last scrape. At most one runs at a
// time, and not within minModelsRefresh of the last: a flood of unknown
// models costs the replicas one refresh a second, and a caller that finds
// one running or too recent returns at once.
func (m *Monitor) RefreshAllModels(ctx context.Context) {
	m.mu.Lock()
	if m.refreshingAll || time.Since(m.lastRefreshAll) < minModelsRefresh {
		m.mu.Unlock()
		return
	}
	m.refreshingAll = true
	m.mu.Unlock()
	var wg sync.WaitGroup
	for _, r := range m.pool.Replicas() {
		wg.Add(1)
		go func() { defer wg.Done(); m.RefreshModels(ctx, r) }()
	}
	wg.Wait()
	m.mu.Lock()
	m.refreshingAll, m.lastRefreshAll = false, time.Now()
	m.mu.Unlock()
}

// minModelsRefresh is the least time between two RefreshAllModels.
const minModelsRefresh = time.Second

// ParseModels reads an OpenAI model list ({"data":[{"id":…,"parent":…}]})
// as it streams: the ids, and the ids of the entries with a parent (vLLM's
// LoRA adapters). It reads at most maxAdapters entries, so a hostile list
// costs no more than that; a longer list, or one without "data", is an
// error: the models stay unknown (any request may go there) rather than
// become a wrong list.
func ParseModels(rd io.Reader) (served, adapters []string, err error) {
	dec := json.NewDecoder(rd)
	bad := func(what string) ([]string, []string, error) {
		return nil, nil, fmt.Errorf("read models: %s", what)
	}
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return bad("not a JSON object")
	}
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return bad(err.Error())
		}
		if key == "data" {
			served, adapters, err := readModelList(dec)
			if err != nil {
				return bad(err.Error())
			}
			return served, adapters, nil
		}
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return bad(err.Error())
		}
	}
	return bad(`no "data" list`)
}

// readModelList reads the list of "data" (ParseModels): the ids, and the
// ids of the entries with a parent.
func readModelList(dec *json.Decoder) (served, adapters []string, err error) {
	if t, err := dec.Token(); err != nil || t != json.Delim('[') {
		return nil, nil, errors.New(`"data" is not a list`)
	}
	served = []string{}
	for n := 0; dec.More() && n < maxAdapters; n++ {
		var d struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		}
		if err := dec.Decode(&d); err != nil {
			return nil, nil, err
		}
		if d.ID == "" {
			continue
		}
		served = append(served, d.ID)
		if d.Parent != nil && *d.Parent != "" {
			adapters = append(adapters, d.ID)
		}
	}
	if dec.More() {
		// Past the cap the list is not known whole: a model beyond it
		// would look unserved. The models stay unknown instead.
		return nil, nil, fmt.Errorf("more than %d models", maxAdapters)
	}
	return served, adapters, nil
}

// Forget drops what the monitor remembers of r (after it left the pool).
func (m *Monitor) Forget(r *replica.Replica) {
	m.mu.Lock()
	delete(m.last, r)
	m.mu.Unlock()
}
