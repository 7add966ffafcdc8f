package router

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/semroute/semroute/routing"
)

// Metrics are the router's per-request Prometheus metrics. Every series
// carries the request's arm and policy. Base units: seconds and tokens.
type Metrics struct {
	requests           *prometheus.CounterVec
	decision           *prometheus.HistogramVec
	matchRatio         *prometheus.HistogramVec
	predicted          *prometheus.CounterVec
	prefixTokens       *prometheus.CounterVec
	reported           *prometheus.CounterVec
	trimmedTokens      *prometheus.CounterVec
	tokenizeN          *prometheus.CounterVec
	chainN             *prometheus.CounterVec
	predictionDiff     *prometheus.HistogramVec
	ttft               *prometheus.HistogramVec
	duration           *prometheus.HistogramVec
	retries            *prometheus.CounterVec
	saturated          *prometheus.CounterVec
	queueWait          *prometheus.HistogramVec
	queueShed          *prometheus.CounterVec
	upstreamErrors     *prometheus.CounterVec
	unreleasedExpiredN *prometheus.CounterVec
	modelTTFT          *prometheus.HistogramVec
	extProcRefused     *prometheus.CounterVec
	pdRequests         *prometheus.CounterVec
	pdFallbacks        *prometheus.CounterVec
	pdPrefill          prometheus.Histogram
	pdDecodeFirst      prometheus.Histogram
	authRefusedN       *prometheus.CounterVec
	tenantN            *prometheus.CounterVec
	tenantMode         string   // TenantLabel's mode
	tenants            sync.Map // tenant → its counter in tenantN

	mu     sync.RWMutex
	models map[string]bool // the model label values given out (at most maxModelLabels)

	// The arms and replicas whose series were made at 0 (arm, Replica),
	// for the series labelled by both.
	seenMu   sync.Mutex
	arms     map[[2]string]bool
	replicas map[string]bool
}

// maxModelLabels bounds the values of the model label over the process's
// life: a replica whose models change (adapters loaded and unloaded, or a
// hostile one) cannot grow the series without end; past it, "other".
const maxModelLabels = 64

// NewMetrics registers the metrics with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	ap := []string{"arm", "policy"}
	apr := []string{"arm", "policy", "replica"}
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_requests_total",
			Help: "Routed requests by route, final status code (0: no response), arm, policy and model (one a replica reports serving; \"other\" for a model no replica listed, \"none\" without one)."},
			[]string{"route", "code", "arm", "policy", "model"}),
		decision: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "semroute_routing_decision_seconds",
			Help: "Time to decide where a request goes: split, hash, match, score, rank.", Buckets: prometheus.ExponentialBuckets(5e-6, 2, 16)}, ap),
		matchRatio: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "semroute_predicted_match_ratio",
			Help: "Predicted matched tokens on the chosen replica ÷ prompt tokens.", Buckets: prometheus.LinearBuckets(0, 0.1, 11)}, ap),
		predicted: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_predicted_cached_tokens_total",
			Help: "Prompt tokens the router predicted cached, for requests whose replica reported usage."}, apr),
		prefixTokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_prefix_tokens_total",
			Help: "Prompt tokens of requests answered OK by prefix outcome, each token in one: hit (cached where served, as its engine reported, else as predicted), cold (no candidate held them), routed_away and routed_away_load (another candidate held them; load: it was the more loaded or slower), evicted (predicted where served, not found by its engine), waited (the same, the request having waited for KV room)."},
			[]string{"arm", "policy", "outcome"}),
		reported: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_reported_cached_tokens_total",
			Help: "Cached prompt tokens replicas reported (usage.prompt_tokens_details.cached_tokens)."}, apr),
		predictionDiff: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "semroute_cached_tokens_prediction_error_tokens",
			Help: "Per request: predicted minus reported cached tokens.", Buckets: []float64{-16384, -4096, -1024, -256, -64, -16, 0, 16, 64, 256, 1024, 4096, 16384}}, ap),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "semroute_upstream_ttft_seconds",
			Help: "Time from the routing decision to the replica's first response byte.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}, apr),
		modelTTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "semroute_model_ttft_seconds",
			Help: "Time from the routing decision to the first response byte, by model (as semroute_requests_total's).", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)},
			[]string{"model"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "semroute_upstream_duration_seconds",
			Help: "Time from the routing decision to the end of the response.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)}, apr),
		trimmedTokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_feedback_trimmed_tokens_total",
			Help: "Tokens evicted from a replica's cache picture because its engine reported fewer cached tokens than predicted (replicas without KV events)."}, []string{"replica"}),
		tokenizeN: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_tokenize_total",
			Help: "Requests in precise mode by how their engine tokens were got: ok (from /tokenize or its cache), or estimated because the tokenizer was slow, failed or had no replica."}, []string{"result"}),
		chainN: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_response_chains_total",
			Help: "Responses API requests continuing a stored response (previous_response_id), by whether the router knew the conversation it continues (known) or routed it on its new input alone (unknown)."}, []string{"result"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "semroute_queue_wait_seconds",
			Help:    "Time requests waited in the router's queue (flow control) before they were sent, by priority.",
			Buckets: []float64{0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}}, []string{"priority"}),
		queueShed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_queue_shed_total",
			Help: "Requests the router's queue refused or let go, answered 429 (503 from the endpoint picker), by reason: full, shed (for a higher priority), expired (its TTL), late (predicted to wait past its deadline: refused at once), sheddable (a negative priority is never queued)."},
			[]string{"reason"}),
		saturated: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_decisions_saturated_total",
			Help: "Requests routed while every replica they could use was saturated (replica.Replica.Saturated): the engine they go to queues them."}, []string{"arm", "policy"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_retries_total",
			Help: "Requests moved to another replica before any byte reached the client."}, ap),
		upstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_upstream_errors_total",
			Help: "Failed upstream attempts by kind: connect, timeout, reset, status_5xx, idle."}, []string{"replica", "kind"}),
		unreleasedExpiredN: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_grpc_unreleased_expired_total",
			Help: "gRPC decisions never released, finished by reason: timeout (routing.release_after) or cap (grpc.max_unreleased_decisions, the oldest first)."}, []string{"reason"}),
		extProcRefused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_ext_proc_refused_total",
			Help: "Endpoint-picker streams refused by reason: buffer_full (429: the bodies buffered across streams are at grpc.ext_proc_max_buffered_bytes), body_too_large (413), silent (no message within timeouts.idle), out_of_order (a message the ext_proc protocol's order does not allow)."}, []string{"reason"}),
		pdRequests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_pd_requests_total",
			Help: "Requests of models a prefill replica serves, by path: disaggregated (prefill replica, then decode replica with its kv_transfer_params), short (the decode replica would compute less than the threshold: aggregated there), batch (several prompts or answers, which one set of kv_transfer_params cannot carry: aggregated), local (its decode replica is predicted to give the first token sooner computing the prompt itself than any prefill replica and the KV's transfer: aggregated there)."}, []string{"path"}),
		pdFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_pd_fallbacks_total",
			Help: "Requests that would have been disaggregated whose decode replica computed the prompt itself, by reason: no_prefill_replica (no prefill replica available: every one ejected, down or draining), prefill_failed (every prefill replica tried failed before answering), prefill_timeout (the prefill replica did not answer within the prefill's bound: timeouts.prefill_floor plus the uncached prompt at timeouts.prefill_tokens_per_second, at most timeouts.first_byte), prefill_refused (a prefill replica answered 4xx), no_transfer_params (a prefill answer without kv_transfer_params)."}, []string{"reason"}),
		pdPrefill: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "semroute_pd_prefill_seconds",
			Help: "Time from sending a disaggregated request's prefill to its prefill replica's whole answer (the prompt computed, its KV held for the decode replica).", Buckets: prometheus.ExponentialBuckets(0.005, 2, 14)}),
		authRefusedN: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_auth_refused_total",
			Help: "Requests answered 401 for their API key (auth.api_keys_file), by reason: missing, invalid."}, []string{"reason"}),
		tenantN: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "semroute_tenant_requests_total",
			Help: "Requests let through by an API key, by the key's tenant (auth.api_keys_file: the file's tenants alone), labelled as metrics.tenant_labels says: hash (t- and a hash of the name, the default), name, or omit (all)."}, []string{"tenant"}),
		pdDecodeFirst: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "semroute_pd_decode_first_byte_seconds",
			Help: "Time from sending a disaggregated request, with its kv_transfer_params, to its decode replica to the first byte of its answer: the KV transfer and the first decode step (vLLM's own vllm:nixl_xfer_time_seconds on the decode replica has the transfer alone).", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}),
	}
	m.models = map[string]bool{}
	for _, p := range []string{"disaggregated", "short", "batch", "local"} {
		m.pdRequests.WithLabelValues(p)
	}
	for _, r := range []string{"missing", "invalid"} {
		m.authRefusedN.WithLabelValues(r)
	}
	for _, r := range pdFallbackReasons {
		m.pdFallbacks.WithLabelValues(r)
	}
	for r := range queueVerdicts {
		m.queueShed.WithLabelValues(r) // 0 from the first scrape
	}
	m.queueWait.WithLabelValues("0")
	for _, r := range []string{"known", "unknown"} {
		m.chainN.WithLabelValues(r) // exported from the start, at 0
	}
	for _, c := range []prometheus.Collector{m.requests, m.decision, m.matchRatio, m.predicted, m.prefixTokens, m.reported, m.trimmedTokens, m.tokenizeN, m.chainN, m.predictionDiff, m.ttft, m.duration, m.retries, m.upstreamErrors, m.unreleasedExpiredN, m.modelTTFT, m.extProcRefused, m.saturated, m.queueWait, m.queueShed, m.pdRequests, m.pdFallbacks, m.pdPrefill, m.pdDecodeFirst, m.authRefusedN, m.tenantN} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, reason := range []string{"timeout", "cap"} {
		m.unreleasedExpiredN.WithLabelValues(reason) // exported at 0 from the start
	}
	for _, reason := range extProcRefusals {
		m.extProcRefused.WithLabelValues(reason)
	}
	return m, nil
}

func (m *Metrics) routed(rt *Routed, seconds float64) {
	if m == nil {
		return
	}
	arm, pol := rt.Arm.Name, rt.Policy
	m.decision.WithLabelValues(arm, pol).Observe(seconds)
	if rt.Saturated {
		m.saturated.WithLabelValues(arm, pol).Inc()
	}
	if rt.Tokens > 0 {
		m.matchRatio.WithLabelValues(arm, pol).Observe(float64(rt.Chosen().Match.Tokens) / float64(rt.Tokens))
	}
}

// disaggregated counts a request of a model a prefill replica serves by
// its path (semroute_pd_requests_total).
func (m *Metrics) disaggregated(path string) {
	if m != nil {
		m.pdRequests.WithLabelValues(path).Inc()
	}
}

// pdFallback counts a disaggregated request its decode replica computed.
func (m *Metrics) pdFallback(reason string) {
	if m != nil {
		m.pdFallbacks.WithLabelValues(reason).Inc()
	}
}

// authRefused counts a request refused for its API key.
func (m *Metrics) authRefused(reason string) {
	if m != nil {
		m.authRefusedN.WithLabelValues(reason).Inc()
	}
}

// Tenant labels: how semroute_tenant_requests_total names a tenant.
const (
	// TenantHash labels a tenant by "t-" and the first 8 bytes of the
	// SHA-256 of its name, in hex: series per tenant, names not shown
	// (the default; `router hashkey --tenant NAME` prints a name's label).
	TenantHash = "hash"
	// TenantName labels a tenant by its name.
	TenantName = "name"
	// TenantOmit keeps no series per tenant: one, labelled "all".
	TenantOmit = "omit"
)

// TenantLabel returns tenant t's label under mode (TenantHash, TenantName
// or TenantOmit; "" is TenantHash).
func TenantLabel(mode, t string) string {
	switch mode {
	case TenantName:
		return t
	case TenantOmit:
		return "all"
	}
	h := sha256.Sum256([]byte(t))
	return "t-" + hex.EncodeToString(h[:8])
}

// LabelTenants sets how tenants are named in semroute_tenant_requests_total
// (TenantLabel's modes). Call it before the metrics are used.
func (m *Metrics) LabelTenants(mode string) {
	if m != nil {
		m.tenantMode = mode
	}
}

// tenant counts a request an API key let through, by its tenant.
func (m *Metrics) tenant(t string) {
	if m != nil {
		m.tenantCounter(t).Inc()
	}
}

// tenantSeen makes tenant t's request counter exist, at 0.
func (m *Metrics) tenantSeen(t string) {
	if m != nil {
		m.tenantCounter(t)
	}
}

// tenantCounter returns tenant t's request counter, its label (a hash of
// the name, by default) made once per tenant, not per request. The
// tenants are the keys file's, so the cache is bounded by it.
func (m *Metrics) tenantCounter(t string) prometheus.Counter {
	if c, ok := m.tenants.Load(t); ok {
		return c.(prometheus.Counter)
	}
	c := m.tenantN.WithLabelValues(TenantLabel(m.tenantMode, t))
	m.tenants.Store(t, c)
	return c
}

// decodeFirst records the time a disaggregated request's decode replica
// took to its first byte.
func (m *Metrics) decodeFirst(d time.Duration) {
	if m != nil {
		m.pdDecodeFirst.Observe(d.Seconds())
	}
}

// prefilled records a prefill's time.
func (m *Metrics) prefilled(d time.Duration) {
	if m != nil {
		m.pdPrefill.Observe(d.Seconds())
	}
}

// queued records a request's wait in the router's queue.
func (m *Metrics) queued(priority int, wait time.Duration) {
	if m != nil {
		m.queueWait.WithLabelValues(strconv.Itoa(priority)).Observe(wait.Seconds())
	}
}

// shed counts a request the router's queue refused or let go.
func (m *Metrics) shed(err error) {
	if m == nil {
		return
	}
	m.queueShed.WithLabelValues(queueReason(err)).Inc()
}

// arm makes a's counters that may stay at 0 for long exist from the start,
// so that a rate over them is 0 rather than no data.
func (m *Metrics) arm(a Arm) {
	if m == nil {
		return
	}
	ap := [2]string{a.Name, a.Policy.Name()}
	for _, v := range []*prometheus.CounterVec{m.saturated, m.retries} {
		v.WithLabelValues(ap[0], ap[1])
	}
	for _, v := range []*prometheus.HistogramVec{m.decision, m.matchRatio, m.predictionDiff} {
		v.WithLabelValues(ap[0], ap[1])
	}
	for o := range routing.NumPrefixOutcomes {
		m.prefixTokens.WithLabelValues(ap[0], ap[1], o.String())
	}
	m.seenMu.Lock()
	defer m.seenMu.Unlock()
	if m.arms == nil {
		m.arms, m.replicas = map[[2]string]bool{}, map[string]bool{}
	}
	m.arms[ap] = true
	for r := range m.replicas {
		m.armReplica(ap, r)
	}
}

// armReplica makes the series labelled by arm, policy and replica.
func (m *Metrics) armReplica(ap [2]string, replica string) {
	m.predicted.WithLabelValues(ap[0], ap[1], replica)
	m.reported.WithLabelValues(ap[0], ap[1], replica)
	m.ttft.WithLabelValues(ap[0], ap[1], replica)
	m.duration.WithLabelValues(ap[0], ap[1], replica)
}

// UpstreamErrorKinds are semroute_upstream_errors_total's kinds.
var UpstreamErrorKinds = []string{"connect", "timeout", "reset", "status_5xx", "idle"}

// Replica makes the series of replica name that may stay at 0 for long
// exist from the start (its upstream errors by kind, and its predicted
// and reported cached tokens and timings under every arm), so that a rate
// over them is 0 rather than no data. Call it for each replica as it
// joins; safe for concurrent use.
func (m *Metrics) Replica(name string) {
	if m == nil {
		return
	}
	for _, k := range UpstreamErrorKinds {
		m.upstreamErrors.WithLabelValues(name, k)
	}
	m.trimmedTokens.WithLabelValues(name)
	m.seenMu.Lock()
	defer m.seenMu.Unlock()
	if m.arms == nil {
		m.arms, m.replicas = map[[2]string]bool{}, map[string]bool{}
	}
	m.replicas[name] = true
	for ap := range m.arms {
		m.armReplica(ap, name)
	}
}

func (m *Metrics) retried(rt *Routed) {
	if m != nil {
		m.retries.WithLabelValues(rt.Arm.Name, rt.Policy).Inc()
	}
}

func (m *Metrics) finished(rt *Routed, o *Outcome) {
	if m == nil {
		return
	}
	arm, pol, rep := rt.Arm.Name, rt.Policy, rt.Served.Replica.Name
	route := rt.req.Route
	if route == "" {
		route = "other"
	}
	model := m.modelLabel(rt)
	m.requests.WithLabelValues(route, strconv.Itoa(o.Status), arm, pol, model).Inc()
	if o.TTFTNs > 0 {
		m.ttft.WithLabelValues(arm, pol, rep).Observe(float64(o.TTFTNs) / 1e9)
		m.modelTTFT.WithLabelValues(model).Observe(float64(o.TTFTNs) / 1e9)
	}
	if o.DurationNs > 0 {
		m.duration.WithLabelValues(arm, pol, rep).Observe(float64(o.DurationNs) / 1e9)
	}
	if o.Status == 200 && o.PromptTokens > 0 && o.CachedReported { // the replica reported cached tokens
		predicted := float64(rt.Served.Predicted())
		m.predicted.WithLabelValues(arm, pol, rep).Add(predicted)
		m.reported.WithLabelValues(arm, pol, rep).Add(float64(o.CachedTokens))
		m.predictionDiff.WithLabelValues(arm, pol).Observe(predicted - float64(o.CachedTokens))
	}
}

// prefixed counts a finished request's prompt tokens by prefix outcome
// (semroute_prefix_tokens_total).
func (m *Metrics) prefixed(rt *Routed, p *routing.PrefixTokens) {
	if m == nil {
		return
	}
	for o, n := range p {
		if n > 0 {
			m.prefixTokens.WithLabelValues(rt.Arm.Name, rt.Policy, routing.PrefixOutcome(o).String()).Add(float64(n))
		}
	}
}

// modelLabel is a request's model as a metric label: the model if the
// replica that served it lists it (so that clients cannot mint series) and
// the label has room (maxModelLabels), "other" if not, "none" without a
// model.
func (m *Metrics) modelLabel(rt *Routed) string {
	model := rt.req.Model
	if model == "" {
		return "none"
	}
	if ms := rt.Served.Replica.Models(); ms == nil || !ms.Serves(model) {
		return "other"
	}
	m.mu.RLock()
	given := m.models[model]
	m.mu.RUnlock()
	if given { // the common case: a read
		return model
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.models[model] {
		if len(m.models) >= maxModelLabels {
			return "other"
		}
		m.models[model] = true
	}
	return model
}

func (m *Metrics) trimmed(rt *Routed, tokens int64) {
	if m != nil {
		m.trimmedTokens.WithLabelValues(rt.Served.Replica.Name).Add(float64(tokens))
	}
}

// Tokenized counts a precise-mode request by result ("ok", "slow",
// "failed", "no_replica").
func (m *Metrics) Tokenized(result string) {
	if m != nil {
		m.tokenizeN.WithLabelValues(result).Inc()
	}
}

// chain counts a continuation of a stored response by whether its
// conversation was known ("known", "unknown").
func (m *Metrics) chain(result string) {
	if m != nil {
		m.chainN.WithLabelValues(result).Inc()
	}
}

func (m *Metrics) unreleasedExpired(reason string, n int) {
	if m != nil && n > 0 {
		m.unreleasedExpiredN.WithLabelValues(reason).Add(float64(n))
	}
}

// extProcRefusal counts an endpoint-picker stream refused for reason, one
// of extProcRefusals.
func (m *Metrics) extProcRefusal(reason string) {
	if m != nil {
		m.extProcRefused.WithLabelValues(reason).Inc()
	}
}

// UpstreamError counts a failed upstream attempt.
func (m *Metrics) UpstreamError(replica, kind string) {
	if m != nil {
		m.upstreamErrors.WithLabelValues(replica, kind).Inc()
	}
}

// errorKind classifies an upstream transport error.
func errorKind(err error) string {
	var op *net.OpError
	var ne net.Error
	switch {
	case errors.As(err, &op) && op.Op == "dial":
		return "connect"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case strings.Contains(err.Error(), "timeout"):
		return "timeout"
	}
	return "reset"
}
