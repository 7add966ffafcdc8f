package tokenizer

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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
