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
	"sync"
	"testing"
	"time"

	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
	"github.com/semroute/semroute/simreplica"
	"github.com/semroute/semroute/tokenizer"
)

// records hands the decision log's records to a test.
type records chan *decisionlog.Record

func (r records) Log(rec *decisionlog.Record) { r <- rec }

// routerOver is a Server over replicas at urls (r0, r1, …) under round
// robin, with tok as its tokenizer (nil: approximate mode) and log as its
// decision log (nil: none), serving on a real socket.
func routerOver(t *testing.T, o ServerOptions, tok Tokenizer, log DecisionLogger, urls ...string) (*Server, *httptest.Server) {
	t.Helper()
	specs := make([]replica.Spec, len(urls))
	for i, u := range urls {
		specs[i] = replica.Spec{Name: fmt.Sprint("r", i), URL: u}
	}
	e, err := routing.New(routing.Options{Replicas: specs})
	if err != nil {
		t.Fatal(err)
	}
	rr, _ := routing.NewPolicy(routing.PolicySpec{Type: "round_robin"})
	copts := CoreOptions{Engine: e, Arms: []Arm{{Name: "default", Policy: rr, Weight: 1}}, Log: log}
	if tok != nil {
		copts.Tokenizer, copts.BlockTokens = tok, 16
	}
	core, err := NewCore(copts)
	if err != nil {
		t.Fatal(err)
	}
	o.Core = core
	o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	srv, err := NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(func() { ts.Close(); srv.CloseIdleConnections() })
	return srv, ts
}

// TestPreciseTokenizesWhatTheEngineRuns: in precise mode, over sockets to
// a simulated replica, a body that also gives "MESSAGES" (or "PROMPT") and
// "Model" is tokenized as the engine reads it: /tokenize gets the body's
// "messages" and "model" and nothing of the other spellings, the model
// asked for is the engine's, and the decision's prompt is exactly the
// tokens the engine counted.
func TestPreciseTokenizesWhatTheEngineRuns(t *testing.T) {
	sim, err := simreplica.Start(simreplica.Options{Tokenizer: "words", Overhead: time.Microsecond, PrefillPerToken: time.Nanosecond,
		InterToken: time.Microsecond, OutputTokens: 1}, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	// A recorder in front of the replica's /tokenize keeps what it was sent.
	var mu sync.Mutex
	var sent [][]byte
	var asked []string
	rec := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		sent = append(sent, b)
		mu.Unlock()
		resp, err := http.Post(sim.URL+r.URL.Path, "application/json", bytes.NewReader(b))
		if err != nil {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		w.WriteHeader(resp.StatusCode)
		_, _ = io.Copy(w, resp.Body)
	}))
	defer rec.Close()
	tok, err := tokenizer.New(tokenizer.Options{Timeout: 10 * time.Second, Pick: func(model string) string {
		mu.Lock()
		asked = append(asked, model)
		mu.Unlock()
		return rec.URL
	}})
	if err != nil {
		t.Fatal(err)
	}
	log := make(records, 1)
	_, ts := routerOver(t, ServerOptions{}, tok, log, sim.URL)

	planted := strings.Repeat("planted words in the picture ", 100)
	const short = `[{"role":"user","content":"a short question"}]`
	cases := []struct {
		name, path, body string
		want             map[string]string // the /tokenize body's fields
	}{
		{"chat", "/v1/chat/completions",
			`{"model":"sim-model","max_tokens":1,"messages":` + short + `,"MESSAGES":[{"role":"user","content":"` + planted + `"}],` +
				`"Model":"evil-model","Add_Generation_Prompt":false}`,
			map[string]string{"model": `"sim-model"`, "messages": short, "add_generation_prompt": "true"}},
		{"completion", "/v1/completions",
			`{"Model":"evil-model","model":"sim-model","max_tokens":1,"prompt":"a short prompt","PROMPT":"` + planted + `",` +
				`"messages":[{"role":"user","content":"` + planted + `"}]}`,
			map[string]string{"model": `"sim-model"`, "prompt": `"a short prompt"`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			mu.Lock()
			sent, asked = nil, nil
			mu.Unlock()
			resp, err := http.Post(ts.URL+c.path, "application/json", strings.NewReader(c.body))
			if err != nil {
				t.Fatal(err)
			}
			var out struct {
				Usage struct {
					Prompt int `json:"prompt_tokens"`
				} `json:"usage"`
			}
			err = json.NewDecoder(resp.Body).Decode(&out)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || out.Usage.Prompt == 0 {
				t.Fatalf("status %d, %v, usage %+v", resp.StatusCode, err, out.Usage)
			}
			r := <-log
			mu.Lock()
			defer mu.Unlock()
			if len(sent) != 1 || len(asked) != 1 || asked[0] != "sim-model" {
				t.Fatalf("%d calls to /tokenize, models asked %q", len(sent), asked)
			}
			var got map[string]json.RawMessage
			if err := json.Unmarshal(sent[0], &got); err != nil {
				t.Fatal(err)
			}
			if len(got) != len(c.want) {
				t.Fatalf("/tokenize got %.300s", sent[0])
			}
			for k, v := range c.want {
				if string(got[k]) != v {
					t.Fatalf("/tokenize got %s = %s, want %s", k, got[k], v)
				}
			}
			if int(r.Tokens) != out.Usage.Prompt {
				t.Fatalf("the decision's prompt is %d tokens, the engine ran %d", r.Tokens, out.Usage.Prompt)
			}
		})
	}
}

// TestBodiesInFlightAreCapped: bodies being uploaded slowly hold their
// bytes against MaxBodyBytesInFlight; a request that would pass it gets
// 503 with Retry-After and an OpenAI-shaped error, and the bytes come
// back when the uploads end, however they end.
func TestBodiesInFlightAreCapped(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[]}`)
	}))
	defer up.Close()
	const slow = 4
	srv, ts := routerOver(t, ServerOptions{Limits: limits.Request{MaxBodyBytesInFlight: slow * bodyPrealloc}}, nil, nil, up.URL)

	// Bodies of unknown length, sent a byte at a time: each holds
	// bodyPrealloc from its first byte.
	type upload struct {
		w    *io.PipeWriter
		done chan int // the status, or 0 if the request failed
	}
	var ups []upload
	for range slow {
		pr, pw := io.Pipe()
		u := upload{pw, make(chan int, 1)}
		ups = append(ups, u)
		go func() {
			resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", pr)
			if err != nil {
				u.done <- 0
				return
			}
			resp.Body.Close()
			u.done <- resp.StatusCode
		}()
		if _, err := pw.Write([]byte(`{"model":"m",`)); err != nil {
			t.Fatal(err)
		}
	}
	waitGauge(t, srv, slow*bodyPrealloc)

	for _, body := range []io.Reader{strings.NewReader(chatBody), io.MultiReader(strings.NewReader(chatBody))} { // known length, then unknown
		resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", body)
		if err != nil {
			t.Fatal(err)
		}
		var e struct {
			Error struct{ Type, Code, Message string }
		}
		_ = json.NewDecoder(resp.Body).Decode(&e)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
			e.Error.Code != "body_bytes_in_flight" || !strings.Contains(e.Error.Message, "retry") {
			t.Fatalf("past the cap: %d, Retry-After %q, %+v", resp.StatusCode, resp.Header.Get("Retry-After"), e.Error)
		}
	}
	if n := srv.bodies.Load(); n != slow*bodyPrealloc {
		t.Fatalf("%d bytes held after the refusals, want %d", n, slow*bodyPrealloc)
	}

	// One upload finishes and is answered; the others' clients go away.
	_, _ = io.WriteString(ups[0].w, `"messages":[{"role":"user","content":"hello"}]}`)
	ups[0].w.Close()
	if status := <-ups[0].done; status != 200 {
		t.Fatalf("the finished upload: status %d", status)
	}
	for _, u := range ups[1:] {
		u.w.CloseWithError(io.ErrClosedPipe)
		<-u.done
	}
	waitGauge(t, srv, 0)

	resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("under the cap again: %d", resp.StatusCode)
	}
	waitGauge(t, srv, 0)
}

// waitGauge waits until the server holds want bytes of bodies.
func waitGauge(t *testing.T, s *Server, want int64) {
	t.Helper()
	testwait.Value(t, fmt.Sprint(want, " bytes of bodies held"), func() (int64, bool) {
		held := s.bodies.Load()
		return held, held == want
	})
}

// TestStreamedCopyCountsInFlight: the copy of a streamed body that asks
// the replica for usage holds its bytes too: with room for one body but
// not two, a streamed request gets 503, a request that is not streamed
// is served, and nothing stays held.
func TestStreamedCopyCountsInFlight(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[]}`)
	}))
	defer up.Close()
	body := `{"model":"m","stream":false,"messages":[{"role":"user","content":"hello"}]}`
	srv, ts := routerOver(t, ServerOptions{Limits: limits.Request{MaxBodyBytesInFlight: int64(2 * len(body))}}, nil, nil, up.URL)
	for _, c := range []struct {
		body string
		want int
	}{{body, 200}, {strings.Replace(body, "false", "true ", 1), http.StatusServiceUnavailable}} {
		resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Fatalf("%s: %d, want %d", c.body, resp.StatusCode, c.want)
		}
		waitGauge(t, srv, 0)
	}
}
