package router

import (
	"context"
	"io"
	"net/http"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// flight is one request's routing state, carried in its context from the
// handler to the proxy hooks and the failover transport.
type flight struct {
	rt   *Routed  // the request, with or without a prompt
	in   *url.URL // the client's request URL, which every attempt is aimed from
	auth []string // the client's Authorization values
	body *body    // the request body; the handler releases it
	next int      // index in the ranking of the next candidate to try
	// remote is the client's address (http.Request.RemoteAddr), keyed for
	// passive ejection only when a soft failure needs it (source).
	remote string
	// stripUsage says the router asked the replica for the stream's usage
	// chunk, which the client must not see.
	stripUsage bool
	// readers are the body's readers given to upstream attempts, closed
	// when the proxy returns.
	readers []*bodyReader
	// retag, if set, makes the body for each replica an attempt goes to
	// (a Responses request's id names the replica that stores it); the
	// flight releases the bodies it made (tagged, the last) when the proxy
	// returns.
	retag  func(*replica.Replica) *body
	tagged *replica.Replica
	made   *body

	status  int
	capture *replyCapture
	cancel  context.CancelFunc // cancels the upstream request (idle timeout)
}

type flightKey struct{}

func flightOf(ctx context.Context) *flight { f, _ := ctx.Value(flightKey{}).(*flight); return f }

// current returns the candidate now carrying the request.
func (f *flight) current() *routing.Candidate { return f.rt.Served }

// forward proxies r, under ctx (r's context, or one derived from it), to
// f's replica.
func (s *Server) forward(w http.ResponseWriter, r *http.Request, ctx context.Context, f *flight) {
	f.in, f.auth, f.remote = r.URL, r.Header.Values("Authorization"), r.RemoteAddr
	r = r.WithContext(context.WithValue(ctx, flightKey{}, f))
	// The body each attempt sends is the flight's (rewrite, failover):
	// ReverseProxy wraps the one it is given in a reader without WriteTo,
	// which the transport would copy 4 KiB at a time. With no length it
	// gives the outgoing request no body at all, for rewrite to set.
	r.Body, r.ContentLength = http.NoBody, 0
	// A pooled connection the replica closed as the request went out is
	// sent again (upstream.go): the body is read afresh.
	r.GetBody = func() (io.ReadCloser, error) { return f.bodyReader(), nil }
	defer func() { // also when the proxy panics with http.ErrAbortHandler
		for _, br := range f.readers {
			br.Close()
		}
		if f.made != nil {
			f.made.release()
		}
	}()
	dw := &deadlineWriter{ResponseWriter: w, rc: http.NewResponseController(w), d: s.o.Timeouts.ClientWrite}
	s.proxy.ServeHTTP(dw, r)
	// The answer's last bytes go out after the handler returns: they get
	// their own d, not what is left of the last write's (the replica may
	// have been slow to end its stream).
	_ = dw.rc.SetWriteDeadline(time.Now().Add(dw.d))
}

// deadlineWriter gives each write of the answer to the client, and each
// flush, d to complete: a client that stops reading fails the write, which
// ends the proxying and cancels the replica's request, instead of holding
// both until the client leaves.
type deadlineWriter struct {
	http.ResponseWriter
	rc *http.ResponseController
	d  time.Duration
}

func (w *deadlineWriter) Write(p []byte) (int, error) {
	_ = w.rc.SetWriteDeadline(time.Now().Add(w.d))
	return w.ResponseWriter.Write(p)
}

func (w *deadlineWriter) FlushError() error {
	_ = w.rc.SetWriteDeadline(time.Now().Add(w.d))
	return w.rc.Flush()
}

// Unwrap lets http.ResponseController reach the server's writer.
func (w *deadlineWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// bodyReader returns a new reader of the request body, closed when the
// proxy returns. Called on the handler's goroutine only.
func (f *flight) bodyReader() io.ReadCloser {
	br := f.body.reader()
	f.readers = append(f.readers, br)
	return br
}

// setBody makes out, an attempt's request, send the flight's body, or none
// when it is empty.
func (f *flight) setBody(out *http.Request) {
	if rep := f.current().Replica; f.retag != nil && f.tagged != rep {
		if f.made != nil {
			f.made.release() // its readers hold their own references
		}
		f.made = f.retag(rep)
		f.body, f.tagged = f.made, rep
	}
	if n := len(f.body.b); n > 0 {
		out.Body, out.ContentLength = f.bodyReader(), int64(n)
	} else {
		out.Body, out.ContentLength = nil, 0
	}
}

func (s *Server) rewrite(pr *httputil.ProxyRequest) {
	f := flightOf(pr.In.Context())
	f.setBody(pr.Out)
	aim(pr.Out, pr.In.URL, f.auth, f.current().Replica)
	pr.Out.Header.Del(headerPriority) // the router's own, between authorize and placement
	pr.SetXForwarded()
	if sc := trace.SpanContextFromContext(pr.In.Context()); sc.IsValid() {
		s.o.Propagator.Inject(pr.In.Context(), propagation.HeaderCarrier(pr.Out.Header))
	}
}

// aim points out, a request to forward, at replica rep: its base URL's
// scheme, host and base path joined with the client's path and query in,
// as httputil.ProxyRequest.SetURL joins them. A replica URL with user
// information (http://user:pass@host) sends it as basic authentication,
// in place of the client's Authorization (auth, the client's values); a
// replica without gets the client's, so that a failover never carries one
// replica's credentials to another. A data-parallel rank is named in
// replica.HeaderDataParallelRank; a client's own is never passed on (it
// would steer the engine past the router's choice).
func aim(out *http.Request, in *url.URL, auth []string, rep *replica.Replica) {
	u := rep.URL
	out.Header.Del(replica.HeaderDataParallelRank)
	if rep.DataParallel.On() {
		out.Header.Set(replica.HeaderDataParallelRank, strconv.Itoa(rep.DataParallel.Rank))
	}
	out.URL = new(url.URL)
	*out.URL = *in
	out.URL.User = nil
	pr := httputil.ProxyRequest{Out: out}
	pr.SetURL(u)
	out.Host = u.Host
	out.Header.Del("Authorization")
	if u.User != nil {
		pass, _ := u.User.Password()
		out.SetBasicAuth(u.User.Username(), pass)
	} else if len(auth) > 0 {
		out.Header["Authorization"] = auth
	}
}

func (s *Server) modifyResponse(resp *http.Response) error {
	f := flightOf(resp.Request.Context())
	f.status = resp.StatusCode
	c := f.current()
	resp.Header.Set(HeaderReplica, c.Replica.Name)
	// A replica silent for IdleTimeout while the proxy waits for its next
	// bytes is cut off, and counted as a soft failure: on every forwarded
	// route. Its first body bytes get FirstByte: vLLM sends a stream's
	// headers at once and its first chunk after queueing and prefill.
	// The timer wraps the replica's body itself, so it measures the
	// replica's silence, not the time the layers above take to gather a
	// whole event.
	var body io.ReadCloser = newIdleBody(resp.Body, s.o.Timeouts.Idle, s.o.Timeouts.FirstByte, func() {
		s.core.e.Strike(c.Replica, time.Now(), s.o.Ejection, f.source())
		s.core.o.Metrics.UpstreamError(c.Replica.Name, "idle")
		s.o.Logger.Warn("replica went silent mid-response; cutting it off", "replica", c.Replica.Name, "path", resp.Request.URL.Path)
		f.cancel()
	})
	if rt := f.rt; rt.req.PassThrough {
		s.core.FirstByte(rt)
	} else {
		resp.Header.Set(HeaderMatchedTokens, strconv.Itoa(c.Predicted()))
		sse := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
		f.capture = &replyCapture{rc: body, limit: s.o.MaxReplyBytes, sse: sse, lim: s.limits.Load().Parse,
			first: func() { s.core.FirstByte(rt) }, end: func() { s.core.EngineDone(rt) }}
		s.core.readyCapture(f.capture, rt, c.Replica.Name)
		body = f.capture
		if sse && f.stripUsage {
			body = newUsageStripper(body, s.limits.Load().Parse)
			// The client gets fewer bytes than the replica sent.
			resp.Header.Del("Content-Length")
			resp.ContentLength = -1
		}
	}
	resp.Body = body
	return nil
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
			cur.Replica.Succeeded(now, t.s.o.Ejection)
			return resp, nil
		case err == nil:
			t.s.core.o.Metrics.UpstreamError(cur.Replica.Name, "status_5xx")
			if resp.StatusCode != http.StatusBadGateway && resp.StatusCode != http.StatusServiceUnavailable {
				// A 500 or 504 may be this request's own (vLLM answers 500
				// to some inputs): it reaches the client as it is, and
				// only a run of them, from several clients, ejects the replica.
				t.s.core.e.Strike(cur.Replica, now, t.s.o.Ejection, f.source())
				return resp, nil
			}
			t.s.core.e.Fail(cur.Replica, now, t.s.o.Ejection)
		default:
			kind := errorKind(err)
			if kind == "timeout" { // no answer within first_byte: hung, or only slow
				t.s.core.e.Strike(cur.Replica, now, t.s.o.Ejection, f.source())
			} else {
				t.s.core.e.Fail(cur.Replica, now, t.s.o.Ejection)
			}
			t.s.core.o.Metrics.UpstreamError(cur.Replica.Name, kind)
		}
		if !t.moveOn(f) {
			return resp, err
		}
		if resp != nil {
			// Not drained: a replica that stalls mid-answer would hold the
			// request here, with no timer running.
			resp.Body.Close()
		}
		t.s.o.Logger.Warn("replica failed before answering; failing over", "replica", cur.Replica.Name, "err", err, "status", statusOf(resp))
		req = req.Clone(req.Context())
		f.setBody(req)
		aim(req, f.in, f.auth, f.current().Replica)
	}
}

// moveOn moves f to its next-ranked candidate and reports whether there
// was one.
func (t *failover) moveOn(f *flight) bool {
	defer func() { f.next++ }()
	return t.s.core.Failover(f.rt, f.next)
}

// source is the client's key for passive ejection (clientSource): a
// replica's soft failures must come from several to eject it.
func (f *flight) source() uint64 { return clientSource(f.remote) }

// clientSource returns the key of the client at remoteAddr (an
// http.Request's RemoteAddr) for passive ejection: a hash of its IPv4
// address, or of its IPv6 address's /64 (one host may hold a whole /64),
// and 0 where the address is not an IP's (a Unix socket). Headers such as
// X-Forwarded-For are not read: a client may send any.
func clientSource(remoteAddr string) uint64 {
	ap, err := netip.ParseAddrPort(remoteAddr)
	if err != nil {
		return 0
	}
	a := ap.Addr().Unmap()
	if a.Is6() {
		a = netip.PrefixFrom(a, 64).Masked().Addr()
	}
	b := a.As16()
	return xxhash.Sum64(b[:])
}

func statusOf(r *http.Response) int {
	if r == nil {
		return 0
	}
	return r.StatusCode
}
