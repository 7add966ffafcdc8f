package router

import (
	"bufio"
	"context"
	"errors"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/semroute/semroute/internal/connpool"
)

// upstream is the router's transport to plain-HTTP replicas: HTTP/1.1 over
// pooled keep-alive connections, with the exchange — write the request,
// read the response headers, read the body — in the calling goroutine.
// http.Transport runs a reader and a writer goroutine for each connection
// and hands every request and response between them over channels; at
// 1 KB that machinery was about a third of the router's CPU (BENCHMARKS.md,
// "Beside nginx"). Requests it does not serve — https replicas, any
// replica when HTTP_PROXY is set, bodies of unknown length, upgrades — go
// to fallback.
//
// Responses come from http.ReadResponse, so framing (Content-Length,
// chunked, close-delimited) is net/http's. A request's context cancels it
// at any point: its connection's deadline is moved to the past, which ends
// a blocked write or read, and the connection is closed rather than
// pooled. Without a reader goroutine nothing watches an idle connection,
// so connections are pooled in a connpool.Pool: only when nothing is left
// to read on one, checked with a non-blocking peek before each reuse
// (bytes the replica sent unasked are never read as the next answer), and
// idle ones swept every sweepEvery. A request is sent again only when it
// did not go out whole; a body over concurrentWrite is written beside the
// read of the answer, so that an early answer (413) is not lost.
//
// Safe for concurrent use.
type upstream struct {
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)
	fallback  http.RoundTripper
	firstByte time.Duration // bounds the wait for response headers after the request is written; 0: none
	maxHeader int           // bytes of response headers read at most
	proxied   bool          // HTTP_PROXY is set: everything goes to fallback

	// pool keeps the idle connections by host:port: MaxPerKey per replica,
	// MaxTotal (maxIdleTotal) over all, for upIdleTimeout each, swept
	// every sweepEvery; each is peeked at before reuse (PeekAfter 0).
	pool connpool.Pool[*upConn]
}

// upIdleTimeout is how long a pooled connection may idle before it is
// closed (http.DefaultTransport's IdleConnTimeout).
const upIdleTimeout = 90 * time.Second

// sweepEvery is how often idle connections are looked at while there are
// any: those the replica closed (vLLM's server, uvicorn, closes keep-alive
// connections after 5 s of idling) or idle past upIdleTimeout are closed,
// so that neither they nor a departed replica's keep file descriptors.
const sweepEvery = 5 * time.Second

// maxIdleTotal bounds the idle connections kept over all replicas (4 per
// replica for 256 replicas; http.DefaultTransport keeps 100).
const maxIdleTotal = 1024

// concurrentWrite is the body size above which the request is written
// beside the read of the answer, as http.Transport does for every
// request: a replica may answer (413, 400) and stop reading before a large
// body is all sent, and that answer must reach the client. Smaller bodies
// fit the socket's buffers and are written first, in the same goroutine.
const concurrentWrite = 64 << 10

// earlyAnswerWait bounds the wait for an answer the replica may have sent
// before a small request's write failed.
const earlyAnswerWait = 100 * time.Millisecond

// newUpstream returns the transport, dialling as t does and sending to t
// what it does not serve.
func newUpstream(t *http.Transport, firstByte time.Duration, maxHeader, maxIdle int) *upstream {
	return &upstream{
		dial:      t.DialContext,
		fallback:  t,
		firstByte: firstByte,
		maxHeader: maxHeader,
		proxied:   os.Getenv("HTTP_PROXY") != "" || os.Getenv("http_proxy") != "",
		pool: connpool.Pool[*upConn]{
			MaxPerKey:   maxIdle,
			MaxTotal:    maxIdleTotal,
			IdleTimeout: upIdleTimeout,
			SweepEvery:  sweepEvery,
		},
	}
}

// upConn is one connection to a replica. Its reads pass through lim, which
// bounds the response headers.
type upConn struct {
	c      net.Conn
	lim    capReader
	br     *bufio.Reader
	bw     *bufio.Writer
	host   string
	reused bool // it served a request before (it came from the pool)
}

// NetConn and Buffered make an upConn a connpool.Conn.
func (pc *upConn) NetConn() net.Conn { return pc.c }
func (pc *upConn) Buffered() int     { return pc.br.Buffered() }

// capReader reads from c, at most n bytes while n >= 0.
type capReader struct {
	c net.Conn
	n int
}

var errUpstreamHeaders = errors.New("router: replica's response headers too large")

func (r *capReader) Read(p []byte) (int, error) {
	if r.n < 0 {
		return r.c.Read(p)
	}
	if r.n == 0 {
		return 0, errUpstreamHeaders
	}
	if len(p) > r.n {
		p = p[:r.n]
	}
	n, err := r.c.Read(p)
	r.n -= n
	return n, err
}

// unsentError is the error of a request that did not go out whole: the
// replica cannot have acted on it, so it may be sent again.
type unsentError struct{ err error }

func (e *unsentError) Error() string { return e.err.Error() }
func (e *unsentError) Unwrap() error { return e.err }

func (t *upstream) RoundTrip(req *http.Request) (*http.Response, error) {
	if !t.serves(req) {
		return t.fallback.RoundTrip(req)
	}
	ctx := req.Context()
	host := req.URL.Host
	if req.URL.Port() == "" { // http://replica, as http.Transport reads it
		host = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	for retried := false; ; retried = true {
		pc, err := t.get(ctx, host)
		if err != nil {
			closeReqBody(req)
			return nil, err
		}
		resp, err := t.exchange(ctx, pc, req)
		if err == nil {
			return resp, nil
		}
		pc.c.Close()
		unsent, ok := err.(*unsentError)
		if !ok {
			return nil, err
		}
		if retried || !pc.reused || req.GetBody == nil || ctx.Err() != nil {
			return nil, unsent.err
		}
		// A pooled connection the replica closed as the request went out
		// (after the check in get): nothing reached it whole, so the
		// request goes again on a new connection.
		body, gerr := req.GetBody()
		if gerr != nil {
			return nil, unsent.err
		}
		req = req.Clone(ctx)
		req.Body = body
	}
}

// serves reports whether req is one this transport sends itself: plain
// HTTP, no proxy, a body of known length, and no protocol upgrade.
func (t *upstream) serves(req *http.Request) bool {
	hasBody := req.Body != nil && req.Body != http.NoBody
	return req.URL.Scheme == "http" && !t.proxied &&
		req.ContentLength >= 0 && (req.ContentLength > 0 || !hasBody) &&
		req.Header.Get("Upgrade") == ""
}

func closeReqBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// pastDeadline ends any blocked read or write on a connection at once.
var pastDeadline = time.Unix(1, 0)

// exchange writes req on pc and reads the response headers. An error is
// the context's once it is done, and an *unsentError when the request did
// not go out whole.
func (t *upstream) exchange(ctx context.Context, pc *upConn, req *http.Request) (*http.Response, error) {
	stop := context.AfterFunc(ctx, func() { _ = pc.c.SetDeadline(pastDeadline) })
	fail := func(err error) (*http.Response, error) {
		stop()
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, err
	}
	pc.lim.n = t.maxHeader
	var wrote chan error // the write of a large body, beside the read
	if req.ContentLength > concurrentWrite {
		wrote = make(chan error, 1)
		go func() {
			err := writeRequest(pc.bw, req)
			closeReqBody(req)
			wrote <- err
		}()
	} else {
		err := writeRequest(pc.bw, req)
		closeReqBody(req)
		if err != nil {
			// The replica may have answered before it stopped reading.
			if ctx.Err() == nil {
				pc.readDeadline(ctx, time.Now().Add(earlyAnswerWait))
				if resp, rerr := t.readResponse(pc, req); rerr == nil {
					return t.answer(ctx, pc, req, resp, stop, false)
				}
			}
			return fail(&unsentError{err})
		}
	}
	if t.firstByte > 0 {
		pc.readDeadline(ctx, time.Now().Add(t.firstByte))
	}
	resp, err := t.readResponse(pc, req)
	if err != nil {
		return fail(err) // a large body's writer ends as the caller closes the connection
	}
	keep := true
	if wrote != nil {
		select {
		case werr := <-wrote:
			keep = werr == nil
		default:
			// The answer came before the body went out: the connection
			// closes when the answer ends, which ends the write.
			keep = false
		}
	}
	return t.answer(ctx, pc, req, resp, stop, keep)
}

// errUpstreamSwitch is a replica's 101 to a request that asked for no
// upgrade (those go to the fallback).
var errUpstreamSwitch = errors.New("router: replica switched protocols unasked")

// readDeadline sets pc's read deadline to at (zero: none), unless ctx is
// done: a deadline set just after the context's watch moved it to the past
// would undo the cancel.
func (pc *upConn) readDeadline(ctx context.Context, at time.Time) {
	_ = pc.c.SetReadDeadline(at)
	if ctx.Err() != nil {
		_ = pc.c.SetDeadline(pastDeadline)
	}
}

// readResponse reads the answer's headers from pc, past interim answers
// (100 Continue, 103 Early Hints). A 101 is an error: nothing this
// transport sends asks to switch protocols.
func (t *upstream) readResponse(pc *upConn, req *http.Request) (*http.Response, error) {
	for {
		resp, err := http.ReadResponse(pc.br, req)
		switch {
		case err != nil:
			return nil, err
		case resp.StatusCode == http.StatusSwitchingProtocols:
			return nil, errUpstreamSwitch
		case resp.StatusCode >= 200 || resp.StatusCode < 100:
			return resp, nil
		}
	}
}

// answer readies resp for the caller: no header cap or deadline on the
// body's reads, and a body that pools pc at its end when keep, neither
// side asked to close, and the context did not fire.
func (t *upstream) answer(ctx context.Context, pc *upConn, req *http.Request, resp *http.Response, stop func() bool, keep bool) (*http.Response, error) {
	pc.lim.n = -1
	pc.readDeadline(ctx, time.Time{})
	resp.Body = &upBody{rc: resp.Body, ctx: ctx, pc: pc, t: t, stop: stop, keep: keep && !resp.Close && !req.Close}
	return resp, nil
}

// hopHeaders are written by writeRequest itself, or not at all: the
// request's body is complete, so nothing waits for 100 Continue, and an
// upgrade goes to the fallback (upstream.serves).
var hopHeaders = map[string]bool{
	"Host": true, "Content-Length": true, "Transfer-Encoding": true,
	"Trailer": true, "Connection": true, "Expect": true,
}

// hopHeadersNoUA are hopHeaders and an empty User-Agent, which says to
// send none.
var hopHeadersNoUA = func() map[string]bool {
	m := maps.Clone(hopHeaders)
	m["User-Agent"] = true
	return m
}()

// writeRequest writes req as HTTP/1.1 with its whole body (of length
// req.ContentLength; upstream.serves) and flushes. Header values are
// net/http's to sanitise (Header.WriteSubset).
func writeRequest(bw *bufio.Writer, req *http.Request) error {
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	bw.WriteString(req.Method)
	bw.WriteByte(' ')
	bw.WriteString(req.URL.RequestURI())
	bw.WriteString(" HTTP/1.1\r\nHost: ")
	bw.WriteString(host)
	bw.WriteString("\r\n")
	if req.Close {
		bw.WriteString("Connection: close\r\n")
	}
	// As http.Transport: a length for any body, and 0 for a POST, PUT or
	// PATCH without one.
	if n := req.ContentLength; n > 0 || req.Method == http.MethodPost || req.Method == http.MethodPut || req.Method == http.MethodPatch {
		var b [20]byte
		bw.WriteString("Content-Length: ")
		bw.Write(strconv.AppendInt(b[:0], n, 10))
		bw.WriteString("\r\n")
	}
	skip := hopHeaders
	if ua, ok := req.Header["User-Agent"]; ok && (len(ua) == 0 || ua[0] == "") {
		skip = hopHeadersNoUA
	}
	if err := req.Header.WriteSubset(bw, skip); err != nil {
		return err
	}
	bw.WriteString("\r\n")
	if req.ContentLength > 0 {
		var n int64
		var err error
		if wt, ok := req.Body.(io.WriterTo); ok {
			// The router's own body writes itself in one call: the part
			// that does not fit the buffer goes to the socket directly.
			n, err = wt.WriteTo(bw)
		} else {
			n, err = io.CopyN(bw, req.Body, req.ContentLength)
		}
		if err != nil {
			return err
		}
		if n != req.ContentLength {
			return errors.New("router: request body not of its stated length")
		}
	}
	return bw.Flush()
}

// get returns a pooled connection to host that is still open, or dials
// one.
func (t *upstream) get(ctx context.Context, host string) (*upConn, error) {
	// The pool peeks at every connection it hands out: bytes from the
	// replica on an idle connection (a close, or an answer nobody asked
	// for) must never be read as this request's answer.
	if pc, ok := t.pool.Get(host); ok {
		pc.reused = true
		return pc, nil
	}
	c, err := t.dial(ctx, "tcp", host)
	if err != nil {
		return nil, err
	}
	pc := &upConn{c: c, host: host, lim: capReader{c: c, n: -1}}
	pc.br = bufio.NewReader(&pc.lim)
	pc.bw = bufio.NewWriter(c)
	return pc, nil
}

// CloseIdleConnections closes every pooled connection, and the fallback's.
func (t *upstream) CloseIdleConnections() {
	t.pool.CloseIdle()
	if f, ok := t.fallback.(interface{ CloseIdleConnections() }); ok {
		f.CloseIdleConnections()
	}
}

// upBody is a response body. Read to its end with the connection still
// good, it pools the connection; closed early, it closes the connection,
// which tells the replica to stop generating.
type upBody struct {
	rc   io.ReadCloser
	ctx  context.Context // the request's
	pc   *upConn
	t    *upstream
	stop func() bool // stops the context's watch; false once it fired
	keep bool        // neither side asked to close the connection
	done atomic.Bool
}

func (b *upBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	switch {
	case err == io.EOF:
		b.finish(true)
	case err != nil && b.ctx.Err() != nil:
		// Cancelled (the client left, or the replica went silent): the
		// past deadline's timeout is not the replica's fault, and reads
		// as http.Transport's would.
		err = b.ctx.Err()
	}
	return n, err
}

func (b *upBody) Close() error {
	b.finish(false)
	return nil
}

func (b *upBody) finish(eof bool) {
	if b.done.Swap(true) {
		return
	}
	if b.stop() && eof && b.keep {
		b.t.pool.Put(b.pc.host, b.pc)
		return
	}
	b.pc.c.Close()
}
