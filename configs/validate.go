package configs

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/eviction"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// FieldError is a validation error naming the offending field.
type FieldError struct {
	Field string
	Msg   string
}

func (e *FieldError) Error() string { return "config: " + e.Field + ": " + e.Msg }

// problems collects the FieldErrors of a validation.
type problems []error

func (p *problems) bad(field, format string, args ...any) {
	*p = append(*p, &FieldError{Field: field, Msg: fmt.Sprintf(format, args...)})
}

// hostPort checks an address field, when set or required.
func (p *problems) hostPort(field, addr string, required bool) {
	if addr == "" && !required {
		return
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		p.bad(field, "%q is not host:port", addr)
	}
}

// uniqueNames returns a check that the i-th entry of list has a name and
// that no earlier entry had the same one; what is the noun in the message.
func (p *problems) uniqueNames(list, what string) func(i int, name string) {
	seen := map[string]bool{}
	return func(i int, name string) {
		f := fmt.Sprintf("%s[%d].name", list, i)
		switch {
		case name == "":
			p.bad(f, "is required")
		case seen[name]:
			p.bad(f, "duplicate %s %q", what, name)
		}
		seen[name] = true
	}
}

// Validate checks every field, returning all the errors joined: one method
// per section, each naming the fields it refuses.
func (c *Config) Validate() error {
	var p problems
	p.hostPort("listen", c.Listen, true)
	c.validateGRPC(&p)
	c.DecisionLog.validate(&p)
	c.Log.validate(&p)
	c.Routing.validate(&p)
	c.Blocks.validate(&p)
	c.Cache.validate(&p)
	c.FlowControl.validate(&p)
	c.Tokenizer.validate(&p)
	c.Limits.validate(&p)
	c.Health.validate(&p)
	c.Timeouts.validate(&p)
	c.Tracing.validate(&p)
	c.Discovery.validate(&p)
	if c.Discovery.Kubernetes.MaxReplicas < 0 {
		p.bad("discovery.kubernetes.max_replicas", "must not be negative")
	}
	c.Runtime.validate(&p)
	c.Cluster.validate(&p)
	p.hostPort("admin.listen", c.Admin.Listen, false)
	c.validateMetrics(&p)
	c.validateReplicas(&p)
	return errors.Join(p...)
}

func (c *Config) validateMetrics(p *problems) {
	switch c.Metrics.Listener {
	case "main":
	case "admin":
		if c.Admin.Listen == "" || c.Admin.Token == "" {
			p.bad("metrics.listener", "admin needs admin.listen and admin.token: the metrics would be served nowhere")
		}
	default:
		p.bad("metrics.listener", "%q is not main or admin", c.Metrics.Listener)
	}
	switch c.Metrics.TenantLabels {
	case "hash", "name", "omit":
	default:
		p.bad("metrics.tenant_labels", "%q is not hash, name or omit", c.Metrics.TenantLabels)
	}
}

func (c *Config) validateGRPC(p *problems) {
	g := c.GRPC
	p.hostPort("grpc_listen", c.GRPCListen, false)
	if c.GRPCListen != "" && g.Token == "" && g.TLSClientCAFile == "" {
		p.bad("grpc.token", "is required with grpc_listen (or grpc.tls_client_ca_file for mTLS): the gRPC API is not served unauthenticated")
	}
	if (g.TLSCertFile == "") != (g.TLSKeyFile == "") || (g.TLSClientCAFile != "" && g.TLSCertFile == "") {
		p.bad("grpc.tls_cert_file", "tls_cert_file and tls_key_file go together, and tls_client_ca_file needs them")
	}
	if g.MaxUnreleasedDecisions < 1 || g.MaxUnreleasedBlocks < 1 {
		p.bad("grpc.max_unreleased_decisions", "max_unreleased_decisions and max_unreleased_blocks must be positive")
	}
	if g.ExtProcMaxBufferedBytes < c.Limits.MaxBodyBytes {
		p.bad("grpc.ext_proc_max_buffered_bytes", "must be at least limits.max_body_bytes, or the largest bodies are never taken")
	}
}

func (d DecisionLogConfig) validate(p *problems) {
	if d.MaxBytes < 1024 || d.MaxFiles < 1 || d.Buffer < 1 || d.FsyncInterval <= 0 {
		p.bad("decision_log", "max_bytes must be at least 1024, max_files and buffer positive, fsync_interval positive")
	}
}

func (l LogConfig) validate(p *problems) {
	switch l.Level {
	case "debug", "info", "warn", "error":
	default:
		p.bad("log.level", "%q is not one of debug, info, warn, error", l.Level)
	}
	if l.Format != "text" && l.Format != "json" {
		p.bad("log.format", "%q is not text or json", l.Format)
	}
}

func (r RoutingConfig) validate(p *problems) {
	if _, err := routing.NewPolicy(r.PolicySpec()); err != nil {
		p.bad("routing.policy", "%v", err)
	}
	r.validatePolicyKeys(p)
	if r.Attempts < 1 || r.Attempts > 16 {
		p.bad("routing.attempts", "%d is not in [1, 16]", r.Attempts)
	}
	r.Matcher.validate(p)
	if r.ReleaseAfter <= 0 {
		p.bad("routing.release_after", "must be positive")
	}
	r.validateArms(p)
	r.validateKindWeights(p)
}

// validatePolicyKeys checks the semantic policy's parameters by their
// older keys.
func (r RoutingConfig) validatePolicyKeys(p *problems) {
	if r.LoadWeight < 0 {
		p.bad("routing.load_weight", "must not be negative")
	}
	if r.RecentWeight < 0 {
		p.bad("routing.recent_weight", "must not be negative")
	}
	if r.SpillFactor < 1 {
		p.bad("routing.spill_factor", "must be at least 1")
	}
	if r.SpillMarginTokens < 0 {
		p.bad("routing.spill_margin_tokens", "must not be negative")
	}
	if r.LoadHalfLife < 0 {
		p.bad("routing.load_half_life", "must not be negative")
	}
}

func (m MatcherConfig) validate(p *problems) {
	if !(m.Threshold >= 0 && m.Threshold <= 1) || !(m.MinSimilarity >= 0 && m.MinSimilarity <= 1) || m.MaxDonors < 1 {
		p.bad("routing.semantic_matcher", "threshold and min_similarity must be in [0, 1] and max_donors positive")
	}
}

func (r RoutingConfig) validateArms(p *problems) {
	arms := p.uniqueNames("routing.arms", "arm")
	for i, a := range r.Arms {
		f := fmt.Sprintf("routing.arms[%d]", i)
		arms(i, a.Name)
		if _, err := routing.NewPolicy(r.ArmSpec(i)); err != nil {
			p.bad(f+".policy", "%v", err)
		}
		if a.Weight <= 0 {
			p.bad(f+".weight", "must be positive")
		}
	}
}

func (r RoutingConfig) validateKindWeights(p *problems) {
	for k, w := range r.KindWeights {
		if _, err := blockhash.ParseKind(k); err != nil {
			p.bad("routing.kind_weights."+k, "unknown kind")
		} else if w < 0 {
			p.bad("routing.kind_weights."+k, "must not be negative")
		}
	}
}

// Weights returns the kind weights: routing's defaults with the config's
// on top. Validate has checked every kind.
func (r RoutingConfig) Weights() *cachemodel.Weights {
	w := routing.DefaultWeights()
	for name, v := range r.KindWeights {
		if k, err := blockhash.ParseKind(name); err == nil {
			w[k] = v
		}
	}
	return w
}

func (b BlocksConfig) validate(p *problems) {
	if _, err := blockhash.NewSplitter(b.Options()); err != nil || b.BlockTokens == 0 || b.BytesPerToken == 0 {
		p.bad("blocks", "block_tokens must be in [1, 1048576] and bytes_per_token in [1, 64]")
	}
}

// Options returns the splitter's options.
func (b BlocksConfig) Options() blockhash.Options {
	return blockhash.Options{BlockTokens: b.BlockTokens, BytesPerToken: b.BytesPerToken}
}

func (c CacheConfig) validate(p *problems) {
	if _, err := eviction.New(c.Eviction); err != nil {
		p.bad("cache.eviction", "%v", err)
	}
	if c.MaxBudgetTokens < 0 || c.MaxBudgetTokens > 1<<40 {
		p.bad("cache.max_budget_tokens", "%d is not in [0, 2^40] (0 means the built-in 8,388,608)", c.MaxBudgetTokens)
	}
	if c.DefaultBudgetTokens < 0 {
		p.bad("cache.default_budget_tokens", "must not be negative (0 means the built-in %d)", DefaultBudgetTokens)
	}
	if c.ResponseChainsBytes < -1 {
		p.bad("cache.response_chains_bytes", "%d is below -1 (0 means 64 MiB, -1 none)", c.ResponseChainsBytes)
	}
}

func (t TokenizerConfig) validate(p *problems) {
	switch t.Mode {
	case "", "auto", "estimate", "replica":
	default:
		p.bad("tokenizer.mode", "%q is not auto, replica or estimate", t.Mode)
	}
	if t.BlockTokens < 0 || t.BlockTokens > 4096 {
		p.bad("tokenizer.block_tokens", "%d is not in [1, 4096]", t.BlockTokens)
	}
	if t.Timeout < 0 {
		p.bad("tokenizer.timeout", "must not be negative")
	}
	if t.CacheTokens < 0 {
		p.bad("tokenizer.cache_tokens", "must not be negative")
	}
	if t.URL != "" {
		if _, err := replica.ParseURL(t.URL); err != nil {
			p.bad("tokenizer.url", "%v", err)
		}
	}
}

func (c ClusterConfig) validate(p *problems) {
	for i, u := range c.URLs {
		if !natsURL(u) {
			p.bad(fmt.Sprintf("cluster.urls[%d]", i), "%q is not nats://host:port or tls://host:port", u)
		}
	}
	if strings.ContainsAny(c.Prefix, " *>\t") {
		p.bad("cluster.prefix", "%q has a space or a NATS wildcard", c.Prefix)
	}
	if strings.ContainsAny(c.ID, " *>.\t") {
		p.bad("cluster.id", "%q has a space, a dot or a NATS wildcard", c.ID)
	}
	if c.FlushInterval < 0 || c.FlushInterval > time.Second {
		p.bad("cluster.flush_interval", "%v is not in [0, 1s]", c.FlushInterval)
	}
	if c.BufferBytes < 0 || c.PeerTimeout < 0 {
		p.bad("cluster", "buffer_bytes and peer_timeout must not be negative")
	}
	if (c.CertFile == "") != (c.KeyFile == "") {
		p.bad("cluster.cert_file", "cert_file and key_file go together")
	}
	if len(c.URLs) > 0 && !c.Insecure && !c.hasCredentials() {
		p.bad("cluster", "no NATS credentials: anyone reaching the server could steer or stop the fleet's routing; "+
			"set credentials, nkey_seed, user and password, token or cert_file, or insecure: true to run without")
	}
}

// natsURL reports whether u is a NATS server's URL: nats:// or tls://
// with a host.
func natsURL(u string) bool {
	pu, err := url.Parse(u)
	return err == nil && pu.Host != "" && (pu.Scheme == "nats" || pu.Scheme == "tls")
}

// hasCredentials reports whether c sets any way of authenticating to the
// NATS server.
func (c ClusterConfig) hasCredentials() bool {
	return c.Credentials != "" || c.NkeySeed != "" || c.User != "" || c.Token != "" || c.CertFile != ""
}

func (l LimitsConfig) validate(p *problems) {
	if l.MaxBodyBytes < 1024 {
		p.bad("limits.max_body_bytes", "must be at least 1024")
	}
	if l.MaxBodyBytesInFlight < l.MaxBodyBytes {
		p.bad("limits.max_body_bytes_in_flight", "must be at least max_body_bytes")
	}
	if l.MaxMessages < 1 {
		p.bad("limits.max_messages", "must be at least 1")
	}
	if l.MaxHeaderBytes < 1024 || l.MaxOutputTokens < 1 {
		p.bad("limits", "max_header_bytes must be at least 1024 and max_output_tokens positive")
	}
	if d := l.MaxJSONDepth; d < 2 || d > 299 {
		p.bad("limits.max_json_depth", "%d is not in [2, 299]", d)
	}
	if l.MaxJSONValues < 16 || l.MaxJSONValuesInFlight < int64(l.MaxJSONValues) {
		p.bad("limits.max_json_values", "must be at least 16, and max_json_values_in_flight at least max_json_values")
	}
}

func (h HealthConfig) validate(p *problems) {
	if h.CheckInterval <= 0 || h.CheckTimeout <= 0 || h.Fall < 1 || h.Rise < 1 || h.ScrapeInterval < 0 || !h.ejectionValid() {
		p.bad("health", "intervals and timeouts must be positive (scrape_interval 0 turns scraping off), fall, rise, eject_consecutive, eject_min_volume and eject_timeouts at least 1, eject_failure_share in [1, 100], eject_min_sources in [1, %d], eject_max ≥ eject_base", replica.MaxEjectSources)
	}
}

// ejectionValid reports whether h's passive ejection is one replica.Ejection takes.
func (h HealthConfig) ejectionValid() bool {
	return h.EjectBase > 0 && h.EjectMax >= h.EjectBase && h.EjectForgive > 0 && h.EjectConsecutive >= 1 &&
		h.EjectMinVolume >= 1 && h.EjectFailureShare >= 1 && h.EjectFailureShare <= 100 &&
		h.EjectMinSources >= 1 && h.EjectMinSources <= replica.MaxEjectSources && h.EjectTimeouts >= 1
}

func (t TimeoutConfig) validate(p *problems) {
	if t.Connect <= 0 || t.FirstByte <= 0 || t.Idle <= 0 || t.ClientWrite <= 0 || t.ShutdownGrace < 0 || t.PrefillFloor <= 0 || !(t.PrefillTokensPerSecond > 0) {
		p.bad("timeouts", "connect, first_byte, idle, client_write, prefill_floor and prefill_tokens_per_second must be positive, shutdown_grace not negative")
	}
}

func (t TracingConfig) validate(p *problems) {
	if t.SampleRatio < 0 || t.SampleRatio > 1 || (t.OTLPEndpoint != "" && !strings.HasPrefix(t.OTLPEndpoint, "http")) {
		p.bad("tracing", "sample_ratio must be in [0, 1] and otlp_endpoint an http(s) URL")
	}
}

func (d DiscoveryConfig) validate(p *problems) {
	if d.DNSName != "" && !d.dnsValid() {
		p.bad("discovery", "interval must be positive, port in [1, 65535], scheme http or https")
	}
	if d.Kubernetes.On() {
		d.validateKubernetes(p)
	}
	var errs fieldErrors
	d.KVEvents.check(&errs)
	if d.KVEvents.Listen != "" && d.KVEvents.Topic != "" {
		errs.add("kv_events.topic", "must be empty with kv_events.listen: each discovered engine is told apart by llm-d's topic kv@<host>:<port>@ of its address")
	}
	if err := replica.CheckDataParallelSize(d.DataParallelSize); err != nil {
		errs.add("data_parallel_size", err.Error())
	}
	d.KVEvents.checkRanks(d.DataParallelSize, &errs)
	for _, e := range errs {
		p.bad("discovery."+e.Field, "%s", e.Msg)
	}
}

// dnsValid reports whether the settings DNS discovery uses are valid.
func (d DiscoveryConfig) dnsValid() bool {
	return d.Interval > 0 && validPort(d.Port) && httpScheme(d.Scheme) && d.BudgetTokens >= 0
}

// validateKubernetes checks discovery through the Kubernetes API, which
// is on: the first problem found, the later ones depending on it.
func (d DiscoveryConfig) validateKubernetes(p *problems) {
	k := d.Kubernetes
	n := 0
	for _, s := range []string{k.Service, k.Selector, k.InferencePool} {
		if s != "" {
			n++
		}
	}
	switch {
	case n > 1:
		p.bad("discovery.kubernetes", "one of service, selector and inference_pool")
	case d.DNSName != "":
		p.bad("discovery.kubernetes", "and discovery.dns_name are two ways to find the same replicas: use one")
	case k.Selector != "" && !validPort(d.Port):
		p.bad("discovery.port", "a selector needs the pods' port")
	case !httpScheme(d.Scheme):
		p.bad("discovery.scheme", "must be http or https")
	case k.PoolAPI != "v1" && k.PoolAPI != "v1alpha2":
		p.bad("discovery.kubernetes.pool_api", "%q: v1 or v1alpha2", k.PoolAPI)
	case d.Interval <= 0:
		p.bad("discovery.interval", "must be positive")
	}
}

func validPort(port int) bool { return port >= 1 && port <= 65535 }

func httpScheme(s string) bool { return s == "http" || s == "https" }

func (r RuntimeConfig) validate(p *problems) {
	if f := r.GCFloorMB; f < 0 || f > 1<<20 {
		p.bad("runtime.gc_floor_mb", "%d is not in [0, 1048576] MiB", f)
	}
}

// CheckServable checks what serving needs beyond Validate: a replica, or a
// DNS name to find them (the demo's config has neither until it adds its
// simulated replicas).
func (c *Config) CheckServable() error {
	if len(c.Replicas) == 0 && c.Discovery.DNSName == "" && !c.Discovery.Kubernetes.On() {
		return &FieldError{"replicas", "at least one replica is required (or discovery.dns_name, or discovery.kubernetes)"}
	}
	return nil
}

func (c *Config) validateReplicas(p *problems) {
	names := p.uniqueNames("replicas", "name")
	for i, rep := range c.Replicas {
		names(i, rep.Name)
		for _, e := range rep.check() {
			p.bad(fmt.Sprintf("replicas[%d].%s", i, e.Field), "%s", e.Msg)
		}
	}
}

// check returns what is wrong with one replica, field by field, checked
// as the pool will check it (an empty name is left to the caller).
func (r Replica) check() []FieldError {
	var errs fieldErrors
	r.checkPool(&errs)
	r.KVEvents.check(&errs)
	r.checkEngine(&errs)
	return errs
}

// fieldErrors collects the FieldErrors of one replica, its fields named
// relative to it.
type fieldErrors []FieldError

func (e *fieldErrors) add(field, msg string) { *e = append(*e, FieldError{field, msg}) }

// checkPool checks what the pool keeps of the replica: its name, URL,
// budget and weight.
func (r Replica) checkPool(errs *fieldErrors) {
	if r.Name != "" {
		if err := replica.ValidateName(r.Name); err != nil {
			errs.add("name", err.Error())
		}
	}
	if _, err := replica.ParseURL(r.URL); err != nil {
		errs.add("url", err.Error())
	}
	if r.BudgetTokens < 0 || r.BudgetTokens > replica.MaxBudgetTokens {
		errs.add("budget_tokens", fmt.Sprintf("%d is not in [0, %d]", r.BudgetTokens, int64(replica.MaxBudgetTokens)))
	}
	if err := replica.ValidateWeight(r.Weight); err != nil {
		errs.add("weight", err.Error())
	}
}

// check checks the ZeroMQ addresses of a replica's KV events and how
// they go together.
func (k KVEventsConfig) check(errs *fieldErrors) {
	for _, f := range []struct{ name, v string }{{"kv_events.endpoint", k.Endpoint}, {"kv_events.replay_endpoint", k.ReplayEndpoint}, {"kv_events.listen", k.Listen}} {
		if f.v != "" && !strings.HasPrefix(f.v, "tcp://") && !strings.HasPrefix(f.v, "ipc://") {
			errs.add(f.name, fmt.Sprintf("%q is not a tcp:// or ipc:// ZeroMQ address", f.v))
		}
	}
	if k.Endpoint == "" && k.Listen == "" && k.ReplayEndpoint != "" {
		errs.add("kv_events.endpoint", "or kv_events.listen is required with kv_events.replay_endpoint")
	}
	if k.Endpoint != "" && k.Listen != "" {
		errs.add("kv_events.listen", "and kv_events.endpoint exclude each other: the router either dials the engine's PUB or binds one the engine dials")
	}
	if k.Listen != "" && !strings.HasPrefix(k.Listen, "tcp://") {
		errs.add("kv_events.listen", "must be a tcp:// address")
	}
	if k.DataParallelRank < -1 {
		errs.add("kv_events.data_parallel_rank", "must be -1 (every rank) or a rank")
	}
}

// checkRanks checks that the KV events ports of n data-parallel ranks do
// not meet: vLLM offsets a rank's events port and its replay port alike by
// its rank, so with vLLM's defaults (5557 and 5558) rank 1's events port
// is rank 0's replay port.
func (k KVEventsConfig) checkRanks(n int, errs *fieldErrors) {
	_, ev, _ := kvevents.TCPPort(cmp.Or(k.Endpoint, k.Listen))
	_, rep, _ := kvevents.TCPPort(k.ReplayEndpoint)
	if n > 1 && ev > 0 && rep > 0 && ev < rep+n && rep < ev+n {
		errs.add("kv_events.replay_endpoint", fmt.Sprintf("port %d meets the events ports %d-%d of %d data-parallel ranks (each rank's ports are its rank higher, as vLLM offsets them): put the replay port %d or more away",
			rep, ev, ev+n-1, n, n))
	}
}

// checkEngine checks what the replica says of its engine: its reuse past
// the prefix, its role, how many requests it runs at once and its
// scheduling policy.
func (r Replica) checkEngine(errs *fieldErrors) {
	if err := r.Spec().Reuse.Check(); err != nil {
		errs.add("reuse", err.Error())
	}
	if err := replica.Role(r.Role).Check(); err != nil {
		errs.add("role", fmt.Sprintf("%q is not prefill, decode or both", r.Role))
	}
	if err := replica.Scheduling(r.Scheduling).Check(); err != nil {
		errs.add("scheduling", fmt.Sprintf("%q is not fcfs or priority", r.Scheduling))
	}
	if err := replica.CheckDataParallelSize(r.DataParallelSize); err != nil {
		errs.add("data_parallel_size", err.Error())
	}
	r.KVEvents.checkRanks(r.DataParallelSize, errs)
	if r.MaxRunning < 0 || r.MaxRunning > 1<<20 {
		errs.add("max_running", fmt.Sprintf("%d is not in [0, 1048576] (0: learned from what the replica reports)", r.MaxRunning))
	}
}

// Validate checks one replica as the config's validation does; the admin
// API shares it. The error names the field.
func (r Replica) Validate() error {
	var errs []error
	if r.Name == "" {
		errs = append(errs, &FieldError{"name", "is required"})
	}
	for _, e := range r.check() {
		errs = append(errs, &e)
	}
	return errors.Join(errs...)
}

// Spec is the replica's pool spec.
func (r Replica) Spec() replica.Spec {
	return replica.Spec{Name: r.Name, URL: r.URL, BudgetTokens: r.BudgetTokens, Weight: r.Weight,
		KVEvents: replica.KVEvents(r.KVEvents), Reuse: replica.Reuse(r.Reuse), MaxRunning: r.MaxRunning, Role: replica.Role(r.Role),
		Scheduling: replica.Scheduling(r.Scheduling), DataParallel: replica.DataParallel{Size: r.DataParallelSize}}
}

func (f FlowControlConfig) validate(p *problems) {
	if f.MaxRequests < 1 || f.MaxBytes < 1 || f.TTL <= 0 || f.LookAhead < 1 || f.AgeBound <= 0 {
		p.bad("flow_control", "max_requests, max_bytes, ttl, look_ahead and age_bound must be positive")
	}
}
