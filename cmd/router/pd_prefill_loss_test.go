package main

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// lossRun is one run of the prefill-loss workload: its client-side
// timings, and what the router counted.
type lossRun struct {
	*truthRun
	fallbacks map[string]float64 // semroute_pd_fallbacks_total by reason
	timeouts  float64            // tp-0's upstream errors of kind timeout
	hung      int64              // prefills tp-0's proxy took and never answered
}

// pdFallbackReasons are the reasons semroute_pd_fallbacks_total counts.
var pdFallbackReasons = []string{"no_prefill_replica", "prefill_failed", "prefill_timeout", "prefill_refused", "no_transfer_params"}

// runPrefillLoss sends n requests of the prefill-heavy workload through
// 2 prefill and 2 decode simulators, 4 at a time, every one
// disaggregated; with fault "kill" prefill replica tp-0's simulator is
// killed before request n/4 is sent, with "hang" its proxy takes every
// prefill from then on and never answers. extra is more of the router's
// YAML.
func runPrefillLoss(t testing.TB, fault string, n int, extra string, simArgs ...string) *lossRun {
	t.Helper()
	f := startPDFleet(t, simArgs...)
	r := startRouterYAML(t, f.config("", -1)+extra)
	run := sendTruth(r.url, pdWork(n, 5), 4, func(i int) {
		if i != n/4 {
			return
		}
		switch fault {
		case "kill":
			f.reps[0].stop()
		case "hang":
			f.prefill[0].hang.Store(true)
		}
	})
	lr := &lossRun{truthRun: run, fallbacks: map[string]float64{}, hung: f.prefill[0].hung.Load(),
		timeouts: metric(t, r.url, "semroute_upstream_errors_total", `kind="timeout",replica="tp-0"`)}
	for _, reason := range pdFallbackReasons {
		lr.fallbacks[reason] = metric(t, r.url, "semroute_pd_fallbacks_total", fmt.Sprintf("reason=%q", reason))
	}
	_ = r.run.stop(time.Second)
	for _, rep := range f.reps {
		rep.stop()
	}
	return lr
}

// TestThirdPartyPrefillLoss (issue 43, item 7): through 2 prefill and 2
// decode simulators, prefill replica tp-0 killed a quarter of the way
// into the load, then, on a new fleet, hung (its proxy takes prefills and
// never answers them, while its health checks pass): no request fails,
// none waits for the general first-byte timeout (300 s; the client gives
// up after 60), each prefill left hanging is cancelled at its own bound
// and its request served by its decode replica, counted as
// prefill_timeout. The TTFT p99 of each run is logged beside the run's
// without a fault (BenchmarkThirdPartyPrefillLoss measures them on more
// requests, at the measured simulators' speed).
func TestThirdPartyPrefillLoss(t *testing.T) {
	thirdPartyBin(t)
	fast := []string{"--prefill-time-per-token", "200us"}
	// A 1 s floor bounds a prefill of these prompts (about 1,300 tokens,
	// a third of a second at 200 µs a token) at 3.6 s, not 12.6: the hung
	// replica's requests wait less, the test's checks are the same.
	const bound = "timeouts:\n  prefill_floor: 1s\n"
	base := runPrefillLoss(t, "none", 40, bound, fast...)
	if base.errors != 0 {
		t.Fatalf("no fault: %d failed; first: %s", base.errors, base.firstErr)
	}
	for _, fault := range []string{"kill", "hang"} {
		lr := runPrefillLoss(t, fault, 40, bound, fast...)
		t.Logf("tp-0 %s: TTFT p99 %.0f ms (%.2fx the run without a fault, %.0f ms); failed %d; fallbacks %v; tp-0 timeouts %.0f, prefills it hung on %d",
			fault, 1000*lr.pct(0.99), lr.pct(0.99)/base.pct(0.99), 1000*base.pct(0.99), lr.errors, lr.fallbacks, lr.timeouts, lr.hung)
		if lr.errors != 0 {
			t.Fatalf("tp-0 %s: %d of 40 failed; first: %s", fault, lr.errors, lr.firstErr)
		}
		if fault == "hang" && (lr.hung == 0 || lr.fallbacks["prefill_timeout"] != float64(lr.hung) || lr.timeouts != float64(lr.hung)) {
			t.Fatalf("tp-0 hung on %d prefills; counted %.0f prefill_timeout fallbacks and %.0f timeouts: want one each", lr.hung, lr.fallbacks["prefill_timeout"], lr.timeouts)
		}
	}
}

// BenchmarkThirdPartyPrefillLoss measures the prefill-heavy workload
// through 2 prefill and 2 decode simulators (the measured simulators'
// speeds), with no fault, with prefill replica tp-0 killed a quarter of
// the way in, and with it hung (accepting prefills, never answering) from
// then on: a sub-benchmark each reporting TTFT p50 and p99, the p99's
// ratio to the run without a fault, the failed requests, the fallbacks by
// reason, tp-0's timeouts, the prefills it hung on and the engines' hit
// ratio. It logs the table. (TestThirdPartyPrefillLoss checks, at a tenth
// of the prefill time, that none of it fails a request.) Run with
//
//	SEMROUTE_THIRDPARTY_SIM=/path/to/llm-d-inference-sim SEMROUTE_THIRDPARTY_PD=1 \
//	  go test -run '^$' -bench BenchmarkThirdPartyPrefillLoss -benchtime 1x -v -timeout 30m ./cmd/router
//
// SEMROUTE_PD_LOSS_N sets the requests of each run (default 120);
// SEMROUTE_PD_LOSS_YAML adds to the router's YAML (e.g. "timeouts:\n  first_byte: 10s\n").
func BenchmarkThirdPartyPrefillLoss(b *testing.B) {
	if os.Getenv("SEMROUTE_THIRDPARTY_PD") == "" {
		b.Skip("set SEMROUTE_THIRDPARTY_PD=1 to measure")
	}
	thirdPartyBin(b)
	n := 120
	fmt.Sscan(os.Getenv("SEMROUTE_PD_LOSS_N"), &n)
	extra := strings.ReplaceAll(os.Getenv("SEMROUTE_PD_LOSS_YAML"), `\n`, "\n")
	var t strings.Builder
	t.WriteString("\n| prefill replica tp-0 | TTFT p50 / p99 ms | p99 / no fault | failed | fallbacks | tp-0 timeouts | prefills tp-0 hung on | engine hit ratio |\n|---|---|---:|---:|---|---:|---:|---:|\n")
	var base float64
	for _, fault := range []string{"none", "kill", "hang"} {
		var lr *lossRun
		b.Run(fault, func(b *testing.B) {
			for range b.N {
				lr = runPrefillLoss(b, fault, n, extra)
			}
			b.ReportMetric(1000*lr.pct(0.5), "ttft-p50-ms")
			b.ReportMetric(1000*lr.pct(0.99), "ttft-p99-ms")
			if base != 0 {
				b.ReportMetric(lr.pct(0.99)/base, "p99/no-fault")
			}
			b.ReportMetric(float64(lr.errors), "failed")
			for _, reason := range pdFallbackReasons {
				b.ReportMetric(lr.fallbacks[reason], reason+"-fallbacks")
			}
			b.ReportMetric(lr.timeouts, "tp-0-timeouts")
			b.ReportMetric(float64(lr.hung), "tp-0-hung")
			b.ReportMetric(lr.hitRatio(), "hit-ratio")
			b.Logf("%s: TTFT deciles (ms) %.0f", fault, deciles(lr.ttfts))
			if lr.errors != 0 {
				b.Logf("%s: first error: %s", fault, lr.firstErr)
			}
		})
		if lr == nil {
			continue
		}
		p99 := lr.pct(0.99)
		if fault == "none" {
			base = p99
		}
		var fb []string
		for _, reason := range pdFallbackReasons {
			if v := lr.fallbacks[reason]; v != 0 {
				fb = append(fb, fmt.Sprintf("%s %.0f", reason, v))
			}
		}
		fmt.Fprintf(&t, "| %s | %.0f / %.0f | %.2f | %d | %s | %.0f | %d | %.3f |\n", fault, 1000*lr.pct(0.5), 1000*p99, p99/base, lr.errors,
			strings.Join(fb, ", "), lr.timeouts, lr.hung, lr.hitRatio())
	}
	b.Log(t.String())
}

// deciles returns the 10th to the 100th percentiles of seconds s, in ms.
func deciles(s []float64) []float64 {
	out := make([]float64, 10)
	for i := range out {
		out[i] = 1000 * pctOf(s, float64(i+1)/10)
	}
	return out
}
