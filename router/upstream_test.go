package router

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
)

func testUpstream(t *testing.T) *upstream {
	t.Helper()
	std := http.DefaultTransport.(*http.Transport).Clone()
	u := newUpstream(std, 5*time.Second, maxResponseHeaderBytes, 4)
	u.proxied = false
	t.Cleanup(u.CloseIdleConnections)
	return u
}

// post sends body to url through u with a rewindable body, as the router's
// proxy does, and returns the status and body of the answer.
func post(t *testing.T, u *upstream, ctx context.Context, url, body string) (int, string, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return roundTrip(u, req)
}

// countConns counts the connections a test server accepts.
func countConns(srv *httptest.Server) *atomic.Int32 {
	var n atomic.Int32
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			n.Add(1)
		}
	}
	return &n
}

func TestUpstreamReusesConnections(t *testing.T) {
	for _, chunked := range []bool{false, true} {
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			if chunked {
				w.Write(b[:1])
				w.(http.Flusher).Flush() // no length: chunked
				w.Write(b[1:])
				return
			}
			w.Write(b)
		}))
		conns := countConns(srv)
		srv.Start()
		u := testUpstream(t)
		for i := range 5 {
			body := strings.Repeat("x", 10+i)
			code, got, err := post(t, u, context.Background(), srv.URL+"/echo", body)
			if err != nil || code != 200 || got != body {
				t.Fatalf("chunked=%v request %d: %d %q %v", chunked, i, code, got, err)
			}
		}
		if n := conns.Load(); n != 1 {
			t.Errorf("chunked=%v: 5 sequential requests opened %d connections, want 1", chunked, n)
		}
		srv.Close()
	}
}

// oneShotServer answers each connection's first request with 200 "ok" and
// closes the connection without saying so (no Connection: close), as a
// replica whose keep-alive timer fired does. It counts connections.
func oneShotServer(t *testing.T) (url string, conns *atomic.Int32) {
	t.Helper()
	s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, _ *http.Request, _ int) bool {
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		return false
	})
	return s.url, &s.conns
}

// brokenConn is a connection whose writes fail once broken is set, as a
// pooled connection the replica closed between the check and the write;
// not a syscall.Conn, so the check passes it.
type brokenConn struct {
	net.Conn
	broken *atomic.Bool
}

func (c brokenConn) Write(p []byte) (int, error) {
	if c.broken.Load() {
		return 0, syscall.EPIPE
	}
	return c.Conn.Write(p)
}

func TestUpstreamSendsAgainOnlyWhatDidNotGoOut(t *testing.T) {
	var seen atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.Add(1)
		io.Copy(w, r.Body)
	}))
	defer srv.Close()
	u := testUpstream(t)
	var broken []*atomic.Bool
	dial := u.dial
	u.dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		b := new(atomic.Bool)
		broken = append(broken, b)
		return brokenConn{c, b}, err
	}
	if code, got, err := post(t, u, context.Background(), srv.URL, "one"); err != nil || code != 200 || got != "one" {
		t.Fatal(code, got, err)
	}
	broken[0].Store(true)
	// The pooled connection's write fails: the request never went out, so
	// it goes again, once, on a new connection.
	if code, got, err := post(t, u, context.Background(), srv.URL, "two"); err != nil || code != 200 || got != "two" {
		t.Fatalf("%d %q %v, want the request sent again on a new connection", code, got, err)
	}
	if len(broken) != 2 || seen.Load() != 2 {
		t.Errorf("dialed %d, replica saw %d requests; want 2 and 2", len(broken), seen.Load())
	}
}

func TestUpstreamDoesNotSendAgainWhatWentOut(t *testing.T) {
	var seen atomic.Int32
	url := rawServer(t, func(c net.Conn) {
		// The first request is answered; the second is read whole, then
		// the connection closes without an answer (a replica that died).
		if seen.Add(1) == 1 {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			return
		}
		c.Close()
	})
	u := testUpstream(t)
	if _, _, err := post(t, u, context.Background(), url, "a"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := post(t, u, context.Background(), url, "b"); err == nil {
		t.Fatal("no error from a replica that closed without answering")
	}
	// Nothing to wait for: a request sent again would have been read
	// before the replica closed, so before RoundTrip returned.
	if n := seen.Load(); n != 2 {
		t.Errorf("the replica read %d requests, want 2: a request it read whole must not be sent again", n)
	}
}

func TestUpstreamChecksPooledConnectionsBeforeUse(t *testing.T) {
	url, conns := oneShotServer(t)
	u := testUpstream(t)
	if _, _, err := post(t, u, context.Background(), url, "a"); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the replica's close to reach the pooled connection", func() bool {
		u.mu.Lock()
		defer u.mu.Unlock()
		for _, l := range u.idle {
			for _, pc := range l {
				if pc.alive() {
					return false
				}
			}
		}
		return true
	})
	// The closed connection is seen before use, so the request does not
	// need its body again.
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader("b"))
	req.GetBody = nil // cannot be sent twice
	resp, err := u.RoundTrip(req)
	if err != nil {
		t.Fatalf("a connection the replica closed was used: %v", err)
	}
	resp.Body.Close()
	if n := conns.Load(); n != 2 {
		t.Errorf("connections = %d, want 2", n)
	}
}

func TestUpstreamCancelClosesTheConnection(t *testing.T) {
	arrived, gone := make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body) // net/http watches for a close once the body is read
		close(arrived)
		<-r.Context().Done() // the router's connection closed: the replica stops
		close(gone)
	}))
	defer srv.Close()
	u := testUpstream(t)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, _, err := post(t, u, ctx, srv.URL, "x"); errc <- err }()
	<-arrived // the replica has the request and works on it
	cancel()
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("err = %v, want context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("RoundTrip did not return after its context was cancelled")
	}
	select {
	case <-gone:
	case <-time.After(5 * time.Second):
		t.Fatal("the replica did not see the connection close")
	}
}

func TestUpstreamEarlyCloseDoesNotPool(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for range 100 {
			if _, err := w.Write(bytes.Repeat([]byte("data: x\n\n"), 100)); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	}))
	conns := countConns(srv)
	srv.Start()
	defer srv.Close()
	u := testUpstream(t)
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("x"))
	resp, err := u.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Read(make([]byte, 10))
	resp.Body.Close() // the client left mid-stream
	if code, _, err := post(t, u, context.Background(), srv.URL, "y"); err != nil || code != 200 {
		t.Fatal(code, err)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("connections = %d, want 2: a body closed early must not be pooled", n)
	}
}

// rawOne serves one request on each connection, then closes it.
func rawOne(t *testing.T, serve func(c net.Conn, br *bufio.Reader, req *http.Request)) string {
	t.Helper()
	return newScripted(t, true, func(c net.Conn, br *bufio.Reader, req *http.Request, _ int) bool {
		serve(c, br, req)
		return false
	}).url
}

// rawServer answers every request on every connection with reply.
func rawServer(t *testing.T, reply func(c net.Conn)) string {
	t.Helper()
	return newScripted(t, true, func(c net.Conn, _ *bufio.Reader, _ *http.Request, _ int) bool {
		reply(c)
		return true
	}).url
}

func TestUpstreamSkipsInterimAnswers(t *testing.T) {
	url := rawServer(t, func(c net.Conn) {
		io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone")
	})
	code, got, err := post(t, testUpstream(t), context.Background(), url, "x")
	if err != nil || code != 201 || got != "done" {
		t.Fatalf("%d %q %v, want 201 \"done\"", code, got, err)
	}
}

func TestUpstreamBoundsResponseHeaders(t *testing.T) {
	url := rawServer(t, func(c net.Conn) {
		io.WriteString(c, "HTTP/1.1 200 OK\r\n")
		line := "X-Big: " + strings.Repeat("a", 1000) + "\r\n"
		for range maxResponseHeaderBytes/len(line) + 2 {
			if _, err := io.WriteString(c, line); err != nil {
				return
			}
		}
		io.WriteString(c, "Content-Length: 0\r\n\r\n")
	})
	_, _, err := post(t, testUpstream(t), context.Background(), url, "x")
	if !errors.Is(err, errUpstreamHeaders) {
		t.Fatalf("err = %v, want %v", err, errUpstreamHeaders)
	}
}

func TestUpstreamFirstByteTimeout(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	u := testUpstream(t)
	u.firstByte = 100 * time.Millisecond
	start := time.Now()
	_, _, err := post(t, u, context.Background(), srv.URL, "x")
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("err = %v, want a timeout", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("timed out after %v", d)
	}
}

func TestUpstreamSendsHeadersAndBody(t *testing.T) {
	var got *http.Request
	var gotBody []byte
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r.Clone(context.Background())
		gotBody, _ = io.ReadAll(r.Body)
	}))
	defer srv.Close()
	body := strings.Repeat("b", 100<<10) // larger than the write buffer
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/x?q=1", strings.NewReader(body))
	req.Host = "replica.example"
	req.Header.Set("Authorization", "Bearer k")
	req.Header.Set("Expect", "100-continue") // the body is sent whole: nothing waits
	req.Header["User-Agent"] = []string{""}
	resp, err := testUpstream(t).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if got.URL.RequestURI() != "/v1/x?q=1" || got.Host != "replica.example" || got.Header.Get("Authorization") != "Bearer k" ||
		got.Header.Get("Expect") != "" || got.UserAgent() != "" || got.ContentLength != int64(len(body)) || string(gotBody) != body {
		t.Errorf("replica got %s %s host %q auth %q expect %q ua %q length %d, body %d bytes",
			got.Method, got.URL, got.Host, got.Header.Get("Authorization"), got.Header.Get("Expect"), got.UserAgent(), got.ContentLength, len(gotBody))
	}
}

func TestUpstreamHTTPSGoesToTheFallback(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "tls") }))
	defer srv.Close()
	u := testUpstream(t)
	u.fallback = srv.Client().Transport
	code, got, err := post(t, u, context.Background(), srv.URL, "x")
	if err != nil || code != 200 || got != "tls" {
		t.Fatalf("%d %q %v", code, got, err)
	}
}

func TestUpstreamCancelMidBodyReadsAsCanceled(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "data: first\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	resp, err := testUpstream(t).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := resp.Body.Read(make([]byte, 64)); err != nil {
		t.Fatal(err)
	}
	time.AfterFunc(20*time.Millisecond, cancel)
	// The proxy logs a body's read errors but context.Canceled: the
	// client's leaving is not the replica's fault.
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, context.Canceled) {
		t.Errorf("read after cancel: %v, want context.Canceled", err)
	}
}
