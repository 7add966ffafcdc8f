package router

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/limits"
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
		return u.pool.Live() == 0
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

// cancelAtDeadline is a connection that, the first time a future read
// deadline is set on it, first cancels the request and waits for the
// context's AfterFunc to set a deadline in the past: the interleaving of a
// client that leaves just after the request is written.
type cancelAtDeadline struct {
	net.Conn
	once   sync.Once
	cancel context.CancelFunc
	moved  chan struct{} // closed when a deadline in the past is set
	past   sync.Once
}

func (c *cancelAtDeadline) SetReadDeadline(t time.Time) error {
	if t.After(time.Now()) {
		c.once.Do(func() {
			c.cancel()
			select {
			case <-c.moved: // the AfterFunc moved the deadline to the past
			case <-time.After(testwait.Deadline): // it never did: RoundTrip's time says so
			}
		})
	}
	return c.Conn.SetReadDeadline(t)
}

func (c *cancelAtDeadline) SetDeadline(t time.Time) error {
	err := c.Conn.SetDeadline(t)
	if !t.IsZero() && t.Before(time.Now()) {
		c.past.Do(func() { close(c.moved) })
	}
	return err
}

// TestUpstreamCancelLostToFirstByteDeadline: exchange sets the first-byte
// read deadline after the write without looking at the context again. A
// cancel whose AfterFunc ran in between (deadline moved to the past) is
// undone by the new deadline: the read waits for the replica's answer or
// the first-byte timeout (default 300 s) although the client has gone, and
// the replica keeps generating for nobody.
func TestUpstreamCancelLostToFirstByteDeadline(t *testing.T) {
	for _, size := range []int{100, 100 << 10} { // the write in line, and beside the read
		done := make(chan struct{})
		s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			<-done // a long non-streamed generation, until the test ends
			c.Write([]byte("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
			return true
		})
		t.Cleanup(func() { close(done) }) // before the replica's own cleanup waits for it
		u := testUpstream(t)
		u.firstByte = time.Hour // nothing but the cancel ends the wait for the answer
		ctx, cancel := context.WithCancel(context.Background())
		d := u.dial
		u.dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &cancelAtDeadline{Conn: c, cancel: cancel, moved: make(chan struct{})}, nil
		}
		req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/x", strings.NewReader(strings.Repeat("x", size)))
		returned := make(chan error, 1)
		go func() {
			resp, err := u.RoundTrip(req)
			if err == nil {
				resp.Body.Close()
			}
			returned <- err
		}()
		select {
		case err := <-returned:
			t.Logf("body %d: cancelled at once; RoundTrip returned %v", size, err)
			if !errors.Is(err, context.Canceled) {
				t.Errorf("body %d: RoundTrip returned %v, want context.Canceled", size, err)
			}
		case <-time.After(testwait.Deadline):
			t.Errorf("body %d: the cancel was lost: RoundTrip still waits for an answer the replica never sends", size)
		}
		cancel()
	}
}

// TestUpstreamFailoverOfEmptyBodyGoesToFallback: failover sets a body reader
// on the next attempt even when the body is empty (ContentLength 0), and
// upstream.serves sends a non-nil body of length 0 to the fallback: the
// attempt after a failover goes through http.Transport (seen by the
// Accept-Encoding: gzip it adds), with its own pool, and a POST's empty body
// goes chunked. Now an empty body is no body, on every attempt.
func TestUpstreamFailoverOfEmptyBodyGoesToFallback(t *testing.T) {
	var seen []string
	var n int
	h := func(name string, _ int) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			n++
			code := 200
			if n%2 == 1 { // every other answer, whichever replica: the first attempt fails over
				code = 503
			}
			seen = append(seen, name+" "+r.Method+" ae="+r.Header.Get("Accept-Encoding")+" te="+r.Header.Get("Transfer-Encoding")+" "+http.StatusText(code))
			w.WriteHeader(code)
		}
	}
	bad := httptest.NewServer(h("bad", 503))
	defer bad.Close()
	good := httptest.NewServer(h("good", 200))
	defer good.Close()
	ts, _ := serverFor(t, ServerOptions{}, bad.URL, good.URL)
	c := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	for _, m := range []string{"GET", "POST", "GET", "POST"} {
		req, _ := http.NewRequest(m, ts.URL+"/v1/files", nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	for _, s := range seen {
		if strings.Contains(s, "ae=gzip") || strings.Contains(s, "te=chunked") {
			t.Errorf("an attempt went through http.Transport: %s", s)
		}
	}
}

// TestUpstreamIdleTotalUnbounded: the idle connections kept over all
// replicas are bounded (maxTotal; 256 per replica would otherwise make
// 12,800 for 50 replicas). After a burst of 64 concurrent requests to each
// of 8 replicas, with the total cap at 100, count the connections left
// idle. http.Transport (MaxIdleConns 100) is logged beside it.
func TestUpstreamIdleTotalUnbounded(t *testing.T) {
	const replicas, per, total = 8, 64, 100
	for _, which := range []string{"upstream", "http.Transport"} {
		t.Run(which, func(t *testing.T) {
			var idle atomic.Int32
			var gate sync.WaitGroup
			gate.Add(replicas * per)
			var urls []string
			for range replicas {
				srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					io.Copy(io.Discard, r.Body)
					gate.Done()
					gate.Wait() // every request holds its connection until all arrived
					w.Write([]byte("ok"))
				}))
				srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
					switch s {
					case http.StateIdle:
						idle.Add(1)
					case http.StateActive:
						// a new connection goes New -> Active; an idle one Idle -> Active
					}
				}
				srv.Start()
				t.Cleanup(srv.Close)
				urls = append(urls, srv.URL)
			}
			var rt http.RoundTripper
			if which == "upstream" {
				u := testUpstream(t)
				u.pool.MaxPerKey, u.pool.MaxTotal = maxIdlePerReplica, total
				rt = u
			} else {
				tr := http.DefaultTransport.(*http.Transport).Clone()
				tr.MaxIdleConnsPerHost = maxIdlePerReplica
				t.Cleanup(tr.CloseIdleConnections)
				rt = tr
			}
			var wg sync.WaitGroup
			for _, u := range urls {
				for range per {
					wg.Add(1)
					go func() {
						defer wg.Done()
						req, _ := http.NewRequest("POST", u+"/x", strings.NewReader("x"))
						resp, err := rt.RoundTrip(req)
						if err != nil {
							t.Error(err)
							return
						}
						io.ReadAll(resp.Body)
						resp.Body.Close()
					}()
				}
			}
			wg.Wait()
			testwait.Until(t, "every answered connection idle on the replica side", func() bool { return idle.Load() >= replicas*per })
			// Idle on the replica side and still open on ours: count ours.
			open := 0
			switch x := rt.(type) {
			case *upstream:
				open = x.pool.Len()
			case *http.Transport:
				open = fds(t) // rough; logged only
			}
			t.Logf("%s: connections kept idle after the burst: %d (replica side went idle %d times, fds %d)", which, open, idle.Load(), fds(t))
			if which == "upstream" && open > total {
				t.Errorf("%d idle connections kept over %d replicas, more than the cap of %d", open, replicas, total)
			}
		})
	}
}

// TestUpstreamFirstByteTimeoutLeaksAddresses: with http.Transport a replica
// that does not answer within FirstByte gave the client "net/http: timeout
// awaiting response headers"; the router's transport gives it the raw read
// error, "read tcp <router ip:port>-><replica ip:port>: i/o timeout".
func TestUpstreamFirstByteTimeoutLeaksAddresses(t *testing.T) {
	done := make(chan struct{}) // the replica never answers; it lets go when the test ends
	defer close(done)
	url := rawOne(t, func(c net.Conn, br *bufio.Reader, req *http.Request) { <-done })
	ts, _ := serverFor(t, ServerOptions{Timeouts: limits.Timeouts{FirstByte: 200 * time.Millisecond}}, url)
	resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("%d %s", resp.StatusCode, b)
	if strings.Contains(string(b), strings.TrimPrefix(url, "http://")) {
		t.Errorf("the client is told the replica's address: %s", b)
	}
}

// TestUpstreamReplicaURLWithoutPort: a replica configured without a port
// (http://host, as replica.ParseURL allows: "http(s)://host[:port]", e.g.
// a Kubernetes Service on port 80) is dialled as "host" — "missing port in
// address" — where http.Transport dialled host:80. Every request fails and
// the replica is ejected, while its health checks (through http.Transport)
// say it is fine. Skipped where port 80 cannot be had.
func TestUpstreamReplicaURLWithoutPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:80")
	if err != nil {
		t.Skip("cannot listen on port 80:", err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"message":{"content":"hi"}}]}`)
	})}
	go srv.Serve(ln)
	defer srv.Close()
	ts, _ := serverWith(t, ServerOptions{}, nil, "http://127.0.0.1")
	resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("replica http://127.0.0.1 (port 80) not reached: %d %s", resp.StatusCode, b)
	}
}

// TestUpstreamFailoverDrainStalls: the first replica answers 503 with a
// Content-Length and then goes silent. failover drains up to 64 KiB of that
// body before moving on, with no deadline: neither the first-byte timeout
// (cleared once headers are in) nor the idle timeout (modifyResponse has
// not wrapped the body yet) bounds it. The request hangs until the client
// leaves although a second, healthy replica is there. The failed answer is
// now closed undrained.
func TestUpstreamFailoverDrainStalls(t *testing.T) {
	serverTransports(t, func(t *testing.T, tr http.RoundTripper) {
		done := make(chan struct{})
		bad := rawOne(t, func(c net.Conn, br *bufio.Reader, req *http.Request) {
			io.WriteString(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\n{")
			<-done // the rest of the body never comes while the test runs
		})
		t.Cleanup(func() { close(done) })
		good := rawOne(t, func(c net.Conn, br *bufio.Reader, req *http.Request) {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
		})
		o := ServerOptions{Timeouts: limits.Timeouts{FirstByte: 500 * time.Millisecond, Idle: 500 * time.Millisecond}}
		o.Transport = tr
		ts, _ := serverFor(t, o, bad, good)
		c := &http.Client{Timeout: testwait.Deadline} // only a request that hangs reaches it
		start := time.Now()
		resp, err := c.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
		if err != nil {
			t.Fatalf("no answer after %v (idle and first-byte timeouts are 0.5 s): %v", time.Since(start).Round(time.Millisecond), err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("%d after %v, want the healthy replica's 200", resp.StatusCode, time.Since(start))
		}
	})
}

// TestUpstreamStreamFlushTrailers: a streamed answer (chunked SSE with a
// trailer, usage chunk stripped): each event reaches the client before the
// replica sends the next, the usage chunk is not seen, the trailer is.
func TestUpstreamStreamFlushTrailers(t *testing.T) {
	serverTransports(t, func(t *testing.T, tr http.RoundTripper) {
		next, done := make(chan struct{}), make(chan struct{})
		url := rawOne(t, func(c net.Conn, br *bufio.Reader, req *http.Request) {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTrailer: X-End\r\nTransfer-Encoding: chunked\r\n\r\n")
			chunk := func(s string) { io.WriteString(c, strings.ToUpper(strconvHex(len(s)))+"\r\n"+s+"\r\n") }
			for i := range 3 {
				chunk("data: {\"choices\":[{\"delta\":{\"content\":\"" + string(rune('a'+i)) + "\"}}]}\n\n")
				select {
				case <-next: // the test read the event
				case <-done: // the test failed before it did
					return
				}
			}
			chunk("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\n")
			chunk("data: [DONE]\n\n")
			io.WriteString(c, "0\r\nX-End: yes\r\n\r\n")
		})
		t.Cleanup(func() { close(done) }) // before the replica's own cleanup waits for it
		o := ServerOptions{}
		o.Transport = tr
		ts, _ := serverFor(t, o, url)
		resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		for i := range 3 {
			line, err := br.ReadString('\n')
			if err != nil || !strings.Contains(line, string(rune('a'+i))) {
				t.Fatalf("event %d: %q %v", i, line, err)
			}
			br.ReadString('\n')
			next <- struct{}{}
		}
		rest, _ := io.ReadAll(br)
		if strings.Contains(string(rest), "usage") || !strings.Contains(string(rest), "[DONE]") {
			t.Errorf("rest %q", rest)
		}
		if resp.Trailer.Get("X-End") != "yes" {
			t.Errorf("trailer %v", resp.Trailer)
		}
	})
}

func strconvHex(n int) string {
	const d = "0123456789abcdef"
	if n == 0 {
		return "0"
	}
	var b []byte
	for n > 0 {
		b = append([]byte{d[n%16]}, b...)
		n /= 16
	}
	return string(b)
}

// TestUpstreamChurn hammers the transport with concurrent requests of small
// and large bodies, random cancels, random early closes from another
// goroutine, a sweep every millisecond, and a replica that misbehaves at
// random; then checks that no goroutine or socket is left.
func TestUpstreamChurn(t *testing.T) {
	g0 := runtime.NumGoroutine()
	f0 := fds(t)
	s := newScripted(t, false, func(c net.Conn, br *bufio.Reader, req *http.Request, i int) bool {
		switch rand.IntN(8) {
		case 0: // early answer, body unread, close
			io.WriteString(c, "HTTP/1.1 413 X\r\nContent-Length: 3\r\n\r\nbig")
			return false
		case 1: // close without answer
			io.Copy(io.Discard, req.Body)
			return false
		case 2: // slow stream
			io.Copy(io.Discard, req.Body)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
			for range 5 {
				// The workload, not synchronisation: a stream slow
				// enough to be cancelled or closed half-way.
				time.Sleep(time.Millisecond)
				if _, err := io.WriteString(c, "5\r\nhello\r\n"); err != nil {
					return false
				}
			}
			io.WriteString(c, "0\r\n\r\n")
			return true
		case 3: // partial body then close
			io.Copy(io.Discard, req.Body)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
			return false
		default:
			n, _ := io.Copy(io.Discard, req.Body)
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(fmt.Sprint(n)), fmt.Sprint(n))
			return true
		}
	})
	u := testUpstream(t)
	u.pool.SweepEvery = time.Millisecond
	small := strings.Repeat("s", 1000)
	large := strings.Repeat("L", 200<<10)
	var wg sync.WaitGroup
	for w := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 60 {
				body := small
				if (w+i)%3 == 0 {
					body = large
				}
				ctx, cancel := context.WithCancel(context.Background())
				if rand.IntN(4) == 0 {
					time.AfterFunc(time.Duration(rand.IntN(3000))*time.Microsecond, cancel)
				}
				req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/x", strings.NewReader(body))
				resp, err := u.RoundTrip(req)
				if err != nil {
					cancel()
					continue
				}
				if rand.IntN(4) == 0 {
					go resp.Body.Close() // from another goroutine, mid-read
				}
				b, err := io.ReadAll(resp.Body)
				if err == nil && resp.StatusCode == 200 && string(b) != fmt.Sprint(len(body)) && string(b) != strings.Repeat("hello", 5) {
					t.Errorf("wrong answer %q for a body of %d", b, len(body))
				}
				resp.Body.Close()
				cancel()
			}
		}()
	}
	wg.Wait()
	u.CloseIdleConnections()
	s.closeAll()
	// The goroutines and sockets wind down; the checks below say what
	// is left if they do not.
	testwait.Within(testwait.Deadline, func() bool { return runtime.NumGoroutine() <= g0+4 && fds(t) <= f0+4 })
	t.Logf("goroutines %d -> %d, fds %d -> %d, conns %d", g0, runtime.NumGoroutine(), f0, fds(t), s.conns.Load())
	if idle := u.pool.Len(); idle != 0 {
		t.Errorf("%d idle connections still pooled after CloseIdleConnections", idle)
	}
	if n := runtime.NumGoroutine(); n > g0+4 {
		buf := make([]byte, 1<<20)
		t.Errorf("goroutines leaked: %d -> %d\n%s", g0, n, buf[:runtime.Stack(buf, true)])
	}
}

type countWrites struct {
	net.Conn
	n *atomic.Int32
}

func (c countWrites) Write(p []byte) (int, error) { c.n.Add(1); return c.Conn.Write(p) }

// TestUpstreamBodyWriteSyscalls: writeRequest means the router's body to go
// out in one write (bodyReader.WriteTo), but ReverseProxy hands the
// transport its body wrapped in a noopCloseReader, which has no WriteTo:
// the body is copied through the 4 KiB bufio.Writer, one write per 4 KiB.
func TestUpstreamBodyWriteSyscalls(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, "{}")
	}))
	defer srv.Close()
	var n atomic.Int32
	std := http.DefaultTransport.(*http.Transport).Clone()
	u := newUpstream(std, 0, maxResponseHeaderBytes, 4)
	u.proxied = false
	d := u.dial
	u.dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countWrites{c, &n}, nil
	}
	ts, _ := serverFor(t, ServerOptions{Transport: u}, srv.URL)
	prompt := strings.Repeat("a", 40<<10)
	body := `{"model":"m","messages":[{"role":"user","content":"` + prompt + `"}]}`
	resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("a %d-byte request went out in %d writes", len(body), n.Load())
	if n.Load() > 3 {
		t.Errorf("%d writes for one %d KiB request", n.Load(), len(body)>>10)
	}
}

// serverTransports runs f with tr nil (the router's own transport to
// replicas) and with a clone of http.DefaultTransport.
func serverTransports(t *testing.T, f func(t *testing.T, tr http.RoundTripper)) {
	for _, which := range []string{"upstream", "http.Transport"} {
		t.Run(which, func(t *testing.T) {
			var tr http.RoundTripper
			if which == "http.Transport" {
				tr = http.DefaultTransport.(*http.Transport).Clone()
			}
			f(t, tr)
		})
	}
}
