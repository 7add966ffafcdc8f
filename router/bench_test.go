package router

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
)

// benchBody is a chat body of about tokens estimated tokens: a system prompt
// of a quarter of them, a document, and a short question. Lines end in a
// newline (escaped in the JSON) and carry a quotation, so that unescaping and
// the code heuristic's symbol count do their real work.
func benchBody(tokens int) []byte {
	prose := func(seed string, n int) string {
		var sb strings.Builder
		for i := 0; sb.Len() < n*4; i++ {
			fmt.Fprintf(&sb, "%s line %d says \"something worth caching\" (once).\n", seed, i)
		}
		return sb.String()[:n*4]
	}
	b, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{
		{"role": "system", "content": prose("system", tokens/4)},
		{"role": "user", "content": prose("document", tokens*3/4-16) + "\nWhat does it say?"},
	}})
	return b
}

// BenchmarkDecide measures the whole routing decision for one request: parse
// the body, split and hash it, match it against every replica's picture and
// score every replica, giving back the parse and the candidate list as the
// server does when the request ends. Replica r holds the first (r%8+1)/8 of
// the prompt.
func BenchmarkDecide(b *testing.B) {
	for _, tokens := range []int{1 << 10, 8 << 10, 32 << 10, 128 << 10} {
		for _, replicas := range []int{8, 64, 1024} {
			b.Run(fmt.Sprintf("tokens=%dk/replicas=%d", tokens>>10, replicas), func(b *testing.B) {
				f := newFixture(b, replicas, "semantic")
				body := benchBody(tokens)
				req, err := blockhash.ParseChat(body, blockhash.Limits{})
				if err != nil {
					b.Fatal(err)
				}
				blocks := f.e.o.Splitter.Split(nil, req)
				for _, r := range f.pool.Replicas() {
					n := len(blocks) * (r.ID%8 + 1) / 8
					f.cache.Record(r.ID, blocks[:n], 1)
				}
				b.SetBytes(int64(len(body)))
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					req, err := blockhash.ParseChat(body, blockhash.Limits{})
					if err != nil {
						b.Fatal(err)
					}
					d, err := f.e.Decide(req, "", false)
					if err != nil {
						b.Fatal(err)
					}
					f.e.Recycle(d) // as Core.Finish does
					req.Release()
				}
			})
		}
	}
}

// BenchmarkParse measures parsing the body alone (fastjson: validate,
// parse, unescape the content in place), releasing each request as the
// server does.
func BenchmarkParse(b *testing.B) {
	for _, tokens := range []int{1 << 10, 8 << 10, 32 << 10, 128 << 10} {
		b.Run(fmt.Sprintf("tokens=%dk", tokens>>10), func(b *testing.B) {
			body := benchBody(tokens)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				req, err := blockhash.ParseChat(body, blockhash.Limits{})
				if err != nil {
					b.Fatal(err)
				}
				req.Release()
			}
		})
	}
}

// BenchmarkSplit measures splitting and hashing alone.
func BenchmarkSplit(b *testing.B) {
	for _, tokens := range []int{1 << 10, 8 << 10, 32 << 10, 128 << 10} {
		b.Run(fmt.Sprintf("tokens=%dk", tokens>>10), func(b *testing.B) {
			req, _ := blockhash.ParseChat(benchBody(tokens), blockhash.Limits{})
			s, _ := blockhash.NewSplitter(blockhash.Options{})
			dst := make([]blockhash.Block, 0, tokens/32)
			b.SetBytes(int64(tokens * 4))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				dst = s.Split(dst[:0], req)
			}
		})
	}
}

// BenchmarkJSONDecode is the floor the decision is compared with: decoding
// the same body into a plain struct with encoding/json.
func BenchmarkJSONDecode(b *testing.B) {
	for _, tokens := range []int{1 << 10, 8 << 10, 32 << 10, 128 << 10} {
		b.Run(fmt.Sprintf("tokens=%dk", tokens>>10), func(b *testing.B) {
			body := benchBody(tokens)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				var v struct {
					Model    string `json:"model"`
					Messages []struct {
						Role    string `json:"role"`
						Content string `json:"content"`
					} `json:"messages"`
				}
				if err := json.Unmarshal(body, &v); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkScore measures the semantic policy's scoring and the ranking of
// the candidates, swept over replica counts.
func BenchmarkScore(b *testing.B) {
	for _, replicas := range []int{8, 64, 1024} {
		b.Run(fmt.Sprintf("replicas=%d", replicas), func(b *testing.B) {
			p, _ := NewPolicy("semantic", PolicyConfig{})
			cs := cands(replicas)
			for i := range cs {
				cs[i].Match.Weighted = float64(i % 7 * 100)
				cs[i].Load.PendingTokens = float64(i % 5 * 300)
			}
			in := &Input{Tokens: 8192, Weighted: 8192, AvgPrefill: 500}
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				p.Score(in, cs)
				rank(cs, uint64(i), 3)
			}
		})
	}
}

// BenchmarkServeHTTP measures the router's own work per request — read the
// body, parse, decide, proxy, read the reply, learn it, finish — with an
// in-memory replica (cannedTransport), for bodies of about 1 KB and 128 KB.
func BenchmarkServeHTTP(b *testing.B) {
	for _, tokens := range []int{256, 32 << 10} {
		b.Run(fmt.Sprintf("tokens=%dk", tokens>>10), func(b *testing.B) {
			fx := newFixture(b, 8, "semantic")
			core, _ := NewCore(CoreOptions{Engine: fx.e})
			// The router's default log line (text, info), formatted but not written.
			srv, _ := NewServer(ServerOptions{Core: core, Transport: cannedTransport{}, RecordReplies: true,
				Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			body := benchBody(tokens)
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
