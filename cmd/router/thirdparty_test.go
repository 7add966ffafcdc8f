package main

import (
	"bytes"
	"cmp"
	"container/heap"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/internal/testwait"
)

// The interoperability suite runs the router against llm-d's vLLM
// simulator (llm-d-inference-sim), written outside this project: its path
// comes from SEMROUTE_THIRDPARTY_SIM, which .ci/run sets from
// the workplace's third-party tools when they exist. A lone clone skips these
// tests with a message; its unit tests still read the simulator's captured
// wire bytes (testdata/thirdparty).

// thirdPartyBin returns the simulator's path, or skips the test.
func thirdPartyBin(t testing.TB) string {
	t.Helper()
	bin := os.Getenv("SEMROUTE_THIRDPARTY_SIM")
	if bin == "" {
		t.Skip("SEMROUTE_THIRDPARTY_SIM is not set: the third-party engine's interoperability tests are skipped (.ci/run sets it when the third-party tools are beside the repository)")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("SEMROUTE_THIRDPARTY_SIM=%s: %v", bin, err)
	}
	return bin
}

// tpOptions shape the third-party replicas of a run.
type tpOptions struct {
	n          int
	mapFormat  bool     // --use-vllm-map-event-format
	events     bool     // publish KV events
	sharedPort bool     // every engine dials one router port (told apart by topic); else a port each
	args       []string // more flags
	blocks     int      // --kv-cache-size; default 768
	// argsFor, when set, gives replica i more flags after args (a fleet
	// whose replicas differ); blocksFor its --kv-cache-size.
	argsFor   func(i int) []string
	blocksFor func(i int) int
	// ranks, over 1, is the simulator's --data-parallel-size: its rank k
	// serves HTTP on port+k and offsets its events and replay ports by k,
	// so each of those ports is the first of ranks free ones.
	ranks int
	// deferred leaves the simulators unstarted, their ports chosen, for
	// launchThirdParty to start once the router listens: a simulator's
	// PUB dials the router's events address 10 times, 250 ms apart, as it
	// starts (go-zeromq's defaults), and under load a router started after
	// it may bind later than that.
	deferred bool
	// ownHosts gives replica i an address of its own, 127.0.0.<10+i>, as
	// pods have theirs: its URL and llm-d topic name it, and every
	// replica binds its replay socket on the same port of its own host.
	ownHosts bool
}

// host is replica i's address.
func (o *tpOptions) host(i int) string {
	if o.ownHosts {
		return fmt.Sprintf("127.0.0.%d", 10+i)
	}
	return "127.0.0.1"
}

// kvBlocks returns replica i's --kv-cache-size.
func (o *tpOptions) kvBlocks(i int) int {
	if o.blocksFor != nil {
		return o.blocksFor(i)
	}
	return cmp.Or(o.blocks, 768)
}

// tpReplica is one simulator process.
type tpReplica struct {
	url, listen, replay string
	proxied             string // a test's proxy in front of it, if any
	port                int
	ranks               int // its data-parallel ranks (tpOptions.ranks), on port+k
	cmd                 *exec.Cmd
	log                 *syncBuffer
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.b.Len() > 1<<20 {
		return len(p), nil
	}
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func freePort(t testing.TB) int {
	t.Helper()
	_, p, _ := net.SplitHostPort(freeAddr(t))
	n, _ := strconv.Atoi(p)
	return n
}

// tpModel is the model the simulators serve (the workloads' model).
const tpModel = "sim-model"

// startThirdParty starts o.n simulators sized like a small vLLM replica: 768
// blocks of 16 tokens, 4 sequences at once, prefill 20 ms + 2 ms a token,
// 10 ms a generated token. With events, each dials the router's listen
// address for its KV events and binds a replay socket.
func startThirdParty(t testing.TB, o tpOptions) []*tpReplica {
	t.Helper()
	bin := thirdPartyBin(t)
	shared := ""
	if o.sharedPort {
		shared = fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t))
	}
	replayPort := freePort(t) // with ownHosts, every host's
	var out []*tpReplica
	start := func(i int) *tpReplica {
		span := max(o.ranks, 1)
		r := &tpReplica{port: freePorts(t, span), ranks: span, log: &syncBuffer{}}
		r.url = fmt.Sprintf("http://%s:%d", o.host(i), r.port)
		args := []string{"--model", tpModel, "--force-dummy-tokenizer", "--port", fmt.Sprint(r.port),
			"--enable-kvcache", "--kv-cache-size", fmt.Sprint(o.kvBlocks(i)),
			"--block-size", "16", "--max-num-seqs", "4", "--max-model-len", "16384",
			"--latency-calculator", "per-token", "--prefill-overhead", "20ms", "--prefill-time-per-token", "2ms",
			"--inter-token-latency", "10ms", "--seed", fmt.Sprint(42 + i),
			"--skip-tool-validation"} // as vLLM, which passes tool schemas to the model verbatim
		if o.events {
			r.listen = shared
			if r.listen == "" {
				r.listen = fmt.Sprintf("tcp://127.0.0.1:%d", freePorts(t, span))
			}
			r.replay = fmt.Sprintf("tcp://127.0.0.1:%d", freePorts(t, span))
			if o.ownHosts {
				r.replay = fmt.Sprintf("tcp://%s:%d", o.host(i), replayPort)
			}
			args = append(args, "--zmq-endpoint", r.listen, "--kv-events-replay-endpoint", r.replay)
			if o.mapFormat {
				args = append(args, "--use-vllm-map-event-format")
			}
		} else {
			args = append(args, "--zmq-endpoint", "")
		}
		if o.ranks > 1 {
			args = append(args, "--data-parallel-size", fmt.Sprint(o.ranks))
		}
		args = append(args, o.args...)
		if o.argsFor != nil {
			args = append(args, o.argsFor(i)...)
		}
		r.cmd = exec.Command(bin, args...)
		r.cmd.Env = append(os.Environ(), "POD_IP="+o.host(i))
		r.cmd.Stdout, r.cmd.Stderr = r.log, r.log
		if !o.deferred {
			r.launch(t)
		}
		return r
	}
	for i := 0; i < o.n; i++ {
		out = append(out, start(i))
	}
	if o.deferred {
		return out
	}
	for i, r := range out {
		if !r.up(20 * time.Second) {
			// Once in a few CI runs a simulator neither listens nor logs:
			// its ports, taken free a moment before, may have gone to
			// another process meanwhile. It is started again on new ones.
			t.Logf("third-party replica %s did not come up; starting it again on new ports:\n%s", r.url, r.log.String())
			r.stop()
			out[i] = start(i)
			out[i].waitUp(t)
		}
	}
	return out
}

// launch starts the simulator.
func (r *tpReplica) launch(t testing.TB) {
	t.Helper()
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.stop)
}

// launchThirdParty starts the simulators of a deferred startThirdParty
// and waits until each answers.
func launchThirdParty(t testing.TB, reps []*tpReplica) {
	t.Helper()
	for _, r := range reps {
		r.launch(t)
	}
	for _, r := range reps {
		r.waitUp(t)
	}
}

func (r *tpReplica) stop() {
	if r.cmd.Process != nil {
		_ = r.cmd.Process.Kill()
		_ = r.cmd.Wait()
	}
}

func (r *tpReplica) waitUp(t testing.TB) {
	t.Helper()
	if !r.up(20 * time.Second) {
		t.Fatalf("third-party replica %s never came up:\n%s", r.url, r.log.String())
	}
}

// up reports whether the simulator answers /v1/models within wait (the
// caller decides what a simulator that does not means).
func (r *tpReplica) up(wait time.Duration) bool {
	return testwait.Within(wait, func() bool {
		for k := range max(r.ranks, 1) {
			resp, err := http.Get(fmt.Sprintf("%s:%d/v1/models", r.url[:strings.LastIndex(r.url, ":")], r.port+k))
			if err != nil {
				return false
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				return false
			}
		}
		return true
	})
}

// freePorts returns the first of n ports free on 127.0.0.1 one after the
// other.
func freePorts(t testing.TB, n int) int {
	t.Helper()
	for range 100 {
		p := freePort(t)
		free := true
		for q := p + 1; q < p+n && free; q++ {
			ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", q))
			if free = err == nil; free {
				ln.Close()
			}
		}
		if free {
			return p
		}
	}
	t.Fatalf("no %d free ports in a row", n)
	return 0
}

// restart kills the simulator and starts it again on the same ports: its
// cache is empty and its event sequence starts over.
func (r *tpReplica) restart(t *testing.T) {
	t.Helper()
	r.stop()
	cmd := exec.Command(r.cmd.Path, r.cmd.Args[1:]...)
	cmd.Env, cmd.Stdout, cmd.Stderr = r.cmd.Env, r.log, r.log
	r.cmd = cmd
	testwait.Value(t, "the simulator started again", func() (error, bool) {
		err := cmd.Start()
		return err, err == nil
	})
	r.waitUp(t)
}

// tpRouter is a router built from a YAML config, serving on a free port.
type tpRouter struct {
	app *app
	run *running
	url string
	log *syncBuffer
}

// startRouterYAML builds and starts a router from the YAML of a config
// whose listen address it sets itself.
func startRouterYAML(t testing.TB, yaml string) *tpRouter { return startRouterWith(t, yaml, nil) }

// startRouterWith is startRouterYAML with prepare, when set, called on the
// app before it starts.
func startRouterWith(t testing.TB, yaml string, prepare func(*app)) *tpRouter {
	t.Helper()
	cfg, err := configs.LoadBytes(configs.NewViper(), []byte("listen: 127.0.0.1:0\n"+yaml))
	if err != nil {
		t.Fatalf("config: %v\n%s", err, yaml)
	}
	lb := &syncBuffer{}
	a, err := build(cfg, newLogger(cfg.Log, lb))
	if err != nil {
		t.Fatal(err)
	}
	if prepare != nil {
		prepare(a)
	}
	r, err := a.start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.stop(time.Second) })
	return &tpRouter{app: a, run: r, url: r.http.URL(), log: lb}
}

// tpConfig is the YAML of a router in front of reps: the replicas' URLs,
// and their KV-event addresses when events is set, nothing else but the
// policy.
func tpConfig(reps []*tpReplica, events bool, policy string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "log:\n  level: warn\n")
	if policy != "" {
		fmt.Fprintf(&b, "routing:\n  policy: %s\n", policy)
	}
	b.WriteString("replicas:\n")
	for i, r := range reps {
		fmt.Fprintf(&b, "  - name: tp-%d\n    url: %s\n", i, r.url)
		if events && r.listen != "" {
			fmt.Fprintf(&b, "    kv_events:\n      listen: %s\n      replay_endpoint: %s\n", r.listen, r.replay)
		}
	}
	return b.String()
}

// waitBudgets waits until the router learned every replica's KV cache size
// from its metrics (vllm:cache_config_info).
// waitBudget waits until the router learned replica id's budget, tokens.
func waitBudget(t testing.TB, r *tpRouter, id int, tokens int64) {
	t.Helper()
	testwait.Value(t, fmt.Sprint("the router to learn replica ", id, "'s budget"), func() (int64, bool) {
		st, _ := r.app.pic.Stats(id)
		return st.Budget, st.Budget == tokens
	})
}

func waitBudgets(t testing.TB, r *tpRouter, n int, tokens int64) {
	t.Helper()
	testwait.Value(t, fmt.Sprint("the router to learn ", n, " replicas' budgets"), func() (int, bool) {
		ok := 0
		for id := range n {
			if st, found := r.app.pic.Stats(id); found && st.Budget == tokens {
				ok++
			}
		}
		return ok, ok == n
	})
}

// tpCeiling returns two references, on the engine's own tokens (from one
// replica's /tokenize), each block 16 tokens chained from the start of the
// prompt: the hit ratio of an infinite cache (every block seen in an
// earlier request is a hit), and that of one pooled LRU cache of the
// fleet's total size, pooledBlocks (the design's upper reference: what
// one cache of all the replicas' memory would hold, with no request
// running).
func tpCeiling(t testing.TB, url string, work [][]byte, pooledBlocks int) (infinite, pooled, opt float64) {
	t.Helper()
	var seq []uint64 // every full block of every prompt, in order
	seen := map[uint64]bool{}
	lruc, _ := lru.New[uint64, struct{}](pooledBlocks)
	var hit, pooledHit, all int
	for _, body := range work {
		var req struct {
			Model    string          `json:"model"`
			Messages json.RawMessage `json:"messages"`
		}
		_ = json.Unmarshal(body, &req)
		tb, _ := json.Marshal(map[string]any{"model": req.Model, "messages": req.Messages, "add_generation_prompt": true})
		resp, err := http.Post(url+"/tokenize", "application/json", bytes.NewReader(tb))
		if err != nil {
			t.Fatal(err)
		}
		var out struct{ Tokens []uint32 }
		_ = json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		all += len(out.Tokens)
		h := blockhash.TokenSeed("")
		for i := 0; i+16 <= len(out.Tokens); i += 16 {
			h = blockhash.TokenBlockHash(h, out.Tokens[i:i+16])
			if seen[h] {
				hit += 16
			}
			if _, ok := lruc.Get(h); ok {
				pooledHit += 16
			}
			seen[h] = true
			lruc.Add(h, struct{}{})
			seq = append(seq, h)
		}
	}
	d := float64(max(all, 1))
	return float64(hit) / d, float64(pooledHit) / d, float64(16*beladyHits(seq, pooledBlocks)) / d
}

// beladyHits is the hits of Belady's optimal eviction (evict the block
// used again farthest in the future) on one cache of size blocks over seq:
// no eviction policy, and no router splitting the same memory between
// replicas, hits more often on this sequence.
func beladyHits(seq []uint64, size int) int {
	next := make([]int, len(seq)) // next use of seq[i]; len(seq): never
	last := map[uint64]int{}
	for i := len(seq) - 1; i >= 0; i-- {
		next[i] = len(seq)
		if j, ok := last[seq[i]]; ok {
			next[i] = j
		}
		last[seq[i]] = i
	}
	held := map[uint64]int{} // block → its next use, as the heap has it
	var h farthest
	hits := 0
	for i, b := range seq {
		if _, ok := held[b]; ok {
			hits++
		} else if len(held) == size {
			for {
				top := heap.Pop(&h).(use)
				if n, ok := held[top.block]; ok && n == top.next {
					delete(held, top.block)
					break
				}
			}
		}
		held[b] = next[i]
		heap.Push(&h, use{b, next[i]})
	}
	return hits
}

// use is a held block and its next use; farthest is a max-heap of them
// (stale entries are skipped when popped).
type use struct {
	block uint64
	next  int
}
type farthest []use

func (h farthest) Len() int           { return len(h) }
func (h farthest) Less(i, j int) bool { return h[i].next > h[j].next }
func (h farthest) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *farthest) Push(x any)        { *h = append(*h, x.(use)) }
func (h *farthest) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// tpWork is the workload of the third-party runs: the mixed chat workload
// of the engine's-truth runs (assistants with long system prompts and
// tools, RAG over shared documents, multi-turn chats, agents), streamed.
func tpWork(n int) [][]byte { return truthWorkload(n, 29) }

// TestThirdPartyPreciseOutOfTheBox: in front of 4 third-party replicas,
// from a config that names only their URLs and KV-event addresses, the
// router's precise mode works as shipped in both event formats and both
// shapes of the one socket direction the simulator has (its PUB always
// dials: one router port shared by every engine, told apart by topic, or a
// port each): no stored block is an orphan, /tokenize never fails, and the
// predicted cached tokens are within 5% of what the engines report.
func TestThirdPartyPreciseOutOfTheBox(t *testing.T) {
	work := tpWork(160)
	for _, c := range []struct {
		name              string
		mapFormat, shared bool
	}{{"positional events, shared port", false, true}, {"map events, a port each", true, false}} {
		t.Run(c.name, func(t *testing.T) {
			reps := startThirdParty(t, tpOptions{n: 4, events: true, mapFormat: c.mapFormat, sharedPort: c.shared})
			r := startRouterYAML(t, tpConfig(reps, true, "")) // the defaults: tokenizer.mode auto
			waitBudgets(t, r, 4, 768*16)
			run := sendTruth(r.url, work, 8, nil)
			ev := r.app.events.stats()
			t.Logf("hit ratio %.3f, predicted ÷ reported %.3f, ttft p50 %.0f ms p99 %.0f ms, errors %d; events %+v",
				run.hitRatio(), float64(run.predicted)/float64(max(run.cached, 1)), 1e3*run.pct(0.5), 1e3*run.pct(0.99), run.errors, ev)
			if run.errors > 0 {
				t.Fatalf("%d requests failed\n%s", run.errors, r.log.String())
			}
			if ev.Stored == 0 || ev.Orphans > ev.Stored/100 {
				t.Fatalf("events: %d blocks stored, %d orphans\n%s", ev.Stored, ev.Orphans, r.log.String())
			}
			if m := metric(t, r.url, "semroute_tokenize_total", `result="failed"`); m > 0 {
				t.Fatalf("%v /tokenize calls failed", m)
			}
			if ratio := float64(run.predicted) / float64(max(run.cached, 1)); ratio < 0.95 || ratio > 1.05 {
				t.Fatalf("predicted ÷ reported cached tokens %.3f, want within 5%%", ratio)
			}
		})
	}
}

// TestThirdPartyBrokenTokenizeAndRestart: with the defaults, one of 4
// third-party replicas whose /tokenize is broken (a proxy in front of it
// answers 500) is named in a warning within seconds, shown on the metrics
// and the admin API, and not asked again, while requests keep being routed
// on the others' tokens. A replica restarted mid-run is seen restarted
// before any request reaches it (its metrics show it: its counters are
// gone), its picture is cleared once (its events, their sequence starting
// over, do not clear it again), the picture rebuilt from its new engine's
// events is kept (its predictions agree with what it reports), and no
// request fails.
func TestThirdPartyBrokenTokenizeAndRestart(t *testing.T) {
	reps := startThirdParty(t, tpOptions{n: 4, events: true, deferred: true})
	target := reps[0].url
	broken := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == "/tokenize" {
			http.Error(w, "tokenizer down", http.StatusInternalServerError)
			return
		}
		u, _ := url.Parse(target)
		httputil.NewSingleHostReverseProxy(u).ServeHTTP(w, req)
	}))
	defer broken.Close()
	cfgReps := append([]*tpReplica{{url: broken.URL, listen: reps[0].listen, replay: reps[0].replay}}, reps[1:]...)
	yaml := tpConfig(cfgReps, true, "") + "admin:\n  listen: 127.0.0.1:0\n  token: t0ken\n"
	// The broken replica's events come with its own topic (its real port).
	yaml = strings.Replace(yaml, "      listen: "+reps[0].listen+"\n", "      listen: "+reps[0].listen+fmt.Sprintf("\n      topic: kv@127.0.0.1:%d@\n", reps[0].port), 1)
	r := startRouterYAML(t, yaml)
	launchThirdParty(t, reps)
	waitBudgets(t, r, 4, 768*16)
	waitEventsConnected(t, r, reps)
	work := tpWork(200)
	run := sendTruth(r.url, work[:100], 8, nil)
	resets := func() float64 { return metric(t, r.url, "semroute_kv_events_resets_total", `replica="tp-1"`) }
	before := resets()
	reps[1].restart(t)
	tpWaitRestartSeen(t, r, "tp-1", before+1)
	run2 := sendTruth(r.url, work[100:], 8, nil)
	logs := r.log.String()
	t.Logf("before the restart: hit ratio %.3f, predicted ÷ reported %.3f; after: %.3f, %.3f; errors %d, %d",
		run.hitRatio(), float64(run.predicted)/float64(max(run.cached, 1)), run2.hitRatio(), float64(run2.predicted)/float64(max(run2.cached, 1)), run.errors, run2.errors)
	if run.errors+run2.errors > 0 {
		t.Fatalf("%d requests failed\n%s", run.errors+run2.errors, logs)
	}
	if !strings.Contains(logs, "replica disagrees with its engine") || !strings.Contains(logs, "replica=tp-0 cause=tokenize_failing") {
		t.Fatalf("no warning named tp-0's broken /tokenize:\n%s", logs)
	}
	if m := metric(t, r.url, "semroute_replica_disagreement", `cause="tokenize_failing",replica="tp-0"`); m != 1 {
		t.Fatalf("semroute_replica_disagreement for tp-0: %v", m)
	}
	if m := metric(t, r.url, "semroute_tokenize_total", `result="ok"`); m < 100 {
		t.Fatalf("only %v requests were tokenized by the other replicas", m)
	}
	// Once: the new engine's events, their sequence starting over after
	// the picture was cleared, did not clear it again.
	if n := resets(); n != before+1 {
		t.Fatalf("tp-1's picture was cleared %v times for one restart; events %+v\n%s", n-before, r.app.events.stats(), logs)
	}
	// Kept: the new engine's blocks chain after the ones it stored before
	// (no orphans), and predict what it reports.
	stored := metric(t, r.url, "semroute_kv_events_blocks_total", `event="stored",replica="tp-1"`)
	orphans := metric(t, r.url, "semroute_kv_events_blocks_total", `event="orphan",replica="tp-1"`)
	ratio := metric(t, r.url, "semroute_replica_predicted_ratio", `replica="tp-1"`)
	t.Logf("tp-1: %.0f blocks stored, %.0f orphans; predicted ÷ reported %.3f", stored, orphans, ratio)
	// Over the few requests tp-1 takes after its restart the ratio spread
	// from 0.996 to 1.193 in seven runs; a picture not its new engine's
	// read 1.88.
	if orphans > stored/100 || ratio < 0.8 || ratio > 1.25 {
		t.Fatalf("tp-1 after its restart: %.0f blocks stored, %.0f orphans, predicted ÷ reported %.2f: its picture is not its new engine's", stored, orphans, ratio)
	}
	if run2.hitRatio() < 0.5 {
		t.Fatalf("hit ratio %.3f after the restart", run2.hitRatio())
	}
}

// waitEventsConnected waits until the router has applied a KV event batch
// from every replica of reps (tp-0, tp-1, … in order), a request sent to
// each engine directly (not through the router), a few blocks long, making
// it publish one.
// An engine dials the router's events listener when it starts, before the
// router listens, and dials again later: a replica whose first events go
// nowhere sees its routed blocks go unconfirmed, and its sessions leave
// it, so a run that begins before every engine is heard from is not the
// run the test means.
func waitEventsConnected(t *testing.T, r *tpRouter, reps []*tpReplica) {
	t.Helper()
	for i, rep := range reps {
		name := fmt.Sprint("tp-", i)
		testwait.Until(t, name+"'s KV events heard", func() bool {
			body := fmt.Sprintf(`{"model":%q,"max_tokens":1,"messages":[{"role":"user","content":"warm-up %d %d: %s"}]}`, tpModel, i, time.Now().UnixNano(), text("warm", 64))
			if resp, err := http.Post(rep.url+"/v1/chat/completions", "application/json", strings.NewReader(body)); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			return metric(t, r.url, "semroute_kv_events_batches_total", `replica="`+name+`"`) > 0
		})
	}
}

// tpWaitRestartSeen waits, sending nothing, until the router has cleared
// the picture of replica name, restarted, resets times in all (its
// semroute_kv_events_resets_total) and said so; then until the replica is
// available again (health checks take it back if its restart ejected it).
// Its picture is empty then.
func tpWaitRestartSeen(t *testing.T, r *tpRouter, name string, resets float64) {
	t.Helper()
	said := func() bool {
		for _, l := range strings.Split(r.log.String(), "\n") {
			if strings.Contains(l, "replica's engine restarted, as its metrics show") && strings.Contains(l, "replica="+name+" ") {
				return true
			}
		}
		return false
	}
	if !testwait.Within(testwait.Deadline, func() bool {
		return metric(t, r.url, "semroute_kv_events_resets_total", `replica="`+name+`"`) == resets && said()
	}) {
		t.Fatalf("the restart of %s was not seen without traffic (events %+v):\n%s", name, r.app.events.stats(), r.log.String())
	}
	rep, _ := r.app.core.Engine().Pool().Get(name)
	if st, _ := r.app.pic.Stats(rep.ID); st.Blocks != 0 {
		t.Fatalf("%s's picture holds %d blocks after its restart, before any request reached it", name, st.Blocks)
	}
	testwait.Until(t, name+" taken back after its restart", func() bool { return rep.Available(time.Now()) })
}

// followerStats adds up every follower's counters.
func (fs *followers) stats() (sum struct{ Stored, Orphans, Removed, Skipped uint64 }) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	for _, f := range fs.by {
		s := f.Stats()
		sum.Stored += s.Stored
		sum.Orphans += s.Orphans
		sum.Removed += s.Removed
		sum.Skipped += s.Skipped
	}
	return sum
}

// BenchmarkThirdPartyTable measures, through 4 third-party replicas on
// this project's mixed chat workload, every configuration of the table in
// BENCHMARKS.md, with the ceiling of an infinite cache on the engine's own
// tokens: a sub-benchmark a workload and configuration reporting the
// engines' hit ratio, TTFT p50, p90 and p99 at the client, the router's
// predicted cached tokens ÷ the engines' and the failed requests, and one a
// workload ("ceiling") reporting the references. It logs the tables. It
// takes minutes: run it with
//
//	SEMROUTE_THIRDPARTY_SIM=/path/to/llm-d-inference-sim SEMROUTE_THIRDPARTY_TABLE=600 \
//	  go test -run '^$' -bench BenchmarkThirdPartyTable -benchtime 1x -v -timeout 40m ./cmd/router
//
// (-v for the tables). SEMROUTE_THIRDPARTY_ROWS=events,llm-d keeps only
// the rows whose names contain one of the words; SEMROUTE_THIRDPARTY_WORKERS
// sets the clients (default 16: 4 replicas × 4 sequences; more overload
// the engines) and SEMROUTE_THIRDPARTY_ONE=1 runs the first workload alone.
func BenchmarkThirdPartyTable(b *testing.B) {
	n, _ := strconv.Atoi(os.Getenv("SEMROUTE_THIRDPARTY_TABLE"))
	if n == 0 {
		b.Skip("set SEMROUTE_THIRDPARTY_TABLE=<requests> to measure")
	}
	workers := 16 // 4 replicas × 4 sequences
	if w, _ := strconv.Atoi(os.Getenv("SEMROUTE_THIRDPARTY_WORKERS")); w > 0 {
		workers = w
	}
	estimate := "tokenizer:\n  mode: estimate\n"
	all := []tpRow{
		{"round robin", "round_robin", estimate, false},
		{"llm-d port", "llmd", estimate, false},
		{"SGLang port", "sglang", estimate, false},
		{"Dynamo port", "dynamo", estimate, false},
		{"approximate + feedback (tokenizer.mode: estimate)", "", estimate, false},
		{"default: auto, /tokenize only", "", "", false},
		{"default: auto + KV events", "", "", true},
		{"default without the queue (flow_control.enabled: false)", "", "flow_control:\n  enabled: false\n", false},
	}
	// 40 sessions open: a working set the fleet's memory holds, as the
	// issue's held-out workload's (its llm-d port reached 0.93 of its
	// ceiling), where the infinite ceiling is within reach.
	b.Run("40 sessions open", func(b *testing.B) {
		b.Log(tpTable(b, "the mixed chat workload, 40 sessions open", truthSessions(n, 29, 40), all, workers))
	})
	if os.Getenv("SEMROUTE_THIRDPARTY_ONE") != "" {
		return
	}
	// The same generator with n/4 sessions open: a working set larger than
	// the fleet's memory.
	b.Run("n÷4 sessions open", func(b *testing.B) {
		b.Log(tpTable(b, "the same, n/4 sessions open", tpWork(n), all, workers))
	})
}

// tpWanted reports whether SEMROUTE_THIRDPARTY_ROWS keeps the row named name.
func tpWanted(name string) bool {
	words := os.Getenv("SEMROUTE_THIRDPARTY_ROWS")
	return words == "" || wordIn(words, name)
}

// wordIn reports whether name contains one of the comma-separated words.
func wordIn(words, name string) bool {
	for w := range strings.SplitSeq(words, ",") {
		if w != "" && strings.Contains(name, w) {
			return true
		}
	}
	return false
}

// tpRow is one configuration of the third-party table.
type tpRow struct {
	name, policy, yaml string
	events             bool
}

// tpTable runs each row, a sub-benchmark of b, through 4 fresh
// third-party replicas, then reports the three references of tpCeiling
// (sub-benchmark "ceiling"), and returns the table.
func tpTable(b *testing.B, title string, work [][]byte, rows []tpRow, workers int) string {
	return tpFleetTable(b, title, work, rows, workers, tpOptions{n: 4})
}

// tpFleetTable is tpTable through the replicas fleet describes (its n,
// flags and blocks; events are each row's).
func tpFleetTable(b *testing.B, title string, work [][]byte, rows []tpRow, workers int, fleet tpOptions) string {
	var t strings.Builder
	blocks := 0
	for i := range fleet.n {
		blocks += fleet.kvBlocks(i)
	}
	fmt.Fprintf(&t, "\n%s\n\n| configuration | engine hit ratio | TTFT p50 / p90 / p99 ms | predicted ÷ reported | errors |\n|---|---:|---|---:|---:|\n", title)
	var ceiling, pooled, opt float64
	for _, row := range rows {
		if !tpWanted(row.name) {
			continue
		}
		var run *truthRun
		b.Run(row.name, func(b *testing.B) {
			for range b.N {
				o := fleet
				o.events = row.events
				reps := startThirdParty(b, o)
				if ceiling == 0 {
					ceiling, pooled, opt = tpCeiling(b, reps[0].url, work, blocks)
				}
				r := startRouterYAML(b, row.yaml+tpConfig(reps, row.events, row.policy))
				for i := range fleet.n {
					waitBudget(b, r, i, int64(fleet.kvBlocks(i))*16)
				}
				run = sendTruth(r.url, work, workers, nil)
				b.Logf("%s, %s done: hit ratio %.3f; first error: %s", title, row.name, run.hitRatio(), run.firstErr)
				for _, st := range r.app.agreement.Status() { // the service-time model against the engines
					b.Logf("%s, %s: %s TTFT predicted ÷ observed %.2f, mean |log| error %.2f, causes %v",
						title, row.name, st.Replica, st.TTFTRatio, st.TTFTError, st.Causes)
				}
				_ = r.run.stop(time.Second)
				for _, rep := range reps {
					rep.stop()
				}
			}
			b.ReportMetric(run.hitRatio(), "hit-ratio")
			b.ReportMetric(1e3*run.pct(0.5), "ttft-p50-ms")
			b.ReportMetric(1e3*run.pct(0.9), "ttft-p90-ms")
			b.ReportMetric(1e3*run.pct(0.99), "ttft-p99-ms")
			b.ReportMetric(float64(run.predicted)/float64(max(run.cached, 1)), "predicted/reported")
			b.ReportMetric(float64(run.errors), "errors")
		})
		if run != nil {
			fmt.Fprintf(&t, "| %s | %.3f | %.0f / %.0f / %.0f | %.3f | %d |\n", row.name, run.hitRatio(),
				1e3*run.pct(0.5), 1e3*run.pct(0.9), 1e3*run.pct(0.99), float64(run.predicted)/float64(max(run.cached, 1)), run.errors)
		}
	}
	if ceiling != 0 {
		b.Run("ceiling", func(b *testing.B) {
			b.ReportMetric(ceiling, "infinite-hit-ratio")
			b.ReportMetric(pooled, "pooled-lru-hit-ratio")
			b.ReportMetric(opt, "pooled-belady-hit-ratio")
		})
	}
	fmt.Fprintf(&t, "| ceiling: an infinite cache on the engine's tokens | %.3f | | | |\n", ceiling)
	fmt.Fprintf(&t, "| reference: one pooled LRU cache of the fleet's %d blocks | %.3f | | | |\n", blocks, pooled)
	fmt.Fprintf(&t, "| bound: one pooled cache of %d blocks with Belady's optimal eviction | %.3f | | | |\n", blocks, opt)
	return t.String()
}

// TestThirdPartyMisconfiguredBlockSize: a router told the engine's blocks
// are 32 tokens, in front of an engine whose blocks are 16, says so within
// seconds, naming the replica and the cause, and every request is served.
func TestThirdPartyMisconfiguredBlockSize(t *testing.T) {
	reps := startThirdParty(t, tpOptions{n: 1, events: true})
	r := startRouterYAML(t, "tokenizer:\n  block_tokens: 32\n"+tpConfig(reps, true, ""))
	waitBudgets(t, r, 1, 768*16)
	run := sendTruth(r.url, tpWork(60), 4, nil)
	if run.errors > 0 {
		t.Fatalf("%d requests failed: %s", run.errors, run.firstErr)
	}
	if !testwait.Within(testwait.Deadline, func() bool { return strings.Contains(r.log.String(), "replica=tp-0 cause=events_unusable") }) {
		t.Fatalf("no warning within %v:\n%s", testwait.Deadline, r.log.String())
	}
	if m := metric(t, r.url, "semroute_replica_disagreement", `cause="events_unusable",replica="tp-0"`); m != 1 {
		t.Fatalf("semroute_replica_disagreement: %v", m)
	}
}

// Belady's eviction keeps the block used again soonest: on a cyclic
// sequence one larger than the cache, LRU never hits and Belady does.
func TestBeladyHits(t *testing.T) {
	if got := beladyHits([]uint64{1, 2, 3, 1, 2, 3}, 2); got != 2 {
		t.Fatalf("hits %d, want 2", got)
	}
	if got := beladyHits([]uint64{1, 1, 2, 2}, 1); got != 2 {
		t.Fatalf("hits %d, want 2", got)
	}
}
