package router

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
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
// Core.Route: the same arms, policies, picture and decision log), and
// answers with the chosen endpoint and its fallbacks in the
// x-gateway-destination-endpoint header and in the envoy.lb dynamic
// metadata. On the response path it reads the endpoint the proxy reports
// as served, and learns the assistant's reply and the engine's usage from
// the response body as the HTTP front end does. A request that cannot be
// routed is answered by the picker itself (an ImmediateResponse with an
// OpenAI-shaped error): 503 when no endpoint can take it, 429 when it is
// shed, 4xx for a bad request.
type ExtProcService struct {
	extprocv3.UnimplementedExternalProcessorServer
	core *Core
	o    ExtProcOptions
}

// ExtProcOptions configure the endpoint picker. Zero fields take the
// defaults.
type ExtProcOptions struct {
	// Limits returns the limits in force, per stream. Nil means the
	// defaults.
	Limits func() limits.Request
	// RecordReplies and MaxReplyBytes: as ServerOptions'.
	RecordReplies bool
	MaxReplyBytes int
	// Timeouts bound a stream's silences, as the HTTP front end's bound a
	// replica's: FirstByte from the request's routing to the response's
	// headers, Idle between any other messages. A stream silent for longer
	// is ended (and its request with it): a gateway that went away, or a
	// client that holds streams open, does not hold load on a replica.
	Timeouts limits.Timeouts
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
	return &ExtProcService{core: core, o: o}
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
	body                                       []byte
	// sawHeaders, sawBody and bodyEOS: what of the request has come. Once
	// it is routed, rt is set (a request answered instead ends the stream).
	sawHeaders, sawBody, bodyEOS bool

	rt      *Routed
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

// errSilent ends a stream silent past its bound.
var errSilent = status.Error(codes.DeadlineExceeded, "ext_proc: the stream was silent for too long")

// recv returns the stream's next message, or errSilent when none came in
// the silence allowed at this point of the request (see
// ExtProcOptions.Timeouts). A reader goroutine receives; it ends with the
// stream, which ends when Process returns.
func (st *epStream) recv() (*extprocv3.ProcessingRequest, error) {
	if st.msgs == nil {
		st.msgs = make(chan recvd, 1)
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
	bound := st.s.o.Timeouts.Idle
	if st.rt != nil && !st.sawResp {
		bound = st.s.o.Timeouts.FirstByte
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
		return nil, errSilent
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
		done, err := st.handle(req)
		if err != nil || done {
			return err
		}
	}
}

// handle answers one message; done says the stream is over (an immediate
// response was sent).
func (st *epStream) handle(req *extprocv3.ProcessingRequest) (done bool, err error) {
	switch v := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return st.requestHeaders(v.RequestHeaders, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_RequestBody:
		return st.requestBody(v.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if !st.sawHeaders {
			return false, status.Error(codes.FailedPrecondition, "ext_proc: request trailers before the headers")
		}
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
	if st.sawHeaders {
		return false, status.Error(codes.FailedPrecondition, "ext_proc: request headers twice on one stream")
	}
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
		}
	}
	st.subset = subsetHint(md)
	if h.GetEndOfStream() { // no body: nothing to parse
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

func (st *epStream) requestBody(b *extprocv3.HttpBody) (bool, error) {
	switch {
	case !st.sawHeaders:
		return false, status.Error(codes.FailedPrecondition, "ext_proc: request body before the headers")
	case st.rt != nil:
		return false, status.Error(codes.FailedPrecondition, "ext_proc: request body after the request was routed")
	}
	if limit := st.s.o.Limits().MaxBodyBytes; int64(len(st.body)+len(b.GetBody())) > limit {
		return st.reject(classify(&http.MaxBytesError{Limit: limit}))
	}
	st.sawBody, st.bodyEOS = true, b.GetEndOfStream()
	st.body = append(st.body, b.GetBody()...)
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

// route parses and routes the request whose headers and body are in, and
// sends the proxy its destination (with the body, in full-duplex mode);
// noBody says the headers ended the request.
func (st *epStream) route(noBody bool) (bool, error) {
	core := st.s.core
	in := CoreRequest{Session: st.session, Tenant: st.tenant}
	var allow func(*replica.Replica) bool
	if sub := st.subset; sub != nil {
		allow = func(r *replica.Replica) bool { return sub.has(Endpoint(r)) }
	}
	fwd := st.body
	var ep blockhash.Endpoint
	if st.path == "/v1/completions" {
		ep = blockhash.Completion
	}
	if st.path != "/v1/chat/completions" && st.path != "/v1/completions" {
		// As the HTTP front end's pass-through, with the same guards.
		decoded, err := url.PathUnescape(st.path)
		if err != nil {
			return st.reject(apiError{http.StatusBadRequest, "invalid_request_error", "invalid_path", "the path is not valid percent-encoding"})
		}
		if e := checkPassPath(decoded, st.path); e != nil {
			return st.reject(*e)
		}
		in.PassThrough, in.Route = true, "passthrough"
	} else {
		if st.method != http.MethodPost {
			return st.reject(apiError{http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed",
				"use POST for " + st.path})
		}
		if e := checkBodyType(st.contentType, st.body); e != nil {
			return st.reject(*e)
		}
		lim := st.s.o.Limits()
		req, err := blockhash.Parse(ep, st.body, lim.Parse)
		if err != nil {
			return st.reject(shedOr(err))
		}
		if e := maxTokensError(req.MaxTokens, &lim); e != nil {
			req.Release()
			return st.reject(*e)
		}
		in.Input = core.Prepare(st.srv.Context(), req, st.body, st.session)
		in.Input.DetachText()
		in.Model, in.Route = req.Model, "ext_proc"
		if req.Stream && !req.StreamOptions && st.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
			// As the HTTP front end: the replica is asked for the stream's
			// usage, and its usage chunk is taken out of the client's stream
			// (in the full-duplex response mode only: in the others the
			// picker cannot hold back what it takes out, or sees no body).
			fwd = withIncludeUsage(st.body).b
			st.stripUsage = true
		}
		req.Release()
	}
	in.Input.Allow = allow
	rt, err := core.Route(in)
	if err != nil {
		return st.reject(classify(err))
	}
	st.rt = rt
	dest := make([]string, 0, 1+extProcFallbacks)
	for i := range rt.Ranked[:min(len(rt.Ranked), 1+extProcFallbacks)] {
		dest = append(dest, Endpoint(rt.Ranked[i].Replica))
	}
	value := strings.Join(dest, ",")
	mut := &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
		setHeader(HeaderDestination, value), setHeader(HeaderArm, rt.Arm.Name)}}
	if len(fwd) != len(st.body) {
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
	if len(fwd) != len(st.body) {
		common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: fwd}}
	}
	return false, st.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta, Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: &extprocv3.BodyResponse{Response: common}}})
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
	resp := &extprocv3.HeadersResponse{}
	if rt := st.rt; rt != nil {
		if served := servedEndpoint(md); served != "" {
			st.moveTo(served)
		}
		set := []*corev3.HeaderValueOption{setHeader(HeaderReplica, rt.Served.Replica.Name)}
		if !rt.req.PassThrough {
			set = append(set, setHeader(HeaderMatchedTokens, strconv.Itoa(rt.Served.Match.Confirmed)))
			st.capture = &replyCapture{limit: st.s.o.MaxReplyBytes, sse: sse, first: func() { st.s.core.FirstByte(rt) },
				end: func() { st.s.core.EngineDone(rt) }}
		} else {
			st.s.core.FirstByte(rt)
		}
		if st.stripUsage && sse { // a stream: its usage chunk comes out
			st.strip = newUsageStripper(nil)
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

// finish ends the request when its stream ends: its work, the reply
// learned, the decision log and the request's log line.
func (st *epStream) finish() {
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
