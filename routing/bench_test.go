package routing

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/internal/benchdata"
)

// BenchmarkDecide measures the whole routing decision for one request: parse
// the body, split and hash it, match it against every replica's picture and
// score every replica, giving back the parse and the candidate list as the
// server does when the request ends. Replica r holds the first (r%8+1)/8 of
// the prompt.
func BenchmarkDecide(b *testing.B) {
	for _, tokens := range []int{1 << 10, 8 << 10, 32 << 10, 128 << 10} {
		for _, replicas := range []int{8, 64, 1024} {
			b.Run(fmt.Sprintf("tokens=%dk/replicas=%d", tokens>>10, replicas), func(b *testing.B) {
				benchDecide(b, newFixture(b, replicas, "semantic"), tokens, "", true)
			})
		}
	}
}

// BenchmarkDecideModels is BenchmarkDecide at 1k and 8k tokens and 1,024
// replicas, each serving a base model and 32 LoRA adapters (two running),
// for a request naming the base model and one naming an adapter: what the
// model filter and the adapter ranks add to a decision.
func BenchmarkDecideModels(b *testing.B) {
	for _, tokens := range []int{1 << 10, 8 << 10} {
		for _, model := range []string{"none", "base", "adapter-7"} {
			b.Run(fmt.Sprintf("tokens=%dk/replicas=1024/model=%s", tokens>>10, model), func(b *testing.B) {
				f := newFixture(b, 1024, "semantic")
				served, adapters := []string{"base"}, []string(nil)
				for i := 0; i < 32; i++ {
					served = append(served, fmt.Sprint("adapter-", i))
					adapters = append(adapters, fmt.Sprint("adapter-", i))
				}
				named := model // the request's model; "" for none
				if model == "none" {
					named = ""
				} else {
					for _, r := range f.pool.Replicas() {
						r.SetServed(served, adapters)
						r.SetLoRA([]string{fmt.Sprint("adapter-", r.ID%32), fmt.Sprint("adapter-", (r.ID+1)%32)}, nil, 4)
					}
				}
				f.e.NoteAdapter("adapter-7")
				benchDecide(b, f, tokens, named, false)
			})
		}
	}
}

// benchDecide times decisions on f for a chat body of about tokens tokens,
// naming model unless it is "", after replica r was given the first
// (r%8+1)/8 of the prompt; setBytes reports the body's bytes per decision.
func benchDecide(b *testing.B, f *fixture, tokens int, model string, setBytes bool) {
	body := benchdata.ChatBody(tokens)
	req, err := blockhash.ParseChat(body, blockhash.Limits{})
	if err != nil {
		b.Fatal(err)
	}
	blocks := f.e.Splitter().Split(nil, req)
	for _, r := range f.pool.Replicas() {
		f.model.Record(r.ID, blocks[:len(blocks)*(r.ID%8+1)/8], 1)
	}
	if setBytes {
		b.SetBytes(int64(len(body)))
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		req, err := blockhash.ParseChat(body, blockhash.Limits{})
		if err != nil {
			b.Fatal(err)
		}
		if model != "" {
			req.Model = model
		}
		d, err := f.decide(req, "", false)
		if err != nil {
			b.Fatal(err)
		}
		f.e.Recycle(d) // as a request's end does
		req.Recycle()
	}
}

// BenchmarkParse measures parsing the body alone (fastjson: validate,
// parse, unescape the content in place), releasing each request as the
// server does.
func BenchmarkParse(b *testing.B) {
	for _, tokens := range []int{1 << 10, 8 << 10, 32 << 10, 128 << 10} {
		b.Run(fmt.Sprintf("tokens=%dk", tokens>>10), func(b *testing.B) {
			body := benchdata.ChatBody(tokens)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				req, err := blockhash.ParseChat(body, blockhash.Limits{})
				if err != nil {
					b.Fatal(err)
				}
				req.Recycle()
			}
		})
	}
}

// BenchmarkSplit measures splitting and hashing alone.
func BenchmarkSplit(b *testing.B) {
	for _, tokens := range []int{1 << 10, 8 << 10, 32 << 10, 128 << 10} {
		b.Run(fmt.Sprintf("tokens=%dk", tokens>>10), func(b *testing.B) {
			req, _ := blockhash.ParseChat(benchdata.ChatBody(tokens), blockhash.Limits{})
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
			body := benchdata.ChatBody(tokens)
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
			p, _ := NewPolicy(PolicySpec{Type: "semantic"})
			cs := cands(replicas)
			for i := range cs {
				cs[i].Match.Weighted = float64(i % 7 * 100)
				cs[i].Load.PendingTokens = float64(i % 5 * 300)
			}
			in := &View{Tokens: 8192, Weighted: 8192, AvgPrefill: 500}
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				p.Score(in, cs)
				rank(cs, uint64(i), 3)
			}
		})
	}
}
