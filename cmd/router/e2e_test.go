package main

// End-to-end tests: the router as `router demo` builds it, over real sockets
// on 127.0.0.1, in front of simulated replicas.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/simreplica"
)

// fastSim answers quickly so that tests of routing spend little time waiting.
var fastSim = simreplica.Options{Overhead: 100 * time.Microsecond, PrefillPerToken: 100 * time.Nanosecond, InterToken: 100 * time.Microsecond, OutputTokens: 4}

func startTestDemo(t testing.TB, o demoOptions) *demo {
	t.Helper()
	if o.replicas == 0 {
		o.replicas = 4
	}
	o.listen = "127.0.0.1:0"
	d, err := startDemo(o, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.close() })
	return d
}

type result struct {
	status  int
	arm     string
	replica string
	matched int
	cached  int
	body    []byte
}

func post(t *testing.T, d *demo, path string, body any, hdr map[string]string) result {
	t.Helper()
	var b []byte
	switch v := body.(type) {
	case []byte:
		b = v
	case string:
		b = []byte(v)
	default:
		var err error
		if b, err = json.Marshal(v); err != nil {
			t.Fatal(err)
		}
	}
	req, err := http.NewRequest(http.MethodPost, d.router.URL()+path, bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r := result{status: resp.StatusCode, replica: resp.Header.Get("X-Semroute-Replica"), arm: resp.Header.Get("X-Semroute-Arm")}
	r.body, _ = io.ReadAll(resp.Body)
	if m := resp.Header.Get("X-Semroute-Matched-Tokens"); m != "" {
		r.matched, _ = strconv.Atoi(m)
	}
	var u struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(r.body, &u) == nil {
		r.cached = u.Usage.Details.Cached
	}
	return r
}

// text returns about tokens×4 bytes of prose that differs with seed.
func text(seed string, tokens int) string {
	var sb strings.Builder
	for i := 0; sb.Len() < tokens*4; i++ {
		fmt.Fprintf(&sb, "%s sentence %d of the document. ", seed, i)
	}
	return sb.String()[:tokens*4]
}

func chat(msgs ...[2]string) map[string]any {
	m := make([]map[string]string, len(msgs))
	for i, x := range msgs {
		m[i] = map[string]string{"role": x[0], "content": x[1]}
	}
	return map[string]any{"model": "sim-model", "messages": m, "max_tokens": 4}
}

func mustOK(t *testing.T, r result) {
	t.Helper()
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	if r.replica == "" {
		t.Fatal("no X-Semroute-Replica header")
	}
}

func TestE2EGroupsStayTogetherAndSpread(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	const groups, perGroup = 4, 10
	where := make([]map[string]int, groups)
	for g := range where {
		where[g] = map[string]int{}
	}
	for q := 0; q < perGroup; q++ {
		for g := 0; g < groups; g++ { // interleaved
			sys := text(fmt.Sprintf("system-%d", g), 300)
			doc := text(fmt.Sprintf("doc-%d", g), 1700)
			r := post(t, d, "/v1/chat/completions", chat(
				[2]string{"system", sys},
				[2]string{"user", doc + "\n\nQuestion: " + text(fmt.Sprintf("q%d-%d", g, q), 10)},
			), nil)
			mustOK(t, r)
			where[g][r.replica]++
		}
	}
	modal := map[string]bool{}
	for g, counts := range where {
		best, bestN := "", 0
		for rep, n := range counts {
			if n > bestN {
				best, bestN = rep, n
			}
		}
		if bestN*10 < perGroup*9 {
			t.Errorf("group %d: only %d of %d on %s: %v", g, bestN, perGroup, best, counts)
		}
		modal[best] = true
	}
	t.Logf("placement per group: %v", where)
	if len(modal) < 3 {
		t.Errorf("groups use %d replicas, want ≥3: %v", len(modal), where)
	}
}

func TestE2EGlobalSystemPromptDoesNotPile(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	sys := text("global system prompt", 1000)
	counts := map[string]int{}
	for i := 0; i < 40; i++ {
		r := post(t, d, "/v1/chat/completions", chat(
			[2]string{"system", sys},
			[2]string{"user", text(fmt.Sprintf("unique request %d", i), 200)},
		), nil)
		mustOK(t, r)
		if i >= 8 { // hot from its 8th use (routing.EngineOptions.HotUses): before, its replica answers first
			counts[r.replica]++
		}
	}
	t.Logf("placement once hot: %v", counts)
	for rep, n := range counts {
		if n > 13 {
			t.Errorf("%s got %d of 32 (> 40%%): %v", rep, n, counts)
		}
	}
}

// repeatedPrefixTraffic sends 7 groups × 6 requests sharing a 1,000-token
// prefix each, and returns the cached tokens the replicas reported.
func repeatedPrefixTraffic(t *testing.T, d *demo) int {
	total := 0
	for q := 0; q < 6; q++ {
		for g := 0; g < 7; g++ { // 7 is prime to 4: round robin does not pin groups by chance
			r := post(t, d, "/v1/chat/completions", chat(
				[2]string{"system", text(fmt.Sprintf("tenant %d", g), 1000)},
				[2]string{"user", text(fmt.Sprintf("question %d %d", g, q), 30)},
			), nil)
			mustOK(t, r)
			total += r.cached
		}
	}
	var fromSims int64
	for _, s := range d.sims {
		fromSims += s.Stats().CachedTokens
	}
	if int64(total) != fromSims {
		t.Fatalf("responses report %d cached tokens, replicas counted %d", total, fromSims)
	}
	return total
}

func TestE2ECacheAwareBeatsRoundRobin(t *testing.T) {
	semantic := repeatedPrefixTraffic(t, startTestDemo(t, demoOptions{sim: fastSim}))
	rr := repeatedPrefixTraffic(t, startTestDemo(t, demoOptions{sim: fastSim, policy: "round_robin"}))
	t.Logf("cached tokens: semantic %d, round_robin %d", semantic, rr)
	if semantic*2 < rr*3 {
		t.Errorf("semantic %d cached tokens, round_robin %d: want at least 1.5×", semantic, rr)
	}
}

func totalStats(d *demo) (s simreplica.Stats) {
	for _, r := range d.sims {
		x := r.Stats()
		s.Requests += x.Requests
		s.Completed += x.Completed
		s.Cancelled += x.Cancelled
	}
	return s
}

func streamRequest(t *testing.T, ctx context.Context, d *demo, maxTokens int) (*http.Response, *bufio.Reader) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": "sim-model", "stream": true, "max_tokens": maxTokens,
		"messages": []map[string]string{{"role": "user", "content": "stream to me"}}})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, d.router.URL()+"/v1/chat/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	return resp, bufio.NewReader(resp.Body)
}

func readEvent(t *testing.T, br *bufio.Reader) string {
	t.Helper()
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("stream ended: %v", err)
		}
		if strings.HasPrefix(line, "data: ") {
			return strings.TrimSpace(strings.TrimPrefix(line, "data: "))
		}
	}
}

func TestE2EStreamingFlushesChunks(t *testing.T) {
	sim := fastSim
	sim.InterToken = 20 * time.Millisecond // 40 tokens: about 0.8 s of generation
	d := startTestDemo(t, demoOptions{sim: sim})
	resp, br := streamRequest(t, context.Background(), d, 40)
	defer resp.Body.Close()
	if first := readEvent(t, br); !strings.Contains(first, "chat.completion.chunk") {
		t.Fatalf("first event %q", first)
	}
	if s := totalStats(d); s.Completed != 0 {
		t.Fatalf("first chunk arrived after the replica finished: %+v", s)
	}
	events := 1
	for {
		ev := readEvent(t, br)
		if ev == "[DONE]" {
			break
		}
		events++
	}
	if events != 40 {
		t.Errorf("got %d chunks, want 40", events)
	}
}

func TestE2EClientDisconnectCancelsUpstream(t *testing.T) {
	sim := fastSim
	sim.InterToken = 10 * time.Millisecond // 2,000 tokens: 20 s if never cancelled
	d := startTestDemo(t, demoOptions{sim: sim})
	ctx, cancel := context.WithCancel(context.Background())
	resp, br := streamRequest(t, ctx, d, 2000)
	readEvent(t, br)
	cancel()
	resp.Body.Close()
	waitCancelled(t, d, "the replica to see the request cancelled")
	if s := totalStats(d); s.Completed != 0 {
		t.Fatalf("the request completed: %+v", s)
	}
	// The router ended the request's work too: no replica still counts it.
	waitNoneInFlight(t, d)
	// Counted as it ends, which its replica's in-flight count may show
	// first (CI, once).
	testwait.Until(t, "the request that broke off counted with code 499 in semroute_requests_total", func() bool {
		return strings.Contains(scrape(t, d), `code="499"`)
	})
}

func TestE2EBadInput(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "small.yaml")
	if err := os.WriteFile(cfg, []byte("limits:\n  max_body_bytes: 4096\n  max_messages: 8\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startTestDemo(t, demoOptions{sim: fastSim, config: cfg})
	many := make([][2]string, 9)
	for i := range many {
		many[i] = [2]string{"user", "x"}
	}
	cases := []struct {
		name   string
		path   string
		body   any
		status int
		code   string
	}{
		{"malformed json", "/v1/chat/completions", `{"model":"sim-model","messages":[`, 400, "invalid_request"},
		{"not an object", "/v1/chat/completions", `[1,2]`, 400, "invalid_request"},
		{"no messages", "/v1/chat/completions", `{"model":"sim-model"}`, 400, "invalid_request"},
		{"empty messages", "/v1/chat/completions", `{"model":"sim-model","messages":[]}`, 400, "invalid_request"},
		{"no prompt", "/v1/completions", `{"model":"sim-model"}`, 400, "invalid_request"},
		{"bad role", "/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"root","content":"x"}]}`, 400, "invalid_request"},
		{"too many messages", "/v1/chat/completions", chat(many...), 400, "invalid_request"},
		{"over limit", "/v1/chat/completions", chat([2]string{"user", strings.Repeat("x", 5000)}), 413, "body_too_large"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := post(t, d, tc.path, tc.body, nil)
			if r.status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
			}
			var e struct {
				Error struct {
					Message, Type, Code string
				} `json:"error"`
			}
			if err := json.Unmarshal(r.body, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" || e.Error.Code != tc.code {
				t.Fatalf("error body %s (code want %q)", r.body, tc.code)
			}
		})
	}
	if s := totalStats(d); s.Requests != 0 {
		t.Fatalf("bad input reached a replica: %+v", s)
	}
	// A good request still works after all that.
	mustOK(t, post(t, d, "/v1/completions", `{"model":"sim-model","prompt":"hello","max_tokens":2}`, nil))
}

func TestE2ENoReplicaAvailable(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, replicas: 2})
	good := chat([2]string{"user", "hello"})
	mustOK(t, post(t, d, "/v1/chat/completions", good, nil))
	for _, s := range d.sims {
		s.Close()
	}
	// Each request marks the replicas it could not reach down; once all are
	// down the router answers 503 without trying.
	var last result
	for i := 0; i < 3 && last.status != http.StatusServiceUnavailable; i++ {
		last = post(t, d, "/v1/chat/completions", good, nil)
		if last.status != http.StatusBadGateway && last.status != http.StatusServiceUnavailable {
			t.Fatalf("status %d: %s", last.status, last.body)
		}
	}
	if last.status != http.StatusServiceUnavailable || !bytes.Contains(last.body, []byte(`"code":"no_replica"`)) {
		t.Fatalf("want 503 no_replica, got %d %s", last.status, last.body)
	}
	resp, err := http.Get(d.router.URL() + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("/readyz = %d with every replica down", resp.StatusCode)
	}
}

func TestE2EFailoverOnRefusedConnection(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	body := chat([2]string{"system", text("failover", 500)}, [2]string{"user", "q"})
	first := post(t, d, "/v1/chat/completions", body, nil)
	mustOK(t, first)
	var victim int
	fmt.Sscanf(first.replica, "sim-%d", &victim)
	d.sims[victim].Close()
	second := post(t, d, "/v1/chat/completions", body, nil)
	mustOK(t, second)
	if second.replica == first.replica {
		t.Fatalf("served by the closed replica %s", second.replica)
	}
	if m := scrape(t, d); !strings.Contains(m, `semroute_retries_total{arm="default",policy="semantic"} 1`) {
		t.Error("the failover is not counted in semroute_retries_total")
	}
}

func TestE2EModelsAndPassthrough(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	resp, err := http.Get(d.router.URL() + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Data []struct{ ID string } `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if err != nil || len(list.Data) != 1 || list.Data[0].ID != "sim-model" {
		t.Fatalf("models: %+v, %v", list, err)
	}
	// An unknown /v1 path reaches a replica (which answers 404) with the
	// replica header set.
	resp, err = http.Get(d.router.URL() + "/v1/files")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound || resp.Header.Get("X-Semroute-Replica") == "" {
		t.Fatalf("passthrough: %d %v", resp.StatusCode, resp.Header)
	}
}

func TestE2EConversationLearnsReplies(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	msgs := [][2]string{{"system", text("assistant persona", 200)}, {"user", text("turn 0", 100)}}
	var prev result
	for turn := 0; turn < 4; turn++ {
		r := post(t, d, "/v1/chat/completions", chat(msgs...), map[string]string{"X-Session-ID": "conv"})
		mustOK(t, r)
		if turn > 0 {
			if r.replica != prev.replica {
				t.Fatalf("turn %d moved from %s to %s", turn, prev.replica, r.replica)
			}
			// The router predicts the whole history, reply included, as
			// cached, in the engine's tokens (learned from its usage): what
			// the engine reports cached, and at most the short reply more.
			if r.cached == 0 || float64(r.matched) < 0.9*float64(r.cached) || float64(r.matched) > 1.25*float64(r.cached)+64 {
				t.Errorf("turn %d: predicted %d matched tokens, the engine reports %d cached", turn, r.matched, r.cached)
			}
		}
		var out struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(r.body, &out); err != nil || len(out.Choices) == 0 {
			t.Fatalf("response %s", r.body)
		}
		msgs = append(msgs, [2]string{"assistant", out.Choices[0].Message.Content}, [2]string{"user", text(fmt.Sprint("turn ", turn+1), 100)})
		prev = r
	}
}

func TestE2EConcurrentRequests(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	var wg sync.WaitGroup
	errs := make(chan string, 64)
	for i := 0; i < 64; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			b, _ := json.Marshal(chat([2]string{"system", text(fmt.Sprint("c", i%5), 300)}, [2]string{"user", fmt.Sprint("q", i)}))
			resp, err := http.Post(d.router.URL()+"/v1/chat/completions", "application/json", bytes.NewReader(b))
			if err != nil {
				errs <- err.Error()
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				errs <- resp.Status
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

func TestE2ESemanticMatcherPrefersDonor(t *testing.T) {
	doc := text("a long shared report about quarterly revenue", 1500)
	body := func(instruction string) map[string]any {
		return chat([2]string{"user", instruction + "\n<document>\n" + doc + "\n</document>"})
	}
	for _, enabled := range []bool{false, true} {
		cfg := filepath.Join(t.TempDir(), "m.yaml")
		os.WriteFile(cfg, []byte(fmt.Sprintf("routing:\n  shared_active: true\n  semantic_matcher:\n    enabled: %v\n", enabled)), 0o600)
		d := startTestDemo(t, demoOptions{sim: fastSim, config: cfg})
		a := post(t, d, "/v1/chat/completions", body("Summarise the document."), nil)
		mustOK(t, a)
		b := post(t, d, "/v1/chat/completions", body("List every number in the document, one per line."), nil)
		mustOK(t, b)
		if b.matched != 0 {
			t.Fatalf("the second prompt differs from its first block: matched %d", b.matched)
		}
		// Without the matcher the second goes where its cost says, which
		// may be anywhere; with it, to its donor.
		if enabled && a.replica != b.replica {
			t.Errorf("matcher on: first on %s, second on %s", a.replica, b.replica)
		}
	}
}

func scrape(t *testing.T, d *demo) string {
	t.Helper()
	resp, err := http.Get(d.router.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func TestE2EMetricsCarryArmAndPolicy(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "arms.yaml")
	os.WriteFile(cfg, []byte("routing:\n  arms:\n    - {name: a, policy: semantic, weight: 1}\n    - {name: b, policy: least_load, weight: 1}\n"), 0o600)
	d := startTestDemo(t, demoOptions{sim: fastSim, config: cfg})
	for i := 0; i < 20; i++ {
		mustOK(t, post(t, d, "/v1/chat/completions", chat([2]string{"system", text("metrics", 300)}, [2]string{"user", fmt.Sprint(i)}),
			map[string]string{"X-Session-ID": fmt.Sprint("m", i)}))
	}
	body := scrape(t, d)
	for _, want := range []string{
		`semroute_requests_total{arm="a",code="200",model="sim-model",policy="semantic",route="chat"}`,
		`semroute_requests_total{arm="b",code="200",model="sim-model",policy="least_load",route="chat"}`,
		`semroute_routing_decision_seconds_count{arm="a",policy="semantic"}`,
		`semroute_predicted_match_ratio_count{arm="b",policy="least_load"}`,
		`semroute_predicted_cached_tokens_total{arm="a",policy="semantic",replica="`,
		`semroute_reported_cached_tokens_total{arm="a",policy="semantic",replica="`,
		`semroute_cached_tokens_prediction_error_tokens_count{arm="a",policy="semantic"}`,
		`semroute_upstream_ttft_seconds_count{arm="a",policy="semantic",replica="`,
		`semroute_model_ttft_seconds_count{model="sim-model"}`,
		`semroute_upstream_duration_seconds_count{arm="b",policy="least_load",replica="`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

func TestE2EHostileInput(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	nested := strings.Repeat(`{"a":`, 20000) + "1" + strings.Repeat("}", 20000)
	cases := []struct {
		name   string
		ct     string
		body   []byte
		header map[string]string
		status int
		code   string
	}{
		{"wrong content type", "text/plain", []byte(`{"model":"sim-model","prompt":"x"}`), nil, 415, "unsupported_media_type"},
		{"form content type", "application/x-www-form-urlencoded", []byte(`a=b`), nil, 415, "unsupported_media_type"},
		{"not utf-8", "application/json", []byte("{\"model\":\"sim-model\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"), nil, 400, "invalid_encoding"},
		{"deeply nested", "application/json", []byte(`{"model":"sim-model","messages":[{"role":"user","content":` + nested + `}]}`), nil, 400, "invalid_request"},
		{"absurd max_tokens", "application/json", []byte(`{"model":"sim-model","max_tokens":1000000000000,"messages":[{"role":"user","content":"x"}]}`), nil, 400, "invalid_request"},
		{"max_tokens as string", "application/json", []byte(`{"model":"sim-model","max_tokens":"lots","messages":[{"role":"user","content":"x"}]}`), nil, 400, "invalid_request"},
		{"missing model", "application/json", []byte(`{"messages":[{"role":"user","content":"x"}]}`), nil, 400, "invalid_request"},
		{"oversized headers", "application/json", []byte(`{"model":"sim-model","prompt":"x"}`), map[string]string{"X-Big": strings.Repeat("a", 100<<10)}, 431, "headers_too_large"},
		{"json with parameters", "application/json; charset=utf-8", []byte(`{"model":"sim-model","prompt":"x","max_tokens":1}`), nil, 200, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, d.router.URL()+"/v1/completions", bytes.NewReader(tc.body))
			req.Header.Set("Content-Type", tc.ct)
			for k, v := range tc.header {
				req.Header.Set(k, v)
			}
			t0 := time.Now()
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, b)
			}
			if tc.code != "" && !bytes.Contains(b, []byte(`"code":"`+tc.code+`"`)) {
				t.Fatalf("body %s lacks code %s", b, tc.code)
			}
			t.Logf("%d in %v", resp.StatusCode, time.Since(t0))
		})
	}
	if s := totalStats(d); s.Requests != 1 {
		t.Fatalf("hostile input reached a replica: %+v", s)
	}
}

// TestDemoExampleHitsTheSecondTime: the request the demo prints (and the
// README shows) hits the cache the second time it is sent.
func TestDemoExampleHitsTheSecondTime(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, picture: "events"}) // as `router demo` runs
	waitSubscribed(t, d)
	var printed bytes.Buffer
	printExample(&printed, d)
	body := demoBody(d.sims[0].Options().Model)
	if !strings.Contains(printed.String(), "-d '"+body+"'") {
		t.Fatalf("the printed example does not send demoBody:\n%s", printed.String())
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "-d '"+body+"'") {
		t.Fatal("the README's demo example is not the demo's request")
	}
	var first, second result
	for i, r := range []*result{&first, &second} {
		req, _ := http.NewRequest(http.MethodPost, d.router.URL()+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Session-ID", "demo-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var u struct {
			Usage struct {
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		_ = json.Unmarshal(b, &u)
		*r = result{status: resp.StatusCode, replica: resp.Header.Get("X-Semroute-Replica"), body: b, cached: u.Usage.Details.Cached}
		r.matched, _ = strconv.Atoi(resp.Header.Get("X-Semroute-Matched-Tokens"))
		if r.status != 200 {
			t.Fatalf("request %d: %d %s", i, r.status, b)
		}
		waitEventsApplied(t, d)
	}
	t.Logf("second: replica %s, matched %d, cached %d", second.replica, second.matched, second.cached)
	if second.replica != first.replica || second.matched == 0 || second.matched != second.cached {
		t.Fatalf("no cache hit the second time: first %s, second %s matched %d cached %d", first.replica, second.replica, second.matched, second.cached)
	}
}

// waitSubscribed waits until every simulated replica's KV events have a
// subscriber (a ZeroMQ subscriber misses what is published before).
func waitSubscribed(t testing.TB, d *demo) {
	t.Helper()
	testwait.Until(t, "every replica's KV events subscribed", func() bool {
		for _, s := range d.sims {
			if !s.KVEventsSubscribed() {
				return false
			}
		}
		return true
	})
}

// waitEventsApplied waits until the router has applied as many KV event
// batches as the replicas published (each simulated event is a batch).
func waitEventsApplied(t *testing.T, d *demo) {
	t.Helper()
	testwait.Value(t, "the router to apply every KV event batch published", func() (string, bool) {
		applied := uint64(0)
		d.app.events.mu.Lock()
		for _, f := range d.app.events.by {
			applied += f.Stats().Subscriber.Applied
		}
		d.app.events.mu.Unlock()
		var published uint64
		for _, s := range d.sims {
			published += s.KVEventsPublished()
		}
		return fmt.Sprintf("%d batches applied of %d published", applied, published), applied >= published
	})
}

// TestStreamingUsageIsLearnedAndHidden: a streaming client that does not
// ask for usage sees no usage chunk, yet the router reads the engine's
// prompt and cached tokens (it asked the replica for them); a client that
// asks gets its usage chunk.
func TestStreamingUsageIsLearnedAndHidden(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim})
	sys := text("a system prompt worth caching", 400)
	stream := func(withUsage bool) string {
		body := map[string]any{"model": "sim-model", "stream": true, "max_tokens": 3,
			"messages": []map[string]string{{"role": "system", "content": sys}, {"role": "user", "content": "hi"}}}
		if withUsage {
			body["stream_options"] = map[string]any{"include_usage": true}
		}
		b, _ := json.Marshal(body)
		resp, err := http.Post(d.router.URL()+"/v1/chat/completions", "application/json", bytes.NewReader(b))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		all, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 || !strings.HasSuffix(string(all), "data: [DONE]\n\n") {
			t.Fatalf("%d %q", resp.StatusCode, all)
		}
		return string(all)
	}
	for i := range 3 {
		if got := stream(false); strings.Contains(got, `"usage"`) {
			t.Fatalf("request %d: a usage chunk the client did not ask for: %q", i, got)
		}
	}
	m := scrape(t, d) // after the three streams that did not ask for usage
	reported := 0.0
	for _, line := range strings.Split(m, "\n") {
		if strings.HasPrefix(line, "semroute_reported_cached_tokens_total{") {
			v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			reported += v
		}
	}
	if reported == 0 {
		t.Fatal("no cached tokens reported: the router saw no usage from the streams")
	}
	t.Logf("cached tokens the replicas reported over 3 streams that did not ask: %.0f", reported)
	if got := stream(true); !strings.Contains(got, `"choices":[],`) || !strings.Contains(got, `"cached_tokens"`) {
		t.Fatalf("the usage chunk asked for is missing: %q", got)
	}
}

// A client that stops reading a long stream is cut off after
// timeouts.client_write, and the replica's request cancelled: before, the
// router's write blocked for as long as the client kept the connection,
// holding the request, its upstream connection and its load.
func TestE2EClientThatStopsReadingIsCutOff(t *testing.T) {
	sim := fastSim
	sim.InterToken = -1 // as fast as it can: megabytes of stream
	sim.MaxOutputTokens = 400000
	d, conn := demoWithClientWrite(t, sim, "300ms")
	_ = conn.(*net.TCPConn).SetReadBuffer(4096)
	body := `{"model":"sim-model","stream":true,"max_tokens":400000,"messages":[{"role":"user","content":"stream a lot"}]}`
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	status := make([]byte, 12)
	if _, err := io.ReadFull(conn, status); err != nil || string(status) != "HTTP/1.1 200" { // then no more reading
		_ = conn.SetReadDeadline(time.Now().Add(time.Second))
		rest, _ := io.ReadAll(conn)
		t.Fatalf("answer %q, %v: %s", status, err, rest)
	}
	waitCancelled(t, d, "the replica's request to be cancelled with the client not reading")
	waitNoneInFlight(t, d)
}

// waitCancelled waits until a simulated replica of d counts a request
// cancelled.
func waitCancelled(t *testing.T, d *demo, what string) {
	t.Helper()
	testwait.Value(t, what, func() (simreplica.Stats, bool) { s := totalStats(d); return s, s.Cancelled > 0 })
}

// waitNoneInFlight waits until no replica of d's router counts a request
// in flight.
func waitNoneInFlight(t *testing.T, d *demo) {
	t.Helper()
	testwait.Value(t, "no request counted in flight", func() (int64, bool) {
		inFlight := int64(0)
		for _, r := range d.app.pool.Replicas() {
			inFlight += r.Load(time.Now()).InFlight
		}
		return inFlight, inFlight == 0
	})
}

// The write deadline a request's answer set does not outlive it: the next
// request on the same keep-alive connection, arriving after
// timeouts.client_write has passed, gets its answer — here an error
// answer, which is not written through the proxy.
func TestE2EWriteDeadlineDoesNotOutliveItsRequest(t *testing.T) {
	// One raw connection, so that no client library retries on another.
	const clientWrite = 200 * time.Millisecond
	_, conn := demoWithClientWrite(t, fastSim, clientWrite.String())
	br := bufio.NewReader(conn)
	post := func(body string) (int, error) {
		fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, err = io.ReadAll(resp.Body)
		return resp.StatusCode, err
	}
	if code, err := post(`{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}`); code != 200 || err != nil {
		t.Fatalf("first request: %d %v", code, err)
	}
	// The thing under test is a deadline passing in real time: the first
	// answer's last write deadline was set before the client read it, so
	// clientWrite from now it has passed, on the same connection.
	time.Sleep(clientWrite)
	if code, err := post(`{"model":"sim-model","messages":[`); code != 400 || err != nil {
		t.Fatalf("a bad request on the kept-alive connection: %d %v, want its 400", code, err)
	}
}

// demoWithClientWrite starts a demo of sim replicas whose router has
// timeouts.client_write d, and a raw connection to it, closed with t.
func demoWithClientWrite(t *testing.T, sim simreplica.Options, d string) (*demo, net.Conn) {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "write.yaml")
	if err := os.WriteFile(cfg, []byte("timeouts:\n  client_write: "+d+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dm := startTestDemo(t, demoOptions{sim: sim, config: cfg})
	conn, err := net.Dial("tcp", strings.TrimPrefix(dm.router.URL(), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return dm, conn
}
