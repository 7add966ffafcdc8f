package router

import (
	"cmp"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// The endpoint picker's names, as the Gateway API Inference Extension's
// endpoint-picker protocol defines them
// (kubernetes-sigs/gateway-api-inference-extension,
// docs/proposals/004-endpoint-picker-protocol/README.md; the constants of
// its reference picker, pkg/epp/metadata/consts.go).
const (
	// HeaderDestination is the request header that names the chosen
	// endpoint, "ip:port", followed by the fallbacks, comma-separated. The
	// same value goes in the dynamic metadata MetadataLB / HeaderDestination.
	HeaderDestination = "x-gateway-destination-endpoint"
	// HeaderPrefillerHostPort names, as host:port, the prefill replica of
	// a disaggregated request whose destination is its decode replica:
	// the header llm-d's routing sidecar on the decode pod reads to send
	// the prefill there first.
	HeaderPrefillerHostPort = "x-prefiller-host-port"
	// MetadataLB is the dynamic-metadata namespace of the destination (set
	// by the picker) and of the served endpoint (set by the proxy).
	MetadataLB = "envoy.lb"
	// MetadataSubset and KeySubset: the filter metadata in which the proxy
	// may restrict the picker to a list of "ip:port" endpoints.
	MetadataSubset = "envoy.lb.subset_hint"
	KeySubset      = "x-gateway-destination-endpoint-subset"
	// KeyServed is the key under MetadataLB at which the proxy reports the
	// endpoint that served the request, on the response path.
	KeyServed = "x-gateway-destination-endpoint-served"
)

// Bounds of the endpoint picker.
const (
	// extProcChunk is the most body bytes sent back in one streamed body
	// response: the reference picker's 62,000 ("certain envoy
	// implementations set a max limit of 64Kb per streamed chunk",
	// pkg/common/envoy/chunking.go), and Envoy recommends no more than 64K.
	extProcChunk = 62000
	// extProcFallbacks is how many endpoints follow the first choice in the
	// destination: the proxy tries them in order when it retries.
	extProcFallbacks = 2
)

// ExtProcService is the endpoint picker of a Gateway API Inference
// Extension gateway: it serves Envoy's external processing protocol
// (envoy.service.ext_proc.v3.ExternalProcessor), one stream per HTTP
// request. It reads the request's headers and body (in the
// FULL_DUPLEX_STREAMED body mode the protocol asks for, or BUFFERED),
// parses and routes it exactly as the HTTP front end does (Core.Prepare and
// Core.Admit and Core.Place: the same arms, policies, picture and decision log), and
// answers with the chosen endpoint and its fallbacks in the
// x-gateway-destination-endpoint header and in the envoy.lb dynamic
// metadata. On the response path it reads the endpoint the proxy reports
// as served, and learns the assistant's reply and the engine's usage from
// the response body as the HTTP front end does. A request that cannot be
// routed is answered by the picker itself (an ImmediateResponse with an
// OpenAI-shaped error): 503 when no endpoint can take it, 429 when it is
// shed or the bodies buffered across streams fill ExtProcOptions.Budget,
// 4xx for a bad request. A stream whose messages break the protocol's order
// (see order) is ended with FailedPrecondition.
type ExtProcService struct {
	extprocv3.UnimplementedExternalProcessorServer
	core   *Core
	o      ExtProcOptions
	budget *BodyBudget
}

// ExtProcOptions configure the endpoint picker. Zero fields take the
// defaults.
type ExtProcOptions struct {
	// Limits returns the limits in force, per stream. Nil means the
	// defaults.
	Limits func() limits.Request
	// RecordReplies, MaxReplyBytes and Priorities: as ServerOptions'.
	Priorities    map[string]int
	RecordReplies bool
	MaxReplyBytes int
	// Timeouts bound a stream's silences, as the HTTP front end's bound a
	// replica's: FirstByte from the request's routing to the response's
	// headers, Idle between any other messages, the first one and the
	// request's body chunks included. A stream silent for longer is ended
	// with DeadlineExceeded (and its request with it, its buffered body
	// given back to Budget): a gateway that went away, or a client that
	// holds streams open, does not hold load on a replica nor memory.
	Timeouts limits.Timeouts
	// Budget bounds the request bodies buffered at once across every
	// stream; a request whose body does not fit is answered 429. Each
	// stream's body is also bounded by Limits' MaxBodyBytes (413). Nil
	// means a budget of this service's own of
	// limits.DefaultExtProcBufferBytes.
	Budget *BodyBudget
	// Logger receives one info line per request (as the HTTP front end's)
	// and protocol warnings. Nil means slog.Default().
	Logger *slog.Logger
}

// NewExtProcService returns the endpoint picker over core.
func NewExtProcService(core *Core, o ExtProcOptions) *ExtProcService {
	if o.Limits == nil {
		l := limits.Request{}.WithDefaults()
		o.Limits = func() limits.Request { return l }
	}
	if o.MaxReplyBytes <= 0 {
		o.MaxReplyBytes = limits.DefaultMaxReplyBytes
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	o.Timeouts = o.Timeouts.WithDefaults()
	if o.Budget == nil {
		o.Budget = NewBodyBudget(0)
	}
	return &ExtProcService{core: core, o: o, budget: o.Budget}
}

// Endpoint returns a replica's endpoint as the gateway names it: the host
// and port of its URL ("10.0.0.5:8000", "[fd00::5]:8000"), the port being
// the scheme's default when the URL has none.
func Endpoint(r *replica.Replica) string {
	if r.URL.Port() != "" {
		return r.URL.Host
	}
	port := "80"
	if r.URL.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(r.URL.Hostname(), port)
}

// epStream is one request's state on its ext_proc stream.
type epStream struct {
	s                 *ExtProcService
	srv               extprocv3.ExternalProcessor_ProcessServer
	reqMode, respMode filterv3.ProcessingMode_BodySendMode

	path, method, contentType, session, tenant string
	subset                                     *endpointSet // the gateway's subset hint; nil: none
	placing                                    http.Header  // the objective and fairness headers; nil: none
	// body is the request's body so far; held is the room it holds in the
	// service's budget (its capacity, in bytes), given back by dropBody.
	body []byte
	held int64
	// sawHeaders, sawBody and bodyEOS: what of the request has come;
	// reqEnded: its end came (end_of_stream on its headers or body, or its
	// trailers). Once it is routed, rt is set (a request answered instead
	// ends the stream).
	sawHeaders, sawBody, bodyEOS, reqEnded bool

	rt      *Routed
	prefill *Routed // a disaggregated request's prefill decision, until its answer's headers
	status  int
	capture *replyCapture
	// stripUsage: the router asked the replica for a stream's usage chunk;
	// strip takes it out of the response, if it is a stream.
	stripUsage bool
	strip      *usageStripper
	respEOS    bool
	sawResp    bool // the response's headers came
	start      time.Time

	msgs  chan recvd // from the stream's reader
	timer *time.Timer
}

// recvd is one Recv's result.
type recvd struct {
	req *extprocv3.ProcessingRequest
	err error
}

// recv returns the stream's next message, or a DeadlineExceeded error when
// none came in the silence allowed at this point of the request (see
// ExtProcOptions.Timeouts). A reader goroutine receives, one message at a
// time (the channel is unbuffered, so that a stream holds at most one
// message not yet handled); it ends with the stream, which ends when
// Process returns.
func (st *epStream) recv() (*extprocv3.ProcessingRequest, error) {
	if st.msgs == nil {
		st.msgs = make(chan recvd)
		go func() {
			for {
				req, err := st.srv.Recv()
				select {
				case st.msgs <- recvd{req, err}:
				case <-st.srv.Context().Done(): // Process returned
					return
				}
				if err != nil {
					return
				}
			}
		}()
	}
	bound, name := st.s.o.Timeouts.Idle, "timeouts.idle"
	if st.rt != nil && !st.sawResp {
		bound, name = st.s.o.Timeouts.FirstByte, "timeouts.first_byte"
	}
	if st.timer == nil {
		st.timer = time.NewTimer(bound)
	} else {
		st.timer.Reset(bound)
	}
	select {
	case m := <-st.msgs:
		return m.req, m.err
	case <-st.srv.Context().Done(): // the gateway cancelled, or went away
		return nil, status.FromContextError(st.srv.Context().Err()).Err()
	case <-st.timer.C:
		st.s.refused("silent")
		return nil, status.Errorf(codes.DeadlineExceeded, "ext_proc: the stream sent nothing for %v (%s): it is ended", bound, name)
	}
}

// Process implements extprocv3.ExternalProcessorServer.
func (s *ExtProcService) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	st := &epStream{s: s, srv: srv, reqMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED,
		respMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, start: time.Now()}
	defer st.finish()
	first := true
	for {
		req, err := st.recv()
		if err == io.EOF || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		if pc := req.GetProtocolConfig(); pc != nil && first { // set in the initial message only
			st.reqMode, st.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
		}
		first = false
		if what := st.order(req); what != "" {
			st.s.refused("out_of_order")
			return status.Error(codes.FailedPrecondition, "ext_proc: "+what)
		}
		done, err := st.handle(req)
		if err != nil || done {
			return err
		}
	}
}

// handle answers one message, one order allowed at this point of the
// stream; done says the stream is over (an immediate response was sent).
func (st *epStream) handle(req *extprocv3.ProcessingRequest) (done bool, err error) {
	switch v := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.requestHeaders(v.RequestHeaders, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.requestBody(v.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		st.reqEnded = true
		if st.rt == nil { // the body ended without end_of_stream: trailers end it
			if done, err := st.route(false); done || err != nil {
				return done, err
			}
		}
		return false, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
			RequestTrailers: &extprocv3.TrailersResponse{}}})
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return false, st.responseHeaders(v.ResponseHeaders, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_ResponseBody:
		return false, st.responseBody(v.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		st.respEOS = true
		if st.strip != nil { // a last event the stream did not end with a blank line
			if rest := st.strip.push(nil, true); len(rest) > 0 { // (strip is full-duplex only)
				if err := st.sendBody(false, rest, false); err != nil {
					return false, err
				}
			}
		}
		if st.capture != nil {
			st.capture.feed(nil, true)
		}
		return false, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}})
	}
	return false, status.Error(codes.InvalidArgument, "ext_proc: a processing request of an unknown kind")
}

func (st *epStream) requestHeaders(h *extprocv3.HttpHeaders, md *corev3.Metadata) (bool, error) {
	st.sawHeaders = true
	for _, hv := range h.GetHeaders().GetHeaders() {
		v := headerValue(hv)
		switch strings.ToLower(hv.GetKey()) {
		case ":path":
			st.path, _, _ = strings.Cut(v, "?")
		case ":method":
			st.method = v
		case "content-type":
			st.contentType = v
		case "x-session-id":
			st.session = v
		case "x-tenant-id":
			st.tenant = v
		case "x-gateway-inference-objective", "x-llm-d-inference-objective", "x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id":
			if st.placing == nil {
				st.placing = http.Header{}
			}
			st.placing.Set(hv.GetKey(), v) // the queue's placement (Server.placement)
		}
	}
	st.subset = subsetHint(md)
	if h.GetEndOfStream() { // no body: nothing to parse
		st.reqEnded = true
		return st.route(true)
	}
	switch st.reqMode {
	case filterv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return false, nil // the headers are answered once the body is in
	case filterv3.ProcessingMode_BUFFERED, filterv3.ProcessingMode_BUFFERED_PARTIAL:
		return false, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{}}})
	}
	// NONE and STREAMED want the headers answered before the body comes:
	// the endpoint would be picked without the prompt.
	return st.reject(apiError{http.StatusInternalServerError, "server_error", "ext_proc_body_mode",
		"the endpoint picker needs the request body: set the ext_proc filter's request_body_mode to FULL_DUPLEX_STREAMED (or BUFFERED)"})
}

// errBufferFull answers a request whose body does not fit in the bodies
// buffered across streams (ExtProcOptions.Budget): the picker is
// overloaded, and the gateway may retry, as for a request shed.
var errBufferFull = apiError{http.StatusTooManyRequests, "rate_limit_exceeded", "ext_proc_buffer_full",
	"the endpoint picker is buffering as many request bodies as it may: retry later"}

func (st *epStream) requestBody(b *extprocv3.HttpBody) (bool, error) {
	chunk := b.GetBody()
	limit := st.s.o.Limits().MaxBodyBytes
	if int64(len(st.body)+len(chunk)) > limit {
		st.s.refused("body_too_large")
		return st.reject(classify(&http.MaxBytesError{Limit: limit}))
	}
	if !st.buffer(chunk, limit) {
		st.s.refused("buffer_full")
		return st.reject(errBufferFull)
	}
	st.sawBody, st.bodyEOS = true, b.GetEndOfStream()
	st.reqEnded = st.bodyEOS
	switch {
	case st.bodyEOS:
	case st.reqMode == filterv3.ProcessingMode_BUFFERED:
		// The whole body, followed by trailers (Envoy's onTrailers sends a
		// buffered body without end_of_stream and waits for its answer).
	case st.reqMode == filterv3.ProcessingMode_BUFFERED_PARTIAL:
		// Envoy sent what fit in its buffer: the prompt is cut short.
		return st.reject(apiError{http.StatusRequestEntityTooLarge, "invalid_request_error", "body_too_large",
			"the request body is larger than the gateway's ext_proc buffer (BUFFERED_PARTIAL): raise its limit, or use FULL_DUPLEX_STREAMED"})
	default:
		return false, nil
	}
	return st.route(false)
}

// buffer appends chunk to the body, whose length with chunk is at most
// limit bytes. When the buffer must grow, the new one's room is taken from
// the budget before the old one's is given back: twice the old capacity
// (at most limit) if the budget has room for it, else just enough; false
// when the budget has not even that.
func (st *epStream) buffer(chunk []byte, limit int64) bool {
	need := len(st.body) + len(chunk)
	if need > cap(st.body) {
		size := max(need, int(min(2*int64(cap(st.body)), limit)))
		if !st.s.budget.take(int64(size)) {
			if size = need; !st.s.budget.take(int64(size)) {
				return false
			}
		}
		grown := make([]byte, len(st.body), size)
		copy(grown, st.body)
		st.s.budget.give(st.held)
		st.body, st.held = grown, int64(size)
	}
	st.body = append(st.body, chunk...)
	return true
}

// dropBody lets the body go and gives its room back to the budget.
func (st *epStream) dropBody() {
	st.s.budget.give(st.held)
	st.body, st.held = nil, 0
}

// order returns what is out of order if req may not come at this point of
// the stream, or "". Envoy sends one request's messages in the order of
// the HTTP exchange (envoy.service.ext_proc.v3.ExternalProcessor, the
// ProcessingRequest and HttpBody messages): the request's headers once;
// its body chunks, the last with end_of_stream unless trailers follow;
// its trailers at most once; then, once the picker has answered with the
// destination, the response's headers, body and trailers likewise. End of
// stream on a headers message means neither body nor trailers follow.
func (st *epStream) order(req *extprocv3.ProcessingRequest) string {
	switch req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		if st.sawHeaders {
			return "request headers twice on one stream"
		}
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.requestOrder("request body", true)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return st.requestOrder("request trailers", false)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		if what := st.responseOrder("response headers"); what != "" {
			return what
		}
		if st.sawResp {
			return "response headers twice on one stream"
		}
	case *extprocv3.ProcessingRequest_ResponseBody:
		return st.responseBodyOrder("response body")
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return st.responseBodyOrder("response trailers")
	}
	return ""
}

// requestOrder: the request's body or trailers (what) may come after its
// headers, until its end; a body chunk not after it was routed (a
// buffered body is routed before the trailers come).
func (st *epStream) requestOrder(what string, body bool) string {
	switch {
	case !st.sawHeaders:
		return what + " before the request headers"
	case st.reqEnded:
		return what + " after the request's end_of_stream"
	case body && st.rt != nil:
		return what + " after the request was routed"
	}
	return ""
}

// responseOrder: no response message (what) before the request was
// routed: the gateway had no destination to send it to.
func (st *epStream) responseOrder(what string) string {
	switch {
	case !st.sawHeaders:
		return what + " before the request headers"
	case st.rt == nil:
		return what + " before the request was routed"
	}
	return ""
}

// responseBodyOrder: the response's body or trailers (what) come after its
// headers, until its end.
func (st *epStream) responseBodyOrder(what string) string {
	switch w := st.responseOrder(what); {
	case w != "":
		return w
	case !st.sawResp:
		return what + " before the response headers"
	case st.respEOS:
		return what + " after the response's end_of_stream"
	}
	return ""
}

// route parses and routes the request whose headers and body are in, and
// sends the proxy its destination (with the body, in full-duplex mode);
// noBody says the headers ended the request. The body is let go (and its
// room in the budget given back) once it is answered.
func (st *epStream) route(noBody bool) (bool, error) {
	defer st.dropBody()
	in, fwd, e := st.input()
	if e != nil {
		return st.reject(*e)
	}
	if sub := st.subset; sub != nil {
		home := in.Input.Allow // the stored response's replica, if any
		in.Input.Allow = func(r *replica.Replica) bool { return sub.has(Endpoint(r)) && (home == nil || home(r)) }
	}
	in.Ctx = st.srv.Context()
	in.Whole = in.Disaggregate && !splittable(fwd)
	p, err := st.s.core.Place(in)
	if err != nil {
		e := classify(err)
		if errors.As(err, new(*QueueError)) {
			e.status = http.StatusServiceUnavailable // the endpoint picker's answer when no endpoint can take it
		}
		return st.reject(e)
	}
	st.rt = p.Routed
	if p.Fallback != nil {
		st.s.o.Logger.Warn("no prefill replica for a disaggregated request: its decode replica computes the prompt", "err", p.Fallback, "decode", p.Served.Replica.Name)
	}
	return st.destine(p.Routed, fwd, noBody, st.prefillOn(p.Prefill)...)
}

// prefillOn takes prt, the prefill decision of a disaggregated request
// whose decode replica is the destination (nil: none), as llm-d's
// scheduler does: the proxy's decode sidecar (llm-d's routing sidecar)
// sends the prefill there, named by HeaderPrefillerHostPort, then the
// request to its decode engine with the answer's kv_transfer_params. It
// returns the headers to set.
func (st *epStream) prefillOn(prt *Routed) []*corev3.HeaderValueOption {
	if prt == nil {
		return nil
	}
	st.prefill = prt
	st.rt.SetRemote()
	st.s.core.o.Metrics.disaggregated("disaggregated")
	return []*corev3.HeaderValueOption{setHeader(HeaderPrefillerHostPort, Endpoint(prt.Served.Replica)), setHeader(HeaderPrefillReplica, prt.Served.Replica.Name)}
}

// prefilled ends the prefill decision of a disaggregated request, if any,
// with status, the decode's: its answer's headers come after the sidecar
// had the prefill's answer.
func (st *epStream) prefilled(status int) {
	if prt := st.prefill; prt != nil {
		st.prefill = nil
		st.s.core.FirstByte(prt)
		st.s.core.Finish(prt, Outcome{Status: status}, nil)
	}
}

// routedPaths are the paths routed by prefix, and their APIs.
var routedPaths = map[string]blockhash.Endpoint{"/v1/chat/completions": blockhash.Chat, "/v1/completions": blockhash.Completion,
	"/v1/responses": blockhash.Responses, "/v1/messages": blockhash.Messages}

// input makes the core's request of the stream's: an inference request
// parsed and prepared, anything else passed through with the HTTP front
// end's guards. fwd is the body to forward (with the stream's usage asked
// for, where the picker takes it out again). A request refused says why.
func (st *epStream) input() (in CoreRequest, fwd []byte, refused *apiError) {
	in = CoreRequest{Session: st.session, Tenant: st.tenant}
	ep, routed := routedPaths[st.path]
	if !routed {
		return st.passInput(in)
	}
	if st.method != http.MethodPost {
		return in, nil, &apiError{http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "use POST for " + st.path}
	}
	lim := st.s.o.Limits()
	ad, err := st.s.core.Admit(Arrival{API: ep, Body: st.body, ContentType: st.contentType, Session: st.session, Tenant: st.tenant,
		Header: st.placing.Get, Priorities: st.s.o.Priorities, Route: "ext_proc", Ctx: st.srv.Context(), Disaggregates: true}, &lim)
	if err != nil {
		e := shedOr(err)
		return in, nil, &e
	}
	defer ad.Recycle()
	fwd, e := st.upstream(ad.Parsed)
	return ad.CoreRequest, fwd, e
}

// passInput makes the core's request of a stream that is not routed by
// prefix: passed through with the HTTP front end's guards, and a request
// about a stored response sent to its home, or refused as the HTTP front
// end's storedResponse refuses it.
func (st *epStream) passInput(in CoreRequest) (CoreRequest, []byte, *apiError) {
	decoded, err := url.PathUnescape(st.path)
	if err != nil {
		return in, nil, &apiError{http.StatusBadRequest, "invalid_request_error", "invalid_path", "the path is not valid percent-encoding"}
	}
	if e := checkPassPath(decoded, st.path); e != nil {
		return in, nil, e
	}
	in.PassThrough, in.Route = true, "passthrough"
	if id, ok := storedResponsePath(decoded); ok {
		allow, refused := st.s.core.ids.home(id, st.tenant)
		if refused {
			e := errNotYours
			return in, nil, &e
		}
		in.Input.Allow, in.Input.Home = allow, allow != nil
	}
	return in, st.body, nil
}

// upstream returns the body to forward for the stream's body, parsed as
// req: without the keys only the router sets (Server.upstreamBody), and
// asking for the stream's usage where the picker can take it out again.
func (st *epStream) upstream(req *blockhash.Request) ([]byte, *apiError) {
	fwd := st.body
	if routerKeys(req) {
		var err error
		if fwd, err = scrubbed(fwd, req.Endpoint); err != nil {
			e := classify(err)
			return nil, &e
		}
	}
	if chatLike(req.Endpoint) && req.Stream && !req.StreamOptions && st.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		// As the HTTP front end: the replica is asked for the stream's
		// usage, and its usage chunk is taken out of the client's stream
		// (in the full-duplex response mode only: in the others the
		// picker cannot hold back what it takes out, or sees no body).
		fwd = withIncludeUsage(fwd).b
		st.stripUsage = true
	}
	return fwd, nil
}

// destinations is the destination header's value for ranked, the first
// and its fallbacks, those of them same allows, each endpoint once, and the
// first's data-parallel rank. The rank is named in a header the proxy
// sends to every destination, so a first choice that is a rank has as
// fallbacks only other engines' same rank.
func destinations(ranked []routing.Candidate, same func(*replica.Replica) bool) (string, replica.DataParallel) {
	var dp replica.DataParallel
	if len(ranked) > 0 {
		dp = ranked[0].Replica.DataParallel
	}
	dest := make([]string, 0, len(ranked))
	for i := range ranked {
		r := ranked[i].Replica
		if ep := Endpoint(r); same(r) && r.DataParallel.On() == dp.On() && r.DataParallel.Rank == dp.Rank && !slices.Contains(dest, ep) {
			dest = append(dest, ep)
		}
	}
	return strings.Join(dest, ","), dp
}

// destine sends the proxy rt's destination (and its fallbacks), with fwd
// where the body changed or, in full-duplex mode, the body itself; noBody
// says the headers ended the request.
func (st *epStream) destine(rt *Routed, fwd []byte, noBody bool, extra ...*corev3.HeaderValueOption) (bool, error) {
	n := min(len(rt.Ranked), 1+extProcFallbacks)
	if rt.req.API == blockhash.Responses && len(rt.Ranked) > 0 {
		// The response's id names the replica that stores it: the first
		// choice alone, or a fallback would store what the id denies.
		n = 1
		fwd = withRequestID(fwd, st.s.core.ids.issue(rt.Ranked[0].Replica.Name, rt.req.Tenant)).b
	}
	// One body goes to every destination: with the request's priority
	// when the first schedules by priority (engineprio.go), and then only
	// to fallbacks that do too; without it, to those that do not.
	same := func(*replica.Replica) bool { return true }
	if len(rt.Ranked) > 0 && prioritizes(rt.req.API, rt.req.Priority) {
		first := rt.Ranked[0].Replica.Scheduling.Prioritized()
		same = func(r *replica.Replica) bool { return r.Scheduling.Prioritized() == first }
		if p := enginePriority(rt.Ranked[0].Replica, rt.req.API, rt.req.Priority); p != 0 {
			fwd = withPriority(fwd, p).b
		}
	}
	value, dp := destinations(rt.Ranked[:n], same)
	mut := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
		setHeader(HeaderDestination, value), setHeader(HeaderArm, rt.Arm.Name)},
		RemoveHeaders: []string{strings.ToLower(replica.HeaderDataParallelRank)}}
	if dp.On() {
		mut.SetHeaders = append(mut.SetHeaders, setHeader(strings.ToLower(replica.HeaderDataParallelRank), strconv.Itoa(dp.Rank)))
		mut.RemoveHeaders = nil
	}
	mut.SetHeaders = append(mut.SetHeaders, extra...)
	changed := !sameBytes(fwd, st.body)
	if changed {
		mut.SetHeaders = append(mut.SetHeaders, setHeader("content-length", strconv.Itoa(len(fwd))))
	}
	meta := &structpb.Struct{Fields: map[string]*structpb.Value{MetadataLB: structpb.NewStructValue(&structpb.Struct{
		Fields: map[string]*structpb.Value{HeaderDestination: structpb.NewStringValue(value)}})}}
	common := &extprocv3.CommonResponse{HeaderMutation: mut, ClearRouteCache: true}
	if noBody || st.reqMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		err := st.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta, Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{Response: common}}})
		if err != nil || noBody || !st.sawBody {
			return false, err
		}
		// end_of_stream only if the body's did: else trailers follow.
		return false, st.sendBody(true, fwd, st.bodyEOS)
	}
	// Buffered: the headers were answered; the body's answer carries the
	// destination, and the body if it changed.
	if changed {
		common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: fwd}}
	}
	return false, st.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta, Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: common}}})
}

// sameBytes reports whether a and b are one slice (not equal contents:
// the same memory), as a body the picker did not change is.
func sameBytes(a, b []byte) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// shedOr classifies err as the HTTP front end does, but for a request shed
// because the router is saturated (its parse budget is spent), which the
// endpoint-picker protocol answers with 429: the gateway may retry it.
func shedOr(err error) apiError {
	if errors.Is(err, blockhash.ErrBusy) {
		return apiError{http.StatusTooManyRequests, "rate_limit_exceeded", "shed", err.Error()}
	}
	return classify(err)
}

// sendBody sends b back as streamed body responses of at most extProcChunk
// bytes, on the request (request true) or response path; eos marks the
// last. An empty b is one empty response.
func (st *epStream) sendBody(request bool, b []byte, eos bool) error {
	for first := true; first || len(b) > 0; first = false {
		n := min(len(b), extProcChunk)
		chunk := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
			Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
				Body: b[:n], EndOfStream: eos && n == len(b)}}}}}
		b = b[n:]
		resp := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: chunk}}
		if request {
			resp.Response = &extprocv3.ProcessingResponse_RequestBody{RequestBody: chunk}
		}
		if err := st.send(resp); err != nil {
			return err
		}
	}
	return nil
}

func (st *epStream) responseHeaders(h *extprocv3.HttpHeaders, md *corev3.Metadata) error {
	st.sawResp = true
	sse := false
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch strings.ToLower(hv.GetKey()) {
		case ":status":
			st.status, _ = strconv.Atoi(headerValue(hv))
		case "content-type":
			sse = strings.HasPrefix(headerValue(hv), "text/event-stream")
		}
	}
	st.prefilled(st.status)
	resp := &extprocv3.HeadersResponse{}
	if rt := st.rt; rt != nil {
		if served := servedEndpoint(md); served != "" {
			st.moveTo(served)
		}
		set := []*corev3.HeaderValueOption{setHeader(HeaderReplica, rt.Served.Replica.Name)}
		if !rt.req.PassThrough {
			set = append(set, setHeader(HeaderMatchedTokens, strconv.Itoa(rt.Served.Predicted())))
			st.capture = &replyCapture{limit: st.s.o.MaxReplyBytes, sse: sse, lim: st.s.o.Limits().Parse, first: func() { st.s.core.FirstByte(rt) },
				end: func() { st.s.core.EngineDone(rt) }}
			st.s.core.readyCapture(st.capture, rt, rt.Served.Replica.Name)
		} else {
			st.s.core.FirstByte(rt)
		}
		if st.stripUsage && sse { // a stream: its usage chunk comes out
			st.strip = newUsageStripper(nil, st.s.o.Limits().Parse)
		}
		resp.Response = &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}
		if st.strip != nil {
			resp.Response.HeaderMutation.RemoveHeaders = []string{"content-length"}
		}
	}
	if h.GetEndOfStream() {
		st.respEOS = true
		if st.capture != nil {
			st.capture.feed(nil, true)
		}
	}
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: resp}})
}

// moveTo follows the proxy's report of the endpoint that served the
// request: when it is a fallback rather than the first choice, the
// request's work and learned reply move to that replica.
func (st *epStream) moveTo(served string) {
	rt := st.rt
	at := newEndpointSet([]string{served})
	if at.has(Endpoint(rt.Served.Replica)) {
		return
	}
	for i := range rt.Ranked {
		if at.has(Endpoint(rt.Ranked[i].Replica)) {
			st.s.core.Failover(rt, i)
			return
		}
	}
	st.s.o.Logger.Warn("ext_proc: the gateway served the request from an endpoint the picker did not name", "served", served, "id", rt.ID)
}

func (st *epStream) responseBody(b *extprocv3.HttpBody) error {
	chunk, eos := b.GetBody(), b.GetEndOfStream()
	if st.capture != nil {
		st.capture.feed(chunk, eos)
	}
	st.respEOS = st.respEOS || eos
	out := chunk
	if st.strip != nil {
		out = st.strip.push(chunk, eos)
	}
	if st.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		return st.sendBody(false, out, eos)
	}
	// The other modes: the body passes unchanged (nothing is stripped
	// there: see route).
	return st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}})
}

// reject answers the request with an error of the picker's own, which
// ends the stream.
func (st *epStream) reject(e apiError) (bool, error) {
	body := errorJSON(e)
	if st.path == "/v1/messages" {
		e.status, body = anthropicError(e)
	}
	err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(e.status)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{setHeader("content-type", "application/json")}},
			Body:    body,
			Details: e.code,
		}}})
	return true, err
}

func (st *epStream) send(r *extprocv3.ProcessingResponse) error { return st.srv.Send(r) }

// extProcRefusals are the reasons a stream is refused, as counted in
// semroute_ext_proc_refused_total.
var extProcRefusals = []string{"buffer_full", "body_too_large", "silent", "out_of_order"}

// refused counts a stream refused for reason, one of extProcRefusals.
func (s *ExtProcService) refused(reason string) { s.core.o.Metrics.extProcRefusal(reason) }

// finish ends the request when its stream ends: the body's room in the
// budget, its work, the reply learned, the decision log and the request's
// log line.
func (st *epStream) finish() {
	st.dropBody()
	st.prefilled(cmp.Or(st.status, 499)) // no answer: the prefill's end is not known
	rt := st.rt
	if rt == nil {
		return
	}
	o := Outcome{Status: st.status}
	if !st.respEOS {
		o.Error = "response broken off"
		if o.Status == 0 {
			o.Status = 499
		}
	}
	endRouted(context.Background(), st.s.core, st.s.o.Logger, st.s.o.RecordReplies, rt, o, st.capture, st.path, "ext_proc", time.Since(st.start))
}

// headerValue is a header's value: Envoy sends it in raw_value.
func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
}

// subsetHint returns the gateway's subset hint: the endpoints under
// MetadataSubset / KeySubset (a list of strings; a comma-separated string
// is read too), or nil when there is none. An empty list is an empty,
// non-nil subset: no endpoint may be picked.
func subsetHint(md *corev3.Metadata) *endpointSet {
	ns, ok := md.GetFilterMetadata()[MetadataSubset]
	if !ok {
		return nil
	}
	v, ok := ns.GetFields()[KeySubset]
	if !ok {
		return nil
	}
	var out []string
	switch x := v.GetKind().(type) {
	case *structpb.Value_ListValue:
		for _, e := range x.ListValue.GetValues() {
			if s := strings.TrimSpace(e.GetStringValue()); s != "" {
				out = append(out, s)
			}
		}
	case *structpb.Value_StringValue:
		for _, s := range strings.Split(x.StringValue, ",") {
			if s = strings.TrimSpace(s); s != "" {
				out = append(out, s)
			}
		}
	}
	return newEndpointSet(out)
}

// servedEndpoint returns the endpoint the proxy reports as served, or "".
func servedEndpoint(md *corev3.Metadata) string {
	return md.GetFilterMetadata()[MetadataLB].GetFields()[KeyServed].GetStringValue()
}

// endpointSet is a set of endpoints, built once per request so that
// testing each replica against it is a map read: "host:port" entries, and
// entries that name a host alone (which admit any port of it). A nil set
// is no set; an empty one admits nothing.
type endpointSet struct {
	full, hosts map[string]struct{}
}

// newEndpointSet returns the set of list's entries.
func newEndpointSet(list []string) *endpointSet {
	set := &endpointSet{full: map[string]struct{}{}, hosts: map[string]struct{}{}}
	for _, e := range list {
		if _, _, err := net.SplitHostPort(e); err != nil { // a host alone
			set.hosts[strings.Trim(e, "[]")] = struct{}{}
		} else {
			set.full[e] = struct{}{}
		}
	}
	return set
}

// has reports whether endpoint ("host:port") is in the set, by itself or
// by its host.
func (s *endpointSet) has(endpoint string) bool {
	if _, ok := s.full[endpoint]; ok {
		return true
	}
	host, _, _ := net.SplitHostPort(endpoint)
	_, ok := s.hosts[host]
	return ok
}
