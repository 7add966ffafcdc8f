package tokenizer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testnet"
	"github.com/semroute/semroute/simreplica"
)

// connCounter is a test server that counts the connections made to it.
func connCounter(t *testing.T, h http.Handler) (url string, conns *atomic.Int64) {
	t.Helper()
	conns = &atomic.Int64{}
	ts := httptest.NewUnstartedServer(h)
	ts.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	ts.Start()
	t.Cleanup(ts.Close)
	return ts.URL, conns
}

// answerOf is vLLM's /tokenize answer of n ids.
func answerOf(n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, `{"count":%d,"max_model_len":8192,"tokens":[`, n)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, 1000+i)
	}
	b.WriteString(`],"token_strs":null}`)
	return b.String()
}

// gate holds each call that reaches it, while on, until n have, then
// lets those n go on together: n calls surely in flight at once.
type gate struct {
	n       int
	on      atomic.Bool
	mu      sync.Mutex
	arrived int
	open    chan struct{}
}

func (g *gate) wrap(h http.Handler) http.Handler {
	g.open = make(chan struct{})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.on.Load() {
			g.mu.Lock()
			wait := g.open
			if g.arrived++; g.arrived == g.n {
				close(g.open)
				g.open, g.arrived = make(chan struct{}), 0
			}
			g.mu.Unlock()
			select {
			case <-wait:
			case <-time.After(5 * time.Second): // the test fails on the count
			}
		}
		h.ServeHTTP(w, r)
	})
}

// TestCallsReuseConnections: the calls of a Client, each a new body (no
// cache hit), go over kept-alive connections, whatever the form of the
// answer (vLLM's: Content-Length and no new line; simreplica's JSON
// encoder's: a new line after the object; chunked, larger than a write
// buffer; chunked, the last chunk coming after the object was read): one for calls one after another, and for rounds of 8 calls in
// flight at once (held at the server until all 8 arrived), the 8 of the
// first round and no more; the connections a round freed are all idle
// before the next starts. A connection not kept is a TCP handshake and a
// goroutine pair on both sides for a later call (net/http's default
// transport keeps 2 idle connections a host: the rounds then made 6 new
// ones each).
func TestCallsReuseConnections(t *testing.T) {
	sr, err := simreplica.New(simreplica.Options{Tokenizer: "words"})
	if err != nil {
		t.Fatal(err)
	}
	answers := map[string]http.Handler{
		"content-length": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			a := answerOf(200)
			w.Header().Set("Content-Length", fmt.Sprint(len(a)))
			_, _ = io.WriteString(w, a)
		}),
		"chunked": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			a := answerOf(5000)
			_, _ = io.WriteString(w, a[:len(a)/2])
			w.(http.Flusher).Flush()
			_, _ = io.WriteString(w, a[len(a)/2:]+"\n")
		}),
		"chunked, ended late": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			_, _ = io.WriteString(w, answerOf(100)+"\n")
			w.(http.Flusher).Flush()
			time.Sleep(5 * time.Millisecond) // the last chunk comes after the object
		}),
		"simreplica": sr,
	}
	for name, h := range answers {
		t.Run(name, func(t *testing.T) {
			const clients, rounds = 8, 10
			g := &gate{n: clients}
			url, conns := connCounter(t, g.wrap(h))
			c, err := New(Options{URL: url, Timeout: 10 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			const calls = 50
			for i := range calls {
				msgs := fmt.Sprintf(`[{"role":"user","content":"question %d"}]`, i)
				if ids, err := c.Chat(context.Background(), "sim-model", []byte(msgs)); err != nil || len(ids) == 0 {
					t.Fatalf("call %d: %v %v", i, ids, err)
				}
			}
			if n := conns.Load(); n != 1 {
				t.Fatalf("%d calls one after another made %d connections, want 1", calls, n)
			}
			g.on.Store(true)
			for round := range rounds {
				var wg sync.WaitGroup
				for k := range clients {
					wg.Add(1)
					go func() {
						defer wg.Done()
						msgs := fmt.Sprintf(`[{"role":"user","content":"round %d call %d"}]`, round, k)
						if _, err := c.Chat(context.Background(), "sim-model", []byte(msgs)); err != nil {
							t.Error(err)
						}
					}()
				}
				wg.Wait()
			}
			// The one of the calls one after another, idle, and 7 more.
			if n := conns.Load(); n != clients {
				t.Fatalf("%d rounds of %d calls in flight at once made %d connections in all, want %d", rounds, clients, n, clients)
			}
			if s := c.Stats(); s.Calls != calls+clients*rounds {
				t.Fatalf("stats %+v: every call should have been sent", s)
			}
		})
	}
}

// scripted is a raw TCP server: each connection is handed to serve, which
// reads the call's request from br and writes what it likes; n is the
// connection's number, from 1, in the order accepted. The connection is
// closed when serve returns. conns counts the connections accepted up to
// the latest whose serve began (the highest n), so that once a
// connection's serve has answered, every connection accepted before it is
// counted, however late its own serve starts.
func scripted(t *testing.T, serve func(c net.Conn, br *bufio.Reader, n int)) (url string, conns *atomic.Int64) {
	t.Helper()
	conns = &atomic.Int64{}
	addr, _ := testnet.ServeNumbered(t, func(c net.Conn, n int) {
		for old := conns.Load(); old < int64(n) && !conns.CompareAndSwap(old, int64(n)); old = conns.Load() {
		}
		defer c.Close()
		serve(c, bufio.NewReader(c), n)
	})
	return "http://" + addr, conns
}

// readCall reads one request and its body.
func readCall(br *bufio.Reader) error {
	req, err := http.ReadRequest(br)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, req.Body)
	return err
}

const okAnswer = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 35\r\n\r\n" + `{"count":3,"tokens":[1,2,3]}       `

// TestPooledConnectionClosedIsCalledAgain: a replica that closes each
// connection after one answer, without saying so, costs no failed call:
// the call on the closed connection, which got no byte of answer, goes
// again on a new one.
func TestPooledConnectionClosedIsCalledAgain(t *testing.T) {
	url, conns := scripted(t, func(c net.Conn, br *bufio.Reader, _ int) {
		if readCall(br) == nil {
			_, _ = io.WriteString(c, okAnswer)
		}
	})
	c, err := New(Options{URL: url, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		ids, err := c.Prompt(context.Background(), "m", []byte(fmt.Sprintf(`"prompt %d"`, i)))
		if err != nil || len(ids) != 3 {
			t.Fatalf("call %d: %v %v", i, ids, err)
		}
	}
	if s := c.Stats(); s.Failures != 0 || s.Calls != 20 {
		t.Fatalf("stats %+v", s)
	}
	if n := conns.Load(); n < 20 {
		t.Fatalf("%d connections for 20 calls on connections closed after each", n)
	}
}

// TestIdleBytesAreNotAnAnswer: bytes a replica sends on an idle connection
// (here a whole answer nobody asked for) are not read as the next call's
// answer: a connection that idled is peeked at and left.
func TestIdleBytesAreNotAnAnswer(t *testing.T) {
	url, conns := scripted(t, func(c net.Conn, br *bufio.Reader, _ int) {
		for readCall(br) == nil {
			_, _ = io.WriteString(c, okAnswer)
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n"+`{"count":1,"tokens":[666]}    `)
		}
	})
	c, err := New(Options{URL: url, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c.conns.pool.PeekAfter = 0 // every reuse peeks
	for i := range 5 {
		ids, err := c.Prompt(context.Background(), "m", []byte(fmt.Sprintf(`"prompt %d"`, i)))
		if err != nil || len(ids) != 3 {
			t.Fatalf("call %d: %v %v", i, ids, err)
		}
		time.Sleep(20 * time.Millisecond) // the unasked answer arrives
	}
	if n := conns.Load(); n != 5 {
		t.Fatalf("%d connections, want 5: each left for the bytes on it", n)
	}
}

// TestCallCancelled: a call whose request is cancelled ends then, with the
// context's error (not ErrSlow, which the 10 s timeout would give: the
// replica was not slow), and its connection is not kept.
func TestCallCancelled(t *testing.T) {
	late := make(chan struct{}) // the first connection's answer comes at the test's end
	url, conns := scripted(t, func(c net.Conn, br *bufio.Reader, n int) {
		for readCall(br) == nil {
			if n == 1 {
				<-late
			}
			_, _ = io.WriteString(c, okAnswer)
		}
	})
	t.Cleanup(func() { close(late) }) // before the server's cleanup
	c, err := New(Options{URL: url, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	if _, err = c.Prompt(ctx, "m", []byte(`"late"`)); !errors.Is(err, context.Canceled) || errors.Is(err, ErrSlow) {
		t.Fatalf("cancelled call: %v", err)
	}
	if ids, err := c.Prompt(context.Background(), "m", []byte(`"next"`)); err != nil || len(ids) != 3 {
		t.Fatalf("next call: %v %v", ids, err)
	}
	if n := conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2: the cancelled call's is not reused", n)
	}
}

// TestAnswerHeadersBounded: an answer's headers past maxHeaderBytes fail
// the call, unread further.
func TestAnswerHeadersBounded(t *testing.T) {
	url, _ := scripted(t, func(c net.Conn, br *bufio.Reader, _ int) {
		if readCall(br) != nil {
			return
		}
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\n")
		line := "X-Pad: " + strings.Repeat("a", 1000) + "\r\n"
		for range 2 * maxHeaderBytes / len(line) {
			if _, err := io.WriteString(c, line); err != nil {
				return
			}
		}
	})
	c, err := New(Options{URL: url, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Prompt(context.Background(), "m", []byte(`"p"`)); err == nil || errors.Is(err, ErrSlow) {
		t.Fatalf("headers of 128 KiB: %v", err)
	}
}

// TestTargets: where a base URL's /tokenize is, as net/http would send to
// it; a base the Client's own connections do not serve goes through
// net/http (nil).
func TestTargets(t *testing.T) {
	p := newConns()
	for base, want := range map[string]*target{
		"http://10.0.0.5:8000":        {addr: "10.0.0.5:8000", host: "10.0.0.5:8000", path: "/tokenize"},
		"http://10.0.0.5:8000/":       {addr: "10.0.0.5:8000", host: "10.0.0.5:8000", path: "/tokenize"},
		"http://replica/prefix/":      {addr: "replica:80", host: "replica", path: "/prefix/tokenize"},
		"http://[::1]:9000":           {addr: "[::1]:9000", host: "[::1]:9000", path: "/tokenize"},
		"http://[::1]":                {addr: "[::1]:80", host: "[::1]", path: "/tokenize"},
		"https://10.0.0.5:8443":       nil,
		"http://user:pw@10.0.0.5:800": nil,
		"10.0.0.5:8000":               nil,
	} {
		got := p.target(base)
		if (got == nil) != (want == nil) || got != nil && *got != *want {
			t.Errorf("%s: %+v, want %+v", base, got, want)
		}
	}
}

// TestOwnConnectionsAsNetHTTP: the Client's own connections get the ids
// net/http gets, for a query that fits the write buffer and one that
// does not (written in one vectored write).
func TestOwnConnectionsAsNetHTTP(t *testing.T) {
	r := sim(t)
	own, err := New(Options{URL: r.URL, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	viaHTTP, err := New(Options{URL: r.URL, Timeout: 10 * time.Second, Client: &http.Client{}})
	if err != nil {
		t.Fatal(err)
	}
	if own.conns == nil || viaHTTP.conns != nil {
		t.Fatal("the Client without an http.Client should have its own connections, the other not")
	}
	for _, words := range []int{10, 40000} {
		msgs := fmt.Sprintf(`[{"role":"system","content":"Be brief."},{"role":"user","content":%q}]`, strings.Repeat("word ", words))
		a, err := own.Chat(context.Background(), "sim-model", []byte(msgs))
		if err != nil {
			t.Fatal(err)
		}
		b, err := viaHTTP.Chat(context.Background(), "sim-model", []byte(msgs))
		if err != nil {
			t.Fatal(err)
		}
		if len(a) < words || !slices.Equal(a, b) {
			t.Fatalf("%d words: %d ids, net/http %d", words, len(a), len(b))
		}
	}
}
