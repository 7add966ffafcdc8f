package router

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/internal/benchdata"
)

// BenchmarkServeHTTP measures the router's own work per request — read the
// body, parse, decide, proxy, read the reply, learn it, finish — with an
// in-memory replica (cannedTransport), for bodies of about 1 KB and 128 KB.
//
// With new=true every prompt is new (numbered at its start) and one replica
// has the default 256K-token picture, as in `cmd/benchproxy`: each
// request records all its blocks and, once the picture is full, evicts as
// many.
func BenchmarkServeHTTP(b *testing.B) {
	for _, c := range []struct {
		tokens int
		new    bool
	}{{256, false}, {32 << 10, false}, {256, true}, {32 << 10, true}} {
		b.Run(fmt.Sprintf("tokens=%dk/new=%v", c.tokens>>10, c.new), func(b *testing.B) {
			tokens := c.tokens
			fx := newFixture(b, 8, "semantic")
			if c.new {
				fx = newFixtureBudget(b, 1, "semantic", 1<<18)
			}
			core, _ := NewCore(CoreOptions{Engine: fx.e, Arms: fx.arms()})
			// The router's default log line (text, info), formatted but not written.
			var tr http.RoundTripper = cannedTransport{}
			if c.new {
				// No usage: the canned reply's 3 prompt tokens would teach
				// the router that a block is a fraction of a token, and the
				// picture would never fill.
				tr = noUsageTransport{}
			}
			srv, _ := NewServer(ServerOptions{Core: core, Transport: tr, RecordReplies: true,
				Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			body := benchdata.ChatBody(tokens)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			b.ResetTimer()
			at := bytes.Index(body, []byte(`"content":"`)) + len(`"content":"`)
			for i := 0; i < b.N; i++ {
				if c.new {
					copy(body[at:], fmt.Sprintf("%012d", i))
					fx.now = fx.now.Add(time.Millisecond) // older prompts are evicted first
				}
				req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				w := httptest.NewRecorder()
				srv.ServeHTTP(w, req)
				if w.Code != 200 {
					b.Fatal(w.Code)
				}
			}
		})
	}
}

// noUsageTransport answers every request in memory, without usage.
type noUsageTransport struct{}

func (noUsageTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	body := `{"choices":[{"message":{"role":"assistant","content":"ok"}}]}`
	return &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"application/json"}},
		Body: io.NopCloser(strings.NewReader(body)), Request: r}, nil
}

// BenchmarkPictureInFlight is the picture's share of BenchmarkServeHTTP's
// worst case with requests overlapping, as `cmd/benchproxy` runs them:
// one replica with the default 256K-token picture, every prompt new
// (about 32K tokens, 512 blocks), 8 requests in flight (each is finished —
// its reply learned, its blocks released — 8 routes after its own), so a
// prompt may be evicted by the others while it runs. Deterministic: one
// goroutine, the clock moved by hand.
func BenchmarkPictureInFlight(b *testing.B) {
	const inFlight = 8
	fx := newFixtureBudget(b, 1, "semantic", 1<<18)
	core, err := NewCore(CoreOptions{Engine: fx.e, Arms: fx.arms()})
	if err != nil {
		b.Fatal(err)
	}
	body := benchdata.ChatBody(32 << 10)
	at := bytes.Index(body, []byte(`"content":"`)) + len(`"content":"`)
	var ring [inFlight]*Routed
	route := func(i int) *Routed {
		copy(body[at:], fmt.Sprintf("%012d", i))
		req, err := blockhash.ParseChat(body, blockhash.Limits{})
		if err != nil {
			b.Fatal(err)
		}
		in := core.prepare(context.Background(), req, body, "")
		req.Recycle()
		rt, err := route(core, CoreRequest{Input: in, Model: req.Model, Route: "chat"})
		if err != nil {
			b.Fatal(err)
		}
		return rt
	}
	reply := []byte("a reply of a few words")
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		fx.now = fx.now.Add(time.Millisecond)
		if old := ring[i%inFlight]; old != nil {
			core.Finish(old, Outcome{Status: 200}, reply)
		}
		ring[i%inFlight] = route(i)
	}
	b.StopTimer()
	for _, rt := range ring {
		if rt != nil {
			core.Finish(rt, Outcome{Status: 200}, reply)
		}
	}
}
