package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/viper"
	"golang.org/x/net/netutil"
	"google.golang.org/grpc"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/semroute/semroute/agreement"
	"github.com/semroute/semroute/apikey"
	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cluster"
	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/eviction"
	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/internal/httpserve"
	"github.com/semroute/semroute/kubedisc"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/matcher"
	"github.com/semroute/semroute/monitor"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/router"
	"github.com/semroute/semroute/routing"
)

// app is a router built from a Config.
type app struct {
	agreement *agreement.Tracker // each replica's sources against its engine
	cfg       *configs.Config    // as built; see current for reloads
	log       *slog.Logger
	pic       *routing.Picture
	pool      *replica.Pool
	engine    *routing.Engine
	core      *router.Core
	server    *router.Server
	decisions *decisionlog.Writer // nil when off
	monitor   *monitor.Monitor
	events    *followers
	fleet     *cluster.Fleet // nil: a router alone
	reg       *prometheus.Registry
	reloads   *prometheus.CounterVec
	current   atomic.Pointer[configs.Config]
	ctx       context.Context // ends when the app stops
	stopCtx   context.CancelFunc
	// path is the config file to watch for reloads; empty: none.
	path string
	// viper returns the viper a reload loads path into: the one the
	// router started with, flags and all, less the file. Nil means
	// configs.NewViper.
	viper       func() *viper.Viper
	stopTracing func(context.Context) error
	// resolver overrides DNS for discovery (tests); nil: the system's.
	resolver replica.Resolver

	// members keeps the pool in step with its sources: the config file
	// (file), the admin API (admin) and DNS discovery; each changes only
	// the replicas it owns.
	members     *replica.Membership
	file, admin *replica.Static
	// pending lists the config keys changed in the file that take effect
	// only after a restart; nil when none.
	pending atomic.Pointer[[]string]
}

// newLogger builds the logger the config asks for, writing to w.
func newLogger(c configs.LogConfig, w io.Writer) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(c.Level)) // validated by configs
	o := &slog.HandlerOptions{Level: lvl}
	if c.Format == "json" {
		return slog.New(slog.NewJSONHandler(w, o))
	}
	return slog.New(slog.NewTextHandler(w, o))
}

// build turns a validated config into the router's parts.
func build(cfg *configs.Config, log *slog.Logger) (*app, error) {
	if err := cfg.CheckServable(); err != nil {
		return nil, err
	}
	specs := specsOf(cfg.Replicas)
	eng, arms, err := newEngine(cfg, specs, log)
	if err != nil {
		return nil, err
	}
	fleet, err := newFleet(cfg.Cluster, cfg.Health.Ejection(), eng, log)
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	ag := newAgreement(log)
	copts, dl, err := coreOptions(cfg, eng, arms, reg, ag, log)
	if err != nil {
		return nil, err
	}
	// The monitor is made below, once the app is: a request for a model no
	// replica lists has the replicas' lists read again first.
	var mon *monitor.Monitor
	copts.RefreshModels = func(ctx context.Context) {
		if mon != nil {
			mon.RefreshAllModels(ctx)
		}
	}
	if fleet != nil && cfg.Cache.ResponseChainsBytes >= 0 {
		copts.ShareChain = fleet.ShareChain
	}
	core, err := router.NewCore(copts)
	if err != nil {
		return nil, err
	}
	if copts.ShareChain != nil {
		fleet.OnChain(core.AddChain)
	}
	srv, keys, stopTracing, err := newServer(cfg, core, copts.Metrics, reg, fleet, log)
	if err != nil {
		return nil, err
	}
	pic, pool := eng.Picture(), eng.Pool()
	registerOps(reg, pool, pic, dl, core)
	reg.MustRegister(agreementMetrics{ag, pool})
	if fleet != nil {
		reg.MustRegister(fleetMetrics{fleet})
	}
	a := &app{agreement: ag, cfg: cfg, log: log, pic: pic, pool: pool, engine: eng, core: core, server: srv, decisions: dl, reg: reg, stopTracing: stopTracing, fleet: fleet,
		file: replica.NewStatic("config", specs), admin: replica.NewStatic("admin", nil)}
	a.current.Store(cfg)
	a.ctx, a.stopCtx = context.WithCancel(context.Background())
	if keys != nil {
		a.watchKeys(keys)
	}
	a.events = newFollowers(pic, eng, cmp.Or(cfg.Tokenizer.BlockTokens, 16), precise(cfg.Tokenizer), log)
	reg.MustRegister(a.events)
	if err := a.joinReplicas(copts.Metrics); err != nil {
		return nil, err
	}
	a.reloads = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_config_reloads_total",
		Help: "Config reloads by result: ok, restart_required (applied, but some changed keys take effect only after a restart), failed."}, []string{"result"})
	reg.MustRegister(a.reloads)
	for _, r := range []string{"ok", "restart_required", "failed"} {
		a.reloads.WithLabelValues(r) // 0 from the first scrape: an alert on the first failure has a series to rise from
	}
	a.monitor = a.newMonitor()
	mon = a.monitor
	reg.MustRegister(restartCollector{pool, a.monitor, a.events})
	return a, nil
}

// newEngine builds the routing engine of cfg (its eviction policy, the
// semantic matcher when it or a donor engine needs one, its weights) over
// the replicas specs, and the A/B arms that route with it.
func newEngine(cfg *configs.Config, specs []replica.Spec, log *slog.Logger) (*routing.Engine, []router.Arm, error) {
	evict, err := eviction.New(cfg.Cache.Eviction)
	if err != nil {
		return nil, nil, fmt.Errorf("config: cache.eviction: %w", err)
	}
	mt, err := matcherFor(cfg.Routing.Matcher, specs)
	if err != nil {
		return nil, nil, err
	}
	arms, err := armsFor(cfg)
	if err != nil {
		return nil, nil, err
	}
	eng, err := routing.New(routing.Options{
		LoadHalfLife: cfg.Routing.LoadHalfLife, Eviction: evict,
		DefaultBudget: cmp.Or(cfg.Cache.DefaultBudgetTokens, configs.DefaultBudgetTokens),
		OnDefaultBudget: func(name string, tokens int64) {
			log.Info("replica budget unknown: assuming cache.default_budget_tokens until it reports vllm:cache_config_info",
				"replica", name, "budget_tokens", tokens)
		},
		Split:    cfg.Blocks.Options(),
		Blending: slices.ContainsFunc(specs, func(sp replica.Spec) bool { return sp.Reuse.Blend() }),
		Engine: routing.EngineOptions{Weights: cfg.Routing.Weights(), Attempts: cfg.Routing.Attempts,
			SharedActive: cfg.Routing.SharedActive, Matcher: mt, PreferDonor: cfg.Routing.Matcher.Enabled,
			PreferSimilarity: cfg.Routing.Matcher.MinSimilarity,
			MatcherThreshold: cfg.Routing.Matcher.Threshold},
	})
	if err != nil {
		return nil, nil, fmt.Errorf("config: %w", err)
	}
	return eng, arms, nil
}

// matcherFor returns the semantic matcher the config's matcher section
// and the donor engines among specs need, nil when none does. Its donor
// index keeps what the least demanding use of it takes: each donor
// engine's own threshold is applied when it is credited.
func matcherFor(mc configs.MatcherConfig, specs []replica.Spec) (routing.Matcher, error) {
	var sims []float64
	if mc.Enabled {
		sims = append(sims, mc.MinSimilarity)
	}
	for _, sp := range specs {
		if sp.Reuse.Donor() {
			sims = append(sims, sp.Reuse.Similarity())
		}
	}
	if len(sims) == 0 {
		return nil, nil
	}
	mt, err := matcher.New(matcher.Options{MinSimilarity: slices.Min(sims), MaxDonors: mc.MaxDonors})
	if err != nil {
		return nil, fmt.Errorf("config: routing.semantic_matcher: %w", err)
	}
	return mt, nil
}

// coreOptions returns the Core's options for cfg, but for RefreshModels,
// and the decision log it opened (nil when off): the request metrics in
// reg, flow control, and in precise mode the tokenizer, whose calls ag
// judges.
func coreOptions(cfg *configs.Config, eng *routing.Engine, arms []router.Arm, reg *prometheus.Registry, ag *agreement.Tracker, log *slog.Logger) (router.CoreOptions, *decisionlog.Writer, error) {
	copts := router.CoreOptions{Engine: eng, Arms: arms, Salt: cfg.Routing.ArmSalt,
		RawIDs: cfg.DecisionLog.RawIDs, LogPrompts: cfg.DecisionLog.LogPrompts, Feedback: cfg.Cache.Feedback,
		Unreleased: limits.Unreleased{Max: cfg.GRPC.MaxUnreleasedDecisions, MaxBlocks: cfg.GRPC.MaxUnreleasedBlocks, ReleaseAfter: cfg.Routing.ReleaseAfter},
		PD:         router.PDOptions{MinPrefillTokens: cfg.Disaggregation.MinPrefillTokens},
		// With API keys the tenant is proven: a stored response's id the
		// router cannot prove is the caller's is refused.
		StrictResponses: cfg.Auth.APIKeysFile != "", ChainBytes: cfg.Cache.ResponseChainsBytes, Agreement: ag, TTFTTargets: cfg.FlowControl.TTFTTargets}
	var dl *decisionlog.Writer
	if d := cfg.DecisionLog; d.Path != "" {
		var err error
		dl, err = decisionlog.Open(decisionlog.Options{Path: d.Path, MaxBytes: d.MaxBytes, MaxFiles: d.MaxFiles, Buffer: d.Buffer, FsyncInterval: d.FsyncInterval, Logger: log})
		if err != nil {
			return copts, nil, fmt.Errorf("config: decision_log: %w", err)
		}
		copts.Log = dl
	}
	var err error
	if copts.Metrics, err = router.NewMetrics(reg); err != nil {
		return copts, nil, err
	}
	copts.Metrics.LabelTenants(cfg.Metrics.TenantLabels)
	if f := cfg.FlowControl; f.Enabled {
		copts.Flow = &flow.Options[*replica.Replica]{MaxRequests: f.MaxRequests, MaxBytes: f.MaxBytes, TTL: f.TTL, LookAhead: f.LookAhead, AgeBound: f.AgeBound}
		copts.Reserve = f.Reserve
	}
	if precise(cfg.Tokenizer) {
		tok, err := tokenizerFor(cfg.Tokenizer.URL, cfg.Tokenizer.Timeout, cfg.Tokenizer.CacheTokens, eng.Pool(), ag)
		if err != nil {
			return copts, nil, fmt.Errorf("config: tokenizer: %w", err)
		}
		copts.Tokenizer, copts.BlockTokens = tok, cmp.Or(cfg.Tokenizer.BlockTokens, 16)
	}
	return copts, dl, nil
}

// precise reports whether the router is in precise mode: the engine's
// token ids from a replica's /tokenize, not estimated tokens.
func precise(c configs.TokenizerConfig) bool { return c.Mode != "estimate" }

// newServer builds the HTTP front door of core for cfg: its tracer (and
// what stops it), its API keys (nil without auth.api_keys_file), limits,
// timeouts and metrics (m in reg), ready once the fleet's warm start is
// done.
func newServer(cfg *configs.Config, core *router.Core, m *router.Metrics, reg *prometheus.Registry, fleet *cluster.Fleet, log *slog.Logger) (*router.Server, *apikey.Set, func(context.Context) error, error) {
	tracer, stopTracing, err := newTracer(cfg.Tracing)
	if err != nil {
		return nil, nil, nil, err
	}
	var keys *apikey.Set
	if f := cfg.Auth.APIKeysFile; f != "" {
		if keys, err = apikey.Load(f); err != nil {
			return nil, nil, nil, err
		}
	}
	srv, err := router.NewServer(router.ServerOptions{
		Keys: keys, UpstreamAPIKey: cfg.Auth.UpstreamAPIKey,
		Tracer: tracer,
		Core:   core, Limits: limitsOf(cfg.Limits),
		RecordReplies: cfg.Routing.RecordReplies, Logger: log,
		Ejection: cfg.Health.Ejection(),
		Timeouts: limits.Timeouts{Connect: cfg.Timeouts.Connect, FirstByte: cfg.Timeouts.FirstByte, Idle: cfg.Timeouts.Idle,
			PrefillFloor: cfg.Timeouts.PrefillFloor, PrefillTokensPerSecond: cfg.Timeouts.PrefillTokensPerSecond,
			ClientWrite: cfg.Timeouts.ClientWrite},
		Metrics:    mainMetrics(cfg.Metrics, reg),
		Ready:      fleetReady(fleet),
		Priorities: cfg.FlowControl.Priorities,
	})
	if err != nil {
		return nil, nil, nil, err
	}
	return srv, keys, stopTracing, nil
}

// watchKeys follows the API keys file while the app runs, logging each
// reload and each refusal (no key is then accepted).
func (a *app) watchKeys(keys *apikey.Set) {
	path := a.cfg.Auth.APIKeysFile
	go keys.Watch(a.ctx, keysReload,
		func() { a.log.Info("API keys reloaded", "path", path, "tenants", len(keys.Tenants())) },
		func(err error) {
			a.log.Error("API keys file refused: no key is accepted until it is valid again", "path", path, "err", err)
		})
}

// joinReplicas makes the membership that keeps the pool in step with its
// sources, each replica added to the engine, its KV events followed and
// its metrics (m) made, and adds the config file's replicas. On failure it
// stops what the app started.
func (a *app) joinReplicas(m *router.Metrics) error {
	a.members = replica.NewMembership(a.pool, replica.MembershipOptions{
		Add: func(s replica.Spec) (*replica.Replica, error) {
			r, err := a.engine.AddReplica(s)
			if err == nil {
				a.events.add(r, s)
				m.Replica(r.Name)
			}
			return r, err
		},
		Retire: a.retire, Precedence: []string{"config", "admin", "dns", "kubernetes"}, Context: a.ctx, Logger: a.log,
	})
	if err := a.members.Reconcile(a.ctx, a.file); err != nil {
		a.stopCtx()
		a.events.close()
		return fmt.Errorf("config: replicas: %w", err)
	}
	return nil
}

// newMonitor returns the health checks and scrapes of the pool's replicas
// the config asks for: each budget a replica reports set in the picture
// (held to cache.max_budget_tokens, the clamps counted in a.reg), engine
// restarts clearing its picture, its LoRA adapters keyed as its engine
// keys them.
func (a *app) newMonitor() *monitor.Monitor {
	cfg, eng := a.cfg, a.engine
	h := cfg.Health
	clamped := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_replica_budget_clamped_total",
		Help: "Budgets a replica reported (vllm:cache_config_info) above cache.max_budget_tokens, held to it."}, []string{"replica"})
	a.reg.MustRegister(clamped)
	return monitor.New(a.pool, monitor.Options{
		MaxBudget:       cfg.Cache.MaxBudgetTokens,
		Authorization:   bearerValue(cfg.Auth.UpstreamAPIKey),
		OnBudgetClamped: func(r *replica.Replica, _, _ int64) { clamped.WithLabelValues(r.Name).Inc() },
		CheckInterval:   h.CheckInterval, CheckTimeout: h.CheckTimeout, Fall: h.Fall, Rise: h.Rise,
		ScrapeInterval: scrapeInterval(h.ScrapeInterval), Logger: a.log,
		OnBudget: func(r *replica.Replica, tokens int64) {
			clamped.WithLabelValues(r.Name) // 0 until it reports too much
			eng.Picture().SetBudget(r.ID, tokens)
		},
		OnEngineRestart: a.events.engineRestarted, // clears a replica's picture once a restart, whichever sees it first
		OnAdapters: func(_ *replica.Replica, adapters []string) {
			for _, a := range adapters {
				eng.NoteAdapter(a) // precise mode keys an adapter's blocks as its engine does
			}
		},
	})
}

// scrapeInterval maps the config's 0 (off) to the monitor's negative.
func scrapeInterval(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// limitsOf turns the limits section into the front end's limits.
func limitsOf(l configs.LimitsConfig) limits.Request {
	return limits.Request{MaxBodyBytes: l.MaxBodyBytes, MaxBodyBytesInFlight: l.MaxBodyBytesInFlight,
		MaxHeaderBytes: l.MaxHeaderBytes, MaxOutputTokens: l.MaxOutputTokens,
		Parse: blockhash.Limits{MaxMessages: l.MaxMessages, MaxDepth: l.MaxJSONDepth, MaxValues: l.MaxJSONValues,
			Budget: blockhash.NewBudget(l.MaxJSONValuesInFlight)}}
}

// specsOf returns the pool specs of the config's replicas.
func specsOf(rs []configs.Replica) []replica.Spec {
	specs := make([]replica.Spec, len(rs))
	for i, r := range rs {
		specs[i] = r.Spec()
	}
	return specs
}

// retire drops a removed replica's cache picture once nothing is in flight
// on it, so that a later replica reusing its id starts clean.
func (a *app) retire(r *replica.Replica) {
	a.events.remove(r.ID)
	a.engine.DropPicture(r.ID)
	a.monitor.Forget(r)
	a.agreement.Forget(r.Name)
}

// drainReplica stops new traffic to a replica and keeps it listed; with
// drain false it lets traffic back. The state follows the replica's name
// until changed here: across reloads, replacements and hand-overs between
// the file and the admin API.
func (a *app) drainReplica(name string, drain bool) error {
	return a.members.SetDraining(name, drain)
}

// grpcMaxConns bounds the gRPC listener's open connections.
const grpcMaxConns = 256

// running is an app serving HTTP, and gRPC when configured.
// mainMetrics returns the handler of GET /metrics on the main listener,
// nil when the metrics are served on the admin listener alone.
func mainMetrics(c configs.MetricsConfig, reg *prometheus.Registry) http.Handler {
	if c.Listener == "admin" {
		return nil
	}
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

type running struct {
	app     *app
	http    *httpserve.Server
	admin   *httpserve.Server // nil when off
	grpc    *grpc.Server
	grpcLn  net.Listener
	cancel  context.CancelFunc
	wg      *sync.WaitGroup // background loops
	once    sync.Once
	stopErr error
}

// start serves the app on its configured addresses.
func (a *app) start() (*running, error) {
	r := &running{app: a}
	var err error
	if a.fleet != nil { // before serving: /readyz waits for its warm start
		if err := a.fleet.Start(a.ctx); err != nil {
			return nil, err
		}
	}
	if r.http, err = httpserve.Serve(a.cfg.Listen, a.server, a.log); err != nil {
		return nil, err
	}
	if a.cfg.GRPCListen != "" {
		ln, err := net.Listen("tcp", a.cfg.GRPCListen)
		if err != nil {
			_ = r.http.Stop(time.Second)
			return nil, fmt.Errorf("listen %s: %w", a.cfg.GRPCListen, err)
		}
		// At most grpcMaxConns connections at once: more wait to be
		// accepted, so idle or handshaking connections cannot take every
		// file descriptor.
		r.grpcLn = netutil.LimitListener(ln, grpcMaxConns)
		creds, err := grpcCreds(a.cfg.GRPC)
		if err != nil {
			_ = r.http.Stop(time.Second)
			_ = r.grpcLn.Close()
			return nil, err
		}
		r.grpc = router.NewGRPCServer(a.core, router.GRPCOptions{
			Limits:      a.server.CurrentLimits,
			Token:       func() string { return a.current.Load().GRPC.Token },
			ExtProcOpen: func() bool { return a.current.Load().GRPC.ExtProcWithoutToken },
			ExtProc: router.ExtProcOptions{RecordReplies: a.cfg.Routing.RecordReplies, Logger: a.log, Priorities: a.cfg.FlowControl.Priorities,
				Timeouts: limits.Timeouts{FirstByte: a.cfg.Timeouts.FirstByte, Idle: a.cfg.Timeouts.Idle},
				Budget:   router.NewBodyBudget(a.cfg.GRPC.ExtProcMaxBufferedBytes)},
		}, grpc.MaxRecvMsgSize(int(a.cfg.Limits.MaxBodyBytes)), creds)
		go func() { _ = r.grpc.Serve(r.grpcLn) }()
	}
	ctx, cancel := context.WithCancel(a.ctx)
	r.cancel = cancel

	var wg sync.WaitGroup
	r.wg = &wg
	wg.Add(3)
	go func() { defer wg.Done(); a.core.Run(ctx, time.Second) }()
	go func() { defer wg.Done(); a.monitor.Run(ctx) }()
	go func() { defer wg.Done(); a.judgeEvents(ctx, 5*time.Second) }()
	if c := a.cfg.Admin; c.Listen != "" && c.Token != "" {
		if r.admin, err = httpserve.Serve(c.Listen, a.adminHandler(), a.log); err != nil {
			cancel()
			_ = r.http.Stop(time.Second)
			return nil, err
		}
	}
	if d := a.cfg.Discovery; d.DNSName != "" {
		dns := replica.NewDNS(replica.DNSOptions{
			Name: d.DNSName, SRV: d.SRV, Port: d.Port, Scheme: d.Scheme, BudgetTokens: d.BudgetTokens, Resolver: a.resolver,
		})
		wg.Add(1)
		go func() { defer wg.Done(); a.members.Watch(ctx, discoveredOf(dns, d), d.Interval) }()
	}
	if d := a.cfg.Discovery; d.Kubernetes.On() {
		src, err := a.kubernetes(ctx, d)
		if err != nil {
			cancel()
			_ = r.http.Stop(time.Second)
			return nil, err
		}
		wg.Add(1)
		go func() { defer wg.Done(); a.members.Watch(ctx, discoveredOf(src, d), kubeInterval) }()
	}
	if a.path != "" {
		w, err := a.watch(ctx)
		if err != nil {
			cancel()
			_ = r.http.Stop(time.Second)
			return nil, err
		}
		wg.Add(1)
		go func() { defer wg.Done(); w() }()
	}
	return r, nil
}

// grpcAddr returns the gRPC listener's address, or "".
func (r *running) grpcAddr() string {
	if r.grpcLn == nil {
		return ""
	}
	return r.grpcLn.Addr().String()
}

// stop shuts down gracefully: HTTP and gRPC stop accepting and finish what
// is in flight (up to grace), then the decision log is flushed and closed.
// It is safe to call more than once.
func (r *running) stop(grace time.Duration) error {
	r.once.Do(func() { r.stopErr = r.shutdown(grace) })
	return r.stopErr
}

func (r *running) shutdown(grace time.Duration) error {
	var errs []error
	errs = append(errs, r.http.Stop(grace))
	if r.grpc != nil {
		done := make(chan struct{})
		go func() { r.grpc.GracefulStop(); close(done) }()
		select {
		case <-done:
		case <-time.After(grace):
			r.grpc.Stop()
		}
	}
	if r.admin != nil {
		errs = append(errs, r.admin.Stop(grace))
	}
	if r.app.fleet != nil {
		r.app.fleet.Close() // after the requests in flight ended: their ends reach the peers
	}
	r.cancel()
	r.app.stopCtx()
	r.wg.Wait()
	r.app.events.close()
	if t, ok := http.DefaultTransport.(*http.Transport); ok {
		t.CloseIdleConnections()
	}
	r.app.server.CloseIdleConnections()
	if r.app.decisions != nil {
		errs = append(errs, r.app.decisions.Close())
	}
	tctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	errs = append(errs, r.app.stopTracing(tctx))
	return errors.Join(errs...)
}

// armsFor builds the A/B arms of cfg: its arms, or one arm, "default",
// running routing.policy.
func armsFor(cfg *configs.Config) ([]router.Arm, error) {
	if len(cfg.Routing.Arms) == 0 {
		pol, err := routing.NewSeededPolicy(cfg.Routing.PolicySpec(), cfg.Routing.Seed)
		if err != nil {
			return nil, fmt.Errorf("config: routing: %w", err)
		}
		return []router.Arm{{Name: "default", Policy: pol, Weight: 1}}, nil
	}
	var arms []router.Arm
	for i, a := range cfg.Routing.Arms {
		ap, err := routing.NewSeededPolicy(cfg.Routing.ArmSpec(i), cfg.Routing.Seed)
		if err != nil {
			return nil, fmt.Errorf("config: routing.arms[%d]: %w", i, err)
		}
		arms = append(arms, router.Arm{Name: a.Name, Policy: ap, Weight: a.Weight})
	}
	return arms, nil
}

// keysReload is how often the API keys file is read again for changes (a
// mounted Secret changes in place).
const keysReload = 2 * time.Second

// bearerValue returns the Authorization header value of key, "" for none.
func bearerValue(key string) string {
	if key == "" {
		return ""
	}
	return "Bearer " + key
}

// kubeInterval is how often the Kubernetes source's informer caches are
// read for changes (the informers follow the API server's watch).
const kubeInterval = time.Second

// kubernetes starts discovery through the Kubernetes API, in-cluster (the
// pod's service account) or, outside, from $KUBECONFIG.
func (a *app) kubernetes(ctx context.Context, d configs.DiscoveryConfig) (*kubedisc.Source, error) {
	k := d.Kubernetes
	rc, err := rest.InClusterConfig()
	if err != nil {
		if rc, err = clientcmd.BuildConfigFromFlags("", os.Getenv("KUBECONFIG")); err != nil {
			return nil, fmt.Errorf("discovery.kubernetes: no cluster config (in a pod, or $KUBECONFIG): %w", err)
		}
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("discovery.kubernetes: %w", err)
	}
	dc, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("discovery.kubernetes: %w", err)
	}
	ns := k.Namespace
	if ns == "" {
		b, err := os.ReadFile("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
		if err != nil {
			return nil, errors.New("discovery.kubernetes.namespace: not set, and not running in a pod")
		}
		ns = strings.TrimSpace(string(b))
	}
	pool := kubedisc.InferencePool
	if k.PoolAPI == "v1alpha2" {
		pool = kubedisc.InferencePoolAlpha
	}
	src, err := kubedisc.Start(ctx, kubedisc.Options{Client: cs, Dynamic: dc, Namespace: ns, Service: k.Service, PortName: k.PortName,
		Selector: k.Selector, InferencePool: k.InferencePool, PoolVersion: pool, Port: d.Port, Scheme: d.Scheme, BudgetTokens: d.BudgetTokens,
		MaxReplicas: k.MaxReplicas, TrustedManagers: k.TrustedManagers, Logger: a.log})
	if err != nil {
		return nil, fmt.Errorf("discovery.kubernetes: %w", err)
	}
	a.log.Info("discovering replicas through the Kubernetes API", "namespace", ns, "service", k.Service, "selector", k.Selector, "inference_pool", k.InferencePool)
	return src, nil
}
