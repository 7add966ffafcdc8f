package main

import (
	"bufio"
	"cmp"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/cluster"
	"github.com/semroute/semroute/internal/httpserve"
	"github.com/semroute/semroute/internal/testwait"
)

// The flow-control checks and measurements of issue 32 beyond
// BenchmarkThirdPartyFlowControl: priorities, fairness between tenants,
// and overload. Each runs 4 fresh third-party replicas of 4 sequences per
// configuration and takes minutes. TestThirdPartyFlowPriority and
// TestThirdPartyFlowFairness check what flow control promises with
// margins a loaded machine keeps; BenchmarkThirdPartyFlowPriority and
// BenchmarkThirdPartyFlowFairness measure the figures of BENCHMARKS.md;
// TestThirdPartyFlowOverload and TestThirdPartyFlowFleet measure. Run
// them with
//
//	SEMROUTE_THIRDPARTY_SIM=/path/to/llm-d-inference-sim SEMROUTE_THIRDPARTY_FLOW=1 \
//	  SEMROUTE_THIRDPARTY_RATE=<the sustained rate BenchmarkThirdPartyFlowControl reported> \
//	  go test -run 'TestThirdPartyFlow(Priority|Fairness|Overload|Fleet)$' -v -timeout 60m ./cmd/router
//	SEMROUTE_THIRDPARTY_SIM=/path/to/llm-d-inference-sim SEMROUTE_THIRDPARTY_FLOW=1 \
//	  SEMROUTE_THIRDPARTY_RATE=<the sustained rate BenchmarkThirdPartyFlowControl reported> \
//	  go test -run '^$' -bench 'BenchmarkThirdPartyFlow(Priority|Fairness)$' -benchtime 1x -v -timeout 60m ./cmd/router

// tpBlocks returns the KV cache blocks of each third-party replica of the
// tenant measurements: SEMROUTE_THIRDPARTY_BLOCKS, else 768 (12,288
// tokens, as every third-party measurement).
func tpBlocks() int {
	if b, _ := strconv.Atoi(os.Getenv("SEMROUTE_THIRDPARTY_BLOCKS")); b > 0 {
		return b
	}
	return 768
}

// flowGate skips the flow measurements and checks unless
// SEMROUTE_THIRDPARTY_FLOW is set, or the simulator is missing.
func flowGate(tb testing.TB) {
	tb.Helper()
	if os.Getenv("SEMROUTE_THIRDPARTY_FLOW") == "" {
		tb.Skip("set SEMROUTE_THIRDPARTY_FLOW=1 to run the flow-control checks and measurements (minutes each)")
	}
	thirdPartyBin(tb)
}

// flowRate returns the sustained rate the flow measurements load against:
// SEMROUTE_THIRDPARTY_RATE, else measured (sustainedRate); a benchmark
// measures it in its sub-benchmark "sustained rate", which reports it.
func flowRate(tb testing.TB) float64 {
	tb.Helper()
	flowGate(tb)
	rate, _ := strconv.ParseFloat(os.Getenv("SEMROUTE_THIRDPARTY_RATE"), 64)
	if rate == 0 {
		if b, ok := tb.(*testing.B); ok {
			b.Run("sustained rate", func(b *testing.B) {
				for range b.N {
					rate = sustainedRate(b, truthSessions(600, 29, 40))
				}
				b.ReportMetric(rate, "requests/s")
			})
			if rate == 0 {
				b.Fatal("the sustained rate was not measured (-bench left its sub-benchmark out): set SEMROUTE_THIRDPARTY_RATE")
			}
		} else {
			rate = sustainedRate(tb, truthSessions(600, 29, 40))
		}
	}
	tb.Logf("sustained rate: %.2f requests/s", rate)
	return rate
}

// tenantLoad is one tenant's open-loop load: its arrivals, bodies and
// headers, and its flow (x-gateway-inference-fairness-id; "": its name).
type tenantLoad struct {
	name, flow string
	at         []time.Duration
	work       [][]byte
	headers    http.Header
}

// mixLoads merges the tenants' loads into one schedule, in arrival order,
// and names each request's tenant.
func mixLoads(loads ...tenantLoad) (at []time.Duration, work [][]byte, header func(i int) http.Header, tenants []string) {
	type one struct {
		at     time.Duration
		body   []byte
		h      http.Header
		tenant string
	}
	var all []one
	for _, l := range loads {
		h := l.headers.Clone()
		if h == nil {
			h = http.Header{}
		}
		h.Set("x-gateway-inference-fairness-id", cmp.Or(l.flow, l.name))
		for i, a := range l.at {
			all = append(all, one{a, l.work[i], h, l.name})
		}
	}
	sort.SliceStable(all, func(i, j int) bool { return all[i].at < all[j].at })
	hs := make([]http.Header, len(all))
	for i, o := range all {
		at, work, hs[i], tenants = append(at, o.at), append(work, o.body), o.h, append(tenants, o.tenant)
	}
	return at, work, func(i int) http.Header { return hs[i] }, tenants
}

// runTenants sends the tenants' loads through a router of yaml in front of
// 4 fresh third-party replicas and returns the run, each request named
// with its tenant.
func runTenants(tb testing.TB, yaml string, loads ...tenantLoad) *olRun {
	blocks := tpBlocks()
	reps := startThirdParty(tb, tpOptions{n: 4, blocks: blocks})
	defer func() {
		for _, rep := range reps {
			rep.stop()
		}
	}()
	// The replicas' capacity is configured (the 4 sequences they run), as
	// an operator may: learned, it would be known only after the first
	// scrape that shows them queueing, and the flood's first second would
	// reach their queues before it.
	r := startRouterYAML(tb, yaml+withMaxRunning(tpConfig(reps, false, ""), 4))
	defer func() { _ = r.run.stop(time.Second) }()
	waitBudgets(tb, r, 4, int64(blocks)*16)
	at, work, header, tenants := mixLoads(loads...)
	run := sendOpenLoop(r.url, work, at, header, 5*time.Minute)
	for i := range run.reqs {
		run.reqs[i].tenant = tenants[i]
	}
	return run
}

// withMaxRunning sets max_running: n on every replica of config cfg.
func withMaxRunning(cfg string, n int) string {
	var b strings.Builder
	for line := range strings.Lines(cfg) {
		b.WriteString(line)
		if strings.HasPrefix(line, "    url: ") {
			fmt.Fprintf(&b, "    max_running: %d\n", n)
		}
	}
	return b.String()
}

func ofTenant(name string) func(q *olRequest) bool {
	return func(q *olRequest) bool { return q.tenant == name }
}

// tenantAt is a tenant's load at a fixed rate for dur: Poisson arrivals
// of seed, bodies of truthSessions(…, sessions, open).
func tenantAt(name string, rate float64, dur time.Duration, seed, sessions uint64, open int, h http.Header) tenantLoad {
	at := arrivals([]phase{{dur, rate}}, seed)
	return tenantLoad{name: name, at: at, work: truthSessions(len(at), sessions, open), headers: h}
}

// The checks run at fixed rates, not the measured sustained rate: the 4
// replicas sustain about 17 requests/s of the mixed chat workload (at
// most 20, with 4,096 blocks; BENCHMARKS.md), the simulators' own clocks
// bound it and a loaded machine only lowers it, so 50/s floods them and
// 5/s stays well within.

// TestThirdPartyFlowPriority: a batch tenant floods 4 third-party
// replicas at 50 requests/s (about 3× what they sustain) for 20 s, its
// backlog waiting tens of seconds, while an interactive tenant sends 5/s;
// both in one flow (so that fairness between flows cannot tell them
// apart), their objectives mapped to priorities 10 and 0. The interactive
// requests go first: their TTFT p50 must be under a quarter of the
// batch's (measured: a twentieth; without the priorities, or without flow
// control, where both wait in one line, 1.2 times it).
func TestThirdPartyFlowPriority(t *testing.T) {
	flowGate(t)
	objective := func(o string) http.Header { return http.Header{"X-Gateway-Inference-Objective": {o}} }
	interactive := tenantAt("interactive", 5, 20*time.Second, 21, 31, 10, objective("interactive"))
	batch := tenantAt("batch", 50, 20*time.Second, 22, 37, 40, objective("batch"))
	interactive.flow, batch.flow = "one", "one"
	run := runTenants(t, "flow_control:\n  enabled: true\n  priorities:\n    interactive: 10\n    batch: 0\n", interactive, batch)
	i, b := run.stats(ofTenant("interactive")), run.stats(ofTenant("batch"))
	t.Logf("interactive (priority 10): %s", i)
	t.Logf("batch (priority 0): %s", b)
	// NaN (a tenant without an answer) fails too.
	if !(4*i.pct(0.5) < b.pct(0.5)) {
		t.Fatalf("interactive TTFT p50 %.0f ms, batch %.0f ms: want the interactive's under a quarter of the batch's", i.pct(0.5), b.pct(0.5))
	}
}

// TestThirdPartyFlowFairness: two tenants of one priority, each asking
// more than half of what 4 third-party replicas sustain (about 17
// requests/s): one 34 requests/s, the other 13, for 40 s. Flow control
// serves the flows fairly by prompt tokens, so while both wait (the
// answers that end from 10 s in to the end of the arrivals) each gets
// about half of the prompt tokens answered; first come, first served
// would give the smaller one about its share of the arrivals, 26%. Each's
// share must be within 0.35–0.65 (measured: 0.49; 0.28 without flow
// control, 0.27 with both tenants in one flow).
func TestThirdPartyFlowFairness(t *testing.T) {
	flowGate(t)
	const dur = 40 * time.Second
	big := tenantAt("big", 34, dur, 23, 37, 40, nil)
	small := tenantAt("small", 13, dur, 24, 31, 40, nil)
	run := runTenants(t, "flow_control:\n  enabled: true\n", big, small)
	t.Logf("big: %s", run.stats(ofTenant("big")))
	t.Logf("small: %s", run.stats(ofTenant("small")))
	var tokens, answers [2]int64
	for _, q := range run.reqs {
		if end := q.at + q.done; q.status != 200 || q.err != "" || end < 10*time.Second || end > dur {
			continue
		}
		k := 0
		if q.tenant == "small" {
			k = 1
		}
		tokens[k] += q.prompt
		answers[k]++
	}
	share := float64(tokens[1]) / float64(max(tokens[0]+tokens[1], 1))
	t.Logf("answered from 10 s to %.0f s: big %d (%d prompt tokens), small %d (%d); the small tenant's share of the tokens %.2f, of the answers %.2f, of the arrivals %.2f",
		dur.Seconds(), answers[0], tokens[0], answers[1], tokens[1], share, float64(answers[1])/float64(max(answers[0]+answers[1], 1)),
		float64(len(small.at))/float64(len(small.at)+len(big.at)))
	if answers[1] == 0 || share < 0.35 || share > 0.65 {
		t.Fatalf("the small tenant got %.2f of the prompt tokens answered while both waited: want 0.35–0.65 (an equal share is 0.5)", share)
	}
}

// BenchmarkThirdPartyFlowPriority: an interactive tenant at 0.3× the
// sustained rate alone, then beside a batch tenant flooding at 3× for the
// same minute; flow control maps their objectives to priorities 10 and 0.
// The issue asks the interactive tenant's TTFT p99 to rise by at most 50%.
// Sub-benchmarks "alone" and "beside the flood" report what the
// interactive tenant got, and the second the p99's ratio and the batch
// tenant's answers a second (quietBesideFlood); it logs them.
func BenchmarkThirdPartyFlowPriority(b *testing.B) {
	objective := func(o string) http.Header { return http.Header{"X-Gateway-Inference-Objective": {o}} }
	quietBesideFlood(b, "flow_control:\n  enabled: true\n  priorities:\n    interactive: 10\n    batch: 0\n",
		tenantLoad{name: "interactive", headers: objective("interactive")}, tenantLoad{name: "batch", headers: objective("batch")}, 21)
}

// BenchmarkThirdPartyFlowFairness: two tenants of one priority, a quiet
// one at 0.3× the sustained rate and one flooding at 3×, for a minute; the
// quiet one alone first. The issue asks the quiet one's TTFT p99 to stay
// within 1.5× of its solo value, and the flooding one to get its fair
// share: all the capacity the quiet one leaves. Reported as for
// BenchmarkThirdPartyFlowPriority.
func BenchmarkThirdPartyFlowFairness(b *testing.B) {
	quietBesideFlood(b, "flow_control:\n  enabled: true\n",
		tenantLoad{name: "quiet", headers: http.Header{}}, tenantLoad{name: "flood", headers: http.Header{}}, 23)
}

// quietBesideFlood runs quiet at 0.3× the sustained rate for a minute
// alone (sub-benchmark "alone"), then beside flood at 3× ("beside the
// flood"), through a router of yaml; each reports the quiet tenant's hit
// ratio, TTFT p50 and p99, router queue p99 and answers a second over the
// run, and the second the quiet tenant's p99 ÷ its p99 alone, the flood's
// answers a second and what the sustained rate less the quiet's answers
// leaves. It logs what each got, by 15 s of arrivals.
func quietBesideFlood(b *testing.B, yaml string, quiet, flood tenantLoad, seed uint64) {
	rate := flowRate(b)
	quiet.at = arrivals([]phase{{60 * time.Second, 0.3 * rate}}, seed)
	quiet.work = truthSessions(len(quiet.at), 31, 10)
	flood.at = arrivals([]phase{{60 * time.Second, 3 * rate}}, seed+1)
	flood.work = truthSessions(len(flood.at), 37, 40)

	report := func(b *testing.B, s *olStats, span time.Duration) {
		b.ReportMetric(s.hitRatio(), "hit-ratio")
		b.ReportMetric(s.pct(0.5), "ttft-p50-ms")
		b.ReportMetric(s.pct(0.99), "ttft-p99-ms")
		b.ReportMetric(s.queuedPct(0.99), "queue-p99-ms")
		b.ReportMetric(float64(s.ok)/span.Seconds(), "answered/s")
	}
	var aloneRun, mixed *olRun
	var alone *olStats
	b.Run("alone", func(b *testing.B) {
		for range b.N {
			aloneRun = runTenants(b, yaml, quiet)
		}
		alone = aloneRun.stats(nil)
		report(b, alone, aloneRun.span())
		b.Logf("%s alone: %s", quiet.name, alone)
	})
	b.Run("beside the flood", func(b *testing.B) {
		for range b.N {
			mixed = runTenants(b, yaml, quiet, flood)
		}
		q, f := mixed.stats(ofTenant(quiet.name)), mixed.stats(ofTenant(flood.name))
		span := mixed.span()
		report(b, q, span)
		b.ReportMetric(float64(f.ok)/span.Seconds(), "flood-answered/s")
		b.ReportMetric(rate-float64(q.ok)/span.Seconds(), "left/s")
		b.Logf("%s beside the flood: %s", quiet.name, q)
		b.Logf("%s: %s", flood.name, f)
		b.Logf("answered per second over the %.0f s the flood was served: %s %.2f, %s %.2f; the sustained rate %.2f less the %s tenant's leaves %.2f",
			span.Seconds(), quiet.name, float64(q.ok)/span.Seconds(), flood.name, float64(f.ok)/span.Seconds(), rate, quiet.name, rate-float64(q.ok)/span.Seconds())
		if alone == nil {
			return
		}
		b.ReportMetric(q.pct(0.99)/alone.pct(0.99), "p99-ratio")
		b.Logf("%s TTFT p99 %.0f ms alone, %.0f ms beside the flood: ×%.2f (the issue asks ≤ ×1.5)",
			quiet.name, alone.pct(0.99), q.pct(0.99), q.pct(0.99)/alone.pct(0.99))
		for w := time.Duration(0); w < time.Minute; w += 15 * time.Second {
			in := func(q *olRequest) bool { return q.at >= w && q.at < w+15*time.Second }
			b.Logf("%s, arrivals %2.0f–%2.0f s: alone %s; beside the flood %s", quiet.name, w.Seconds(), (w + 15*time.Second).Seconds(),
				aloneRun.stats(in), mixed.stats(func(q *olRequest) bool { return q.tenant == quiet.name && in(q) }))
		}
	})
}

// span returns the time from the first arrival to the last answer.
func (r *olRun) span() time.Duration {
	var last time.Duration
	for _, q := range r.reqs {
		last = max(last, q.at+q.done)
	}
	return last
}

// TestThirdPartyFlowOverload: 5× the sustained rate for a minute, then
// 0.5× for 90 s, through the router binary (its own process, so that its
// memory is its own) with a queue bounded at 1,000 requests. Every
// request must be answered: a success, or 429 with Retry-After within the
// queue's TTL; the router's peak memory, the queue's peak and the TTFT
// p99 of the last 30 s (against the same load alone) are reported.
func TestThirdPartyFlowOverload(t *testing.T) {
	rate := flowRate(t)
	bin := filepath.Join(t.TempDir(), "router")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	const ttl = 60 * time.Second
	calm := []phase{{90 * time.Second, 0.5 * rate}}
	burst := []phase{{60 * time.Second, 5 * rate}, {180 * time.Second, 0.5 * rate}}
	for _, c := range []struct {
		name   string
		phases []phase
	}{{"0.5× alone", calm}, {"5× for a minute, then 0.5×", burst}} {
		at := arrivals(c.phases, 25)
		work := truthSessions(len(at), 29, 40)
		reps := startThirdParty(t, tpOptions{n: 4})
		cmd, url := startRouterProc(t, bin, fmt.Sprintf("flow_control:\n  enabled: true\n  max_requests: 1000\n  ttl: %s\n%s", ttl, tpConfig(reps, false, "")))
		waitReady(t, url)
		peakQueue := 0.0
		var emptied time.Duration // the first time the queue was seen empty after the burst's minute
		stop := make(chan struct{})
		sampled := make(chan struct{})
		start := time.Now()
		go func() {
			defer close(sampled)
			for {
				select {
				case <-stop:
					return
				case <-time.After(250 * time.Millisecond): // a sampling period, not synchronisation
				}
				n := metric(t, url, "semroute_queue_requests", "")
				peakQueue = max(peakQueue, n)
				if at := time.Since(start); n == 0 && emptied == 0 && at > c.phases[0].dur {
					emptied = at
				}
			}
		}()
		run := sendOpenLoop(url, work, at, nil, 5*time.Minute)
		close(stop)
		<-sampled
		hwm := vmHWM(cmd.Process.Pid)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		for _, rep := range reps {
			rep.stop()
		}
		all := run.stats(nil)
		lateShed := 0
		for _, q := range run.reqs {
			if q.status == http.StatusTooManyRequests && q.done > ttl+2*time.Second {
				lateShed++
			}
		}
		end := c.phases[len(c.phases)-1]
		var from time.Duration
		for _, p := range c.phases {
			from += p.dur
		}
		from -= 30 * time.Second
		last := run.stats(func(q *olRequest) bool { return q.at >= from })
		t.Logf("%s: %s; 429s without a whole-second Retry-After %d, later than the TTL %d; unanswered or failed %d", c.name, all, all.badRetry, lateShed, all.failed)
		t.Logf("%s: router peak RSS %d MiB, queue peak %.0f requests, first empty after the first minute at %.0f s; the last 30 s (%.2f requests/s): %s",
			c.name, hwm>>20, peakQueue, emptied.Seconds(), end.rate, last)
		for w := time.Duration(0); w < from+30*time.Second; w += 30 * time.Second {
			s := run.stats(func(q *olRequest) bool { return q.at >= w && q.at < w+30*time.Second })
			t.Logf("%s: arrivals %3.0f–%3.0f s: %s", c.name, w.Seconds(), (w + 30*time.Second).Seconds(), s)
		}
	}
}

// vmHWM returns the peak resident memory of process pid in bytes (Linux),
// or 0.
func vmHWM(pid int) int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// TestThirdPartyFlowFleet: the burst load of BenchmarkThirdPartyFlowControl
// (0.9× the sustained rate, 2× for 30 s) through flow control in one
// router process, then in two sharing one picture and load over NATS,
// each request sent to one of them in turn (as a Service would), then
// through the two without flow control: how far a fleet's queues depart
// from one router's. SEMROUTE_THIRDPARTY_ROWS picks rows by name.
func TestThirdPartyFlowFleet(t *testing.T) {
	rate := flowRate(t)
	bin := filepath.Join(t.TempDir(), "router")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	ns, err := cluster.Serve("127.0.0.1", -1, fleetAccount)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Shutdown()
	burst := []phase{{60 * time.Second, 0.9 * rate}, {30 * time.Second, 2 * rate}, {60 * time.Second, 0.9 * rate}}
	at := arrivals(burst, 5)
	work := truthSessions(len(at), 29, 40)
	for _, row := range []struct {
		name    string
		routers int
		fc      bool
	}{{"1 router with flow control", 1, true}, {"2 routers with flow control", 2, true}, {"2 routers without flow control", 2, false}} {
		if !tpWanted(row.name) {
			continue
		}
		routers := row.routers
		reps := startThirdParty(t, tpOptions{n: 4})
		var urls []string
		var procs []*exec.Cmd
		for i := range routers {
			yaml := fmt.Sprintf("flow_control:\n  enabled: %v\n", row.fc) + tpConfig(reps, false, "")
			if routers > 1 {
				yaml += fmt.Sprintf("cluster:\n  urls: [%s]\n  id: router-%d\n  user: %s\n  password: %s\n",
					ns.ClientURL(), i, fleetAccount.User, fleetAccount.Password)
			}
			cmd, url := startRouterProc(t, bin, yaml)
			procs = append(procs, cmd)
			urls = append(urls, url)
		}
		for _, u := range urls {
			waitReady(t, u)
			waitMetric(t, u, "semroute_replica_budget_tokens", 4*768*16)
		}
		front, err := httpserve.Serve("127.0.0.1:0", newFront(urls), slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		s := sendOpenLoop(front.URL(), work, at, nil, 5*time.Minute).stats(nil)
		t.Logf("%s, %d requests: engine hit ratio %.3f, TTFT p50 / p90 / p99 %.0f / %.0f / %.0f ms, answered %d, shed %d, failed %d (%s)",
			row.name, len(at), s.hitRatio(), s.pct(0.5), s.pct(0.9), s.pct(0.99), s.ok, s.shed, s.failed, s)
		_ = front.Stop(time.Second)
		for _, cmd := range procs {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		for _, rep := range reps {
			rep.stop()
		}
	}
}

// startRouterProc starts the router binary bin with config yaml (less its
// listen line) and returns the process and its URL; the caller kills it.
func startRouterProc(t *testing.T, bin, yaml string) (*exec.Cmd, string) {
	t.Helper()
	addr := freeAddr(t)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	if err := os.WriteFile(cfg, []byte("listen: "+addr+"\n"+yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "serve", "--config", cfg)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, "http://" + addr
}

// waitMetric waits until the router at url reports want as the sum of
// metric name.
func waitMetric(t *testing.T, url, name string, want float64) {
	t.Helper()
	testwait.Value(t, fmt.Sprintf("%s: %s at %.0f", url, name, want), func() (float64, bool) {
		got := metric(t, url, name, "")
		return got, got == want
	})
}
