package router

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/semroute/semroute/apikey"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// serverFor is a Server over replicas at urls (named r0, r1, … in order)
// under round robin, with o's timeouts, serving on a real socket.
func serverFor(t *testing.T, o ServerOptions, urls ...string) (*httptest.Server, *routing.Engine) {
	t.Helper()
	return serverWith(t, o, nil, urls...)
}

// serverForMetrics is serverFor with the core's metrics set.
func serverForMetrics(t *testing.T, m *Metrics, urls ...string) (*httptest.Server, *routing.Engine) {
	t.Helper()
	return serverWith(t, ServerOptions{}, m, urls...)
}

func serverWith(t *testing.T, o ServerOptions, m *Metrics, urls ...string) (*httptest.Server, *routing.Engine) {
	t.Helper()
	ts, core := serverWithCore(t, o, CoreOptions{Metrics: m}, urls...)
	return ts, core.e
}

// serverWithCore is serverWith with the core's options co (its engine and
// a round-robin arm set here), returning the core.
func serverWithCore(t *testing.T, o ServerOptions, co CoreOptions, urls ...string) (*httptest.Server, *Core) {
	t.Helper()
	specs := make([]replica.Spec, len(urls))
	for i, u := range urls {
		specs[i] = replica.Spec{Name: fmt.Sprint("r", i), URL: u}
	}
	return serveRouter(t, specs, "round_robin", co, o)
}

// serveRouter serves, on 127.0.0.1, a router over the replicas specs with
// one arm of policy, the core's options co and the server's o (their
// engine, arms, core and logger set here); it returns the server and the
// core.
func serveRouter(t *testing.T, specs []replica.Spec, policy string, co CoreOptions, o ServerOptions) (*httptest.Server, *Core) {
	t.Helper()
	e, err := routing.New(routing.Options{Replicas: specs})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := routing.NewPolicy(routing.PolicySpec{Type: policy})
	if err != nil {
		t.Fatal(err)
	}
	co.Engine, co.Arms = e, []Arm{{Name: "default", Policy: pol, Weight: 1}}
	core, err := NewCore(co)
	if err != nil {
		t.Fatal(err)
	}
	o.Core = core
	o.Logger = slog.New(slog.DiscardHandler)
	srv, err := NewServer(o)
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(func() { ts.Close(); srv.CloseIdleConnections() })
	return ts, core
}

// closedURL is the URL of a port nothing listens on.
func closedURL(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := "http://" + ln.Addr().String()
	ln.Close()
	return u
}

const chatBody = `{"model":"m","messages":[{"role":"user","content":"hello"}]}`

func postChat(t *testing.T, url string) *http.Response {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// inFlight is the requests the engine counts on every replica.
func inFlight(e *routing.Engine) (n int64) {
	for _, r := range e.Pool().Replicas() {
		n += r.Load(time.Now()).InFlight
	}
	return n
}

// TestServerFailsOverBeforeTheFirstByte: a refused connection and a 503
// move the request down the ranking; the client sees only the answer.
func TestServerFailsOverBeforeTheFirstByte(t *testing.T) {
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"hi"}}]}`)
	}))
	defer good.Close()
	busy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer busy.Close()
	ts, e := serverFor(t, ServerOptions{}, closedURL(t), busy.URL, good.URL)
	for i := range 6 {
		resp := postChat(t, ts.URL)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get(HeaderReplica) != "r2" {
			t.Fatalf("request %d: %d from %s: %s", i, resp.StatusCode, resp.Header.Get(HeaderReplica), b)
		}
	}
	waitIdle(t, e)
}

// waitIdle waits until no request counts in flight: the handler ends a
// request's work just after its client has the whole response.
func waitIdle(t *testing.T, e *routing.Engine) {
	t.Helper()
	testwait.Value(t, "no request counted in flight", func() (int64, bool) {
		n := inFlight(e)
		return n, n == 0
	})
}

// TestServerStreamsChunkByChunk: each event reaches the client while the
// replica is still writing the next.
func TestServerStreamsChunkByChunk(t *testing.T) {
	next := make(chan struct{})
	replicaSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"%d\"}}]}\n\n", i)
			w.(http.Flusher).Flush()
			select {
			case <-next:
			case <-r.Context().Done():
				return
			}
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer replicaSrv.Close()
	ts, e := serverFor(t, ServerOptions{}, replicaSrv.URL)
	resp := postChat(t, ts.URL)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := br.ReadString('\n')
		if err != nil || !strings.Contains(line, fmt.Sprintf(`\"content\":\"%d\"`, i)) && !strings.Contains(line, fmt.Sprintf(`"content":"%d"`, i)) {
			t.Fatalf("event %d: %q %v", i, line, err)
		}
		_, _ = br.ReadString('\n') // the blank line after the event
		next <- struct{}{}         // only now does the replica write the next one
	}
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("stream ended without [DONE]: %q", rest)
	}
	resp.Body.Close()
	waitIdle(t, e) // the finished stream
}

// TestServerIdleTimeoutOnEveryRoute: a replica silent after its first
// bytes is cut off after IdleTimeout, on a routed path and a pass-through
// one, the request stops counting on the replica, and the cut-off counts as
// a soft failure (here one ejects).
func TestServerIdleTimeoutOnEveryRoute(t *testing.T) {
	release := make(chan struct{})
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(200)
		_, _ = io.WriteString(w, "{")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer func() { close(release); silent.Close() }()
	for _, path := range []string{"/v1/chat/completions", "/v1/embeddings"} {
		ts, e := serverFor(t, ServerOptions{Timeouts: limits.Timeouts{Idle: 200 * time.Millisecond}, Ejection: replica.Ejection{Consecutive: 1, MinVolume: 1, MinSources: 1}}, silent.URL)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, ts.URL+path, strings.NewReader(chatBody))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		if ctx.Err() != nil || err == nil {
			cancel()
			t.Fatalf("%s: not cut off (read error %v, client %v)", path, err, ctx.Err())
		}
		cancel()
		waitIdle(t, e) // the cut-off request
		if e.Pool().Replicas()[0].Available(time.Now()) {
			t.Fatalf("%s: the silent replica was not taken out of rotation", path)
		}
	}
}

// TestServerAimsAtTheReplicasBaseAndCredentials: a replica URL's base path
// and user information are used on every attempt, failover included, and
// never leak into responses.
func TestServerAimsAtTheReplicasBaseAndCredentials(t *testing.T) {
	type seen struct{ path, auth string }
	got := make(chan seen, 4)
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- seen{r.URL.Path + "?" + r.URL.RawQuery, r.Header.Get("Authorization")}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"hi"}}]}`)
	}))
	defer good.Close()
	withCreds := strings.Replace(good.URL, "http://", "http://alice:s3cret@", 1) + "/base"
	ts, _ := serverFor(t, ServerOptions{}, closedURL(t)+"/other", withCreds)
	req, _ := http.NewRequest(http.MethodPost, ts.URL+"/v1/chat/completions?x=1", strings.NewReader(chatBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer client-key")
	for range 2 { // the first goes to r0 (refused) and fails over to r1
		resp, err := http.DefaultClient.Do(req.Clone(context.Background()))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || strings.Contains(string(b)+fmt.Sprint(resp.Header), "s3cret") {
			t.Fatalf("%d %s %v", resp.StatusCode, b, resp.Header)
		}
		s := <-got
		if s.path != "/base/v1/chat/completions?x=1" || s.auth != "Basic YWxpY2U6czNjcmV0" {
			t.Fatalf("the replica saw %+v", s)
		}
		req.Body = io.NopCloser(strings.NewReader(chatBody))
	}
}

// TestServerFailoverCarriesNoCredentials: a replica with credentials that
// answers 503 hands the request to one without, which gets the client's own
// Authorization, not the first replica's.
func TestServerFailoverCarriesNoCredentials(t *testing.T) {
	got := make(chan string, 4)
	busy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- "busy " + r.Header.Get("Authorization")
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer busy.Close()
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- "good " + r.Header.Get("Authorization")
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"hi"}}]}`)
	}))
	defer good.Close()
	ts, _ := serverFor(t, ServerOptions{}, strings.Replace(busy.URL, "http://", "http://svc:s3cret@", 1), good.URL)
	req, _ := http.NewRequest(http.MethodPost, ts.URL+"/v1/chat/completions", strings.NewReader(chatBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer client-key")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if first, second := <-got, <-got; first != "busy Basic c3ZjOnMzY3JldA==" || second != "good Bearer client-key" {
		t.Fatalf("replicas saw %q then %q", first, second)
	}
}

// TestNegativeUsageIsRefused: a replica reporting negative token counts
// does not take the router down (a metric counter cannot decrease).
func TestNegativeUsageIsRefused(t *testing.T) {
	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":-1}}}`)
	}))
	defer bad.Close()
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	ts, e := serverForMetrics(t, m, bad.URL)
	for range 3 {
		resp := postChat(t, ts.URL)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	waitIdle(t, e) // a finish that panicked would leave them counted
}

// TestStrippedStreamTricklingAndLength: a replica that sends an event a few
// bytes at a time, more slowly than an event takes as a whole but never
// silent for the idle timeout, is not cut off while the usage stripper
// gathers the event; and a stream that declares its length reaches the
// client whole, its Content-Length dropped since the usage chunk is not.
func TestStrippedStreamTricklingAndLength(t *testing.T) {
	const ev = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n"
	const usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\n"
	replicaSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		if r.URL.Query().Get("length") != "" {
			all := ev + usage + "data: [DONE]\n\n"
			w.Header().Set("Content-Length", strconv.Itoa(len(all)))
			_, _ = io.WriteString(w, all)
			return
		}
		for i := 0; i < len(ev); i += 8 { // 8 bytes every 40ms: 0.3 s for the event
			_, _ = io.WriteString(w, ev[i:min(i+8, len(ev))])
			w.(http.Flusher).Flush()
			// The thing under test, in real time: a pause shorter than
			// the idle timeout (150 ms), an event longer than it.
			time.Sleep(40 * time.Millisecond)
		}
		_, _ = io.WriteString(w, usage+"data: [DONE]\n\n")
	}))
	defer replicaSrv.Close()
	ts, e := serverFor(t, ServerOptions{Timeouts: limits.Timeouts{Idle: 150 * time.Millisecond}}, replicaSrv.URL)
	for _, q := range []string{"", "?length=1"} {
		body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`
		resp, err := http.Post(ts.URL+"/v1/chat/completions"+q, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(got) != ev+"data: [DONE]\n\n" {
			t.Fatalf("%q: %v, got %q", q, err, got)
		}
		if resp.ContentLength != -1 {
			t.Fatalf("%q: Content-Length %d kept", q, resp.ContentLength)
		}
	}
	if !e.Pool().Replicas()[0].Available(time.Now()) {
		t.Fatal("the trickling replica was cut off and ejected")
	}
}

// A stream whose replica is slower than timeouts.client_write to end it
// after its last event is not cut off: the bytes that close the answer,
// written after the proxy returns, get a deadline of their own. (Found by
// a helper's review.)
func TestClientWriteDeadlineRenewedForTheEnd(t *testing.T) {
	const clientWrite = 200 * time.Millisecond
	end := make(chan struct{}) // the replica ends its answer when the test closes it
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-end:
		case <-r.Context().Done():
		}
	}))
	defer up.Close()
	ts, _ := serverFor(t, ServerOptions{Timeouts: limits.Timeouts{ClientWrite: clientWrite}}, up.URL)
	resp := postChat(t, ts.URL)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	var got string
	for !strings.HasSuffix(got, "data: [DONE]\n\n") {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("the stream before its end: %q: %v", got+line, err)
		}
		got += line
	}
	// The thing under test is a deadline passing in real time: the one
	// the proxy gave its write of [DONE] was set before the client read
	// it, so clientWrite from now it has passed. Only then does the
	// replica end its answer.
	time.Sleep(clientWrite)
	close(end)
	if b, err := io.ReadAll(br); err != nil {
		t.Fatalf("the stream, whole to its [DONE], ended in an error: %q: %v", got+string(b), err)
	}
}

// TestServerSoftFailuresDoNotEject: a 500 to one request (vLLM answers 500
// to some inputs) reaches its client and leaves the replica in rotation,
// and a stream whose first chunk comes later than IdleTimeout (vLLM sends
// a stream's headers at once, its first chunk after queueing and prefill)
// is not cut off while within FirstByte.
func TestServerSoftFailuresDoNotEject(t *testing.T) {
	const idle = 100 * time.Millisecond
	rep := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if strings.Contains(string(b), "poison") {
			http.Error(w, `{"error":{"message":"bad input"}}`, http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		// The thing under test, in real time: the first chunk comes four
		// idle timeouts after the headers (a prefill). Nothing the test
		// can see marks when the proxy started its timer (it has the
		// headers before the client does), so no gate: on a machine slow
		// enough to shorten the gap, the test only proves less.
		time.Sleep(4 * idle)
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n")
	}))
	defer rep.Close()
	ts, e := serverFor(t, ServerOptions{Timeouts: limits.Timeouts{Idle: idle, FirstByte: 5 * time.Second}}, rep.URL)
	post := func(content string) (int, string) {
		body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + content + `"}]}`
		resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("%s: %v after %q", content, err, b)
		}
		return resp.StatusCode, string(b)
	}
	if code, _ := post("poison"); code != http.StatusInternalServerError {
		t.Fatalf("poison: %d, want the replica's 500", code)
	}
	if !e.Pool().Replicas()[0].Available(time.Now()) {
		t.Fatal("one 500 took the replica out of rotation")
	}
	code, b := post("hello")
	if code != 200 || !strings.Contains(b, "[DONE]") {
		t.Fatalf("a stream whose first chunk came after 400 ms (idle 100 ms): %d %q", code, b)
	}
	if !e.Pool().Replicas()[0].Available(time.Now()) {
		t.Fatal("a slow first chunk took the replica out of rotation")
	}
}

// A key's tenant is its requests' flow, whatever the client's fairness
// header says, and an objective above the key's max_priority is not taken.
func TestKeyDecidesFlowAndPriority(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "keys.yaml")
	body := "keys:\n  - {tenant: acme, max_priority: 1, sha256: " + apikey.Hash("sk-a") + "}\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	keys, err := apikey.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	var seen http.Header
	s := &Server{o: ServerOptions{Keys: keys, Priorities: map[string]int{"critical": 10, "normal": 1}}}
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("/v1/", func(w http.ResponseWriter, r *http.Request) { seen = r.Header.Clone() })
	s.limits.Store(&limits.Request{MaxHeaderBytes: 1 << 20})
	s.core = &Core{}
	for _, c := range []struct{ objective, want string }{{"critical", ""}, {"normal", "normal"}} {
		req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		req.Header.Set("Authorization", "Bearer sk-a")
		req.Header.Set("X-Gateway-Inference-Fairness-Id", "someone-else")
		req.Header.Set("X-Gateway-Inference-Objective", c.objective)
		s.ServeHTTP(httptest.NewRecorder(), req)
		if seen.Get(HeaderTenantID) != "acme" || seen.Get("X-Gateway-Inference-Fairness-Id") != "" || seen.Get("X-Gateway-Inference-Objective") != c.want {
			t.Errorf("objective %s: the handler saw tenant %q, flow %q, objective %q", c.objective, seen.Get(HeaderTenantID),
				seen.Get("X-Gateway-Inference-Fairness-Id"), seen.Get("X-Gateway-Inference-Objective"))
		}
		if seen.Get("Authorization") != "" {
			t.Error("the client's key went on")
		}
	}
}
