package router

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/http/httputil"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/semroute/semroute/blockhash"
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
)

// ServerOptions configure the HTTP front end. Core is required.
type ServerOptions struct {
	Core *Core
	// Transport sends requests to replicas. Nil means a clone of
	// http.DefaultTransport.
	Transport http.RoundTripper
	// Limits bound each request; SetLimits changes them while serving.
	Limits
	// RecordReplies caches the assistant's reply on the replica that wrote
	// it once the response completes: it is the prefix of the next turn.
	RecordReplies bool
	// MaxReplyBytes caps how much of a response is kept to learn the reply;
	// a longer reply is not learned. Default 1 MiB.
	MaxReplyBytes int
	// Ejection tunes passive ejection: a replica that refuses or resets
	// connections, times out, or answers 5xx is taken out for a cool-down
	// that grows while it keeps failing.
	Ejection replica.Ejection
	// ConnectTimeout bounds dialing a replica (default 5s);
	// FirstByteTimeout bounds the wait for its response headers (default
	// 300s: a non-streaming answer's headers come when it is complete);
	// IdleTimeout bounds the silence between response chunks (default 60s).
	// A request that times out before any byte reached the client moves to
	// the next replica.
	ConnectTimeout, FirstByteTimeout, IdleTimeout time.Duration
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
}

// Limits bound each request the front end takes. Zero fields take the
// defaults.
type Limits struct {
	// MaxBodyBytes limits request bodies; larger ones get 413, refused from
	// their Content-Length when they declare one. Default 16 MiB.
	MaxBodyBytes int64
	// MaxHeaderBytes bounds a request's headers; larger ones get 431.
	// Default 64 KiB.
	MaxHeaderBytes int
	// MaxOutputTokens rejects requests asking for more (max_tokens or
	// max_completion_tokens) with 400. Default 1,048,576.
	MaxOutputTokens int
	// Parse bounds what the parser accepts (messages, nesting, values),
	// and the values being parsed at once across requests (a nil
	// Parse.Budget means one of blockhash.DefaultBudgetValues).
	Parse blockhash.Limits
}

func (l *Limits) defaults() {
	if l.Parse.Budget == nil {
		l.Parse.Budget = blockhash.NewBudget(blockhash.DefaultBudgetValues)
	}
	l.MaxBodyBytes = cmp.Or(max(l.MaxBodyBytes, 0), 16<<20)
	l.MaxHeaderBytes = cmp.Or(max(l.MaxHeaderBytes, 0), 64<<10)
	l.MaxOutputTokens = cmp.Or(max(l.MaxOutputTokens, 0), 1<<20)
}

// Server is the router's HTTP front end.
type Server struct {
	o      ServerOptions
	limits atomic.Pointer[Limits]
	core   *Core
	e      *routing.Engine
	proxy  *httputil.ReverseProxy
	mux    *http.ServeMux
	// client is used for the /v1/models fan-out.
	client *http.Client
}

// NewServer returns the HTTP front end.
func NewServer(o ServerOptions) (*Server, error) {
	if o.Core == nil {
		return nil, errors.New("router: ServerOptions.Core is required")
	}
	if o.Transport == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConnsPerHost = 256
		o.Transport = t
	}
	if o.MaxReplyBytes <= 0 {
		o.MaxReplyBytes = 1 << 20
	}
	if o.ConnectTimeout <= 0 {
		o.ConnectTimeout = 5 * time.Second
	}
	if o.FirstByteTimeout <= 0 {
		o.FirstByteTimeout = 300 * time.Second
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = 60 * time.Second
	}
	if o.ModelsTimeout <= 0 {
		o.ModelsTimeout = 3 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Tracer == nil {
		o.Tracer = noop.NewTracerProvider().Tracer("semroute")
	}
	if o.Propagator == nil {
		o.Propagator = propagation.TraceContext{}
	}
	if t, ok := o.Transport.(*http.Transport); ok {
		t.DialContext = (&net.Dialer{Timeout: o.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext
		t.ResponseHeaderTimeout = o.FirstByteTimeout
	}
	s := &Server{o: o, core: o.Core, e: o.Core.Engine(), mux: http.NewServeMux(), client: &http.Client{Transport: o.Transport}}
	s.SetLimits(o.Limits)
	s.proxy = &httputil.ReverseProxy{
		BufferPool:     &bufferPool{},
		Rewrite:        s.rewrite,
		Transport:      &failover{s: s, next: o.Transport},
		FlushInterval:  -1,
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
	s.mux.HandleFunc("GET /v1/models", s.models)
	s.mux.HandleFunc("/v1/", s.passthrough)
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	s.mux.HandleFunc("GET /readyz", s.ready)
	if o.Metrics != nil {
		s.mux.Handle("GET /metrics", o.Metrics)
	}
	return s, nil
}

// bufferPool lends a reverse proxy its 32 KiB copy buffers, so a request
// does not allocate one.
type bufferPool struct{ p sync.Pool }

// NewBufferPool returns the buffer pool the router's proxy uses, for other
// proxies measured against it.
func NewBufferPool() httputil.BufferPool { return &bufferPool{} }

func (b *bufferPool) Get() []byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return *v
	}
	return make([]byte, 32<<10)
}

func (b *bufferPool) Put(buf []byte) { b.p.Put(&buf) }

// SetLimits replaces the limits; requests already reading keep theirs.
// Safe to call while serving.
func (s *Server) SetLimits(l Limits) {
	l.defaults()
	s.limits.Store(&l)
}

// CurrentLimits returns the limits in force.
func (s *Server) CurrentLimits() Limits { return *s.limits.Load() }

// CloseIdleConnections closes the idle connections to replicas.
func (s *Server) CloseIdleConnections() {
	if t, ok := s.o.Transport.(interface{ CloseIdleConnections() }); ok {
		t.CloseIdleConnections()
	}
}

// ServeHTTP implements http.Handler. Requests whose headers exceed
// MaxHeaderBytes get 431 before anything else.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
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
	s.mux.ServeHTTP(w, r)
}

// checkBody rejects a routed request's body before parsing: a content type
// other than JSON (415), or bytes that are not UTF-8 (400).
func checkBody(r *http.Request, body []byte) *apiError {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || (mt != "application/json" && !strings.HasSuffix(mt, "+json")) {
			return &apiError{http.StatusUnsupportedMediaType, "invalid_request_error", "unsupported_media_type",
				"Content-Type must be application/json, not " + strconv.Quote(ct)}
		}
	}
	if !utf8.Valid(body) {
		return &apiError{http.StatusBadRequest, "invalid_request_error", "invalid_encoding", "request body is not valid UTF-8"}
	}
	return nil
}

// apiError is an error turned into an OpenAI-style error body.
type apiError struct {
	status int
	typ    string
	code   string
	msg    string
}

// maxErrorMessage bounds an error body's message, in bytes, whatever the
// input or upstream error behind it.
const maxErrorMessage = 512

// writeError is the one place that turns errors into HTTP statuses and
// OpenAI-style bodies. The message is cut to maxErrorMessage bytes.
func writeError(w http.ResponseWriter, e apiError) {
	e.msg = truncate(e.msg, maxErrorMessage)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": e.msg, "type": e.typ, "code": e.code}})
}

// truncate cuts s to at most n bytes on a UTF-8 boundary, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n - len("…")
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + "…"
}

// methodNotAllowed answers a routed path called with a method other than
// POST.
func methodNotAllowed(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Allow", http.MethodPost)
	writeError(w, apiError{http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed",
		r.Method + " is not allowed on " + r.URL.Path + "; use POST"})
}

func (s *Server) classify(err error) apiError {
	var ie *blockhash.InputError
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return apiError{http.StatusRequestEntityTooLarge, "invalid_request_error", "body_too_large",
			"request body is larger than the limit of " + strconv.FormatInt(tooBig.Limit, 10) + " bytes"}
	case errors.As(err, &ie):
		return apiError{http.StatusBadRequest, "invalid_request_error", "invalid_request", ie.Error()}
	case errors.Is(err, blockhash.ErrBusy):
		return apiError{http.StatusServiceUnavailable, "server_busy", "parse_budget", err.Error()}
	case errors.Is(err, routing.ErrNoReplica):
		return apiError{http.StatusServiceUnavailable, "service_unavailable", "no_replica", "no replica is available to serve the request"}
	}
	return apiError{http.StatusBadGateway, "upstream_error", "upstream_unreachable", err.Error()}
}

// flight is one request's routing state, carried in its context from the
// handler to the proxy hooks and the failover transport.
type flight struct {
	rt     *Routed            // a routed (prompt) request; nil for pass-through
	any    *routing.Decision  // a pass-through request's ranking
	served *routing.Candidate // pass-through: the candidate carrying the request
	body   *body              // the request body; the handler releases it
	next   int                // index in the ranking of the next candidate to try
	// readers are the body's readers given to upstream attempts, closed
	// when the proxy returns.
	readers []*bodyReader

	status  int
	capture *replyCapture
	cancel  context.CancelFunc // cancels the upstream request (idle timeout)
}

type flightKey struct{}

func flightOf(ctx context.Context) *flight { f, _ := ctx.Value(flightKey{}).(*flight); return f }

// current returns the candidate now carrying the request.
func (f *flight) current() *routing.Candidate {
	if f.rt != nil {
		return f.rt.Served
	}
	return f.served
}

func (s *Server) routed(w http.ResponseWriter, r *http.Request, ep blockhash.Endpoint) {
	body, err := s.readBody(w, r)
	if err != nil {
		writeError(w, s.classify(err))
		return
	}
	defer body.release()
	if e := checkBody(r, body.b); e != nil {
		writeError(w, *e)
		return
	}
	lim := s.limits.Load()
	req, err := blockhash.Parse(ep, body.b, lim.Parse)
	if err != nil {
		writeError(w, s.classify(err))
		return
	}
	defer req.Release() // after Finish: prompt logging reads the parts' text
	if req.MaxTokens > lim.MaxOutputTokens {
		writeError(w, apiError{http.StatusBadRequest, "invalid_request_error", "invalid_request",
			"max_tokens: " + strconv.Itoa(req.MaxTokens) + " is more than the limit of " + strconv.Itoa(lim.MaxOutputTokens)})
		return
	}
	sid, tenant := r.Header.Get(HeaderSessionID), r.Header.Get(HeaderTenantID)
	route := "chat"
	if ep == blockhash.Completion {
		route = "completions"
	}
	tctx := s.o.Propagator.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
	tctx, span := s.o.Tracer.Start(tctx, "semroute.route", trace.WithAttributes(attribute.String("semroute.route", route)))
	rt, err := s.core.Route(CoreRequest{
		Input: s.e.Prepare(req, sid, s.core.o.LogPrompts), Model: req.Model, Session: sid, Tenant: tenant, Route: route,
	})
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		span.End()
		writeError(w, s.classify(err))
		return
	}
	span.SetAttributes(attribute.String("semroute.decision_id", rt.ID), attribute.String("semroute.arm", rt.Arm.Name),
		attribute.String("semroute.policy", rt.Policy), attribute.String("semroute.replica", rt.Chosen().Replica.Name),
		attribute.Int("semroute.prompt_tokens", rt.Tokens), attribute.Int("semroute.matched_tokens", rt.Chosen().Match.Tokens))
	span.End()
	w.Header().Set(HeaderArm, rt.Arm.Name)
	_, up := s.o.Tracer.Start(tctx, "semroute.upstream", trace.WithSpanKind(trace.SpanKindClient))
	ctx, cancel := context.WithCancel(r.Context()) // the client's context: leaving cancels upstream
	defer cancel()
	ctx = trace.ContextWithSpan(ctx, up)
	f := &flight{rt: rt, body: body, next: 1, cancel: cancel}
	// ReverseProxy panics with http.ErrAbortHandler when a response breaks
	// off part-way (the client left, or the replica's stream broke); the
	// request's work must end all the same, so its bookkeeping is deferred.
	done := false
	defer func() { s.finishRouted(r, rt, f, up, !done) }()
	s.forward(w, r.WithContext(ctx), f)
	done = true
}

// finishRouted ends a routed request: its upstream span, its work and
// decision (Core.Finish, learning the reply of a whole response), and its log
// line. aborted says the response broke off part-way.
func (s *Server) finishRouted(r *http.Request, rt *Routed, f *flight, up trace.Span, aborted bool) {
	o := Outcome{Status: f.status}
	if aborted {
		o.Error = "response broken off"
		if r.Context().Err() != nil { // the client left
			o.Status, f.status = 499, 499
		}
	}
	up.SetAttributes(attribute.String("semroute.replica", rt.Served.Replica.Name), attribute.Int("http.response.status_code", f.status))
	if f.status >= 500 || f.status == 0 || aborted {
		up.SetStatus(codes.Error, "upstream status "+strconv.Itoa(f.status))
	}
	up.End()
	var reply []byte
	if c := f.capture; c != nil {
		o.PromptTokens, o.OutputTokens, o.CachedTokens = c.tokens()
		if rep, ok := c.reply(); ok && s.o.RecordReplies && f.status == http.StatusOK {
			reply = rep
		}
		c.release()
	}
	s.core.Finish(rt, o, reply)
	s.o.Logger.LogAttrs(r.Context(), slog.LevelInfo, "request",
		slog.String("id", rt.ID), slog.String("arm", rt.Arm.Name), slog.String("path", r.URL.Path),
		slog.String("replica", rt.Served.Replica.Name), slog.Int("status", f.status), slog.Int("prompt_tokens", rt.Tokens),
		slog.Int("matched_tokens", rt.Served.Match.Tokens), slog.Int64("cached_tokens", o.CachedTokens),
		slog.String("reason", rt.Served.Reason), slog.Duration("ttft", rt.ttft()), slog.Duration("duration", s.e.Now().Sub(rt.start)))
}

func (s *Server) forward(w http.ResponseWriter, r *http.Request, f *flight) {
	r = r.WithContext(context.WithValue(r.Context(), flightKey{}, f))
	br := f.body.reader()
	f.readers = append(f.readers, br)
	r.Body = br
	r.ContentLength = int64(len(f.body.b))
	defer func() { // also when the proxy panics with http.ErrAbortHandler
		for _, br := range f.readers {
			br.Close()
		}
	}()
	s.proxy.ServeHTTP(w, r)
}

// readBody reads a request's body, up to MaxBodyBytes, into a pooled
// buffer that the caller must release. A body that cannot be read (the
// client went away, or sent less than its Content-Length) is an
// *blockhash.InputError; a body over the limit an *http.MaxBytesError.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) (*body, error) {
	limit := s.limits.Load().MaxBodyBytes
	if r.ContentLength > limit {
		// Refused from the header: nothing is read, and a client that sent
		// Expect: 100-continue is not asked for its body.
		return nil, &http.MaxBytesError{Limit: limit}
	}
	rd := http.MaxBytesReader(w, r.Body, limit)
	var (
		b   *body
		err error
	)
	if n := r.ContentLength; n < 0 {
		var all []byte
		all, err = io.ReadAll(rd) // unknown length: MaxBytesReader stops it at the limit
		b = bodyOf(all)
	} else {
		b = newBody(int(n))
		_, err = io.ReadFull(rd, b.b)
	}
	if err != nil {
		b.release()
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, err
		}
		return nil, &blockhash.InputError{Msg: "reading the request body: " + err.Error()}
	}
	return b, nil
}

// passthrough forwards any other /v1/ request to the least-loaded replica.
// A path with dot segments (sent percent-encoded, as %2e%2e, so that the
// mux did not clean it) is refused: it would name another path upstream.
func (s *Server) passthrough(w http.ResponseWriter, r *http.Request) {
	if hasDotSegment(r.URL.Path) {
		writeError(w, apiError{http.StatusBadRequest, "invalid_request_error", "invalid_path",
			"the path must not contain . or .. segments"})
		return
	}
	body, err := s.readBody(w, r)
	if err != nil {
		writeError(w, s.classify(err))
		return
	}
	defer body.release()
	d, err := s.e.DecideAny()
	if err != nil {
		writeError(w, s.classify(err))
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	f := &flight{any: d, served: d.Chosen(), body: body, next: 1, cancel: cancel}
	f.served.Replica.Begin(&d.Work)
	defer func() { f.served.Replica.End(&d.Work, time.Now()) }() // also when the response breaks off
	s.forward(w, r.WithContext(ctx), f)
}

// hasDotSegment reports whether the decoded path p has a "." or ".."
// segment.
func hasDotSegment(p string) bool {
	for seg := range strings.SplitSeq(p, "/") {
		if seg == "." || seg == ".." {
			return true
		}
	}
	return false
}

func (s *Server) rewrite(pr *httputil.ProxyRequest) {
	u := flightOf(pr.In.Context()).current().Replica.URL
	pr.SetURL(u)
	pr.Out.Host = u.Host
	pr.SetXForwarded()
	if sc := trace.SpanContextFromContext(pr.In.Context()); sc.IsValid() {
		s.o.Propagator.Inject(pr.In.Context(), propagation.HeaderCarrier(pr.Out.Header))
	}
}

func (s *Server) modifyResponse(resp *http.Response) error {
	f := flightOf(resp.Request.Context())
	f.status = resp.StatusCode
	c := f.current()
	resp.Header.Set(HeaderReplica, c.Replica.Name)
	body := resp.Body
	if f.rt != nil {
		resp.Header.Set(HeaderMatchedTokens, strconv.Itoa(c.Match.Tokens))
		rt := f.rt
		f.capture = &replyCapture{rc: resp.Body, limit: s.o.MaxReplyBytes,
			sse:   strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream"),
			first: func() { s.core.FirstByte(rt) }}
		body = f.capture
	}
	// A replica silent for IdleTimeout while the proxy waits for its next
	// chunk is cut off, and counted as failing: on every forwarded route.
	resp.Body = newIdleBody(body, s.o.IdleTimeout, func() {
		c.Replica.Fail(time.Now(), s.o.Ejection)
		s.core.o.Metrics.UpstreamError(c.Replica.Name, "idle")
		s.o.Logger.Warn("replica went silent mid-response; cutting it off", "replica", c.Replica.Name, "path", resp.Request.URL.Path)
		f.cancel()
	})
	return nil
}

func (s *Server) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	f := flightOf(r.Context())
	if r.Context().Err() != nil { // the client left; nobody to answer
		if f != nil {
			f.status = 499
		}
		return
	}
	e := s.classify(err)
	if f != nil {
		f.status = e.status
		w.Header().Set(HeaderReplica, f.current().Replica.Name)
	}
	s.o.Logger.Warn("upstream error", "err", err)
	writeError(w, e)
}

// failover sends a request to its flight's current candidate and, when no
// response comes back (the connection is refused, or a pooled connection
// turns out dead), moves the request to the next-ranked replica. Nothing has
// reached the client at that point. A refused connection also takes the
// replica out of rotation for DownCooldown.
type failover struct {
	s    *Server
	next http.RoundTripper
}

func (t *failover) RoundTrip(req *http.Request) (*http.Response, error) {
	f := flightOf(req.Context())
	for {
		resp, err := t.next.RoundTrip(req)
		if req.Context().Err() != nil { // the client left
			return resp, err
		}
		now := time.Now()
		cur := f.current()
		switch {
		case err == nil && resp.StatusCode < 500:
			return resp, nil
		case err == nil:
			cur.Replica.Fail(now, t.s.o.Ejection)
			t.s.core.o.Metrics.UpstreamError(cur.Replica.Name, "status_5xx")
			if resp.StatusCode != http.StatusBadGateway && resp.StatusCode != http.StatusServiceUnavailable {
				return resp, nil // other 5xx reach the client as they are
			}
		default:
			cur.Replica.Fail(now, t.s.o.Ejection)
			t.s.core.o.Metrics.UpstreamError(cur.Replica.Name, errorKind(err))
		}
		if !t.moveOn(f, now) {
			return resp, err
		}
		if resp != nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
		}
		t.s.o.Logger.Warn("replica failed before answering; failing over", "replica", cur.Replica.Name, "err", err, "status", statusOf(resp))
		req = req.Clone(req.Context())
		u := f.current().Replica.URL
		req.URL.Scheme, req.URL.Host, req.Host = u.Scheme, u.Host, u.Host
		br := f.body.reader()
		f.readers = append(f.readers, br)
		req.Body = br
	}
}

// moveOn moves f to its next-ranked candidate and reports whether there
// was one.
func (t *failover) moveOn(f *flight, now time.Time) bool {
	defer func() { f.next++ }()
	if f.rt != nil {
		return t.s.core.Failover(f.rt, f.next)
	}
	if f.next >= len(f.any.Ranked) {
		return false
	}
	f.served.Replica.End(&f.any.Work, now)
	f.served = &f.any.Ranked[f.next]
	f.served.Replica.Begin(&f.any.Work)
	return true
}

func statusOf(r *http.Response) int {
	if r == nil {
		return 0
	}
	return r.StatusCode
}

// models merges GET /v1/models across the available replicas.
func (s *Server) models(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), s.o.ModelsTimeout)
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
	if len(seen) == 0 {
		writeError(w, s.classify(routing.ErrNoReplica))
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

func (s *Server) ready(w http.ResponseWriter, _ *http.Request) {
	now := time.Now()
	for _, r := range s.e.Pool().Replicas() {
		if r.Available(now) {
			_, _ = io.WriteString(w, "ready\n")
			return
		}
	}
	writeError(w, s.classify(routing.ErrNoReplica))
}
