package tokenizer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/simreplica"
)

func sim(t testing.TB) *simreplica.Running {
	t.Helper()
	r, err := simreplica.Start(simreplica.Options{Tokenizer: "words", Overhead: time.Microsecond, PrefillPerToken: time.Nanosecond,
		InterToken: time.Microsecond, OutputTokens: 1}, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// TestChatTokensAreTheEngines: the ids /tokenize gives for a chat are the
// prompt the engine serves (its usage counts as many), and a repeat is
// answered from the cache.
func TestChatTokensAreTheEngines(t *testing.T) {
	r := sim(t)
	c, err := New(Options{URL: r.URL, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	msgs := `[{"role":"system","content":"You answer briefly."},{"role":"user","content":"How many tokens is this question?"}]`
	ids, err := c.Chat(context.Background(), "sim-model", []byte(msgs))
	if err != nil || len(ids) == 0 {
		t.Fatalf("%v %v", ids, err)
	}
	resp, err := http.Post(r.URL+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"sim-model","max_tokens":1,"messages":`+msgs+`}`))
	if err != nil {
		t.Fatal(err)
	}
	var out struct {
		Usage struct {
			Prompt int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&out)
	resp.Body.Close()
	if out.Usage.Prompt != len(ids) {
		t.Fatalf("/tokenize gave %d ids, the engine counted %d prompt tokens", len(ids), out.Usage.Prompt)
	}
	again, err := c.Chat(context.Background(), "sim-model", []byte(msgs))
	if err != nil || !slices.Equal(again, ids) || c.Stats().Hits != 1 || c.Stats().Calls != 1 {
		t.Fatalf("repeat: %v, stats %+v", err, c.Stats())
	}
	p, err := c.Prompt(context.Background(), "sim-model", []byte(`"a completion prompt"`))
	if err != nil || len(p) == 0 {
		t.Fatalf("prompt: %v %v", p, err)
	}
}

// TestSlowOrBrokenTokenizer: a tokenizer that does not answer in time, or
// answers badly, is an error at once, counted; nothing is cached.
func TestSlowOrBrokenTokenizer(t *testing.T) {
	cases := map[string]http.HandlerFunc{
		"slow": func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-time.After(3 * time.Second): // far past the 100ms timeout
			case <-r.Context().Done():
			}
		},
		"500":         func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(500) },
		"not json":    func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "{") },
		"wrong count": func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, `{"count":3,"tokens":[1,2]}`) },
		"too many": func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, `{"count":5000,"tokens":[`+strings.Repeat("1,", 4999)+`1]}`)
		},
	}
	for name, h := range cases {
		t.Run(name, func(t *testing.T) {
			srv := httptest.NewServer(h)
			defer srv.Close()
			c, _ := New(Options{URL: srv.URL, Timeout: 100 * time.Millisecond, MaxTokens: 1000})
			t0 := time.Now()
			_, err := c.Chat(context.Background(), "m", []byte(`[]`))
			if err == nil {
				t.Fatal("no error")
			}
			if name == "slow" && (!errors.Is(err, ErrSlow) || c.Stats().Slow != 1 || time.Since(t0) > 5*time.Second) {
				t.Fatalf("%v after %v, stats %+v", err, time.Since(t0), c.Stats())
			}
			if c.cache.Len() != 0 {
				t.Fatal("a failed answer was cached")
			}
		})
	}
}

// TestCacheIsBoundedInTokens: the cache keeps at most CacheTokens tokens.
func TestCacheIsBoundedInTokens(t *testing.T) {
	r := sim(t)
	c, _ := New(Options{URL: r.URL, Timeout: 2 * time.Second, CacheTokens: 200})
	for i := range 20 {
		if _, err := c.Prompt(context.Background(), "sim-model", []byte(fmt.Sprintf("%q", strings.Repeat(fmt.Sprint("word", i, " "), 20)))); err != nil {
			t.Fatal(err)
		}
	}
	if held := c.held.Load(); held > 200+60 { // one entry may pass the bound
		t.Fatalf("%d tokens cached, bound 200", held)
	}
}

// BenchmarkTokenizeLatency measures what tokenizer: replica adds to a
// request that misses the cache: one /tokenize call on 127.0.0.1 to a
// simulated replica, for a chat of about 2 KB and 32 KB; p50 and p99 are
// reported as metrics.
func BenchmarkTokenizeLatency(b *testing.B) {
	r := sim(b)
	for _, size := range []int{2 << 10, 32 << 10} {
		b.Run(fmt.Sprintf("%dKB", size>>10), func(b *testing.B) {
			c, _ := New(Options{URL: r.URL, Timeout: 5 * time.Second})
			var lat []time.Duration
			text := strings.Repeat("a sentence of ordinary prose for the tokenizer. ", size/48)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				msgs, _ := json.Marshal([]map[string]string{{"role": "user", "content": fmt.Sprint(i, " ", text)}})
				t0 := time.Now()
				if _, err := c.Chat(context.Background(), "sim-model", msgs); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
		})
	}
}

// TestThirdPartyTokenIDs: llm-d's simulator answers /tokenize with uint32
// ids, about half of them ≥ 2^31 (its captured answer); they are read, and
// kept as their 32-bit pattern, so a block is keyed as the same ids key it
// in its KV events.
func TestThirdPartyTokenIDs(t *testing.T) {
	answer, err := os.ReadFile("../testdata/thirdparty/tokenize-chat.json")
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(answer) }))
	defer srv.Close()
	c, _ := New(Options{URL: srv.URL, Timeout: 5 * time.Second})
	ids, err := c.Body(context.Background(), blockhash.Chat, "fake-model", []byte(`{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	var want struct{ Tokens []uint32 }
	json.Unmarshal(answer, &want)
	high := 0
	for i, id := range ids {
		if uint32(id) != want.Tokens[i] {
			t.Fatalf("id %d: %d, want %d", i, uint32(id), want.Tokens[i])
		}
		if want.Tokens[i] >= 1<<31 {
			high++
		}
	}
	if len(ids) != 23 || high == 0 {
		t.Fatalf("%d ids, %d of them ≥ 2^31", len(ids), high)
	}
	if blockhash.TokenBlockHash(1, ids[:16]) != blockhash.TokenBlockHash(1, want.Tokens[:16]) {
		t.Fatal("a block of the ids is keyed unlike the same uint32 ids in a KV event")
	}
	// Ids no 32-bit integer holds are refused, not wrapped.
	srv2 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(`{"tokens":[1,4294967296]}`)) }))
	defer srv2.Close()
	c2, _ := New(Options{URL: srv2.URL, Timeout: 5 * time.Second})
	if _, err := c2.Body(context.Background(), blockhash.Chat, "m", []byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`)); err == nil {
		t.Fatal("an id of 2^32 was accepted")
	}
}
