package main

import (
	"bytes"
	"cmp"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// An open-loop load: requests arrive on a schedule whatever the router's
// answers, as users do, so that a queue anywhere shows as waiting time
// rather than as a slower client (which a closed loop of workers would be).

// phase is a stretch of an open-loop schedule: rate requests per second
// for dur.
type phase struct {
	dur  time.Duration
	rate float64
}

// arrivals returns Poisson arrival times (offsets from the start) through
// the phases, from seed.
func arrivals(phases []phase, seed uint64) []time.Duration {
	r := rand.New(rand.NewPCG(seed, 11))
	var out []time.Duration
	var start time.Duration
	for _, p := range phases {
		t := 0.0
		for p.rate > 0 {
			t += r.ExpFloat64() / p.rate
			if t >= p.dur.Seconds() {
				break
			}
			out = append(out, start+time.Duration(t*float64(time.Second)))
		}
		start += p.dur
	}
	return out
}

// olRequest is one request of an open-loop run and what it got.
type olRequest struct {
	at      time.Duration // its arrival, from the start
	tenant  string        // set by runTenants
	status  int           // 0: no answer
	ttft    time.Duration // to the first streamed chunk, from its arrival
	done    time.Duration // its arrival to the end of its answer
	retry   string        // Retry-After, on a 429
	queued  time.Duration // X-Semroute-Queue-Ms: its wait in the router's queue
	prompt  int64
	cached  int64
	replica string
	err     string
}

// olRun is an open-loop run.
type olRun struct {
	reqs []olRequest
}

// sendOpenLoop sends body i at its arrival time at[i] with header(i)'s
// headers (nil: none), each in its own goroutine, and waits for every
// answer. A request not answered within timeout counts as unanswered.
func sendOpenLoop(url string, work [][]byte, at []time.Duration, header func(i int) http.Header, timeout time.Duration) *olRun {
	run := &olRun{reqs: make([]olRequest, len(at))}
	client := &http.Client{Timeout: timeout, Transport: &http.Transport{MaxIdleConnsPerHost: 4096, MaxConnsPerHost: 0}}
	defer client.CloseIdleConnections()
	start := time.Now()
	var wg sync.WaitGroup
	for i := range at {
		if d := time.Until(start.Add(at[i])); d > 0 {
			time.Sleep(d) // the schedule itself, not synchronisation
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			q := &run.reqs[i]
			q.at = at[i]
			req, _ := http.NewRequest("POST", url+"/v1/chat/completions", bytes.NewReader(work[i%len(work)]))
			req.Header.Set("Content-Type", "application/json")
			if header != nil {
				for k, v := range header(i) {
					req.Header[k] = v
				}
			}
			sent := time.Now()
			resp, err := client.Do(req)
			if err != nil {
				q.err = err.Error()
				return
			}
			defer resp.Body.Close()
			q.status, q.replica, q.retry = resp.StatusCode, resp.Header.Get("X-Semroute-Replica"), resp.Header.Get("Retry-After")
			if ms, err := strconv.ParseFloat(resp.Header.Get("X-Semroute-Queue-Ms"), 64); err == nil {
				q.queued = time.Duration(ms * float64(time.Millisecond))
			}
			if resp.StatusCode != 200 {
				b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
				q.err, q.done = fmt.Sprintf("%d: %s", resp.StatusCode, b), time.Since(sent)
				return
			}
			q.ttft, q.prompt, q.cached, err = readStream(resp.Body, sent)
			q.done = time.Since(sent)
			if err != nil {
				q.err = err.Error()
			} else if q.prompt == 0 {
				q.err = "a stream without usage"
			}
		}()
	}
	wg.Wait()
	return run
}

// olStats summarises the requests of a run that keep says to keep (nil:
// all).
type olStats struct {
	n, ok, shed, failed int
	prompt, cached      int64
	ttfts               []float64 // seconds, of the answered
	queued              []float64 // seconds in the router's queue, of the answered
	firstErr            string
	badRetry            int       // 429s without a Retry-After of whole seconds
	refusals            []float64 // seconds from arrival to the 429, of the shed
}

func (r *olRun) stats(keep func(q *olRequest) bool) *olStats {
	s := &olStats{}
	for i := range r.reqs {
		q := &r.reqs[i]
		if keep != nil && !keep(q) {
			continue
		}
		s.n++
		switch {
		case q.status == 200 && q.err == "":
			s.ok++
			s.prompt += q.prompt
			s.cached += q.cached
			s.ttfts = append(s.ttfts, q.ttft.Seconds())
			s.queued = append(s.queued, q.queued.Seconds())
		case q.status == http.StatusTooManyRequests:
			s.shed++
			if n, err := strconv.Atoi(q.retry); err != nil || n < 1 {
				s.badRetry++
			}
			s.refusals = append(s.refusals, q.done.Seconds())
		default:
			s.failed++
			s.firstErr = cmp.Or(s.firstErr, q.err)
		}
	}
	slices.Sort(s.ttfts)
	slices.Sort(s.queued)
	slices.Sort(s.refusals)
	return s
}

// refusedPct returns the q-quantile of the time to a 429 in milliseconds
// (0 without refusals).
func (s *olStats) refusedPct(q float64) float64 {
	if len(s.refusals) == 0 {
		return 0
	}
	return 1e3 * s.refusals[min(int(q*float64(len(s.refusals))), len(s.refusals)-1)]
}

func (s *olStats) hitRatio() float64 { return float64(s.cached) / float64(max(s.prompt, 1)) }

// pct returns the q-quantile of TTFT in milliseconds (NaN without answers).
func (s *olStats) pct(q float64) float64 {
	if len(s.ttfts) == 0 {
		return math.NaN()
	}
	return 1e3 * s.ttfts[min(int(q*float64(len(s.ttfts))), len(s.ttfts)-1)]
}

// queuedPct returns the q-quantile of the wait in the router's queue in
// milliseconds (0 without answers).
func (s *olStats) queuedPct(q float64) float64 {
	if len(s.queued) == 0 {
		return 0
	}
	return 1e3 * s.queued[min(int(q*float64(len(s.queued))), len(s.queued)-1)]
}

func (s *olStats) String() string {
	return fmt.Sprintf("%d requests: %d answered, %d shed (429), %d failed; hit ratio %.3f; TTFT p50 %.0f p99 %.0f ms; router queue p99 %.0f ms",
		s.n, s.ok, s.shed, s.failed, s.hitRatio(), s.pct(0.5), s.pct(0.99), s.queuedPct(0.99))
}

// sustainedRate measures the requests per second 4 fresh third-party
// replicas sustain behind the default router: a closed loop of as many
// clients as the engines have sequences, over n requests of work.
func sustainedRate(t testing.TB, work [][]byte) float64 {
	blocks := tpBlocks()
	reps := startThirdParty(t, tpOptions{n: 4, blocks: blocks})
	defer func() {
		for _, rep := range reps {
			rep.stop()
		}
	}()
	r := startRouterYAML(t, tpConfig(reps, false, ""))
	defer func() { _ = r.run.stop(time.Second) }()
	waitBudgets(t, r, 4, int64(blocks)*16)
	start := time.Now()
	run := sendTruth(r.url, work, 16, nil)
	if run.errors > 0 {
		t.Fatalf("%d errors measuring the sustained rate: %s", run.errors, run.firstErr)
	}
	return float64(len(work)) / time.Since(start).Seconds()
}

// BenchmarkThirdPartyFlowControl measures, through 4 third-party replicas
// of 4 sequences each on the mixed chat workload, open-loop loads against
// the rate they sustain: 0.9× with a burst to 2× for 30 s, for every port
// (as they ship: no queue of the router's; engines queue) and the default
// with and without its queue (flow_control.enabled: false); 0.5×, for the
// default with and without; and 5× for a minute between two minutes at
// 0.5×, for the default with and without (one run each). A sub-benchmark a
// schedule and configuration reports the engines' hit ratio, TTFT p50, p90
// and p99 at the client, the requests answered, shed (429) and failed,
// the time to a 429 (p99 and max) and, for the overload, the TTFT p99 of
// the requests that arrive in its last minute (recovered) and the router's
// heap at its largest; "sustained rate" the rate when it measures it. It
// logs the tables. It takes about 30 minutes:
//
//	SEMROUTE_THIRDPARTY_SIM=/path/to/llm-d-inference-sim SEMROUTE_THIRDPARTY_FLOW=1 \
//	  go test -run '^$' -bench BenchmarkThirdPartyFlowControl -benchtime 1x -v -timeout 90m ./cmd/router
//
// SEMROUTE_THIRDPARTY_RATE=<requests/s> skips measuring the sustained rate;
// SEMROUTE_THIRDPARTY_ROWS keeps some rows, as for BenchmarkThirdPartyTable;
// SEMROUTE_THIRDPARTY_SCHEDULES the schedules whose names contain one of
// its comma-separated words (burst, 0.5×, overload).
func BenchmarkThirdPartyFlowControl(b *testing.B) {
	rate := flowRate(b)
	off := "flow_control:\n  enabled: false\n"
	rows := []tpRow{
		{"llm-d port", "llmd", off, false},
		{"SGLang port", "sglang", off, false},
		{"Dynamo port", "dynamo", off, false},
		{"AIBrix port", "aibrix", off, false},
		{"default without the queue (flow_control.enabled: false)", "", off, false},
		{"default", "", "", false},
	}
	schedules := []struct {
		name   string
		phases []phase
		rows   []tpRow
		after  time.Duration // the recovered requests arrive from here
	}{
		{"burst: 0.9× with a burst to 2×", []phase{{60 * time.Second, 0.9 * rate}, {30 * time.Second, 2 * rate}, {60 * time.Second, 0.9 * rate}}, rows, 0},
		{"0.5×", []phase{{90 * time.Second, 0.5 * rate}}, rows[4:], 0},
		{"overload: 5× for a minute", []phase{{60 * time.Second, 0.5 * rate}, {60 * time.Second, 5 * rate}, {60 * time.Second, 0.5 * rate}}, rows[4:], 120 * time.Second},
	}
	want := os.Getenv("SEMROUTE_THIRDPARTY_SCHEDULES")
	for _, sc := range schedules {
		if want != "" && !wordIn(want, sc.name) {
			continue
		}
		b.Run(sc.name, func(b *testing.B) {
			b.Log(olTable(b, fmt.Sprintf("%s of %.2f requests/s", sc.name, rate), sc.phases, sc.rows, sc.after))
		})
	}
}

// olTable runs the schedule through each row's router in front of 4 fresh
// third-party replicas, a sub-benchmark of b each, and returns the table.
// With after, it also reports the TTFT p99 of the requests that arrive
// from after on (recovered) and the router's heap at its largest.
func olTable(b *testing.B, title string, phases []phase, rows []tpRow, after time.Duration) string {
	at := arrivals(phases, 5)
	work := truthSessions(len(at), 29, 40)
	var t strings.Builder
	fmt.Fprintf(&t, "\n%s: %d requests\n\n| configuration | engine hit ratio | TTFT p50 / p90 / p99 ms | answered | shed (429) | failed | 429 within p99 / max ms | recovered p99 ms | heap max MiB |\n|---|---:|---|---:|---:|---:|---|---:|---:|\n", title, len(at))
	for _, row := range rows {
		if !tpWanted(row.name) {
			continue
		}
		var s, late *olStats
		var heap float64
		b.Run(row.name, func(b *testing.B) {
			for range b.N {
				reps := startThirdParty(b, tpOptions{n: 4})
				r := startRouterYAML(b, row.yaml+tpConfig(reps, row.events, row.policy))
				waitBudgets(b, r, 4, 768*16)
				stop := make(chan struct{})
				peak := make(chan float64)
				go func() { peak <- heapPeak(stop) }()
				run := sendOpenLoop(r.url, work, at, nil, 5*time.Minute)
				close(stop)
				heap = <-peak
				s = run.stats(nil)
				late = run.stats(func(q *olRequest) bool { return after > 0 && q.at >= after })
				b.Logf("%s, %s: %s; first error: %s", title, row.name, s, s.firstErr)
				_ = r.run.stop(time.Second)
				for _, rep := range reps {
					rep.stop()
				}
			}
			b.ReportMetric(s.hitRatio(), "hit-ratio")
			b.ReportMetric(s.pct(0.5), "ttft-p50-ms")
			b.ReportMetric(s.pct(0.9), "ttft-p90-ms")
			b.ReportMetric(s.pct(0.99), "ttft-p99-ms")
			b.ReportMetric(float64(s.ok), "answered")
			b.ReportMetric(float64(s.shed), "shed")
			b.ReportMetric(float64(s.failed), "failed")
			b.ReportMetric(s.refusedPct(0.99), "refused-p99-ms")
			b.ReportMetric(s.refusedPct(1), "refused-max-ms")
			b.ReportMetric(heap, "heap-max-MiB")
			if after > 0 {
				b.ReportMetric(late.pct(0.99), "recovered-ttft-p99-ms")
			}
		})
		if s != nil {
			recovered := "–"
			if after > 0 {
				recovered = fmt.Sprintf("%.0f", late.pct(0.99))
			}
			fmt.Fprintf(&t, "| %s | %.3f | %.0f / %.0f / %.0f | %d | %d | %d | %.0f / %.0f | %s | %.0f |\n", row.name, s.hitRatio(),
				s.pct(0.5), s.pct(0.9), s.pct(0.99), s.ok, s.shed, s.failed, s.refusedPct(0.99), s.refusedPct(1), recovered, heap)
		}
	}
	return t.String()
}

// heapPeak samples the process's heap in use every second until stop
// closes and returns the largest, in MiB: the router runs in the test's
// process.
func heapPeak(stop <-chan struct{}) float64 {
	var most uint64
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		most = max(most, m.HeapInuse)
		select {
		case <-stop:
			return float64(most) / (1 << 20)
		case <-tick.C:
		}
	}
}
