package simreplica

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
)

var fast = Options{Overhead: time.Microsecond, PrefillPerToken: time.Nanosecond, InterToken: time.Microsecond, OutputTokens: 3, Tokenizer: TokenizerBytes}

func start(t *testing.T, o Options) *Running {
	t.Helper()
	r, err := Start(o, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

type usage struct {
	Prompt  int `json:"prompt_tokens"`
	Output  int `json:"completion_tokens"`
	Details struct {
		Cached int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func call(t *testing.T, r *Running, path, body string) (int, usage, []byte) {
	t.Helper()
	resp, err := http.Post(r.URL+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		Usage usage `json:"usage"`
	}
	_ = json.Unmarshal(b, &out)
	return resp.StatusCode, out.Usage, b
}

func chatBody(system, user string) string {
	b, _ := json.Marshal(map[string]any{"model": "sim-model", "messages": []map[string]string{
		{"role": "system", "content": system}, {"role": "user", "content": user}}})
	return string(b)
}

func TestPrefixCacheReportsCachedTokens(t *testing.T) {
	r := start(t, fast)
	sys := strings.Repeat("a", 4000) // 1,000 tokens
	code, u1, body := call(t, r, "/v1/chat/completions", chatBody(sys, "one"))
	if code != 200 || u1.Details.Cached != 0 || u1.Output != 3 {
		t.Fatalf("first: %d %+v %s", code, u1, body)
	}
	_, u2, _ := call(t, r, "/v1/chat/completions", chatBody(sys, "two"))
	// The rendered prompt is "<|s|>" + 4,000 bytes + "<|u|>two": the first
	// 4,005 bytes are shared, 62 full 64-byte blocks = 992 tokens.
	if u2.Details.Cached != 992 || u2.Prompt != u1.Prompt {
		t.Fatalf("second: %+v (first %+v)", u2, u1)
	}
	// The same prompt again: all full blocks cached, but never the last token.
	_, u3, _ := call(t, r, "/v1/chat/completions", chatBody(sys, "two"))
	if u3.Details.Cached != (u3.Prompt-1)/16*16 {
		t.Fatalf("repeat: %+v", u3)
	}
	if s := r.Stats(); s.Completed != 3 || s.CachedTokens != int64(u2.Details.Cached+u3.Details.Cached) {
		t.Fatalf("stats %+v", s)
	}
}

func TestLRUEvictionUnderBudget(t *testing.T) {
	o := fast
	o.NumBlocks = 80 // 1,280 tokens: room for one 1,000-token prompt
	r := start(t, o)
	a, b := strings.Repeat("a", 4000), strings.Repeat("b", 4000)
	call(t, r, "/v1/chat/completions", chatBody(a, "x"))
	call(t, r, "/v1/chat/completions", chatBody(b, "x"))
	// b's 62 blocks evicted 44 of a's 62, tail first: a's first 18 blocks
	// (288 tokens) are left.
	if _, u, _ := call(t, r, "/v1/chat/completions", chatBody(a, "y")); u.Details.Cached != 18*16 {
		t.Fatalf("a after b: %+v, want its first 288 tokens cached", u)
	}
	r.DropCache()
	if _, u, _ := call(t, r, "/v1/chat/completions", chatBody(a, "z")); u.Details.Cached != 0 {
		t.Fatalf("cached after DropCache: %+v", u)
	}
}

func TestErrors(t *testing.T) {
	r := start(t, fast)
	cases := []struct {
		body   string
		status int
	}{
		{`{"model":"other","prompt":"x"}`, 404},
		{`{"model":"sim-model","prompt":"x","max_tokens":100000}`, 400},
		{`{"model":"sim-model"}`, 400},
		{`nope`, 400},
	}
	for _, tc := range cases {
		if code, _, body := call(t, r, "/v1/completions", tc.body); code != tc.status || !bytes.Contains(body, []byte(`"error"`)) {
			t.Errorf("%s: %d %s", tc.body, code, body)
		}
	}
}

// TestRequestBodies: a body is read the same with or without a
// Content-Length, however the requests before it left the reused buffers,
// and one over MaxBodyBytes is refused either way.
func TestRequestBodies(t *testing.T) {
	o := fast
	o.MaxBodyBytes = 10 << 10
	r := start(t, o)
	post := func(body string, withLength bool) (int, usage) {
		t.Helper()
		var rd io.Reader = strings.NewReader(body)
		if !withLength {
			rd = io.MultiReader(rd) // hides the length: the body goes chunked
		}
		resp, err := http.Post(r.URL+"/v1/chat/completions", "application/json", rd)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out struct {
			Usage usage `json:"usage"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&out)
		return resp.StatusCode, out.Usage
	}
	long, short := chatBody(strings.Repeat("L", 8000), "q"), chatBody("s", "q")
	_, first := post(long, true)
	for i, tc := range []struct {
		body       string
		withLength bool
		prompt     int
	}{
		{short, true, 0}, {long, false, first.Prompt}, {short, false, 0}, {long, true, first.Prompt},
	} {
		code, u := post(tc.body, tc.withLength)
		if code != 200 || (tc.prompt > 0 && (u.Prompt != tc.prompt || u.Details.Cached != (u.Prompt-1)/16*16)) {
			t.Fatalf("request %d (length sent: %v): %d %+v, want prompt %d with every full block cached", i, tc.withLength, code, u, tc.prompt)
		}
	}
	huge := chatBody(strings.Repeat("h", 11<<10), "q")
	for _, withLength := range []bool{true, false} {
		if code, _ := post(huge, withLength); code != http.StatusRequestEntityTooLarge {
			t.Fatalf("a body over MaxBodyBytes (length sent: %v): status %d, want 413", withLength, code)
		}
	}
}

func TestStreamFormat(t *testing.T) {
	r := start(t, fast)
	resp, err := http.Post(r.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"sim-model","prompt":"hello","stream":true,"max_tokens":2,"stream_options":{"include_usage":true}}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	var events []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			events = append(events, d)
		}
	}
	if len(events) != 4 || events[3] != "[DONE]" || !strings.Contains(events[2], `"cached_tokens"`) ||
		!strings.Contains(events[0], `"text_completion"`) || !strings.Contains(events[1], `"finish_reason":"length"`) {
		t.Fatalf("events %q", events)
	}
}

func TestWaitingQueueAndCancel(t *testing.T) {
	o := fast
	o.MaxRunning = 1
	o.InterToken = 50 * time.Millisecond
	r := start(t, o)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.URL+"/v1/completions",
				strings.NewReader(`{"model":"sim-model","prompt":"p","max_tokens":200}`))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	metric := func(name string) string {
		resp, err := http.Get(r.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), name+"{") {
				return sc.Text()[strings.LastIndex(sc.Text(), " ")+1:]
			}
		}
		return ""
	}
	testwait.Value(t, "one request running and one waiting", func() (string, bool) {
		running, waiting := metric("vllm:num_requests_running"), metric("vllm:num_requests_waiting")
		return "running " + running + " waiting " + waiting, running == "1" && waiting == "1"
	})
	cancel()
	wg.Wait()
	testwait.Value(t, "both requests cancelled", func() (Stats, bool) { st := r.Stats(); return st, st.Cancelled == 2 })
}

func TestMetricsAndModels(t *testing.T) {
	r := start(t, fast)
	call(t, r, "/v1/completions", `{"model":"sim-model","prompt":"hello there"}`)
	resp, err := http.Get(r.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, name := range []string{
		"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
		"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
		`vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="16384"} 1`, `vllm:num_requests_running{engine="0",model_name="sim-model"}`,
	} {
		if !bytes.Contains(b, []byte(name)) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	resp, err = http.Get(r.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if !bytes.Contains(b, []byte(`"id":"sim-model"`)) {
		t.Errorf("models: %s", b)
	}
	if resp, err := http.Get(r.URL + "/health"); err != nil || resp.StatusCode != 200 {
		t.Errorf("health: %v", err)
	}
}

// TestKVUsageCountsRunningRequestsOnly: vllm:kv_cache_usage_perc counts the
// blocks running requests hold, as vLLM does; a full prefix cache with
// nothing running is free (evictable) memory, not usage.
func TestKVUsageCountsRunningRequestsOnly(t *testing.T) {
	o := fast
	o.NumBlocks = 64 // 1,024 tokens
	o.InterToken = 20 * time.Millisecond
	r := start(t, o)
	usage := func() string {
		resp, err := http.Get(r.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "vllm:kv_cache_usage_perc") {
				return l[strings.LastIndexByte(l, ' ')+1:]
			}
		}
		t.Fatal("no vllm:kv_cache_usage_perc")
		return ""
	}
	for i := range 8 { // 8 × ~250 tokens: more than the cache holds
		call(t, r, "/v1/completions", fmt.Sprintf(`{"model":"sim-model","max_tokens":1,"prompt":%q}`, strings.Repeat(fmt.Sprint(i, " distinct words "), 60)))
	}
	if u := usage(); u != "0" {
		t.Fatalf("idle replica with a full prefix cache reports usage %s", u)
	}
	done := make(chan struct{})
	go func() { // 256 prompt tokens + 16 output tokens: 17 of 64 blocks while it runs
		defer close(done)
		call(t, r, "/v1/completions", fmt.Sprintf(`{"model":"sim-model","max_tokens":16,"prompt":%q}`, strings.Repeat("x", 1024)))
	}()
	// The prompt renders to 257 tokens: with 16 output tokens, 18 blocks of 64.
	testwait.Until(t, "usage 18/64 = 0.28125 while the request runs", func() bool {
		if u := usage(); u == "0.28125" {
			return true
		}
		select {
		case <-done:
			t.Fatal("the request ended and its usage was never seen at 18/64 = 0.28125")
		default:
		}
		return false
	})
	<-done
	if u := usage(); u != "0" {
		t.Fatalf("usage after the request: %s", u)
	}
}

// Prefills take turns: two prompts sent together are computed one after
// the other, the second waits (vllm:num_requests_waiting) while the first
// computes, and when its turn comes it finds the first one's blocks cached,
// as a vLLM scheduler's second request does.
func TestPrefillsTakeTurns(t *testing.T) {
	o := fast
	o.PrefillPerToken = 200 * time.Microsecond // 1,000 tokens: 200 ms
	r := start(t, o)
	sys := strings.Repeat("a", 4000)
	// post sends body from another goroutine; its usage comes back on the
	// channel (a failure as a status other than 200, never t.Fatal there).
	post := func(body string) chan usage {
		c := make(chan usage, 1)
		go func() {
			var u usage
			resp, err := http.Post(r.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err == nil {
				var out struct {
					Usage usage `json:"usage"`
				}
				_ = json.NewDecoder(resp.Body).Decode(&out)
				resp.Body.Close()
				if resp.StatusCode == 200 {
					u = out.Usage
				}
			}
			c <- u
		}()
		return c
	}
	first := post(chatBody(sys, "one"))
	testwait.Until(t, "the first request", func() bool { return r.Stats().Requests == 1 })
	second := post(chatBody(sys, "two"))
	testwait.Value(t, "the second request waiting behind the first's prefill", func() (map[string]string, bool) {
		m := metricValues(t, r)
		return m, m["vllm:num_requests_waiting"] == "1" && m["vllm:num_requests_running"] == "1"
	})
	if u := <-first; u.Prompt == 0 || u.Details.Cached != 0 {
		t.Fatalf("first: %+v", u)
	}
	if u := <-second; u.Details.Cached != 992 {
		t.Fatalf("second, queued behind the first: %+v, want its 992 shared tokens cached", u)
	}
}

// metricValues reads the replica's /metrics: name → value of its first
// labelled sample.
func metricValues(t *testing.T, r *Running) map[string]string {
	t.Helper()
	resp, err := http.Get(r.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if i := strings.IndexByte(line, '{'); i > 0 && !strings.HasPrefix(line, "#") {
			if _, ok := out[line[:i]]; !ok {
				out[line[:i]] = line[strings.LastIndex(line, " ")+1:]
			}
		}
	}
	return out
}

// Adapters load and unload while serving, with vLLM's answers.
func TestRuntimeLoRA(t *testing.T) {
	o := fast
	o.EnableLoRA = true
	r := start(t, o)
	post := func(path, body string) int {
		resp, err := http.Post(r.URL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	chat := `{"model":"sql","messages":[{"role":"user","content":"q"}]}`
	if code := post("/v1/chat/completions", chat); code != 404 {
		t.Fatalf("before loading: %d", code)
	}
	if code := post("/v1/load_lora_adapter", `{"lora_name":"sql","lora_path":"/a"}`); code != 200 {
		t.Fatalf("load: %d", code)
	}
	if code := post("/v1/load_lora_adapter", `{"lora_name":"sql","lora_path":"/a"}`); code != 400 {
		t.Fatalf("load twice: %d", code)
	}
	if code := post("/v1/chat/completions", chat); code != 200 {
		t.Fatalf("after loading: %d", code)
	}
	if code := post("/v1/unload_lora_adapter", `{"lora_name":"sql"}`); code != 200 {
		t.Fatalf("unload: %d", code)
	}
	if code := post("/v1/unload_lora_adapter", `{"lora_name":"sim-model"}`); code != 404 {
		t.Fatalf("unload the base model: %d", code)
	}
	if code := post("/v1/chat/completions", chat); code != 404 {
		t.Fatalf("after unloading: %d", code)
	}
}

// A running request's blocks are not evicted, as in vLLM: while a request
// for prompt a still decodes, a second prompt b that does not fit beside
// it caches only its head, and a third request for a, still running,
// finds a whole. Once a's request ends, b's next request evicts it.
func TestRunningRequestsBlocksPinned(t *testing.T) {
	o := fast
	o.NumBlocks = 80 // 1,280 tokens: room for one 1,000-token prompt
	o.InterToken = 10 * time.Millisecond
	r := start(t, o)
	a, b := strings.Repeat("a", 4000), strings.Repeat("b", 4000)
	long := func(system string) string {
		body, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": 40, "messages": []map[string]string{
			{"role": "system", "content": system}, {"role": "user", "content": "x"}}})
		return string(body)
	}
	done := make(chan struct{})
	go func() { defer close(done); call(t, r, "/v1/chat/completions", long(a)) }() // runs 400 ms
	testwait.Until(t, "a's prefill stored", func() bool { return r.CachedBlocks() > 0 })
	call(t, r, "/v1/chat/completions", chatBody(b, "x"))
	if _, u, _ := call(t, r, "/v1/chat/completions", chatBody(a, "y")); u.Details.Cached != 62*16 {
		t.Fatalf("a while its first request runs: %+v, want all 62 full blocks (992 tokens) cached", u)
	}
	<-done
	call(t, r, "/v1/chat/completions", chatBody(b, "x"))
	call(t, r, "/v1/chat/completions", chatBody(b, "x"))
	if _, u, _ := call(t, r, "/v1/chat/completions", chatBody(a, "z")); u.Details.Cached == 62*16 {
		t.Fatalf("a after its requests ended and b was used twice: %+v, want part of it evicted", u)
	}
}

// A block is not left cached without its parent when requests sharing a
// prefix end: eviction passes over a running request's blocks by making
// them the most recently used, which can make a child newer than its
// parent; a request's blocks are freed tail first when it ends, as vLLM
// queues them, so the child goes first again. (Found by a helper's
// review.)
func TestNoOrphanAfterPinnedBlocksFreed(t *testing.T) {
	o := fast
	o.NumBlocks = 4
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	m := s.models["sim-model"]
	block := func(a, b int32) []int32 {
		out := make([]int32, 16)
		for i := range out {
			out[i] = a*1000 + b*16 + int32(i)
		}
		return out
	}
	ids := func(tags ...int32) ([]uint64, []int32) {
		var out []int32
		for _, g := range tags {
			out = append(out, block(g, 0)...)
		}
		return chain("sim-model", out), out
	}
	ka, ia := ids(1, 2)
	kb, ib := ids(1, 3)
	kc, ic := ids(4, 5)
	kd, id := ids(6)
	endA := s.store(ka, ia, m) // a0, a1 pinned while A runs
	s.store(kb, ib, m)()       // B shares a0 and ends
	s.store(kc, ic, m)()       // passes over pinned a1, making it the newest
	endA()
	s.store(kd, id, m)() // evicts one block
	if !s.cache.Contains(ka[0]) && s.cache.Contains(ka[1]) {
		t.Fatal("a1 cached without its parent a0: no lookup can reach it")
	}
}

// A prefill for a decode replica (kv_transfer_params.do_remote_decode)
// computes the prompt and answers one token with the parameters of its KV,
// as vLLM's NIXL connector does; a decode given them (do_remote_prefill)
// pulls the KV it lacks in the transfer time instead of computing it, and
// holds it after.
func TestDisaggregatedPrefillAndDecode(t *testing.T) {
	p, d := start(t, fast), start(t, Options{Overhead: time.Microsecond, PrefillPerToken: time.Second, InterToken: time.Microsecond,
		OutputTokens: 3, Tokenizer: TokenizerBytes, TransferLatency: time.Microsecond, TransferPerToken: time.Nanosecond})
	sys := strings.Repeat("b", 4000)
	var req map[string]any
	_ = json.Unmarshal([]byte(chatBody(sys, "q")), &req)
	req["kv_transfer_params"] = map[string]any{"do_remote_decode": true, "do_remote_prefill": false}
	req["max_tokens"], req["stream"] = 1, false
	b, _ := json.Marshal(req)
	code, u, body := call(t, p, "/v1/chat/completions", string(b))
	var ans struct {
		KV map[string]any `json:"kv_transfer_params"`
	}
	_ = json.Unmarshal(body, &ans)
	if code != 200 || u.Output != 1 || ans.KV["do_remote_prefill"] != true || ans.KV["remote_engine_id"] == "" || ans.KV["remote_block_ids"] == nil {
		t.Fatalf("prefill: %d %+v %s", code, u, body)
	}
	req["kv_transfer_params"], req["max_tokens"] = ans.KV, 5
	b, _ = json.Marshal(req)
	// Computed at a second a token, the prompt would take 1,000 s (the
	// test's timeout): it is pulled instead.
	code, u, body = call(t, d, "/v1/chat/completions", string(b))
	if code != 200 || u.Output != 5 {
		t.Fatalf("decode: %d %+v %s", code, u, body)
	}
	if ps, ds := p.Stats(), d.Stats(); ps.RemoteDecodes != 1 || ds.Transfers != 1 || d.CachedBlocks() == 0 {
		t.Fatalf("prefill %+v, decode %+v, decode cache %d blocks", ps, ds, d.CachedBlocks())
	}
}
