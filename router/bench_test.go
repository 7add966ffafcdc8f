package router

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/semroute/semroute/internal/benchdata"
)

// BenchmarkServeHTTP measures the router's own work per request — read the
// body, parse, decide, proxy, read the reply, learn it, finish — with an
// in-memory replica (cannedTransport), for bodies of about 1 KB and 128 KB.
func BenchmarkServeHTTP(b *testing.B) {
	for _, tokens := range []int{256, 32 << 10} {
		b.Run(fmt.Sprintf("tokens=%dk", tokens>>10), func(b *testing.B) {
			fx := newFixture(b, 8, "semantic")
			core, _ := NewCore(CoreOptions{Engine: fx.e, Arms: fx.arms()})
			// The router's default log line (text, info), formatted but not written.
			srv, _ := NewServer(ServerOptions{Core: core, Transport: cannedTransport{}, RecordReplies: true,
				Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			body := benchdata.ChatBody(tokens)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
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
