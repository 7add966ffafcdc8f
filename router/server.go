package router

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/semroute/semroute/apikey"
	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// Response headers set on every routed response.
const (
	HeaderReplica       = "X-Semroute-Replica"
	HeaderMatchedTokens = "X-Semroute-Matched-Tokens"
	HeaderArm           = "X-Semroute-Arm"
	HeaderSessionID     = "X-Session-ID"
	HeaderTenantID      = "X-Tenant-ID"
	// HeaderQueueMs is how long the request waited in the router's queue
	// (flow control), milliseconds; absent when it did not wait.
	HeaderQueueMs = "X-Semroute-Queue-Ms"
)

// The Gateway API Inference Extension's request headers that place a
// request in the router's queue, and llm-d's spellings of them: the
// objective names its priority (ServerOptions.Priorities), the fairness id
// its flow.
var (
	objectiveHeaders = []string{"X-Gateway-Inference-Objective", "X-Llm-D-Inference-Objective"}
	fairnessHeaders  = []string{"X-Gateway-Inference-Fairness-Id", "X-Llm-D-Inference-Fairness-Id"}
)

// headerPriority carries a request's priority from authorize to
// placement when its API key has a max_priority: the priority its
// objective names (0 without one), at most the key's, in decimal. The
// router sets it; authorize removes a client's from every request.
const headerPriority = "X-Semroute-Priority"

// placement returns the priority and the flow of a request in the
// router's queue, its headers read by get: the priority headerPriority
// says (authorize's, for a key with a max_priority), else the one its
// objective names (objectivePriority); the flow its fairness header
// names, else its tenant, else the body's user, else none.
func placement(priorities map[string]int, get func(string) string, tenant, user string) (priority int, flowKey string) {
	priority = objectivePriority(priorities, get)
	if p, err := strconv.Atoi(get(headerPriority)); err == nil {
		priority = p
	}
	for _, h := range fairnessHeaders {
		if v := get(h); v != "" {
			return priority, v
		}
	}
	if tenant != "" {
		return priority, tenant
	}
	return priority, user
}

// objectivePriority returns the priority the request's objective header
// (the first spelling present, read by get) names in priorities: 0
// without one, or for a name not listed.
func objectivePriority(priorities map[string]int, get func(string) string) int {
	for _, h := range objectiveHeaders {
		if v := get(h); v != "" {
			return priorities[v]
		}
	}
	return 0
}

// objectiveTarget returns the TTFT target the request's objective header
// (the first spelling present, read by get) names in targets: 0 without
// one, or for a name not listed.
func objectiveTarget(targets map[string]time.Duration, get func(string) string) time.Duration {
	for _, h := range objectiveHeaders {
		if v := get(h); v != "" {
			return targets[v]
		}
	}
	return 0
}

// capPriority makes ceiling the highest priority of the request whose
// headers are h, whatever it asks for: its objective's (objectivePriority,
// the default 0 included), at most ceiling, goes in headerPriority, and an
// objective above ceiling is removed (the replica does not see it).
func capPriority(priorities map[string]int, h http.Header, ceiling int) {
	p := objectivePriority(priorities, h.Get)
	for _, name := range objectiveHeaders { // every spelling: the first read is not the only one a replica may
		if v := h.Get(name); v != "" && priorities[v] > ceiling {
			h.Del(name)
		}
	}
	h.Set(headerPriority, strconv.Itoa(min(p, ceiling)))
}

// ServerOptions configure the HTTP front end. Core is required.
type ServerOptions struct {
	Core *Core
	// Priorities maps an inference objective's name (the
	// x-gateway-inference-objective header) to its priority in the
	// router's queue: higher first, negative never queued. An objective
	// not listed has priority 0.
	Priorities map[string]int
	// Transport sends requests to replicas. Nil means the router's own
	// (upstream.go): plain-HTTP replicas over its pooled connections, https
	// ones through a clone of http.DefaultTransport.
	Transport http.RoundTripper
	// Limits bound each request; SetLimits changes them while serving.
	Limits limits.Request
	// Keys, if set, are the API keys a /v1/* request must present
	// (Authorization: Bearer, or x-api-key), each naming the request's
	// tenant (X-Tenant-ID is then the key's, not the client's); a request
	// without one is answered 401 before any replica is touched.
	Keys *apikey.Set
	// UpstreamAPIKey, if set, is the replicas' key: sent as
	// "Authorization: Bearer" in place of whatever the client sent.
	UpstreamAPIKey string
	// RecordReplies caches the assistant's reply on the replica that wrote
	// it once the response completes: it is the prefix of the next turn.
	RecordReplies bool
	// MaxReplyBytes caps how much of a response is kept to learn the reply;
	// a longer reply is not learned. Default limits.DefaultMaxReplyBytes.
	MaxReplyBytes int
	// Ejection tunes passive ejection: a replica that refuses or resets
	// connections, times out, or answers 5xx is taken out for a cool-down
	// that grows while it keeps failing.
	Ejection replica.Ejection
	// Timeouts bound each upstream request (see limits.Timeouts). A
	// request that times out before any byte reached the client moves to
	// the next replica.
	Timeouts limits.Timeouts
	// ModelsTimeout bounds the fan-out of GET /v1/models. Default 3s.
	ModelsTimeout time.Duration
	// Logger receives one info line per request (decision id, arm,
	// replica, status, matched and cached tokens, durations) and warnings on
	// replica errors; never prompt text. Nil means slog.Default().
	Logger *slog.Logger
	// Metrics, if set, is served at GET /metrics.
	Metrics http.Handler
	// Tracer makes the spans of each request ("semroute.route" for the
	// decision, "semroute.upstream" for the call to the replica); nil means
	// none. Propagator carries the trace context in and out (W3C
	// traceparent); nil means W3C trace context. With no tracer an incoming
	// traceparent still reaches the replica unchanged.
	Tracer     trace.Tracer
	Propagator propagation.TextMapPropagator
	// Ready, if set, must report true for GET /readyz to say ready: a
	// router of a fleet is not ready until its warm start has loaded the
	// fleet's picture. Nil: ready once a replica is available.
	Ready func() bool
}

// Server is the router's HTTP front end.
type Server struct {
	o      ServerOptions
	limits atomic.Pointer[limits.Request]
	core   *Core
	e      *routing.Engine
	proxy  *httputil.ReverseProxy
	mux    *http.ServeMux
	// client is used for the /v1/models fan-out.
	client *http.Client
	// bodies counts the request body bytes held (limits.Request.MaxBodyBytesInFlight).
	bodies bodyGauge
	// upstreamAuth is the Authorization the replicas get in place of the
	// client's ("Bearer " and ServerOptions.UpstreamAPIKey), "" for none.
	upstreamAuth string
}

// BodyBytesInFlight returns the request-body bytes the server holds now
// (limits.Request.MaxBodyBytesInFlight counts against it): each body
// being read holds at least its first read's buffer.
func (s *Server) BodyBytesInFlight() int64 { return s.bodies.Load() }

// NewServer returns the HTTP front end.
func NewServer(o ServerOptions) (*Server, error) {
	if o.Core == nil {
		return nil, errors.New("router: ServerOptions.Core is required")
	}
	// std is the net/http transport the router configures: the given one,
	// or a clone of the default for its own transport to fall back on and
	// for the replicas' model lists.
	std, _ := o.Transport.(*http.Transport)
	if o.Transport == nil {
		std = http.DefaultTransport.(*http.Transport).Clone()
		std.MaxIdleConnsPerHost = maxIdlePerReplica
	}
	o.MaxReplyBytes = cmp.Or(max(o.MaxReplyBytes, 0), limits.DefaultMaxReplyBytes)
	o.Timeouts = o.Timeouts.WithDefaults()
	o.ModelsTimeout = cmp.Or(max(o.ModelsTimeout, 0), 3*time.Second)
	o.Logger = cmp.Or(o.Logger, slog.Default())
	if o.Propagator == nil {
		o.Propagator = propagation.TraceContext{}
	}
	if std != nil {
		std.DialContext = (&net.Dialer{Timeout: o.Timeouts.Connect, KeepAlive: 30 * time.Second}).DialContext
		std.ResponseHeaderTimeout = o.Timeouts.FirstByte
		std.MaxResponseHeaderBytes = maxResponseHeaderBytes
	}
	client := &http.Client{Transport: o.Transport}
	if o.Transport == nil {
		o.Transport = newUpstream(std, o.Timeouts.FirstByte, maxResponseHeaderBytes, maxIdlePerReplica)
		client.Transport = std
	}
	s := &Server{o: o, core: o.Core, e: o.Core.Engine(), mux: http.NewServeMux(), client: client}
	if o.UpstreamAPIKey != "" {
		s.upstreamAuth = "Bearer " + o.UpstreamAPIKey
	}
	if o.Keys != nil {
		for _, t := range o.Keys.Tenants() {
			o.Core.o.Metrics.tenantSeen(t) // 0 from the first scrape
		}
	}
	s.SetLimits(o.Limits)
	s.proxy = &httputil.ReverseProxy{
		BufferPool: &bufferPool{},
		Rewrite:    s.rewrite,
		Transport:  &failover{s: s, next: o.Transport},
		// No periodic flush: ReverseProxy flushes each write of an event
		// stream (text/event-stream) or of a body of unknown length at once,
		// and a whole answer of known length goes out in as few writes as
		// its size allows (flushing every copy of a JSON answer was a
		// chunked write and a syscall each: 17% of the router's CPU in a
		// profile of 1 KB requests, BENCHMARKS.md, "Beside nginx").
		FlushInterval:  0,
		ModifyResponse: s.modifyResponse,
		ErrorHandler:   s.proxyError,
		ErrorLog:       slog.NewLogLogger(o.Logger.Handler(), slog.LevelWarn),
	}
	s.mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.routed(w, r, blockhash.Chat) })
	s.mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.routed(w, r, blockhash.Completion) })
	// Any other method on the routed paths is refused, not passed through:
	// it would reach a replica unvalidated.
	s.mux.HandleFunc("/v1/chat/completions", methodNotAllowed)
	s.mux.HandleFunc("/v1/completions", methodNotAllowed)
	// The routed paths with anything after them (a trailing slash) would
	// reach a replica unvalidated through the pass-through route.
	s.mux.HandleFunc("/v1/chat/completions/", notRouted)
	s.mux.HandleFunc("/v1/completions/", notRouted)
	s.mux.HandleFunc("GET /v1/models", s.models)
	s.mux.HandleFunc("GET /v1/models/{id...}", s.model) // ids with slashes: meta-llama/Llama-3.1-8B
	s.mux.HandleFunc("POST /v1/responses", func(w http.ResponseWriter, r *http.Request) { s.routed(w, r, blockhash.Responses) })
	s.mux.HandleFunc("POST /v1/messages", func(w http.ResponseWriter, r *http.Request) { s.routed(w, r, blockhash.Messages) })
	s.mux.HandleFunc("/v1/responses", methodNotAllowed)
	s.mux.HandleFunc("/v1/messages", methodNotAllowed)
	// A stored response (GET, DELETE, POST .../cancel) lives on the
	// replica that made it.
	s.mux.HandleFunc("/v1/responses/{id}", s.storedResponse)
	s.mux.HandleFunc("/v1/responses/{id}/{action}", s.storedResponse)
	s.mux.HandleFunc("/v1/", s.passthrough)
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	s.mux.HandleFunc("GET /readyz", s.ready)
	if o.Metrics != nil {
		s.mux.Handle("GET /metrics", o.Metrics)
	}
	return s, nil
}

// maxResponseHeaderBytes bounds a replica's response headers (net/http's
// default is 10 MB): a replica is not a browser talking to the world.
const maxResponseHeaderBytes = 256 << 10

// maxIdlePerReplica bounds the idle keep-alive connections kept to one
// replica.
const maxIdlePerReplica = 256

// maxModelsPerReplica bounds the models read from one replica's /v1/models.
const maxModelsPerReplica = 1024

// bufferPool lends a reverse proxy its 32 KiB copy buffers, so a request
// does not allocate one.
type bufferPool struct{ p sync.Pool }

// NewBufferPool returns the buffer pool the router's proxy uses, for other
// proxies measured against it.
func NewBufferPool() httputil.BufferPool { return &bufferPool{} }

// proxyBuf is the size of the proxy's copy buffers. They are pooled as
// array pointers, which a []byte converts back to without allocating (a
// *[]byte per Put would allocate each time).
const proxyBuf = 32 << 10

func (b *bufferPool) Get() []byte {
	if v, ok := b.p.Get().(*[proxyBuf]byte); ok {
		return v[:]
	}
	return make([]byte, proxyBuf)
}

func (b *bufferPool) Put(buf []byte) {
	if cap(buf) >= proxyBuf {
		b.p.Put((*[proxyBuf]byte)(buf[:proxyBuf]))
	}
}

// SetLimits replaces the limits; requests already reading keep theirs.
// Safe to call while serving.
func (s *Server) SetLimits(l limits.Request) {
	l = l.WithDefaults()
	s.limits.Store(&l)
}

// CurrentLimits returns the limits in force.
func (s *Server) CurrentLimits() limits.Request { return *s.limits.Load() }

// CloseIdleConnections closes the idle connections to replicas.
func (s *Server) CloseIdleConnections() {
	if t, ok := s.o.Transport.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
}

// ServeHTTP implements http.Handler. Requests whose headers exceed
// MaxHeaderBytes get 431 before anything else.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/messages" || strings.HasPrefix(r.URL.Path, "/v1/messages/") {
		w = anthropicWriter{w} // Anthropic's clients read its error shape
	}
	n := len(r.Method) + len(r.RequestURI) + 12
	for k, vs := range r.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	if max := s.limits.Load().MaxHeaderBytes; n > max {
		writeError(w, apiError{http.StatusRequestHeaderFieldsTooLarge, "invalid_request_error", "headers_too_large",
			"request headers are larger than the limit of " + strconv.Itoa(max) + " bytes"})
		return
	}
	if strings.HasPrefix(r.URL.Path, "/v1/") && !s.authorize(w, r) {
		return
	}
	s.mux.ServeHTTP(w, r)
}

// bearerToken returns the credentials of an Authorization header of the
// Bearer scheme (its name in any case, RFC 7235), or "".
func bearerToken(h string) string {
	scheme, token, ok := strings.Cut(strings.TrimSpace(h), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	return strings.TrimSpace(token)
}

// authorize checks a /v1/* request's API key (ServerOptions.Keys) and
// answers 401 when it has none the router holds, reporting false. A
// request let through carries its key's tenant in X-Tenant-ID, its
// priority capped by the key's max_priority (capPriority: whatever
// priority it ends with, the default included), and the replicas' key
// (ServerOptions.UpstreamAPIKey) instead of the client's. A client's
// headerPriority is removed from every request, keys or not.
func (s *Server) authorize(w http.ResponseWriter, r *http.Request) bool {
	r.Header.Del(headerPriority) // the router's own: never the client's
	if s.o.Keys != nil {
		presented := bearerToken(r.Header.Get("Authorization"))
		if presented == "" {
			presented = r.Header.Get("X-Api-Key") // Anthropic's clients
		}
		key, ok := s.o.Keys.Check(presented)
		if !ok {
			reason := "invalid"
			if presented == "" {
				reason = "missing"
			}
			s.core.o.Metrics.authRefused(reason)
			w.Header().Set("WWW-Authenticate", `Bearer realm="semroute"`)
			writeError(w, apiError{http.StatusUnauthorized, "invalid_request_error", "invalid_api_key",
				"Incorrect or missing API key: send Authorization: Bearer <key> with a key the router's operator issued."})
			return false
		}
		// The key's tenant is the request's, and its flow in the router's
		// queue: not what the client's headers say.
		r.Header.Set(HeaderTenantID, key.Tenant)
		for _, h := range fairnessHeaders {
			r.Header.Del(h)
		}
		if m := key.MaxPriority; m != nil { // the ceiling of whatever priority it ends with
			capPriority(s.o.Priorities, r.Header, *m)
		}
		r.Header.Del("Authorization")
		r.Header.Del("X-Api-Key")
		s.core.o.Metrics.tenant(key.Tenant)
	}
	if s.upstreamAuth != "" {
		r.Header.Del("X-Api-Key")
		r.Header.Set("Authorization", s.upstreamAuth)
	}
	return true
}

// models merges GET /v1/models across the available replicas.
func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	seen := s.gatherModels(r.Context())
	if len(seen) == 0 {
		writeError(w, classify(routing.ErrNoReplica))
		return
	}
	ids := make([]string, 0, len(seen))
	for id := range seen {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	data := make([]json.RawMessage, len(ids))
	for i, id := range ids {
		data[i] = seen[id]
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
}

// model answers GET /v1/models/{id} from the replicas' merged list, as
// OpenAI does: the model's object, or 404 in OpenAI's error shape.
func (s *Server) model(w http.ResponseWriter, r *http.Request) {
	if hasDotSegment(r.URL.Path) { // sent encoded (%2e%2e): the path means another resource
		writeError(w, apiError{http.StatusBadRequest, "invalid_request_error", "invalid_path", "the path must not contain . or .. segments"})
		return
	}
	id := r.PathValue("id") // an id with slashes, sent as they are or as %2F
	seen := s.gatherModels(r.Context())
	if len(seen) == 0 {
		writeError(w, classify(routing.ErrNoReplica))
		return
	}
	m, ok := seen[id]
	if !ok {
		writeError(w, apiError{http.StatusNotFound, "invalid_request_error", "model_not_found",
			fmt.Sprintf("The model %s does not exist.", strconv.Quote(id))})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(m, '\n'))
}

// gatherModels asks every available replica for its models and returns
// them by id, the first replica's object for an id that several serve.
func (s *Server) gatherModels(ctx context.Context) map[string]json.RawMessage {
	ctx, cancel := context.WithTimeout(ctx, s.o.ModelsTimeout)
	defer cancel()
	now := time.Now()
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		seen = map[string]json.RawMessage{}
	)
	for _, rep := range s.e.Pool().Replicas() {
		if !rep.Available(now) {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, rep.URL.JoinPath("/v1/models").String(), nil)
			if err != nil {
				return
			}
			if s.upstreamAuth != "" {
				req.Header.Set("Authorization", s.upstreamAuth)
			}
			resp, err := s.client.Do(req)
			if err != nil {
				return
			}
			defer resp.Body.Close()
			var list struct {
				Data []json.RawMessage `json:"data"`
			}
			if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&list) != nil {
				return
			}
			if len(list.Data) > maxModelsPerReplica {
				list.Data = list.Data[:maxModelsPerReplica]
			}
			mu.Lock()
			defer mu.Unlock()
			for _, m := range list.Data {
				var id struct {
					ID string `json:"id"`
				}
				if json.Unmarshal(m, &id) == nil && id.ID != "" {
					if _, dup := seen[id.ID]; !dup {
						seen[id.ID] = m
					}
				}
			}
		}()
	}
	wg.Wait()
	return seen
}

func (s *Server) ready(w http.ResponseWriter, _ *http.Request) {
	if s.o.Ready != nil && !s.o.Ready() {
		writeError(w, apiError{http.StatusServiceUnavailable, "service_unavailable", "warming_up",
			"the router is loading the fleet's cache picture from a peer"})
		return
	}
	now := time.Now()
	for _, r := range s.e.Pool().Replicas() {
		if r.Available(now) {
			_, _ = io.WriteString(w, "ready\n")
			return
		}
	}
	writeError(w, classify(routing.ErrNoReplica))
}
