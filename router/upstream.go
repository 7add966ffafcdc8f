package router

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// upstream is the router's transport to plain-HTTP replicas: HTTP/1.1 over
// pooled keep-alive connections, with the whole exchange — write the
// request, read the response headers, read the body — in the calling
// goroutine. http.Transport runs a reader and a writer goroutine for each
// connection and hands every request and response between them over
// channels; at 1 KB that machinery was about a third of the router's CPU
// (BENCHMARKS.md, "Beside nginx"). Requests it does not serve — https
// replicas, or any replica when HTTP_PROXY is set — go to fallback.
//
// Responses come from http.ReadResponse, so framing (Content-Length,
// chunked, close-delimited) is net/http's. A request's context cancels it
// at any point: its connection's deadline is moved to the past, which ends
// a blocked write or read, and the connection is closed rather than pooled.
//
// Safe for concurrent use.
type upstream struct {
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)
	fallback  http.RoundTripper
	firstByte time.Duration // bounds the wait for response headers after the request is written; 0: none
	maxHeader int           // bytes of response headers read at most
	maxIdle   int           // idle connections kept per replica
	proxied   bool          // HTTP_PROXY is set: everything goes to fallback

	mu   sync.Mutex
	idle map[string][]*upConn // by host:port, most recently used last
}

// upIdleTimeout is how long a pooled connection may idle before it is
// closed instead of reused (http.DefaultTransport's IdleConnTimeout).
const upIdleTimeout = 90 * time.Second

// upCheckAfter is how long a pooled connection may idle before it is
// checked for a close from the replica before reuse: vLLM's server
// (uvicorn) closes keep-alive connections after 5 s of idling. A connection
// used more recently is trusted, and a close that races the request is
// retried once on a new connection.
const upCheckAfter = time.Second

func newUpstream(t *http.Transport, connect, firstByte time.Duration, maxHeader, maxIdle int) *upstream {
	return &upstream{
		dial:      (&net.Dialer{Timeout: connect, KeepAlive: 30 * time.Second}).DialContext,
		fallback:  t,
		firstByte: firstByte,
		maxHeader: maxHeader,
		maxIdle:   maxIdle,
		proxied:   os.Getenv("HTTP_PROXY") != "" || os.Getenv("http_proxy") != "",
		idle:      make(map[string][]*upConn),
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
	reused bool      // it served a request before
	since  time.Time // when it went idle
}

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

// errNoAnswer marks a pooled connection that failed before any answer:
// the replica closed it while it idled.
var errNoAnswer = errors.New("router: pooled connection closed by the replica")

func (t *upstream) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "http" || t.proxied {
		return t.fallback.RoundTrip(req)
	}
	ctx := req.Context()
	for retried := false; ; retried = true {
		pc, err := t.get(ctx, req.URL.Host)
		if err != nil {
			closeReqBody(req)
			return nil, err
		}
		resp, err := t.exchange(ctx, pc, req)
		if err == nil {
			return resp, nil
		}
		pc.c.Close()
		if retried || !errors.Is(err, errNoAnswer) || req.GetBody == nil || ctx.Err() != nil {
			return nil, errors.Unwrap(err)
		}
		// The replica closed a pooled connection as the request went out:
		// nothing was answered, so it goes again on a new connection.
		body, gerr := req.GetBody()
		if gerr != nil {
			return nil, errors.Unwrap(err)
		}
		req = req.Clone(ctx)
		req.Body = body
	}
}

func closeReqBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// pastDeadline ends any blocked read or write on a connection at once.
var pastDeadline = time.Unix(1, 0)

// exchange writes req on pc and reads the response headers. Its errors
// are *wrapped around their cause; on a reused connection, before any
// response byte, they are marked errNoAnswer.
func (t *upstream) exchange(ctx context.Context, pc *upConn, req *http.Request) (*http.Response, error) {
	stop := context.AfterFunc(ctx, func() { _ = pc.c.SetDeadline(pastDeadline) })
	fail := func(err error) (*http.Response, error) {
		stop()
		if ctx.Err() != nil {
			err = ctx.Err()
		} else if pc.reused && pc.lim.n == t.maxHeader && noAnswer(err) {
			return nil, &wrapped{errNoAnswer, err}
		}
		return nil, &wrapped{err, err}
	}
	pc.lim.n = t.maxHeader // and nothing read yet
	err := writeRequest(pc.bw, req)
	closeReqBody(req)
	if err != nil {
		return fail(err)
	}
	if t.firstByte > 0 {
		_ = pc.c.SetReadDeadline(time.Now().Add(t.firstByte))
	}
	var resp *http.Response
	for {
		if resp, err = http.ReadResponse(pc.br, req); err != nil {
			return fail(err)
		}
		// Interim answers (100 Continue, 103 Early Hints) come before the
		// real one; 101 would switch protocols, which a replica has no
		// reason to, and reaches the client as an answer.
		if resp.StatusCode < 100 || resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
	}
	pc.lim.n = -1
	if t.firstByte > 0 {
		_ = pc.c.SetReadDeadline(time.Time{})
		if ctx.Err() != nil { // cancelled as the deadline was cleared
			_ = pc.c.SetDeadline(pastDeadline)
		}
	}
	resp.Body = &upBody{rc: resp.Body, pc: pc, t: t, stop: stop, keep: !resp.Close && !req.Close}
	return resp, nil
}

// wrapped is an error that Is its mark and unwraps to its cause.
type wrapped struct{ mark, cause error }

func (w *wrapped) Error() string        { return w.cause.Error() }
func (w *wrapped) Is(target error) bool { return target == w.mark }
func (w *wrapped) Unwrap() error        { return w.cause }

// noAnswer reports whether err is what a connection the peer had closed
// gives: EOF, or a reset or broken pipe.
func noAnswer(err error) bool {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	var op *net.OpError
	return errors.As(err, &op) && !op.Timeout()
}

// hopHeaders are written by writeRequest itself, or not at all: the
// request's body is complete, so nothing waits for 100 Continue.
var hopHeaders = map[string]bool{
	"Host": true, "User-Agent": true, "Content-Length": true, "Transfer-Encoding": true,
	"Trailer": true, "Connection": true, "Expect": true,
}

// writeRequest writes req as HTTP/1.1 with its whole body and flushes.
// Header values are net/http's to sanitise (Header.WriteSubset).
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
	if ua := req.Header.Get("User-Agent"); ua != "" {
		bw.WriteString("User-Agent: ")
		bw.WriteString(ua)
		bw.WriteString("\r\n")
	}
	if req.Close {
		bw.WriteString("Connection: close\r\n")
	}
	if req.Body != nil && req.Body != http.NoBody || req.ContentLength > 0 {
		var n [20]byte
		bw.WriteString("Content-Length: ")
		bw.Write(strconv.AppendInt(n[:0], req.ContentLength, 10))
		bw.WriteString("\r\n")
	}
	if err := req.Header.WriteSubset(bw, hopHeaders); err != nil {
		return err
	}
	bw.WriteString("\r\n")
	if req.Body != nil && req.ContentLength > 0 {
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

// get returns a pooled connection to host, or dials one.
func (t *upstream) get(ctx context.Context, host string) (*upConn, error) {
	now := time.Now()
	for {
		t.mu.Lock()
		l := t.idle[host]
		if len(l) == 0 {
			t.mu.Unlock()
			break
		}
		pc := l[len(l)-1]
		l[len(l)-1] = nil
		t.idle[host] = l[:len(l)-1]
		t.mu.Unlock()
		idle := now.Sub(pc.since)
		if idle < upCheckAfter || idle < upIdleTimeout && pc.alive() {
			return pc, nil
		}
		pc.c.Close()
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

// alive reports whether an idle connection is still open: nothing to
// read means it is; EOF, an error, or bytes nobody asked for mean it is
// not.
func (pc *upConn) alive() bool {
	return pc.br.Buffered() == 0 && peekIdle(pc.c)
}

// put pools pc for reuse, or closes it when the pool for its host is full.
// Connections idle past upIdleTimeout are closed on the way.
func (t *upstream) put(pc *upConn) {
	pc.reused, pc.since = true, time.Now()
	t.mu.Lock()
	l := t.idle[pc.host]
	var stale *upConn
	if len(l) > 0 && pc.since.Sub(l[0].since) > upIdleTimeout {
		stale = l[0]
		l = append(l[:0], l[1:]...)
	}
	full := len(l) >= t.maxIdle
	if !full {
		l = append(l, pc)
	}
	t.idle[pc.host] = l
	t.mu.Unlock()
	if stale != nil {
		stale.c.Close()
	}
	if full {
		pc.c.Close()
	}
}

// CloseIdleConnections closes every pooled connection, and the fallback's.
func (t *upstream) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = make(map[string][]*upConn)
	t.mu.Unlock()
	for _, l := range idle {
		for _, pc := range l {
			pc.c.Close()
		}
	}
	if f, ok := t.fallback.(interface{ CloseIdleConnections() }); ok {
		f.CloseIdleConnections()
	}
}

// upBody is a response body. Read to its end with the connection still
// good, it pools the connection; closed early, it closes the connection,
// which tells the replica to stop generating.
type upBody struct {
	rc   io.ReadCloser
	pc   *upConn
	t    *upstream
	stop func() bool // stops the context's watch; false once it fired
	keep bool        // neither side asked to close the connection
	done atomic.Bool
}

func (b *upBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.finish(true)
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
		b.t.put(b.pc)
		return
	}
	b.pc.c.Close()
}
