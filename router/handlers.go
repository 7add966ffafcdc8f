package router

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
)

// checkBodyType rejects a routed request's body before parsing, given its
// Content-Type header's value: a content type other than JSON (415), or
// bytes that are not UTF-8 (400).
func checkBodyType(ct string, body []byte) *apiError {
	if ct != "" && ct != "application/json" { // the common case, without parsing
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

// routeNames are the routed endpoints' names in metrics and logs.
var routeNames = map[blockhash.Endpoint]string{blockhash.Chat: "chat", blockhash.Completion: "completions",
	blockhash.Responses: "responses", blockhash.Messages: "messages"}

func (s *Server) routed(w http.ResponseWriter, r *http.Request, ep blockhash.Endpoint) {
	body, err := s.readBody(w, r)
	if err != nil {
		writeError(w, classify(err))
		return
	}
	defer body.release()
	tctx, span := s.startSpan(r, routeNames[ep])
	cr, fwd, strip, err := s.admit(w, r, tctx, ep, body)
	if err != nil {
		span.End()
		writeError(w, classify(err))
		return
	}
	if fwd != body {
		defer fwd.release()
	}
	var rt *Routed
	if cr.Disaggregate {
		rt, err = s.routeDisaggregated(w, r, cr, &fwd)
		if err == nil {
			defer fwd.release()
		}
	} else {
		var p *Placement
		if p, err = s.core.Place(cr); err == nil {
			rt = p.Routed
		}
	}
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		span.End()
		if qe := (*QueueError)(nil); errors.As(err, &qe) {
			w.Header().Set("Retry-After", strconv.Itoa(max(int(qe.RetryAfter/time.Second), 1)))
		}
		writeError(w, classify(err))
		return
	}
	s.routedSpan(span, rt)
	if rt.Queued > 0 {
		w.Header().Set(HeaderQueueMs, strconv.FormatInt(rt.Queued.Milliseconds(), 10))
	}
	w.Header().Set(HeaderArm, rt.Arm.Name)
	f := &flight{body: fwd, stripUsage: strip, retag: s.perReplica(fwd, cr)}
	s.forwardRouted(w, r, tctx, rt, f)
}

// admit admits the request r of API ep whose body is b (Core.Admit),
// within the limits now, and returns the core's request and the body to
// forward (upstreamBody: b, or a copy the caller releases). tctx carries
// the request's trace.
func (s *Server) admit(w http.ResponseWriter, r *http.Request, tctx context.Context, ep blockhash.Endpoint, b *body) (CoreRequest, *body, bool, error) {
	lim := s.limits.Load()
	ad, err := s.core.Admit(Arrival{API: ep, Body: b.b, ContentType: r.Header.Get("Content-Type"),
		Session: r.Header.Get(HeaderSessionID), Tenant: r.Header.Get(HeaderTenantID), Header: r.Header.Get, Priorities: s.o.Priorities,
		Route: routeNames[ep], Ctx: tctx, Disaggregates: true}, lim)
	if err != nil {
		return CoreRequest{}, nil, false, err
	}
	prio := prioritizes(ep, ad.Priority) && anyPrioritized(s.e.Pool().Replicas())
	fwd, strip, err := s.upstreamBody(b, ad.Parsed, prio, lim.MaxBodyBytesInFlight)
	ad.Recycle() // the parse is done with: its tree is not held while the response streams
	if err != nil {
		if errors.As(err, new(*bodiesInFlightError)) {
			w.Header().Set("Retry-After", "1")
		}
		return CoreRequest{}, nil, false, err
	}
	ad.Bytes = int64(len(fwd.b))
	return ad.CoreRequest, fwd, strip, nil
}

// startSpan starts the span of a routed request on route, if a tracer is
// set, from the trace context its headers carry. Without a tracer no span
// is made (an incoming traceparent reaches the replica with the other
// headers, unchanged): it returns r's context and its span.
func (s *Server) startSpan(r *http.Request, route string) (context.Context, trace.Span) {
	if s.o.Tracer == nil {
		return r.Context(), trace.SpanFromContext(r.Context())
	}
	tctx := s.o.Propagator.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
	return s.o.Tracer.Start(tctx, "semroute.route", trace.WithAttributes(attribute.String("semroute.route", route)))
}

// routedSpan ends a routed request's span with its decision.
func (s *Server) routedSpan(span trace.Span, rt *Routed) {
	if s.o.Tracer != nil {
		span.SetAttributes(attribute.String("semroute.decision_id", rt.ID), attribute.String("semroute.arm", rt.Arm.Name),
			attribute.String("semroute.policy", rt.Policy), attribute.String("semroute.replica", rt.Chosen().Replica.Name),
			attribute.Int("semroute.prompt_tokens", rt.Tokens), attribute.Int("semroute.matched_tokens", rt.Chosen().Match.Tokens))
	}
	span.End()
}

// upstreamBody returns the body to send the replicas for a client's body
// b, parsed as req, and whether the router asked for the stream's usage
// chunk, which the client must then not see: b itself, or a copy counted
// against limit (bytes of bodies in flight) that the caller releases.
// prio says a replica may be sent a copy with the request's priority
// (perReplica), whose bytes are counted here too.
//   - A client's kv_transfer_params never reach a replica: they are the
//     router's to set (disaggregation), and a client's would make an
//     engine pull KV from wherever they say. A Responses body's request_id
//     is taken out too: the router issues the response's id (respid.go).
//     So is a client's priority: the router sets a priority engine's
//     (engineprio.go).
//   - A streamed request the client did not ask usage for asks for it
//     upstream (the engine's prompt and cached tokens teach the router).
//     The Responses and Messages APIs end every stream with the usage.
func (s *Server) upstreamBody(b *body, req *blockhash.Request, prio bool, limit int64) (fwd *body, strip bool, err error) {
	fwd = b
	if routerKeys(req) {
		clean, err := scrubbed(b.b, req.Endpoint)
		if err != nil {
			return nil, false, err
		}
		fwd = bodyOf(clean)
	}
	if chatLike(req.Endpoint) && req.Stream && !req.StreamOptions {
		withUsage := withIncludeUsage(fwd.b)
		if fwd != b {
			fwd.release()
		}
		fwd, strip = withUsage, true
	}
	held := len(fwd.b)
	copies := 0 // the bytes of the copies made for each replica (perReplica)
	if req.Endpoint == blockhash.Responses {
		copies += held + 128 // the copy that carries the response's id
	}
	if prio {
		copies += held + 128 + priorityBytes // the copy that carries the priority
	}
	held += copies
	if fwd != b {
		fwd.count(&s.bodies, limit) // the copy is body bytes held too
	}
	if !fwd.hold(held) {
		if fwd != b {
			fwd.release()
		}
		return nil, false, &bodiesInFlightError{limit}
	}
	return fwd, strip, nil
}

// routerKeys reports whether the body req was parsed from gives keys only
// the router sets: kv_transfer_params, priority, or a Responses body's
// request_id.
func routerKeys(req *blockhash.Request) bool {
	return req.KVTransferParams || req.PriorityKey || req.RequestID && req.Endpoint == blockhash.Responses
}

// scrubbed returns body b, a JSON object of API ep, without the keys only
// the router sets: kv_transfer_params, priority, and a Responses body's
// request_id (another API's request_id is the client's, vLLM's
// chatcmpl-<id>).
func scrubbed(b []byte, ep blockhash.Endpoint) ([]byte, error) {
	m, err := fieldsOf(b)
	if err != nil {
		return nil, &blockhash.InputError{Msg: "request body: " + err.Error()}
	}
	return m.rewrite(len(b), func(m fields) {
		delete(m, "kv_transfer_params")
		delete(m, "priority")
		if ep == blockhash.Responses {
			delete(m, "request_id")
		}
	})
}

// forwardRouted forwards a routed request to its replica (failing over
// down its ranking) and ends it, however its response ends: every request,
// with a prompt or not, has this one lifecycle.
func (s *Server) forwardRouted(w http.ResponseWriter, r *http.Request, tctx context.Context, rt *Routed, f *flight) {
	ctx, cancel := context.WithCancel(r.Context()) // the client's context: leaving cancels upstream
	defer cancel()
	up := trace.SpanFromContext(tctx)
	if s.o.Tracer != nil {
		_, up = s.o.Tracer.Start(tctx, "semroute.upstream", trace.WithSpanKind(trace.SpanKindClient))
		ctx = trace.ContextWithSpan(ctx, up)
	}
	f.rt, f.next, f.cancel = rt, 1, cancel
	// ReverseProxy panics with http.ErrAbortHandler when a response breaks
	// off part-way (the client left, or the replica's stream broke); the
	// request's work must end all the same, so its bookkeeping is deferred.
	done := false
	defer func() { s.finish(r, f, up, !done) }()
	s.forward(w, r, ctx, f)
	done = true
}

// finish ends a request: its upstream span, its work and decision
// (Core.Finish, learning the reply of a whole response), and its log line.
// aborted says the response broke off part-way.
func (s *Server) finish(r *http.Request, f *flight, up trace.Span, aborted bool) {
	rt := f.rt
	o := Outcome{Status: f.status}
	if aborted {
		o.Error = "response broken off"
		if r.Context().Err() != nil { // the client left
			o.Status, f.status = 499, 499
		}
	}
	if s.o.Tracer != nil {
		up.SetAttributes(attribute.String("semroute.replica", rt.Served.Replica.Name), attribute.Int("http.response.status_code", f.status))
		if f.status >= 500 || f.status == 0 || aborted {
			up.SetStatus(codes.Error, "upstream status "+strconv.Itoa(f.status))
		}
		up.End()
	}
	endRouted(r.Context(), s.core, s.o.Logger, s.o.RecordReplies, rt, o, f.capture, r.URL.Path, "", s.e.Now().Sub(rt.start))
}

// endRouted ends a routed request as every front end does: the usage its
// capture read (c may be nil) and the reply, learned only from a whole 200
// answer and when recordReplies; Core.Finish; the request's log line
// (front, if not "", names a front end other than HTTP; duration is the
// request's).
func endRouted(ctx context.Context, core *Core, log *slog.Logger, recordReplies bool, rt *Routed, o Outcome, c *replyCapture,
	path, front string, duration time.Duration) {
	var reply []byte
	if c != nil {
		o.PromptTokens, o.OutputTokens, o.CachedTokens, o.CachedReported = c.tokens()
		o.Streamed = c.sse
		if rep, ok := c.reply(); ok && recordReplies && o.Status == http.StatusOK {
			reply = rep
		}
		c.release()
	}
	core.Finish(rt, o, reply)
	var buf [12]slog.Attr // on the stack: the line costs no allocation of its own
	attrs := append(buf[:0], slog.String("id", rt.ID), slog.String("arm", rt.Arm.Name), slog.String("path", path))
	if front != "" {
		attrs = append(attrs, slog.String("front", front))
	}
	log.LogAttrs(ctx, slog.LevelInfo, "request", append(attrs,
		slog.String("replica", rt.Served.Replica.Name), slog.Int("status", o.Status), slog.Int("prompt_tokens", rt.Tokens),
		slog.Int("matched_tokens", rt.Served.Match.Tokens), slog.Int64("cached_tokens", o.CachedTokens),
		slog.String("reason", rt.Served.Reason), slog.Duration("ttft", rt.ttft()), slog.Duration("duration", duration))...)
}

// readBody reads a request's body, up to MaxBodyBytes, into a pooled
// buffer that the caller must release; until then its bytes count against
// MaxBodyBytesInFlight. A body that cannot be read (the client went away,
// or sent less than its Content-Length) is an *blockhash.InputError; a
// body over the limit an *http.MaxBytesError; a body the bodies in flight
// leave no room for an *bodiesInFlightError, with Retry-After set on w.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request) (*body, error) {
	lim := s.limits.Load()
	limit := lim.MaxBodyBytes
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
	if n := r.ContentLength; n >= 0 && n <= bodyPrealloc {
		b = newBody(int(n))
		b.count(&s.bodies, lim.MaxBodyBytesInFlight)
		if !b.hold(int(n)) {
			err = &bodiesInFlightError{lim.MaxBodyBytesInFlight}
		} else {
			_, err = io.ReadFull(rd, b.b)
		}
	} else {
		// Unknown or large: memory follows the bytes that arrive, not the
		// length a client declares (a declared 16 MiB sent one byte at a
		// time would otherwise hold 16 MiB per connection).
		b = newBody(bodyPrealloc)
		b.count(&s.bodies, lim.MaxBodyBytesInFlight)
		err = b.readAll(rd, n)
	}
	if err != nil {
		b.release()
		var tooBig *http.MaxBytesError
		var busy *bodiesInFlightError
		if errors.As(err, &busy) {
			w.Header().Set("Retry-After", "1")
		}
		if errors.As(err, &tooBig) || busy != nil {
			return nil, err
		}
		return nil, &blockhash.InputError{Msg: "reading the request body: " + err.Error()}
	}
	return b, nil
}

// passthrough forwards any other /v1/ request to the least-loaded replica,
// through the same core and proxy as a routed one.
// A path with dot segments (sent percent-encoded, as %2e%2e, so that the
// mux did not clean it) is refused: it would name another path upstream.
func (s *Server) passthrough(w http.ResponseWriter, r *http.Request) { s.passTo(w, r, nil) }

// passTo passes a request without a prompt to the least-loaded replica of
// those allow admits (all, if nil).
func (s *Server) passTo(w http.ResponseWriter, r *http.Request, allow func(*replica.Replica) bool) {
	if e := checkPassPath(r.URL.Path, r.URL.RawPath); e != nil {
		writeError(w, *e)
		return
	}
	body, err := s.readBody(w, r)
	if err != nil {
		writeError(w, classify(err))
		return
	}
	defer body.release()
	cr := CoreRequest{PassThrough: true, Route: "passthrough"}
	cr.Input.Allow, cr.Input.Home = allow, allow != nil
	p, err := s.core.Place(cr)
	if err != nil {
		writeError(w, classify(err))
		return
	}
	s.forwardRouted(w, r, r.Context(), p.Routed, &flight{body: body})
}

// checkPassPath refuses a path that is not to be passed through to a
// replica unvalidated: one with dot segments (sent percent-encoded, as
// %2e%2e, so that no server cleaned it), an encoded / or \, or a backslash
// (each names another path once a server decodes it), and one that names
// a routed endpoint once a server decodes or trims it (chat%2Fcompletions,
// completions;x, chat/completions/): those must be routed and validated.
// path is the decoded path, raw the escaped one ("" if the same).
func checkPassPath(path, raw string) *apiError {
	if hasDotSegment(path) || encodesSeparator(raw) || strings.ContainsRune(path, '\\') {
		return &apiError{http.StatusBadRequest, "invalid_request_error", "invalid_path",
			"the path must not contain . or .. segments, nor an encoded / or \\"}
	}
	if strings.HasPrefix(path, "/v1/chat/completions") || strings.HasPrefix(path, "/v1/completions") || strings.HasPrefix(path, "/v1/messages") {
		e := unknownRoute(path)
		return &e
	}
	if _, ok := storedResponsePath(path); !ok && strings.HasPrefix(path, "/v1/responses") {
		e := unknownRoute(path) // routed, or about a stored response: /v1/responses/, ;x, /x/ and /x/a/b are neither
		return &e
	}
	return nil
}

// storedResponsePath returns the response id of a decoded path about a
// stored response, /v1/responses/{id} or /v1/responses/{id}/{action}, and
// false for any other path.
func storedResponsePath(p string) (id string, ok bool) {
	rest, ok := strings.CutPrefix(p, "/v1/responses/")
	if !ok {
		return "", false
	}
	id, action, more := strings.Cut(rest, "/")
	if id == "" || more && (action == "" || strings.Contains(action, "/")) {
		return "", false
	}
	return id, true
}

// encodesSeparator reports whether a raw (escaped) path encodes a / or a
// \\ (%2F, %5C): a server that decodes before it routes reads another path.
func encodesSeparator(raw string) bool {
	u := strings.ToUpper(raw)
	return strings.Contains(u, "%2F") || strings.Contains(u, "%5C")
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
