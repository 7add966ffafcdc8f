package main

// Hostile input, as an attacker would send it: each test here reproduces
// one way the router was exhausted or misled, over real sockets, and fails
// on the code before its fix.

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	pb "github.com/semroute/semroute/api/proto/semroute/v1"
	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/internal/testwait"
)

// rawPost posts body to the router's path and returns the status, the
// response body and the header.
func rawPost(t *testing.T, base, path string, body []byte) (int, []byte, http.Header) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+path, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := hostileClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b, resp.Header
}

// hostileClient gives up after 20 s: a hostile body that stalls the router
// fails its test instead of hanging it.
var hostileClient = &http.Client{Timeout: 20 * time.Second}

// routerOverSim serves a router over one fast simulated replica, "a", with
// yaml (config keys) before its replica list.
func routerOverSim(t *testing.T, yaml string) *running {
	t.Helper()
	sims := startSims(t, 1, fastSim)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("%sreplicas:\n  - {name: a, url: %q}\n", yaml, sims[0].URL))
	return serveConfig(t, cfg)
}

// memAfterGC returns the memory statistics right after a collection.
func memAfterGC() runtime.MemStats {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m
}

// grpcClient dials the router's gRPC API with token (none when empty).
func grpcClient(t *testing.T, addr, token string) *grpc.ClientConn {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearer(token)))
	}
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// Item 1: unbalanced nesting is refused at the depth limit, in time linear
// in the body, with a short error, over HTTP and over gRPC.
func TestHostileNestingRefusedWithShortError(t *testing.T) {
	sims := startSims(t, 2, fastSim)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("grpc_listen: 127.0.0.1:0\ngrpc: {token: tok}\nreplicas:\n  - {name: a, url: %q}\n  - {name: b, url: %q}\n", sims[0].URL, sims[1].URL))
	r := serveConfig(t, cfg)
	bodies := map[string][]byte{
		"20k [":        []byte(strings.Repeat("[", 20000)),
		"1M [":         []byte(strings.Repeat("[", 1<<20)),
		"20k {\"a\":":  []byte(strings.Repeat(`{"a":`, 20000)),
		"in a message": []byte(`{"model":"sim-model","messages":[{"role":"user","content":` + strings.Repeat("[", 100000) + `}]}`),
	}
	c := pb.NewRouterClient(grpcClient(t, r.grpcAddr(), "tok"))
	for name, b := range bodies {
		t.Run(name, func(t *testing.T) {
			code, resp, _ := rawPost(t, r.http.URL(), "/v1/chat/completions", b)
			if code != http.StatusBadRequest || len(resp) > 1024 || !bytes.Contains(resp, []byte("nesting")) {
				t.Fatalf("HTTP: %d, %d-byte body %.300s", code, len(resp), resp)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			_, err := c.Route(ctx, &pb.RouteRequest{Input: &pb.RouteRequest_OpenaiBody{OpenaiBody: b}})
			if status.Code(err) != codes.InvalidArgument || len(err.Error()) > 1024 {
				t.Fatalf("gRPC: %.300v", err)
			}
		})
	}
	for _, s := range sims {
		if n := s.Server.Stats().Requests; n != 0 {
			t.Fatalf("nested bodies reached a replica: %d requests", n)
		}
	}
}

// Item 2: the gRPC API needs its token (the health service excepted), and
// no answer carries a replica's credentials.
func TestGRPCNeedsTokenAndHidesCredentials(t *testing.T) {
	sims := startSims(t, 2, fastSim)
	withCreds := strings.Replace(sims[0].URL, "http://", "http://user:hunter2@", 1)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf(`grpc_listen: 127.0.0.1:0
grpc: {token: tok}
admin: {listen: 127.0.0.1:0, token: adm}
replicas:
  - {name: a, url: %q}
  - {name: b, url: %q}
`, withCreds, sims[1].URL))
	r := serveConfig(t, cfg)
	ctx := context.Background()
	in := &pb.RouteRequest{Model: "sim-model", Input: &pb.RouteRequest_Prompt{Prompt: "hello"}}
	for _, tok := range []string{"", "wrong"} {
		c := pb.NewRouterClient(grpcClient(t, r.grpcAddr(), tok))
		if _, err := c.Route(ctx, in); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("Route with token %q: %v", tok, err)
		}
		if _, err := c.ListReplicas(ctx, &pb.ListReplicasRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Fatalf("ListReplicas with token %q: %v", tok, err)
		}
	}
	open := grpcClient(t, r.grpcAddr(), "")
	if h, err := healthpb.NewHealthClient(open).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health without a token: %v %v", h, err)
	}
	c := pb.NewRouterClient(grpcClient(t, r.grpcAddr(), "tok"))
	var urls []string
	for i := range 8 {
		resp, err := c.Route(ctx, &pb.RouteRequest{Model: "sim-model", SessionId: strconv.Itoa(i), Input: &pb.RouteRequest_Prompt{Prompt: "hello"}, DryRun: true})
		if err != nil {
			t.Fatal(err)
		}
		urls = append(urls, resp.Url)
	}
	list, err := c.ListReplicas(ctx, &pb.ListReplicasRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, rep := range list.Replicas {
		urls = append(urls, rep.Url)
	}
	adminReq := func(path string) string {
		_, body := adminCall(t, r.admin.URL(), "adm", http.MethodGet, path, "")
		return body
	}
	seen := strings.Join(urls, " ") + adminReq("/admin/replicas") + adminReq("/admin/config") + scrapeURL(t, r.http.URL())
	if strings.Contains(seen, "hunter2") || strings.Contains(seen, "user:") {
		t.Fatalf("credentials exported: %s", seen)
	}
	if !strings.Contains(strings.Join(urls, " "), strings.TrimPrefix(sims[0].URL, "http://")) {
		t.Fatalf("replica a's address is missing from %v", urls)
	}
	// A config that would serve gRPC without authentication is refused.
	v := configs.NewViper()
	if _, err := configs.LoadBytes(v, []byte("grpc_listen: 127.0.0.1:0\n")); err == nil || !strings.Contains(err.Error(), "grpc.token") {
		t.Fatalf("an open gRPC listener was accepted: %v", err)
	}
}

// heldRoutes is how many Route calls TestGRPCHeldDecisionsAreCapped makes;
// SEMROUTE_HELD_ROUTES overrides it (the figure is 200,000).
func heldRoutes() int {
	if n, err := strconv.Atoi(os.Getenv("SEMROUTE_HELD_ROUTES")); err == nil && n > 0 {
		return n
	}
	return 20000
}

// Item 2: Route calls never released hold at most the cap; the oldest are
// finished first and counted; the heap stays bounded.
func TestGRPCHeldDecisionsAreCapped(t *testing.T) {
	sims := startSims(t, 2, fastSim)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	const maxHeld = 1000
	// Estimated, not tokenized: the heap's bound is the unreleased
	// decisions', not the tokenizer cache's (tokenizer.cache_tokens).
	writeConfig(t, cfg, fmt.Sprintf(`grpc_listen: 127.0.0.1:0
grpc: {token: tok, max_unreleased_decisions: %d}
tokenizer: {mode: estimate}
replicas:
  - {name: a, url: %q}
  - {name: b, url: %q}
`, maxHeld, sims[0].URL, sims[1].URL))
	r := serveConfig(t, cfg)
	c := pb.NewRouterClient(grpcClient(t, r.grpcAddr(), "tok"))
	before := memAfterGC().HeapAlloc
	n := heldRoutes()
	var next, failed, maxSeen atomic.Int64
	prompt := strings.Repeat("a prompt of a few blocks that the router must hold. ", 40)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1); i <= int64(n); i = next.Add(1) {
				_, err := c.Route(context.Background(), &pb.RouteRequest{Model: "sim-model", SessionId: strconv.FormatInt(i, 10),
					Input: &pb.RouteRequest_Prompt{Prompt: prompt + strconv.FormatInt(i, 10)}})
				if err != nil {
					failed.Add(1)
				}
				if i%97 == 0 {
					held, _ := r.app.core.Unreleased().Len()
					if int64(held) > maxSeen.Load() {
						maxSeen.Store(int64(held))
					}
				}
			}
		}()
	}
	wg.Wait()
	held, blocks := r.app.core.Unreleased().Len()
	grown := int64(memAfterGC().HeapAlloc) - int64(before)
	metrics := scrapeURL(t, r.http.URL())
	t.Logf("%d Routes without Release: %d held (%d blocks), at most %d seen; heap grew %d KB", n, held, blocks, maxSeen.Load(), grown>>10)
	if failed.Load() != 0 {
		t.Fatalf("%d Route calls failed", failed.Load())
	}
	if held != maxHeld || maxSeen.Load() > maxHeld {
		t.Fatalf("held %d (at most %d seen), cap %d", held, maxSeen.Load(), maxHeld)
	}
	want := fmt.Sprintf(`semroute_grpc_unreleased_expired_total{reason="cap"} %d`, n-maxHeld)
	if !strings.Contains(metrics, want) {
		t.Fatalf("metrics lack %s", want)
	}
	for _, rep := range r.app.pool.Replicas() {
		if l := rep.Load(time.Now()); l.InFlight > maxHeld {
			t.Fatalf("replica %s counts %d in flight with %d held", rep.Name, l.InFlight, maxHeld)
		}
	}
	// 1,000 held decisions of ~9 blocks are well under 8 MB; without the
	// cap, 20,000 grew the heap by about 26 MB.
	if grown > 8<<20 {
		t.Fatalf("heap grew %d MB", grown>>20)
	}
}

// Item 5: a replica whose budget is neither configured nor reported still
// has a bounded picture, and the admin API takes the config's field names.
func TestUnknownBudgetIsBounded(t *testing.T) {
	sims := startSims(t, 2, fastSim)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	// Scraping off: the replicas never report vllm:cache_config_info.
	writeConfig(t, cfg, fmt.Sprintf(`cache: {default_budget_tokens: 0}
health: {scrape_interval: 0s}
admin: {listen: 127.0.0.1:0, token: adm}
replicas:
  - {name: a, url: %q}
`, sims[0].URL))
	r := serveConfig(t, cfg)
	for i := range 48 { // 48 × 8,000 tokens of unique prompts: more than the assumed budget
		if code, _, err := postURL(r.http.URL(), chat([2]string{"user", text(fmt.Sprint("unique ", i), 8000)}), nil); err != nil || code != 200 {
			t.Fatalf("request %d: %d %v", i, code, err)
		}
	}
	rep, _ := r.app.pool.Get("a")
	st, _ := r.app.pic.Stats(rep.ID)
	t.Logf("picture of a: %d tokens in %d blocks, budget %d", st.Tokens, st.Blocks, st.Budget)
	if st.Budget != configs.DefaultBudgetTokens || st.Tokens > st.Budget || st.Evictions == 0 {
		t.Fatalf("unbounded picture: %+v", st)
	}
	req, _ := http.NewRequest(http.MethodPost, r.admin.URL()+"/admin/replicas",
		strings.NewReader(fmt.Sprintf(`{"name":"b","url":%q,"budget_tokens":5000}`, sims[1].URL)))
	req.Header.Set("Authorization", "Bearer adm")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	b, ok := r.app.pool.Get("b")
	if resp.StatusCode != 200 || !ok {
		t.Fatalf("add with budget_tokens: %d %s", resp.StatusCode, body)
	}
	if st, _ := r.app.pic.Stats(b.ID); st.Budget != 5000 {
		t.Fatalf("budget_tokens not applied: %+v", st)
	}
}

// Item 6: keys are read as vLLM reads them, repeated keys are refused, and
// only POST reaches the routed paths.
func TestRouterReadsTheBodyAsTheEngine(t *testing.T) {
	// A replica that records every request that reaches it.
	var mu sync.Mutex
	var reached []string
	rec := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" || r.URL.Path == "/metrics" {
			return
		}
		mu.Lock()
		reached = append(reached, r.Method+" "+r.URL.RawPath+r.URL.Path)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`)
	}))
	defer rec.Close()
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	// Estimated tokens: the valid request is not also sent to /tokenize.
	writeConfig(t, cfg, fmt.Sprintf("limits: {max_output_tokens: 4096}\ntokenizer: {mode: estimate}\nhealth: {scrape_interval: 0s}\nreplicas:\n  - {name: a, url: %q}\n", rec.URL))
	r := serveConfig(t, cfg)
	msgs := `[{"role":"user","content":"hi"}]`
	cases := []struct{ name, body, want string }{
		// vLLM reads max_tokens 99,999,999: over the limit.
		{"upper-case decoy max_tokens", `{"model":"sim-model","max_tokens":99999999,"MAX_TOKENS":5,"messages":` + msgs + `}`, "max_tokens"},
		// vLLM reads no messages at all.
		{"upper-case MESSAGES only", `{"model":"sim-model","MESSAGES":` + msgs + `}`, "messages"},
		{"upper-case MODEL only", `{"MODEL":"sim-model","messages":` + msgs + `}`, "model"},
		// The last of duplicates is under the limit: only refusing the
		// repeat keeps the router from reading another value than some engine.
		{"repeated max_tokens", `{"model":"sim-model","max_tokens":99999999,"max_tokens":5,"messages":` + msgs + `}`, "max_tokens"},
		{"repeated messages", `{"model":"sim-model","messages":[{"role":"user","content":"decoy"}],"messages":` + msgs + `}`, "messages"},
		{"repeated model", `{"model":"other","model":"sim-model","messages":` + msgs + `}`, "model"},
		{"repeated role", `{"model":"sim-model","messages":[{"role":"user","role":"system","content":"x"}]}`, "role"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, body, _ := rawPost(t, r.http.URL(), "/v1/chat/completions", []byte(tc.body))
			if code != http.StatusBadRequest || !bytes.Contains(body, []byte(tc.want)) {
				t.Fatalf("%d %s", code, body)
			}
		})
	}
	// A key the router does not read may repeat, as the engine allows.
	if code, body, _ := rawPost(t, r.http.URL(), "/v1/chat/completions",
		[]byte(`{"model":"sim-model","temperature":1,"temperature":0,"max_tokens":2,"messages":`+msgs+`}`)); code != 200 {
		t.Fatalf("repeated unread key: %d %s", code, body)
	}
	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		for _, method := range []string{http.MethodGet, http.MethodPut, http.MethodPatch, http.MethodDelete} {
			req, _ := http.NewRequest(method, r.http.URL()+path, strings.NewReader(`{"model":"sim-model","prompt":"x"}`))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != "POST" {
				t.Fatalf("%s %s: %d, Allow %q", method, path, resp.StatusCode, resp.Header.Get("Allow"))
			}
		}
	}
	// Paths under the routed ones, or that a server decoding before it
	// routes reads as them, do not slip through the pass-through route.
	for _, p := range []string{"/v1/chat/completions/", "/v1/completions/x", "/v1/chat%2Fcompletions", "/v1/chat%2fcompletions",
		"/v1/chat%5Ccompletions", "/v1/chat/completions%2F", "/v1/chat/completions;x", "/v1/completions%00"} {
		conn, err := net.Dial("tcp", r.http.Addr)
		if err != nil {
			t.Fatal(err)
		}
		b := `{"model":"sim-model","messages":"not validated","max_tokens":999999999999}`
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", p, len(b), b)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		conn.Close()
		if resp.StatusCode != http.StatusNotFound && resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("POST %s: %d", p, resp.StatusCode)
		}
	}
	// Dot segments sent encoded are refused, not passed on raw.
	for _, p := range []string{"/v1/%2e%2e/metrics", "/v1/models/%2E%2E/%2e%2e/health", "/v1/%2e/models"} {
		conn, err := net.Dial("tcp", r.http.Addr)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", p)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		conn.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("%s: %d", p, resp.StatusCode)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(reached) != 1 || reached[0] != "POST /v1/chat/completions" {
		t.Fatalf("requests reached the replica: %q, want only the valid POST", reached)
	}
}

// Item 7: every key either takes effect on reload or is reported as needing
// a restart; the admin token and the limits rotate live.
func TestReloadAppliesOrReportsEveryKey(t *testing.T) {
	sims := startSims(t, 1, fastSim)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	conf := func(token string, maxBody int, idle string) string {
		return fmt.Sprintf("admin: {listen: 127.0.0.1:0, token: %s}\nlimits: {max_body_bytes: %d}\ntimeouts: {idle: %s}\nreplicas:\n  - {name: a, url: %q}\n",
			token, maxBody, idle, sims[0].URL)
	}
	writeConfig(t, cfg, conf("old", 1<<20, "60s"))
	r := serveConfig(t, cfg)
	admin := func(token string) (int, string) {
		return adminCall(t, r.admin.URL(), token, http.MethodGet, "/admin/config", "")
	}
	big := []byte(`{"model":"sim-model","max_tokens":2,"messages":[{"role":"user","content":"` + strings.Repeat("x", 8000) + `"}]}`)
	if code, _, _ := rawPost(t, r.http.URL(), "/v1/chat/completions", big); code != 200 {
		t.Fatalf("8 KB body under a 1 MiB limit: %d", code)
	}
	// Live keys only: the reload is ok and they apply at once.
	writeConfig(t, cfg, conf("new", 4096, "60s"))
	testwait.Until(t, "the new admin token works", func() bool { code, _ := admin("new"); return code == 200 })
	if code, _ := admin("old"); code != 401 {
		t.Fatalf("the old admin token still works: %d", code)
	}
	if code, _, _ := rawPost(t, r.http.URL(), "/v1/chat/completions", big); code != http.StatusRequestEntityTooLarge {
		t.Fatalf("8 KB body after lowering the limit to 4 KB: %d", code)
	}
	if !strings.Contains(scrapeURL(t, r.http.URL()), `semroute_config_reloads_total{result="ok"} 1`) {
		t.Fatal("the live reload was not counted ok")
	}
	// A key that needs a restart is reported, not silently ignored.
	writeConfig(t, cfg, conf("new", 4096, "5s"))
	testwait.Until(t, "restart_required counted", func() bool {
		return strings.Contains(scrapeURL(t, r.http.URL()), `semroute_config_reloads_total{result="restart_required"} 1`)
	})
	_, body := admin("new")
	if !strings.Contains(body, `"pending_restart": [`) || !strings.Contains(body, `"timeouts.idle"`) || strings.Contains(body, `"new"`) {
		t.Fatalf("/admin/config: %s", body)
	}
}

// Item 8: a pass-through route is cut off when its replica goes silent
// after its headers, as a routed one is.
func TestPassthroughSilentReplicaIsCutOff(t *testing.T) {
	release := make(chan struct{})
	silent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(200)
		_, _ = io.WriteString(w, `{"data":[`)
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(release); silent.Close() })
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("timeouts: {idle: 300ms}\nhealth: {check_interval: 1h, scrape_interval: 0s}\nreplicas:\n  - {name: s, url: %q}\n", silent.URL))
	r := serveConfig(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.http.URL()+"/v1/embeddings", strings.NewReader(`{"model":"m","input":"x"}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, err = io.ReadAll(resp.Body)
	resp.Body.Close()
	if ctx.Err() != nil {
		t.Fatal("the pass-through request hung until the client gave up")
	}
	if err == nil {
		t.Fatal("the cut-off response read as complete")
	}
	rep, _ := r.app.pool.Get("s")
	if l := rep.Load(time.Now()); l.InFlight != 0 {
		t.Fatalf("the request still counts on the replica: %+v", l)
	}
}

// Item 9: a body declared larger than the limit is refused from its header,
// before a byte of it is read, and Expect: 100-continue gets no 100.
func TestOverLimitBodyRefusedFromHeader(t *testing.T) {
	r := routerOverSim(t, "limits: {max_body_bytes: 65536}\n")
	for _, path := range []string{"/v1/chat/completions", "/v1/embeddings"} {
		for _, expect := range []string{"", "Expect: 100-continue\r\n"} {
			conn, err := net.Dial("tcp", r.http.Addr)
			if err != nil {
				t.Fatal(err)
			}
			_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
			// The headers only: a slow client that has not sent its body yet.
			fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 104857600\r\n%s\r\n", path, expect)
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			conn.Close()
			if err != nil {
				t.Fatalf("%s %q: no answer before the body: %v", path, expect, err)
			}
			if resp.StatusCode != http.StatusRequestEntityTooLarge {
				t.Fatalf("%s %q: %d, want 413 at once", path, expect, resp.StatusCode)
			}
		}
	}
}

// The smaller items: undrain, admin-added replicas across reloads, and the
// admin API validating as the config does.
func TestAdminAPIValidatesAndPersists(t *testing.T) {
	sims := startSims(t, 3, fastSim)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	file := func(extra string) string {
		return fmt.Sprintf("admin: {listen: 127.0.0.1:0, token: adm}\nrouting: {policy: round_robin}\nreplicas:\n  - {name: a, url: %q}\n%s", sims[0].URL, extra)
	}
	writeConfig(t, cfg, file(""))
	r := serveConfig(t, cfg)
	call := func(method, path, body string) (int, string) {
		return adminCall(t, r.admin.URL(), "adm", method, path, body)
	}
	for name, body := range map[string]string{
		"tiny weight":   fmt.Sprintf(`{"name":"x","url":%q,"weight":1e-308}`, sims[1].URL),
		"60 KB name":    fmt.Sprintf(`{"name":%q,"url":%q}`, strings.Repeat("n", 60<<10), sims[1].URL),
		"trailing JSON": fmt.Sprintf(`{"name":"x","url":%q} {"name":"y"}`, sims[1].URL),
		"Go field name": fmt.Sprintf(`{"name":"x","url":%q,"BudgetTokens":5}`, sims[1].URL),
		"control char":  fmt.Sprintf(`{"name":"x\ny","url":%q}`, sims[1].URL),
	} {
		if code, resp := call("POST", "/admin/replicas", body); code != 400 {
			t.Fatalf("%s: %d %s", name, code, resp)
		}
	}
	if _, ok := r.app.pool.Get("x"); ok {
		t.Fatal("a refused replica joined")
	}
	code, resp := call("POST", "/admin/replicas", fmt.Sprintf(`{"name":"b","url":%q,"budget_tokens":100000,"weight":2}`, sims[1].URL))
	if code != 200 || !strings.Contains(resp, "restart") {
		t.Fatalf("add b: %d %s", code, resp)
	}
	// Drain and undrain.
	if code, _ := call("POST", "/admin/replicas/b/drain", ""); code != 200 {
		t.Fatal("drain")
	}
	b, _ := r.app.pool.Get("b")
	if b.Available(time.Now()) {
		t.Fatal("b takes traffic while draining")
	}
	if code, _ := call("POST", "/admin/replicas/b/undrain", ""); code != 200 || !b.Available(time.Now()) {
		t.Fatal("undrain did not bring b back")
	}
	// A reload of the file keeps b (added through the API) and adds c.
	writeConfig(t, cfg, file(fmt.Sprintf("  - {name: c, url: %q}\n", sims[2].URL)))
	testwait.Until(t, "the reload to add c", func() bool { _, ok := r.app.pool.Get("c"); return ok })
	if got, ok := r.app.pool.Get("b"); !ok || got != b {
		t.Fatal("the reload dropped the replica added through the admin API")
	}
	if _, body := call("GET", "/admin/replicas", ""); !strings.Contains(body, `"source": "admin"`) {
		t.Fatalf("list does not say where b came from: %s", body)
	}
}

// A body of many small values (16 MiB of "1,") would build a parse tree of
// about 4 GB: the values of a body are bounded, refused from a linear scan.
// (The budget shared by large bodies parsed at once is tested in blockhash:
// a parse is released before the response, so sockets cannot hold one.)
func TestJSONValuesAreBounded(t *testing.T) {
	r := routerOverSim(t, "limits: {max_json_values: 8000, max_messages: 16384}\n")
	ids := func(n int) []byte {
		return []byte(`{"model":"sim-model","max_tokens":1,"prompt":[` + strings.Repeat("1,", n-1) + `1]}`)
	}
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	code, body, _ := rawPost(t, r.http.URL(), "/v1/completions", ids(8<<20-1000))
	runtime.ReadMemStats(&m1)
	if grew := m1.TotalAlloc - m0.TotalAlloc; grew > 256<<20 { // the body itself is 16 MiB
		t.Fatalf("refusing 8 Mi values allocated %d MB", grew>>20)
	}
	if code != http.StatusBadRequest || !bytes.Contains(body, []byte("more values than the limit of 8000")) {
		t.Fatalf("16 MiB of values: %d %s", code, body)
	}
	// Under the limit, a long token-id prompt is routed (it is one prompt,
	// not 6,000 against limits.max_messages).
	if code, body, _ := rawPost(t, r.http.URL(), "/v1/completions", ids(6000)); code != 200 {
		t.Fatalf("6,000 token ids: %d %s", code, body)
	}
}

// A client that declares a large body and sends it slowly holds only what
// it sent: the router does not allocate the declared length up front.
func TestDeclaredLengthDoesNotAllocate(t *testing.T) {
	r := routerOverSim(t, "")
	before := memAfterGC().HeapAlloc
	const conns = 50
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := range conns {
		c, err := net.Dial("tcp", r.http.Addr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
		path := "/v1/chat/completions"
		if i%2 == 1 {
			path = "/v1/embeddings"
		}
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{", path, 16<<20-1)
	}
	// Every handler is reading its body once each holds its first buffer
	// (router.bodyPrealloc, 64 KiB).
	testwait.Value(t, fmt.Sprint("a first buffer held for each of ", conns, " connections"), func() (int64, bool) {
		held := r.app.server.BodyBytesInFlight()
		return held, held >= conns*64<<10
	})
	grown := int64(memAfterGC().HeapAlloc) - int64(before)
	t.Logf("%d connections declaring 16 MiB each: heap +%d MB", conns, grown>>20)
	if grown > 32<<20 { // declared-length buffers would be 800 MB
		t.Fatalf("heap grew %d MB for %d bytes sent", grown>>20, conns)
	}
}

// A gRPC caller without the token costs no message decoding (the token is
// checked from the call's headers), and one with it cannot make the router
// build a message list past limits.max_messages.
func TestGRPCLargeMessagesCostNothingUnauthenticated(t *testing.T) {
	r := routerOverSim(t, "grpc_listen: 127.0.0.1:0\ngrpc: {token: tok}\n")
	// 1 Mi almost empty messages in a 5 MiB request: decoded, hundreds of
	// MB (3 Mi took 16 s of CI's time to build and send under -race).
	many := &pb.RouteRequest{Model: "sim-model", Input: &pb.RouteRequest_Messages{Messages: &pb.ChatMessages{
		Messages: make([]*pb.ChatMessage, 1<<20)}}}
	for i := range many.GetMessages().Messages {
		many.GetMessages().Messages[i] = &pb.ChatMessage{Role: "u"}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	anon := pb.NewRouterClient(grpcClient(t, r.grpcAddr(), ""))
	before := memAfterGC().TotalAlloc
	if _, err := anon.Route(ctx, many); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("without a token: %v", err)
	}
	// The client marshalled the message (about 5 MB here); the router
	// must not have decoded it (1 Mi ChatMessages: over 100 MB).
	if grew := memAfterGC().TotalAlloc - before; grew > 48<<20 {
		t.Fatalf("an unauthenticated call allocated %d MB", grew>>20)
	}
	// With the token, a message count past the limit is refused (one past
	// it is enough: decoding 3 Mi of them under -race took 25 s).
	many.GetMessages().Messages = many.GetMessages().Messages[:4097]
	authed := pb.NewRouterClient(grpcClient(t, r.grpcAddr(), "tok"))
	_, err := authed.Route(ctx, many)
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "limit of 4096") {
		t.Fatalf("4,097 messages with the token: %.300v", err)
	}
}

// A Release with negative counts is refused; it must not reach a metric
// counter, which would panic and take the process down.
func TestGRPCReleaseRefusesNegativeCounts(t *testing.T) {
	r := routerOverSim(t, "grpc_listen: 127.0.0.1:0\ngrpc: {token: tok}\n")
	c := pb.NewRouterClient(grpcClient(t, r.grpcAddr(), "tok"))
	ctx := context.Background()
	rt, err := c.Route(ctx, &pb.RouteRequest{Model: "sim-model", Input: &pb.RouteRequest_Prompt{Prompt: "hello"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range []*pb.ReleaseRequest{
		{DecisionId: rt.DecisionId, Status: 200, PromptTokens: 3, CachedTokens: -1},
		{DecisionId: rt.DecisionId, Status: 200, PromptTokens: -3},
		{DecisionId: rt.DecisionId, Status: 200, PromptTokens: 3, CachedTokens: 4},
		{DecisionId: rt.DecisionId, Status: 200, TtftMs: -1},
	} {
		if _, err := c.Release(ctx, in); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("%v: %v", in, err)
		}
	}
	if _, err := c.Release(ctx, &pb.ReleaseRequest{DecisionId: rt.DecisionId, Status: 200, PromptTokens: 3, CachedTokens: 1}); err != nil {
		t.Fatalf("a valid release after the refused ones: %v", err)
	}
}
