package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/router"
)

// envoy plays Envoy's side of the ext_proc protocol against a router's
// endpoint picker, and Envoy's forwarding: it sends the request to the
// endpoint picked, over HTTP, and streams the response back through the
// picker, as an ext_proc filter in FULL_DUPLEX_STREAMED (or BUFFERED) mode
// does.
type envoy struct {
	t      *testing.T
	client extprocv3.ExternalProcessorClient
	mode   filterv3.ProcessingMode_BodySendMode
	// chunk is the size of the body chunks sent to the picker.
	chunk int
}

// newEnvoy connects to d's gRPC listener with its token, as Envoy does with
// the grpc_service's initial_metadata.
func newEnvoy(t *testing.T, d *demo) *envoy {
	t.Helper()
	return &envoy{t: t, client: extprocv3.NewExternalProcessorClient(dial(t, d)), mode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, chunk: 700}
}

// picked is what the picker answered and, when forwarded, what came back.
type picked struct {
	dest      string            // the destination header
	meta      string            // envoy.lb / x-gateway-destination-endpoint
	immediate int               // the status of an immediate response; 0: none
	errBody   []byte            // its body
	status    int               // the replica's status
	respHdr   map[string]string // headers the picker set on the response
	reqHdr    map[string]string // headers the picker set on the request
	body      []byte            // the response body the client gets
	upstream  []byte            // the request body sent to the endpoint
}

func hdrs(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

func subsetMD(endpoints ...string) *corev3.Metadata {
	vals := make([]*structpb.Value, len(endpoints))
	for i, e := range endpoints {
		vals[i] = structpb.NewStringValue(e)
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{router.MetadataSubset: {Fields: map[string]*structpb.Value{
		router.KeySubset: structpb.NewListValue(&structpb.ListValue{Values: vals})}}}}
}

// do sends one request through the picker: headers, the body in chunks,
// then (if forward) the request to the first endpoint picked, and its
// response back through the picker. served, if set, overrides the
// endpoint Envoy reports as served (and forwards to).
func (e *envoy) do(path string, body []byte, hdr map[string]string, md *corev3.Metadata, forward bool, served string) picked {
	t := e.t
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := e.client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kv := []string{":method", "POST", ":path", path, ":authority", "gateway", "content-type", "application/json"}
	for k, v := range hdr {
		kv = append(kv, strings.ToLower(k), v)
	}
	send := func(r *extprocv3.ProcessingRequest) {
		t.Helper()
		if err := st.Send(r); err != nil {
			t.Fatal(err)
		}
	}
	recv := func() *extprocv3.ProcessingResponse {
		t.Helper()
		r, err := st.Recv()
		if err != nil {
			t.Fatalf("recv: %v", err)
		}
		return r
	}
	send(&extprocv3.ProcessingRequest{MetadataContext: md,
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: e.mode, ResponseBodyMode: e.mode},
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs(kv...)}}})
	var p picked
	var upstream []byte
	var common *extprocv3.CommonResponse
	var meta *structpb.Struct
	take := func(r *extprocv3.ProcessingResponse) bool { // false: an immediate response ended it
		if ir := r.GetImmediateResponse(); ir != nil {
			p.immediate, p.errBody = int(ir.GetStatus().GetCode()), ir.GetBody()
			return false
		}
		if r.GetDynamicMetadata() != nil {
			meta = r.GetDynamicMetadata()
		}
		return true
	}
	if e.mode == filterv3.ProcessingMode_BUFFERED {
		r := recv()
		if !take(r) {
			return p
		}
		send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}})
		r = recv()
		if !take(r) {
			return p
		}
		common = r.GetRequestBody().GetResponse()
		upstream = body
		if b := common.GetBodyMutation().GetBody(); b != nil {
			upstream = b
		}
	} else {
		for i := 0; i < len(body); i += e.chunk {
			end := min(i+e.chunk, len(body))
			send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
				Body: body[i:end], EndOfStream: end == len(body)}}})
		}
		r := recv()
		if !take(r) {
			return p
		}
		if r.GetRequestHeaders() == nil {
			t.Fatalf("first answer is not the request headers': %v", r)
		}
		common = r.GetRequestHeaders().GetResponse()
		if !common.GetClearRouteCache() {
			t.Fatal("the headers answer does not clear the route cache")
		}
		for {
			r := recv()
			sb := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if sb == nil {
				t.Fatalf("expected a streamed request body, got %v", r)
			}
			upstream = append(upstream, sb.GetBody()...)
			if sb.GetEndOfStream() {
				break
			}
		}
	}
	p.upstream = upstream
	p.reqHdr = map[string]string{}
	for _, h := range common.GetHeaderMutation().GetSetHeaders() {
		p.reqHdr[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
		if h.GetHeader().GetKey() == router.HeaderDestination {
			p.dest = string(h.GetHeader().GetRawValue())
		}
	}
	p.meta = meta.GetFields()[router.MetadataLB].GetStructValue().GetFields()[router.HeaderDestination].GetStringValue()
	if !forward {
		st.CloseSend()
		return p
	}
	// Forward as Envoy would, to the first endpoint (or the one it says
	// it served from).
	target := strings.Split(p.dest, ",")[0]
	if served != "" {
		target = served
	}
	resp, err := http.Post("http://"+target+path, "application/json", bytes.NewReader(upstream))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p.status = resp.StatusCode
	rh := []string{":status", strconv.Itoa(resp.StatusCode), "content-type", resp.Header.Get("Content-Type")}
	send(&extprocv3.ProcessingRequest{
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{router.MetadataLB: {Fields: map[string]*structpb.Value{
			router.KeyServed: structpb.NewStringValue(target)}}}},
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: hdrs(rh...)}}})
	r := recv()
	p.respHdr = map[string]string{}
	for _, h := range r.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		p.respHdr[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	buf := make([]byte, 512) // small reads: several body chunks per response
	for {
		n, rerr := resp.Body.Read(buf)
		eos := rerr == io.EOF
		if n == 0 && !eos {
			if rerr != nil {
				t.Fatal(rerr)
			}
			continue
		}
		send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
			Body: bytes.Clone(buf[:n]), EndOfStream: eos}}})
		if e.mode == filterv3.ProcessingMode_BUFFERED {
			r := recv()
			if b := r.GetResponseBody().GetResponse().GetBodyMutation().GetBody(); b != nil {
				p.body = append(p.body, b...)
			} else {
				p.body = append(p.body, buf[:n]...)
			}
		} else {
			for { // the echo of this chunk: one or more streamed responses, or none
				r := recv()
				sb := r.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
				if sb == nil {
					t.Fatalf("expected a streamed response body, got %v", r)
				}
				p.body = append(p.body, sb.GetBody()...)
				if sb.GetEndOfStream() || len(sb.GetBody()) > 0 || !eos {
					break
				}
			}
		}
		if eos {
			break
		}
	}
	st.CloseSend()
	if _, err := st.Recv(); err != io.EOF {
		t.Fatalf("the picker did not end the stream: %v", err)
	}
	return p
}

// endpoints maps each simulated replica's endpoint to its name.
func endpoints(d *demo) map[string]string {
	out := map[string]string{}
	for _, r := range d.app.core.Engine().Pool().Replicas() {
		out[router.Endpoint(r)] = r.Name
	}
	return out
}

// The endpoint picker routes exactly as the HTTP front end does: two
// identical routers in front of identical replicas, one fed over HTTP and
// one through Envoy's ext_proc protocol, make the same choices with the
// same matched tokens over a workload of shared prompts and multi-turn
// chats whose replies must be learned, streamed and not. Both route on
// the token formula (routing.load_weight above 0): the seconds cost reads
// each router's own timing of its replicas' answers, which two routers
// never see alike.
func TestExtProcRoutesAsTheHTTPPathDoes(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "tokens.yaml")
	if err := os.WriteFile(cfg, []byte("routing:\n  load_weight: 0.1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	httpd := startTestDemo(t, demoOptions{sim: fastSim, config: cfg})
	epd := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0", config: cfg})
	env := newEnvoy(t, epd)
	names := endpoints(epd)

	type turn struct {
		body    map[string]any
		session string
	}
	var work []turn
	for s := 0; s < 6; s++ {
		sys := text(fmt.Sprintf("assistant %d", s%3), 400)
		msgs := [][2]string{{"system", sys}}
		for k := 0; k < 3; k++ {
			msgs = append(msgs, [2]string{"user", text(fmt.Sprintf("question %d.%d", s, k), 40)})
			b := chat(msgs...)
			b["max_tokens"] = 6
			if (s+k)%2 == 1 {
				b["stream"] = true
			}
			work = append(work, turn{b, fmt.Sprintf("s%d", s)})
			msgs = append(msgs, [2]string{"assistant", ""}) // filled from the reply below
		}
	}
	replies := map[string][]string{} // session → replies so far, per path
	learned := 0
	for i, w := range work {
		// Fill the assistant turns with the replies this session got.
		msgs := w.body["messages"].([]map[string]string)
		k := 0
		for _, m := range msgs {
			if m["role"] == "assistant" {
				m["content"] = replies[w.session][k]
				k++
			}
		}
		b, _ := json.Marshal(w.body)
		hr := post(t, httpd, "/v1/chat/completions", b, map[string]string{"X-Session-ID": w.session})
		mustOK(t, hr)
		p := env.do("/v1/chat/completions", b, map[string]string{"X-Session-ID": w.session}, nil, true, "")
		if p.immediate != 0 || p.status != 200 {
			t.Fatalf("request %d: immediate %d status %d: %s", i, p.immediate, p.status, p.errBody)
		}
		if p.dest != p.meta {
			t.Fatalf("request %d: header %q and metadata %q differ", i, p.dest, p.meta)
		}
		dests := strings.Split(p.dest, ",")
		if len(dests) != 3 {
			t.Fatalf("request %d: destination %q: want the choice and 2 fallbacks", i, p.dest)
		}
		if got := names[dests[0]]; got != hr.replica {
			t.Fatalf("request %d: ext_proc picked %s (%s), the HTTP path %s", i, got, p.dest, hr.replica)
		}
		if p.respHdr[router.HeaderReplica] != hr.replica || p.respHdr[router.HeaderMatchedTokens] != strconv.Itoa(hr.matched) {
			t.Fatalf("request %d: ext_proc response headers %v, HTTP path replica %s matched %d", i, p.respHdr, hr.replica, hr.matched)
		}
		if k > 0 && hr.matched > 0 {
			learned++
		}
		// The client sees what it would have seen over HTTP: no usage chunk
		// it did not ask for.
		if w.body["stream"] == true && bytes.Contains(p.body, []byte(`"usage"`)) {
			t.Fatalf("request %d: a stream whose client did not ask for usage got it: %s", i, p.body)
		}
		reply := assistantText(t, p.body, w.body["stream"] == true)
		if want := assistantText(t, hr.body, w.body["stream"] == true); reply == "" || (reply != want && w.body["stream"] != true) {
			t.Fatalf("request %d: reply %q over ext_proc, %q over HTTP", i, reply, want)
		}
		replies[w.session] = append(replies[w.session], reply)
	}
	if learned < 6 {
		t.Fatalf("only %d later turns matched anything", learned)
	}
}

// assistantText returns a response's assistant text (a stream's deltas
// joined).
func assistantText(t *testing.T, body []byte, stream bool) string {
	t.Helper()
	if !stream {
		var r struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(body, &r); err != nil || len(r.Choices) == 0 {
			t.Fatalf("not a completion: %s", body)
		}
		return r.Choices[0].Message.Content
	}
	var sb strings.Builder
	for _, line := range strings.Split(string(body), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c struct {
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
		}
		if json.Unmarshal([]byte(data), &c) == nil && len(c.Choices) > 0 {
			sb.WriteString(c.Choices[0].Delta.Content)
		}
	}
	return sb.String()
}

// The gateway's subset hint limits the choice; an empty subset, or one
// naming no replica of the pool, is a 503 from the picker itself; a bad
// body is a 400 and a request without a body is routed by load; the
// buffered body mode works too; the health service serves ext_proc.
func TestExtProcSubsetErrorsAndModes(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0"})
	env := newEnvoy(t, d)
	names := endpoints(d)
	var eps []string
	for ep := range names {
		eps = append(eps, ep)
	}
	body, _ := json.Marshal(chat([2]string{"system", text("subset", 300)}, [2]string{"user", "hello"}))

	// The subset hint: whatever is cached elsewhere, only these two.
	for i := 0; i < 4; i++ {
		p := env.do("/v1/chat/completions", body, nil, subsetMD(eps[1], eps[2]), true, "")
		dests := strings.Split(p.dest, ",")
		if p.status != 200 || len(dests) != 2 {
			t.Fatalf("subset of 2: status %d destination %q", p.status, p.dest)
		}
		for _, dst := range dests {
			if dst != eps[1] && dst != eps[2] {
				t.Fatalf("subset %v: picked %q", eps[1:3], p.dest)
			}
		}
	}
	// A subset named by address alone.
	host := eps[3][:strings.LastIndex(eps[3], ":")]
	if p := env.do("/v1/chat/completions", body, nil, subsetMD(host), false, ""); !strings.HasPrefix(p.dest, host+":") {
		t.Fatalf("subset %q: picked %q", host, p.dest)
	}
	for _, md := range []*corev3.Metadata{subsetMD(), subsetMD("10.255.255.1:8000")} {
		p := env.do("/v1/chat/completions", body, nil, md, false, "")
		if p.immediate != http.StatusServiceUnavailable || !bytes.Contains(p.errBody, []byte(`"no_replica"`)) {
			t.Fatalf("no endpoint in the subset: immediate %d %s", p.immediate, p.errBody)
		}
	}
	if p := env.do("/v1/chat/completions", []byte(`{"model":"sim-model","messages":"nope"}`), nil, nil, false, ""); p.immediate != 400 ||
		!bytes.Contains(p.errBody, []byte(`"invalid_request_error"`)) {
		t.Fatalf("bad body: immediate %d %s", p.immediate, p.errBody)
	}
	// Buffered mode: the headers are answered at once, the destination comes
	// with the body's answer.
	env.mode = filterv3.ProcessingMode_BUFFERED
	p := env.do("/v1/chat/completions", body, nil, nil, true, "")
	if p.status != 200 || names[strings.Split(p.dest, ",")[0]] == "" || p.dest != p.meta {
		t.Fatalf("buffered: status %d destination %q meta %q", p.status, p.dest, p.meta)
	}
	// A fallback served: the request's load and reply move there.
	env.mode = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	fresh, _ := json.Marshal(chat([2]string{"system", text("fallback", 300)}, [2]string{"user", "hi"}))
	p = env.do("/v1/chat/completions", fresh, nil, nil, true, "")
	dests := strings.Split(p.dest, ",")
	again := env.do("/v1/chat/completions", fresh, nil, nil, true, dests[1])
	if again.respHdr[router.HeaderReplica] != names[dests[1]] {
		t.Fatalf("served by the fallback %s: response says %v", names[dests[1]], again.respHdr)
	}
	// Health: the ext_proc service reports serving.
	conn, err := grpc.NewClient(d.run.grpcAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hr, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{Service: extprocv3.ExternalProcessor_ServiceDesc.ServiceName})
	if err != nil || hr.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health of ext_proc: %v %v", hr, err)
	}
}

// waitModels waits until the router knows what every replica serves.
func waitModels(t *testing.T, d *demo) {
	t.Helper()
	for _, r := range d.app.core.Engine().Pool().Replicas() {
		testwait.Until(t, "the models of "+r.Name, func() bool { return r.Models() != nil })
	}
}

// rawStream is one ext_proc stream driven message by message.
type rawStream struct {
	t      *testing.T
	st     extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
	got    chan *extprocv3.ProcessingResponse
	end    chan error
}

func openRaw(t *testing.T, conn *grpc.ClientConn) *rawStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r := &rawStream{t: t, st: st, cancel: cancel, got: make(chan *extprocv3.ProcessingResponse, 256), end: make(chan error, 1)}
	go func() {
		for {
			m, err := st.Recv()
			if err != nil {
				r.end <- err
				return
			}
			r.got <- m
		}
	}()
	return r
}

func (r *rawStream) headers(mode filterv3.ProcessingMode_BodySendMode, respMode filterv3.ProcessingMode_BodySendMode, eos bool, kv ...string) {
	_ = r.st.Send(&extprocv3.ProcessingRequest{
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: respMode},
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs(kv...), EndOfStream: eos}}})
}

func (r *rawStream) body(b []byte, eos bool) {
	_ = r.st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}})
}

func (r *rawStream) respHeaders() {
	_ = r.st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: hdrs(":status", "200", "content-type", "application/json")}}})
}

func (r *rawStream) trailers() {
	_ = r.st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
}

// wait returns the answers that came until the stream ended, and how it
// ended (nil: still open after testwait.Deadline).
func (r *rawStream) wait() (out []*extprocv3.ProcessingResponse, ended error) {
	deadline := time.After(testwait.Deadline)
	for {
		select {
		case m := <-r.got:
			out = append(out, m)
		case err := <-r.end:
			for len(r.got) > 0 {
				out = append(out, <-r.got)
			}
			return out, err
		case <-deadline:
			return out, nil
		}
	}
}

// until returns the answers that came until one for which last is true,
// that one included, and any that came with it; or those that came before
// the stream ended or testwait.Deadline passed.
func (r *rawStream) until(last func(*extprocv3.ProcessingResponse) bool) (out []*extprocv3.ProcessingResponse) {
	deadline := time.After(testwait.Deadline)
	for {
		select {
		case m := <-r.got:
			out = append(out, m)
			if last(m) {
				for len(r.got) > 0 {
					out = append(out, <-r.got)
				}
				return out
			}
		case <-r.end:
			for len(r.got) > 0 {
				out = append(out, <-r.got)
			}
			return out
		case <-deadline:
			return out
		}
	}
}

func inFlight(d *demo) int64 {
	var n int64
	for _, r := range d.app.core.Engine().Pool().Replicas() {
		n += r.Load(time.Now()).InFlight
	}
	return n
}

// A gateway that breaks the protocol's order gets an error, and whatever it
// sends, every request it routed ends with its stream: no load is left on a
// replica. Found by attacking the picker (a second headers message routed
// the request again, and the first decision never ended).
func TestExtProcHostileOrdersLeaveNoLoad(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0"})
	conn := dial(t, d)
	body, _ := json.Marshal(chat([2]string{"user", "hello"}))
	post := []string{":method", "POST", ":path", "/v1/chat/completions", "content-type", "application/json"}
	get := []string{":method", "GET", ":path", "/v1/models"}
	const fd, buf = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED
	cases := map[string]func(r *rawStream){
		"headers twice without a body": func(r *rawStream) { r.headers(fd, fd, true, get...); r.headers(fd, fd, true, get...) },
		"routed, then headers again": func(r *rawStream) {
			r.headers(fd, fd, false, post...)
			r.body(body, true)
			r.headers(fd, fd, true, get...)
		},
		"body before headers":       func(r *rawStream) { r.body(body, true); r.headers(fd, fd, true, get...) },
		"trailers before headers":   func(r *rawStream) { r.trailers(); r.headers(fd, fd, true, get...) },
		"body after routing":        func(r *rawStream) { r.headers(fd, fd, false, post...); r.body(body, true); r.body(body, true) },
		"cut before the body ended": func(r *rawStream) { r.headers(fd, fd, false, post...); r.body(body[:5], false) },
		"response before any request": func(r *rawStream) {
			r.respHeaders()
			r.headers(fd, fd, true, get...)
		},
		"routed, response headers twice": func(r *rawStream) {
			r.headers(fd, fd, true, get...)
			r.respHeaders()
			r.respHeaders()
		},
	}
	for name, run := range cases {
		r := openRaw(t, conn)
		run(r)
		if name == "cut before the body ended" { // breaks no order: the gateway leaves
			r.cancel()
			r.wait()
		} else { // the router ends the stream once it reads the message out of order
			if _, ended := r.wait(); status.Code(ended) != codes.FailedPrecondition {
				t.Fatalf("%s: the stream ended with %v, want FailedPrecondition", name, ended)
			}
			r.cancel()
		}
		waitNoLoad(t, d, name)
	}

	// Buffered, with trailers: Envoy sends the whole body without
	// end_of_stream and waits for the answer before the trailers.
	r := openRaw(t, conn)
	r.headers(buf, buf, false, post...)
	r.body(body, false)
	got := r.until(func(m *extprocv3.ProcessingResponse) bool { return m.GetRequestBody() != nil })
	if len(got) != 2 || got[0].GetRequestHeaders() == nil || got[1].GetRequestBody() == nil {
		t.Fatalf("buffered body with trailers to come: answers %v", got)
	}
	r.cancel()
	waitNoLoad(t, d, "buffered with trailers")

	// Full duplex, the body ended by trailers: the body's answer does not
	// claim end_of_stream; a request without any body gets no body answer.
	r = openRaw(t, conn)
	r.headers(fd, fd, false, post...)
	r.body(body, false)
	r.trailers()
	got = r.until(func(m *extprocv3.ProcessingResponse) bool { return m.GetRequestTrailers() != nil })
	var eos, trailersAnswered bool
	for _, m := range got {
		eos = eos || m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream()
		trailersAnswered = trailersAnswered || m.GetRequestTrailers() != nil
	}
	if eos || !trailersAnswered {
		t.Fatalf("body ended by trailers: end_of_stream %v, trailers answered %v: %v", eos, trailersAnswered, got)
	}
	r.cancel()
	waitNoLoad(t, d, "body ended by trailers")

	// Paths the HTTP front end refuses to pass through are refused here too.
	for path, want := range map[string]int{"/v1/chat%2Fcompletions": 400, "/v1/chat/completions/": 404, "/v1/%2e%2e/admin": 400, "/v1/completions;x": 404} {
		r := openRaw(t, conn)
		r.headers(fd, fd, false, ":method", "POST", ":path", path, "content-type", "application/json")
		r.body(body, true)
		got := r.until(func(*extprocv3.ProcessingResponse) bool { return true })
		if len(got) == 0 || int(got[0].GetImmediateResponse().GetStatus().GetCode()) != want {
			t.Fatalf("%s: %v, want an immediate %d", path, got, want)
		}
		r.cancel()
	}
	waitNoLoad(t, d, "the end")
}

// waitNoLoad waits for every request in flight on d's replicas to end.
func waitNoLoad(t *testing.T, d *demo, what string) {
	t.Helper()
	testwait.Value(t, what+": no request in flight after the streams ended", func() (int64, bool) {
		n := inFlight(d)
		return n, n == 0
	})
}

// A stream silent past its bound is ended, and its request with it: a
// gateway that went away, or a client holding streams open, holds no load.
func TestExtProcSilentStreamEnds(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "t.yaml")
	os.WriteFile(cfg, []byte("timeouts:\n  first_byte: 300ms\n  idle: 300ms\n"), 0o600)
	d := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0", config: cfg})
	r := openRaw(t, dial(t, d))
	body, _ := json.Marshal(chat([2]string{"user", "hello"}))
	r.headers(filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, false,
		":method", "POST", ":path", "/v1/chat/completions", "content-type", "application/json")
	r.body(body, true)
	testwait.Value(t, "the request routed, one in flight", func() (int64, bool) {
		n := inFlight(d)
		return n, n == 1
	})
	_, ended := r.wait()
	if status.Code(ended) != codes.DeadlineExceeded {
		t.Fatalf("a silent stream ended with %v", ended)
	}
	waitNoLoad(t, d, "the silent stream")
}

// The request bodies the picker buffers across its streams are capped by
// grpc.ext_proc_max_buffered_bytes: of many streams each holding a body it
// has not ended, those past the cap are answered 429 (and counted), and
// once the others go away, requests are routed again. Found by review:
// 100 streams each sending 15 MiB without end_of_stream took the router
// from 779 MB to 3.44 GB.
func TestExtProcBufferCapFromConfig(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "t.yaml")
	os.WriteFile(cfg, []byte("limits: {max_body_bytes: 131072}\ngrpc: {ext_proc_max_buffered_bytes: 262144}\n"), 0o600)
	d := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0", config: cfg})
	conn := dial(t, d)
	const fd, streams = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, 12
	chunk := bytes.Repeat([]byte("a"), 64<<10)
	answers := make(chan *extprocv3.ImmediateResponse, streams)
	for range streams {
		r := openRaw(t, conn)
		defer r.cancel()
		go func() {
			r.headers(fd, fd, false, ":method", "POST", ":path", "/v1/chat/completions", "content-type", "application/json")
			r.body(chunk, false)
			r.body(chunk, false)
		}()
		go func() {
			for {
				select {
				case m := <-r.got:
					answers <- m.GetImmediateResponse()
				case <-r.end:
					for len(r.got) > 0 { // what came before the end
						answers <- (<-r.got).GetImmediateResponse()
					}
					return
				}
			}
		}()
	}
	// Two 128 KiB bodies fill the 256 KiB: at least the ten other streams
	// are answered, each with a 429.
	timeout := time.After(20 * time.Second)
	for i := 0; i < streams-2; i++ {
		select {
		case ir := <-answers:
			if ir.GetStatus().GetCode() != http.StatusTooManyRequests || !bytes.Contains(ir.GetBody(), []byte(`"ext_proc_buffer_full"`)) {
				t.Fatalf("a stream past the cap: %v", ir)
			}
		case <-timeout:
			t.Fatalf("%d of %d streams past the cap answered", i, streams-2)
		}
	}
	var refused float64
	for _, line := range strings.Split(scrape(t, d), "\n") {
		if v, ok := strings.CutPrefix(line, `semroute_ext_proc_refused_total{reason="buffer_full"} `); ok {
			refused, _ = strconv.ParseFloat(v, 64)
		}
	}
	if refused < streams-2 {
		t.Fatalf("semroute_ext_proc_refused_total{reason=\"buffer_full\"} %v, want at least %d", refused, streams-2)
	}
	// Every stream goes away: what they held comes back, and a request is
	// routed (it may meet a stream's bytes not yet given back: it retries,
	// as a gateway would).
	conn.Close()
	env := newEnvoy(t, d)
	body, _ := json.Marshal(chat([2]string{"user", "hello"}))
	testwait.Until(t, "a request routed after the streams went away", func() bool {
		p := env.do("/v1/chat/completions", body, nil, nil, false, "")
		if p.immediate == 0 && p.dest != "" {
			return true
		}
		if p.immediate != http.StatusTooManyRequests {
			t.Fatalf("after the streams went away: immediate %d %s", p.immediate, p.errBody)
		}
		return false
	})
}

// The endpoint picker sends no client's kv_transfer_params upstream, and a
// Responses request goes to one endpoint with the id the router issued for
// it (a fallback would store what the id denies), in both body modes.
func TestExtProcBodiesTheRouterSets(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0"})
	waitModels(t, d)
	model := d.sims[0].Options().Model
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED} {
		env := newEnvoy(t, d)
		env.mode = mode
		body := []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"hello"}],"max_tokens":2,"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.66.66.66"}}`)
		p := env.do("/v1/chat/completions", body, nil, nil, true, "")
		if p.status != 200 || bytes.Contains(p.upstream, []byte("kv_transfer")) || !bytes.Contains(p.upstream, []byte(`"messages"`)) {
			t.Fatalf("%v: chat: %d, upstream %s", mode, p.status, p.upstream)
		}
		p = env.do("/v1/responses", []byte(`{"model":"`+model+`","input":"hello","max_output_tokens":2,"request_id":"resp_mine"}`), nil, nil, true, "")
		var sent struct {
			RequestID string `json:"request_id"`
		}
		if err := json.Unmarshal(p.upstream, &sent); err != nil || p.status != 200 || !strings.HasPrefix(sent.RequestID, "resp_sr1_") || strings.Contains(p.dest, ",") {
			t.Fatalf("%v: responses: %d to %q, upstream %s (%v)", mode, p.status, p.dest, p.upstream, err)
		}
	}
}
