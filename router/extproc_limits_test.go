package router

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/limits"
)

// picker is an endpoint picker served by NewGRPCServer on 127.0.0.1, over
// a fixture's replicas, with its metrics in a registry of its own.
type picker struct {
	core   *Core
	budget *BodyBudget
	reg    *prometheus.Registry
	conn   *grpc.ClientConn
}

func startPicker(t *testing.T, maxBody int64, o ExtProcOptions) *picker {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	fx := newFixture(t, 2, "least_load")
	core, err := NewCore(CoreOptions{Engine: fx.e, Arms: fx.arms(), Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	if o.Budget == nil {
		o.Budget = NewBodyBudget(0)
	}
	lim := limits.Request{MaxBodyBytes: maxBody}.WithDefaults()
	conn := serveGRPC(t, core, GRPCOptions{Limits: func() limits.Request { return lim }, ExtProc: o})
	return &picker{core: core, budget: o.Budget, reg: reg, conn: conn}
}

// serveGRPC serves core's gRPC API (NewGRPCServer) on 127.0.0.1 until the
// test ends and returns a client connection to it.
func serveGRPC(t *testing.T, core *Core, o GRPCOptions) *grpc.ClientConn {
	t.Helper()
	s := NewGRPCServer(core, o)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.Serve(ln) }()
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// refused reads semroute_ext_proc_refused_total{reason}.
func (p *picker) refused(t *testing.T, reason string) float64 {
	t.Helper()
	mfs, err := p.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "semroute_ext_proc_refused_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == reason {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no semroute_ext_proc_refused_total{reason=%q}", reason)
	return 0
}

// waitUsed waits until the budget's bytes taken are want.
func (p *picker) waitUsed(t *testing.T, want int64, what string) {
	t.Helper()
	testwait.Value(t, fmt.Sprintf("%s: %d bytes taken from the budget", what, want), func() (int64, bool) {
		used := p.budget.Used()
		return used, used == want
	})
}

// epClient is one ext_proc stream played as Envoy would, message by message.
type epClient struct {
	t      *testing.T
	st     extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
}

func (p *picker) open(t *testing.T) *epClient {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	st, err := extprocv3.NewExternalProcessorClient(p.conn).Process(ctx)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(cancel)
	return &epClient{t: t, st: st, cancel: cancel}
}

const fullDuplex = filterv3.ProcessingMode_FULL_DUPLEX_STREAMED

func epHeaders(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

// Messages of the protocol, as Envoy sends them. A pass-through path is
// routed by load, with no model to know.
var (
	epPost = epHeaders(":method", "POST", ":path", "/v1/embeddings", "content-type", "application/json")
	epGet  = epHeaders(":method", "GET", ":path", "/v1/models")
)

func reqHeaders(mode filterv3.ProcessingMode_BodySendMode, h *corev3.HeaderMap, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode},
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: h, EndOfStream: eos}}}
}

func reqBody(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}}
}

func reqTrailers() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
}

func respHeaders(eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: epHeaders(":status", "200", "content-type", "application/json"), EndOfStream: eos}}}
}

func respBody(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}}
}

func respTrailers() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: &extprocv3.HttpTrailers{}}}
}

// send sends msgs; an error means the picker ended the stream, which end
// reports.
func (c *epClient) send(msgs ...*extprocv3.ProcessingRequest) {
	for _, m := range msgs {
		if c.st.Send(m) != nil {
			return
		}
	}
}

// end reads the stream's answers until it ends: the immediate response, if
// one came, and the stream's final error (io.EOF for none).
func (c *epClient) end() (*extprocv3.ImmediateResponse, error) {
	var ir *extprocv3.ImmediateResponse
	for {
		r, err := c.st.Recv()
		if err != nil {
			return ir, err
		}
		if r.GetImmediateResponse() != nil {
			ir = r.GetImmediateResponse()
		}
	}
}

// The bodies buffered across streams are bounded: streams that hold a body
// without ending it take the budget, and streams past it are answered
// 429, many at once; the budget is never passed, and every byte comes back
// when a stream is answered or ends. Found by review: 100 streams each
// sending 15 MiB without end_of_stream took the router from 779 MB to
// 3.44 GB.
func TestExtProcBodyBudgetAcrossStreams(t *testing.T) {
	const chunk = 64 << 10
	const held = 4 * chunk // a stream's 4 chunks: a buffer of 64, 128, then 256 KiB
	p := startPicker(t, 1<<20, ExtProcOptions{Budget: NewBodyBudget(4 * held)})
	body := bytes.Repeat([]byte("a"), chunk)
	hold := func(c *epClient) {
		c.send(reqHeaders(fullDuplex, epPost, false))
		for range held / chunk {
			c.send(reqBody(body, false))
		}
	}
	// Three streams hold their bodies, one after the other.
	var holders []*epClient
	for i := range 3 {
		c := p.open(t)
		hold(c)
		holders = append(holders, c)
		p.waitUsed(t, int64(i+1)*held, "holding")
	}
	// Many more at once: the 256 KiB left cannot take a buffer growing to
	// 256 KiB (it needs the old one's room too), so every one is answered
	// 429, and gives back what it took.
	const many = 24
	var wg sync.WaitGroup
	errs := make(chan string, many)
	for range many {
		c := p.open(t)
		wg.Add(1)
		go func() {
			defer wg.Done()
			go hold(c)
			ir, err := c.end()
			switch {
			case ir == nil:
				errs <- "no immediate response: " + err.Error()
			case ir.GetStatus().GetCode() != 429 || !bytes.Contains(ir.GetBody(), []byte(`"ext_proc_buffer_full"`)):
				errs <- "immediate " + ir.GetStatus().GetCode().String() + ": " + string(ir.GetBody())
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	p.waitUsed(t, 3*held, "after the streams answered 429")
	if p.budget.Peak() > p.budget.Max() {
		t.Fatalf("the budget of %d bytes was passed: %d", p.budget.Max(), p.budget.Peak())
	}
	if n := p.refused(t, "buffer_full"); n != many {
		t.Fatalf("buffer_full refusals: %v, want %d", n, many)
	}
	// The holders go away: every byte comes back, and a request is routed
	// again.
	for _, c := range holders {
		c.cancel()
	}
	p.waitUsed(t, 0, "after the holders went away")
	c := p.open(t)
	c.send(reqHeaders(fullDuplex, epPost, false), reqBody(body, true))
	r, err := c.st.Recv()
	if err != nil || r.GetRequestHeaders() == nil {
		t.Fatalf("a request after the holders: %v %v", r, err)
	}
	c.st.CloseSend()
	c.end()
	p.waitUsed(t, 0, "after a routed request")
}

// Each stream's body stays bounded by the request body limit (413), and
// what it took comes back.
func TestExtProcBodyLimitPerStream(t *testing.T) {
	p := startPicker(t, 100<<10, ExtProcOptions{})
	c := p.open(t)
	c.send(reqHeaders(fullDuplex, epPost, false))
	for range 3 {
		c.send(reqBody(make([]byte, 40<<10), false))
	}
	ir, _ := c.end()
	if ir.GetStatus().GetCode() != 413 {
		t.Fatalf("past the body limit: %v", ir)
	}
	p.waitUsed(t, 0, "after the 413")
	if n := p.refused(t, "body_too_large"); n != 1 {
		t.Fatalf("body_too_large refusals: %v", n)
	}
}

// A stream that sends nothing for timeouts.idle is ended with
// DeadlineExceeded, and its buffered body given back: before its first
// message, and in the middle of its body.
func TestExtProcIdleStreamEnds(t *testing.T) {
	p := startPicker(t, 0, ExtProcOptions{Timeouts: limits.Timeouts{Idle: 50 * time.Millisecond}})
	for name, msgs := range map[string][]*extprocv3.ProcessingRequest{
		"silent from the start": nil,
		"silent mid-body":       {reqHeaders(fullDuplex, epPost, false), reqBody([]byte(`{"input":`), false)},
	} {
		c := p.open(t)
		c.send(msgs...)
		_, err := c.end()
		if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "timeouts.idle") {
			t.Fatalf("%s: ended with %v", name, err)
		}
		p.waitUsed(t, 0, name)
	}
	if n := p.refused(t, "silent"); n != 2 {
		t.Fatalf("silent refusals: %v", n)
	}
}

// Messages out of the order Envoy sends them in end the stream with
// FailedPrecondition naming what was out of order: the response's before
// the request was routed, anything twice, anything after its end.
func TestExtProcMessageOrder(t *testing.T) {
	// (A stream the picker let through would end at its idle bound.)
	p := startPicker(t, 0, ExtProcOptions{Timeouts: limits.Timeouts{Idle: 5 * time.Second, FirstByte: 5 * time.Second}})
	const buffered = filterv3.ProcessingMode_BUFFERED
	routed := []*extprocv3.ProcessingRequest{reqHeaders(fullDuplex, epGet, true)}
	cases := []struct {
		name string
		msgs []*extprocv3.ProcessingRequest
		want string
	}{
		{"response headers first", []*extprocv3.ProcessingRequest{respHeaders(false)}, "response headers before the request headers"},
		{"response body first", []*extprocv3.ProcessingRequest{respBody(nil, true)}, "response body before the request headers"},
		{"response trailers first", []*extprocv3.ProcessingRequest{respTrailers()}, "response trailers before the request headers"},
		{"response before routing", []*extprocv3.ProcessingRequest{reqHeaders(fullDuplex, epPost, false), respHeaders(false)},
			"response headers before the request was routed"},
		{"request headers twice", []*extprocv3.ProcessingRequest{reqHeaders(fullDuplex, epPost, false), reqHeaders(fullDuplex, epPost, false)},
			"request headers twice"},
		{"request body first", []*extprocv3.ProcessingRequest{reqBody([]byte("{}"), true)}, "request body before the request headers"},
		{"request trailers first", []*extprocv3.ProcessingRequest{reqTrailers()}, "request trailers before the request headers"},
		{"request body after its end", []*extprocv3.ProcessingRequest{reqHeaders(fullDuplex, epPost, false), reqBody([]byte("{}"), true),
			reqBody([]byte("{}"), true)}, "request body after the request's end_of_stream"},
		{"request body after headers that ended it", append(routed, reqBody([]byte("{}"), false)), "request body after the request's end_of_stream"},
		{"request body after a buffered body", []*extprocv3.ProcessingRequest{reqHeaders(buffered, epPost, false), reqBody([]byte("{}"), false),
			reqBody([]byte("{}"), false)}, "request body after the request was routed"},
		{"request trailers twice", []*extprocv3.ProcessingRequest{reqHeaders(buffered, epPost, false), reqBody([]byte("{}"), false),
			reqTrailers(), reqTrailers()}, "request trailers after the request's end_of_stream"},
		{"response headers twice", append(routed, respHeaders(false), respHeaders(false)), "response headers twice"},
		{"response body before its headers", append(routed, respBody([]byte("{}"), true)), "response body before the response headers"},
		{"response body after its end", append(routed, respHeaders(false), respBody(nil, true), respBody(nil, true)),
			"response body after the response's end_of_stream"},
		{"response trailers after its end", append(routed, respHeaders(true), respTrailers()), "response trailers after the response's end_of_stream"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := p.open(t)
			c.send(tc.msgs...)
			_, err := c.end()
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ended with %v, want FailedPrecondition %q", err, tc.want)
			}
		})
	}
	if n := p.refused(t, "out_of_order"); n != float64(len(cases)) {
		t.Fatalf("out_of_order refusals: %v, want %d", n, len(cases))
	}
	p.waitUsed(t, 0, "after the order errors")
}

// The budget never passes its size, whatever takes and gives race.
func TestBodyBudget(t *testing.T) {
	b := NewBodyBudget(1000)
	if NewBodyBudget(0).Max() != limits.DefaultExtProcBufferBytes {
		t.Fatal("the default")
	}
	if !b.take(600) || b.take(401) || !b.take(400) || b.take(1) {
		t.Fatal("take past the size")
	}
	b.give(1000)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10000 {
				n := int64(1 + (g*7+i)%300)
				if b.take(n) {
					b.give(n)
				}
			}
		}()
	}
	wg.Wait()
	if b.Used() != 0 || b.Peak() > b.Max() || b.Peak() != 1000 {
		t.Fatalf("used %d peak %d max %d", b.Used(), b.Peak(), b.Max())
	}
}
