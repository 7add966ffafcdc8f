package router

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testnet"
	"github.com/semroute/semroute/internal/testwait"
)

// scripted is a raw replica: serve is called for each request read on a
// connection, with the connection and the request number on it; returning
// false closes the connection. reqs counts requests fully read.
type scripted struct {
	url      string
	reqs     atomic.Int32
	conns    atomic.Int32
	ended    atomic.Int32 // connections whose script ended, or whose client left
	mu       sync.Mutex
	seen     []string // "METHOD path body"
	closeAll func()
}

func newScripted(t testing.TB, readBody bool, serve func(c net.Conn, br *bufio.Reader, req *http.Request, i int) bool) *scripted {
	t.Helper()
	s := &scripted{}
	addr, closeAll := testnet.Serve(t, func(c net.Conn) {
		s.conns.Add(1)
		defer s.ended.Add(1)
		defer c.Close()
		br := bufio.NewReader(c)
		for i := 0; ; i++ {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			var b []byte
			if readBody {
				b, _ = io.ReadAll(req.Body)
			}
			s.reqs.Add(1)
			s.mu.Lock()
			if len(s.seen) < 64 { // a benchmark sends many
				s.seen = append(s.seen, req.Method+" "+req.URL.Path+" "+string(b))
			}
			s.mu.Unlock()
			if !serve(c, br, req, int(s.reqs.Load())-1) {
				return
			}
		}
	})
	s.url, s.closeAll = "http://"+addr, closeAll
	return s
}

// both runs f against the router's transport. With
// SEMROUTE_COMPARE_TRANSPORT set it runs f against http.Transport as well,
// to compare: not in the suite, as http.Transport has races of its own
// here (a 204 with a body is sometimes read as the next answer).
func both(t *testing.T, f func(t *testing.T, rt http.RoundTripper)) {
	t.Run("upstream", func(t *testing.T) { f(t, testUpstream(t)) })
	if os.Getenv("SEMROUTE_COMPARE_TRANSPORT") == "" {
		return
	}
	t.Run("http.Transport", func(t *testing.T) {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.DisableCompression = true
		t.Cleanup(tr.CloseIdleConnections)
		f(t, tr)
	})
}

func do(t *testing.T, rt http.RoundTripper, method, url, body string) (int, string, error) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, _ := http.NewRequest(method, url, rd)
	return roundTrip(rt, req)
}

// roundTrip sends req through rt and reads the whole answer.
func roundTrip(rt http.RoundTripper, req *http.Request) (int, string, error) {
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// burst posts "x" to url n times at once through rt and waits for all.
func burst(t *testing.T, rt http.RoundTripper, url string, n int) {
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() { defer wg.Done(); do(t, rt, "POST", url, "x") }()
	}
	wg.Wait()
}

// secondAnswer is what a scripted replica answers after a hostile first
// answer: a desync shows as the next request getting anything else.
const secondAnswer = "HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond"

// thenSecond is a script that answers a connection's first request with
// first (which reports whether the connection stays open) and every later
// one with secondAnswer.
func thenSecond(first func(c net.Conn) bool) func(net.Conn, *bufio.Reader, *http.Request, int) bool {
	return func(c net.Conn, _ *bufio.Reader, _ *http.Request, i int) bool {
		if i == 0 {
			return first(c)
		}
		io.WriteString(c, secondAnswer)
		return true
	}
}

// A1: a replica sends more bytes than its Content-Length. The surplus is a
// whole response; the next request on the pooled connection gets it.
func TestUpstreamHostileExcessBytesDesync(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		s := newScripted(t, true, thenSecond(func(c net.Conn) bool {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"+
				"HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\nSMUGGLED-FOR-")
			return true
		}))
		_, b1, err := do(t, rt, "POST", s.url+"/a", "tenant A")
		t.Logf("req1: %q %v", b1, err)
		_, b2, err := do(t, rt, "POST", s.url+"/b", "tenant B")
		t.Logf("req2: %q %v", b2, err)
		if b2 != "second" {
			t.Errorf("second request got %q, want \"second\"", b2)
		}
	})
}

// A2: 204 (and 304) carry a body anyway: the body is the next response.
func TestUpstreamHostile204WithBody(t *testing.T) {
	for _, code := range []int{204, 304} {
		both(t, func(t *testing.T, rt http.RoundTripper) {
			s := newScripted(t, true, thenSecond(func(c net.Conn) bool {
				fmt.Fprintf(c, "HTTP/1.1 %d X\r\nContent-Length: 42\r\n\r\nHTTP/1.1 418 Teapot\r\nContent-Length: 0\r\n\r\n", code)
				return true
			}))
			c1, _, err := do(t, rt, "GET", s.url+"/a", "")
			t.Logf("req1: %d %v", c1, err)
			c2, b2, err := do(t, rt, "GET", s.url+"/b", "")
			t.Logf("req2: %d %q %v", c2, b2, err)
			if c2 != 200 || b2 != "second" {
				t.Errorf("code %d: second request got %d %q", code, c2, b2)
			}
		})
	}
}

// A3: HEAD answered with a body.
func TestUpstreamHostileHeadWithBody(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			if req.Method == "HEAD" {
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 38\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
				return true
			}
			io.WriteString(c, secondAnswer)
			return true
		})
		do(t, rt, "HEAD", s.url+"/a", "")
		c2, b2, err := do(t, rt, "GET", s.url+"/b", "")
		t.Logf("req2: %d %q %v", c2, b2, err)
		if b2 != "second" {
			t.Errorf("second request got %d %q", c2, b2)
		}
	})
}

// A4: a reused connection; the replica reads the whole POST (and would run
// the generation), then the connection dies without an answer. Is the POST
// sent a second time? (The script runs once the whole request is read: it
// closes at once, which is as late as any close for the transport.)
func TestUpstreamHostileRetryDuplicatesPOST(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			if i == 0 {
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
				return true
			}
			return false // crash, or a load balancer's idle timeout
		})
		do(t, rt, "POST", s.url+"/v1/completions", "warm")
		req, _ := http.NewRequest("POST", s.url+"/v1/completions", strings.NewReader(`{"prompt":"charge me"}`))
		// GetBody is set by NewRequest for strings.Reader, as proxy.go sets it.
		resp, err := rt.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		s.mu.Lock()
		t.Logf("err=%v; replica read %d requests: %q", err, s.reqs.Load(), s.seen)
		s.mu.Unlock()
		if n := s.reqs.Load(); n != 2 {
			t.Errorf("the replica read the POST %d times", n-1)
		}
	})
}

// earlyAnswer POSTs a 16 MiB body to a replica that writes reply without
// reading it, ends its side of the connection (a FIN) if closeWrite, and
// holds the connection, unread, until the client has its answer. It
// returns what the client got, and heldUp: the client had nothing until
// the replica let go of the connection after testwait.Deadline (the
// exchange waited for a body the replica would never read).
func earlyAnswer(t *testing.T, rt http.RoundTripper, reply string, closeWrite bool) (code int, heldUp bool, err error) {
	answered := make(chan struct{})
	var gaveUp atomic.Bool
	s := newScripted(t, false, func(c net.Conn, _ *bufio.Reader, _ *http.Request, _ int) bool {
		io.WriteString(c, reply)
		if closeWrite {
			c.(*net.TCPConn).CloseWrite()
		}
		select {
		case <-answered:
		case <-time.After(testwait.Deadline):
			gaveUp.Store(true)
		}
		return false
	})
	code, b, err := do(t, rt, "POST", s.url+"/v1/completions", strings.Repeat("x", 16<<20))
	heldUp = gaveUp.Load()
	close(answered)
	t.Logf("%d %q %v (held up until the replica let go: %v)", code, b, err, heldUp)
	return code, heldUp, err
}

// A5: the replica answers early (413) without reading a large body, and
// closes. Does the client get the 413?
func TestUpstreamHostileEarlyAnswerThenClose(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		code, _, err := earlyAnswer(t, rt, "HTTP/1.1 413 Payload Too Large\r\nConnection: close\r\nContent-Length: 7\r\n\r\ntoo big", true)
		if code != 413 {
			t.Errorf("got %d %v, want the replica's 413", code, err)
		}
	})
}

// A6: the same, but the replica keeps the connection open and never reads
// the body: does the exchange end before the client gives up?
func TestUpstreamHostileEarlyAnswerNoRead(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		code, heldUp, err := earlyAnswer(t, rt, "HTTP/1.1 400 Bad Request\r\nContent-Length: 3\r\n\r\nbad", false)
		if code != 400 || heldUp {
			t.Errorf("got %d %v, held up until the replica let go: %v; want the 400 while the replica holds the connection", code, err, heldUp)
		}
	})
}

// A7: the replica closes idle keep-alive connections (uvicorn: 5 s). With
// no further traffic, are the closed sockets dropped from the pool?
func TestUpstreamHostileClosedIdleConnsStayPooled(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			return true
		})
		before := fds(t)
		burst(t, rt, s.url+"/x", 50)
		// The replica's keep-alive timeout: it closes all of them, and the
		// pool must let go of them.
		s.closeAll()
		after := testwait.Value(t, "at most 5 sockets more than before the burst", func() (int, bool) {
			after := fds(t)
			return after, after-before <= 5
		})
		t.Logf("fds before %d, after the replica closed all: %d (connections %d)", before, after, s.conns.Load())
	})
}

func fds(t *testing.T) int {
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip(err)
	}
	return len(es)
}

// A8: a 1xx flood within the header cap: the upstream skips the interim
// answers (http.Transport gives up after 5) and gives the final one; it
// never hands a 1xx to the caller, nor hangs.
func TestUpstreamHostile1xxFlood(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			w := bufio.NewWriter(c)
			for range 10000 {
				w.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
			}
			w.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			w.Flush()
			return true
		})
		start := time.Now()
		code, b, err := do(t, rt, "POST", s.url+"/x", "x")
		t.Logf("%d %q %v in %v", code, b, err, time.Since(start))
		if _, std := rt.(*http.Transport); std {
			if err == nil && code < 200 {
				t.Errorf("a 1xx answer reached the caller: %d", code)
			}
			return
		}
		if err != nil || code != 200 || b != "ok" {
			t.Errorf("after 10,000 interim answers: %d %q %v, want 200 \"ok\"", code, b, err)
		}
	})
}

// A9: a request with a body of unknown length (ContentLength -1), as a
// RoundTripper user other than the router's proxy might send.
func TestUpstreamHostileUnknownLengthBody(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		var got string
		var gmu sync.Mutex
		defer gmu.Unlock()
		s := newScripted(t, false, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			b, err := io.ReadAll(req.Body)
			gmu.Lock()
			defer gmu.Unlock()
			got = fmt.Sprintf("CL=%v TE=%v body=%q err=%v", req.Header["Content-Length"], req.TransferEncoding, b, err)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			return true
		})
		req, _ := http.NewRequest("POST", s.url+"/x", io.NopCloser(strings.NewReader("hello")))
		req.ContentLength = -1
		resp, err := rt.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		gmu.Lock()
		t.Logf("err=%v; replica saw %s", err, got)
		if want := `CL=[] TE=[chunked] body="hello" err=<nil>`; err != nil || got != want {
			t.Errorf("a body of unknown length: err %v, the replica saw %s; want it whole, chunked", err, got)
		}
	})
}

// A10: a request asking to upgrade: the upstream sends the caller's
// Connection header as it is (the proxy in front of it strips hop-by-hop
// headers; the transport must not add or drop any).
func TestUpstreamHostileUpgradeHeaderDropped(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		connc := make(chan []string, 1)
		s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			connc <- req.Header["Connection"]
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
			return true
		})
		req, _ := http.NewRequest("GET", s.url+"/v1/realtime", nil)
		req.Header.Set("Connection", "Upgrade")
		req.Header.Set("Upgrade", "websocket")
		resp, err := rt.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		got := <-connc
		t.Logf("replica saw Connection: %q", got)
		if len(got) != 1 || got[0] != "Upgrade" {
			t.Errorf("the replica saw Connection: %q, want the caller's [\"Upgrade\"]", got)
		}
	})
}

// A11: unsolicited bytes after an answer
// arrive late (after the body ended, before the next request).
func TestUpstreamHostileLateUnsolicitedBytes(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		answered, late := make(chan struct{}), make(chan struct{})
		s := newScripted(t, true, thenSecond(func(c net.Conn) bool {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst")
			<-answered
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\nunsolicited!")
			close(late)
			return true
		}))
		do(t, rt, "GET", s.url+"/a", "")
		close(answered)
		<-late // written to a loopback socket: in the client's buffer
		if _, std := rt.(*http.Transport); std {
			// http.Transport's reader drops the connection when the bytes
			// come; the replica sees its close.
			testwait.Until(t, "http.Transport to drop the connection", func() bool { return s.ended.Load() == 1 })
		}
		c2, b2, err := do(t, rt, "GET", s.url+"/b", "")
		t.Logf("req2: %d %q %v", c2, b2, err)
		if b2 != "second" {
			t.Errorf("second request got %q", b2)
		}
	})
}

// A7b: as in production (256 idle per replica), a burst, then the replica
// closes its idle connections and traffic stops (or the replica leaves the
// fleet: DNS discovery). What stays open?
func TestUpstreamHostileClosedIdleConnsStayPooled256(t *testing.T) {
	both(t, func(t *testing.T, rt http.RoundTripper) {
		if u, ok := rt.(*upstream); ok {
			u.pool.MaxPerKey = maxIdlePerReplica
		} else {
			rt.(*http.Transport).MaxIdleConnsPerHost = maxIdlePerReplica
		}
		const n = 200
		var all sync.WaitGroup
		all.Add(n)
		s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			all.Done()
			all.Wait() // every request holds its connection until all arrived: the burst needs n
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			return true
		})
		if u, ok := rt.(*upstream); ok {
			// upstream's sweep looks every sweepEvery (http.Transport's
			// reader sees each close at once): not 5 s here.
			u.pool.SweepEvery = 200 * time.Millisecond
		}
		before := fds(t)
		burst(t, rt, s.url+"/x", n)
		mid := fds(t)
		// The replica (uvicorn, 5 s keep-alive) closes every idle connection:
		// here, the test's server-side close of all its accepted conns.
		s.closeAll()
		after := testwait.Value(t, "the sockets the replica closed let go (not held in CLOSE_WAIT until a request to that host or CloseIdleConnections)", func() (int, bool) {
			after := fds(t)
			return after, after-before <= 5
		})
		t.Logf("fds before %d, after burst %d, after the replica closed all: %d (connections %d)", before, mid, after, s.conns.Load())
	})
}

func BenchmarkUpstreamRoundTrip(b *testing.B) {
	body := strings.Repeat("y", 1024)
	srv := newScriptedB(b, body)
	run := func(b *testing.B, rt http.RoundTripper) {
		payload := strings.Repeat("x", 1024)
		b.ReportAllocs()
		for b.Loop() {
			req, _ := http.NewRequest("POST", srv+"/x", strings.NewReader(payload))
			resp, err := rt.RoundTrip(req)
			if err != nil {
				b.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}
	b.Run("upstream", func(b *testing.B) {
		std := http.DefaultTransport.(*http.Transport).Clone()
		u := newUpstream(std, 5*time.Second, maxResponseHeaderBytes, 4)
		u.proxied = false
		defer u.CloseIdleConnections()
		run(b, u)
	})
	b.Run("http.Transport", func(b *testing.B) {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		defer tr.CloseIdleConnections()
		run(b, tr)
	})
}

func newScriptedB(b *testing.B, body string) string {
	resp := fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	return newScripted(b, true, func(c net.Conn, _ *bufio.Reader, _ *http.Request, _ int) bool {
		io.WriteString(c, resp)
		return true
	}).url
}

// A12: framing variants. The first answer is one of these; the second
// request must get "second" (or a new connection).
func TestUpstreamHostileFramingVariants(t *testing.T) {
	variants := map[string]string{
		"CL+TE":           "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
		"TE+CL-short":     "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 100\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
		"http10-ka":       "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nhello",
		"http10-close":    "HTTP/1.0 200 OK\r\n\r\nhello",
		"chunk-trailer":   "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
		"two-CL":          "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
		"TE-gzip,chunked": "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
		"bare-LF":         "HTTP/1.1 200 OK\nContent-Length: 5\n\nhello",
		"100-then-close":  "HTTP/1.1 100 Continue\r\n\r\n",
	}
	for name, v := range variants {
		t.Run(name, func(t *testing.T) {
			both(t, func(t *testing.T, rt http.RoundTripper) {
				s := newScripted(t, true, thenSecond(func(c net.Conn) bool {
					io.WriteString(c, v)
					return name != "http10-close" && name != "100-then-close"
				}))
				c1, b1, err1 := do(t, rt, "GET", s.url+"/a", "")
				c2, b2, err2 := do(t, rt, "GET", s.url+"/b", "")
				t.Logf("1: %d %q %v | 2: %d %q %v | conns %d", c1, b1, err1, c2, b2, err2, s.conns.Load())
				if b2 != "second" {
					t.Errorf("second got %q", b2)
				}
			})
		})
	}
}
