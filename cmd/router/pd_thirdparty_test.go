package main

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Prefill/decode disaggregation through the third-party simulator, which
// speaks vLLM's protocol: a prefill request (kv_transfer_params with
// do_remote_decode) is answered with the parameters of its KV, a decode
// request with do_remote_prefill parameters waits the configured transfer
// time instead of computing the prompt. Each replica sits behind a
// recording proxy of the test's, which counts what it was sent and, for
// the fault runs, strips the parameters from prefill answers.

// pdProxy forwards to one simulator and counts the requests it sent with
// do_remote_decode (prefills) and with do_remote_prefill (decodes given a
// prefill's parameters); with strip set it takes kv_transfer_params out
// of the answers (a prefill replica whose connector is misconfigured);
// with hang set it takes prefills and never answers them (a hung engine
// whose server still accepts them and answers its health checks).
type pdProxy struct {
	target             string
	prefills, decodes  atomic.Int64
	others             atomic.Int64
	strip              atomic.Bool
	hang               atomic.Bool
	hung               atomic.Int64 // prefills taken while hanging
	client             *http.Client
	mu                 sync.Mutex
	lastDecode, lastPF map[string]any
}

func (p *pdProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var m map[string]any
	if strings.HasSuffix(r.URL.Path, "/completions") && json.Unmarshal(body, &m) == nil { // not /tokenize
		kv, _ := m["kv_transfer_params"].(map[string]any)
		if kv["do_remote_decode"] == true && p.hang.Load() {
			p.hung.Add(1)
			<-r.Context().Done() // until the router gives up on it
			return
		}
		p.mu.Lock()
		switch {
		case kv["do_remote_decode"] == true:
			p.prefills.Add(1)
			p.lastPF = kv
		case kv["do_remote_prefill"] == true:
			p.decodes.Add(1)
			p.lastDecode = kv
		default:
			p.others.Add(1)
		}
		p.mu.Unlock()
	}
	out, _ := http.NewRequestWithContext(r.Context(), r.Method, p.target+r.URL.RequestURI(), bytes.NewReader(body))
	out.Header = r.Header.Clone()
	resp, err := p.client.Do(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	if p.strip.Load() && !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		b, _ := io.ReadAll(resp.Body)
		var a map[string]json.RawMessage
		if json.Unmarshal(b, &a) == nil {
			delete(a, "kv_transfer_params")
			b, _ = json.Marshal(a)
		}
		w.Header().Del("Content-Length")
		w.WriteHeader(resp.StatusCode)
		_, _ = w.Write(b)
		return
	}
	w.WriteHeader(resp.StatusCode)
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			_, _ = w.Write(buf[:n])
			w.(http.Flusher).Flush()
		}
		if err != nil {
			return
		}
	}
}

// pdFleet is 2 prefill and 2 decode simulators, each behind a pdProxy.
type pdFleet struct {
	reps            []*tpReplica
	prefill, decode []*pdProxy
}

func startPDFleet(t testing.TB, args ...string) *pdFleet {
	t.Helper()
	f := &pdFleet{reps: startThirdParty(t, tpOptions{n: 4, args: append([]string{"--kv-cache-transfer-latency", "5ms", "--kv-cache-transfer-time-per-token", "50us"}, args...)})}
	for i, rep := range f.reps {
		p := &pdProxy{target: rep.url, client: &http.Client{}}
		ts := httptest.NewServer(p)
		t.Cleanup(ts.Close)
		p.target = rep.url
		if i < 2 {
			f.prefill = append(f.prefill, p)
		} else {
			f.decode = append(f.decode, p)
		}
		rep.proxied = ts.URL
	}
	return f
}

// config returns the replicas' YAML: tp-0 and tp-1 prefill, tp-2 and tp-3
// decode, each at its proxy.
func (f *pdFleet) config(policy string, minPrefill int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "log:\n  level: warn\ndisaggregation:\n  min_prefill_tokens: %d\n", minPrefill)
	if policy != "" {
		fmt.Fprintf(&b, "routing:\n  policy: %s\n", policy)
	}
	b.WriteString("replicas:\n")
	for i, rep := range f.reps {
		role := "decode"
		if i < 2 {
			role = "prefill"
		}
		fmt.Fprintf(&b, "  - name: tp-%d\n    url: %s\n    role: %s\n    max_running: 4\n", i, rep.proxied, role)
	}
	return b.String()
}

// pdWork is a prefill-heavy workload: questions about 20 long shared
// documents (about 1,300 tokens each, each asked about as often), answered
// in 8 tokens, streamed with usage. The documents hold twice what one
// simulator's cache does (768 blocks, 12,288 tokens) and about what two
// do: a prefill pool that splits them between its replicas keeps them.
func pdWork(n int, seed uint64) [][]byte {
	r := rand.New(rand.NewPCG(seed, 11))
	docs := make([]string, 20)
	for i := range docs {
		docs[i] = fmt.Sprintf("Document %d. ", i) + words(fmt.Sprint("pd", i), 1000+r.IntN(300))
	}
	out := make([][]byte, n)
	for i := range out {
		body, _ := json.Marshal(map[string]any{"model": tpModel, "stream": true, "stream_options": map[string]any{"include_usage": true},
			"max_tokens": 8, "messages": []map[string]any{
				{"role": "system", "content": docs[r.IntN(len(docs))]},
				{"role": "user", "content": fmt.Sprintf("Question %d: %s", i, words(fmt.Sprint("q", i), 12))}}})
		out[i] = body
	}
	return out
}

// TestThirdPartyDisaggregation: through 2 prefill and 2 decode simulators,
// every request is answered; each prefill replica is sent do_remote_decode,
// each decode replica the kv_transfer_params a prefill replica returned,
// and the simulators' own metrics count the prefills they finished for a
// remote decode. Then the faults: a prefill answer stripped of its
// kv_transfer_params (counted, answered), a prefill replica killed
// mid-load and a decode replica killed mid-load (no request fails).
func TestThirdPartyDisaggregation(t *testing.T) {
	f := startPDFleet(t, "--prefill-time-per-token", "200us") // a tenth of the measurements': the protocol, not the timing, is tested
	r := startRouterYAML(t, f.config("", -1))
	work := pdWork(30, 1)
	run := sendTruth(r.url, work, 4, nil)
	if run.errors != 0 {
		t.Fatalf("%d of %d failed; first: %s", run.errors, len(work), run.firstErr)
	}
	var prefills, decodes, remote int64
	for i, p := range f.prefill {
		prefills += p.prefills.Load()
		if p.decodes.Load()+p.others.Load() != 0 {
			t.Errorf("prefill replica %d was sent %d decodes and %d others", i, p.decodes.Load(), p.others.Load())
		}
		remote += int64(metric(t, f.reps[i].url, "vllm:request_success_total", `finish_reason="remote_decode"`))
	}
	for i, p := range f.decode {
		decodes += p.decodes.Load()
		if p.prefills.Load() != 0 {
			t.Errorf("decode replica %d was sent %d prefills", i, p.prefills.Load())
		}
	}
	t.Logf("%d requests: prefills sent %d, finished for a remote decode by the simulators %d; decodes sent with a prefill's kv_transfer_params %d; engine hit ratio %.3f, TTFT p50 %.0f ms",
		len(work), prefills, remote, decodes, run.hitRatio(), 1000*run.pct(0.5))
	if prefills != int64(len(work)) || remote != prefills || decodes != prefills {
		t.Fatalf("prefills %d, finished for a remote decode %d, decodes with parameters %d; want %d each", prefills, remote, decodes, len(work))
	}
	f.decode[0].mu.Lock()
	last := f.decode[0].lastDecode
	f.decode[0].mu.Unlock()
	if last["remote_engine_id"] == nil || last["remote_block_ids"] == nil {
		t.Fatalf("a decode replica's kv_transfer_params lack the prefill's: %v", last)
	}
	// The decode replicas' time to first byte is timed, and holds the
	// transfer the simulators were told to take (5 ms and more each).
	n, sum := metric(t, r.url, "semroute_pd_decode_first_byte_seconds_count", ""), metric(t, r.url, "semroute_pd_decode_first_byte_seconds_sum", "")
	t.Logf("decode replicas' first byte: %.0f timed, mean %.1f ms", n, 1000*sum/n)
	if n != float64(len(work)) || sum/n < 0.005 {
		t.Fatalf("decode first bytes timed %.0f (want %d), mean %.4f s (the transfer alone is 5 ms)", n, len(work), sum/n)
	}

	// A prefill answer without kv_transfer_params: the decode replica computes.
	for _, p := range f.prefill {
		p.strip.Store(true)
	}
	before := metric(t, r.url, "semroute_pd_fallbacks_total", `reason="no_transfer_params"`)
	run = sendTruth(r.url, pdWork(6, 2), 2, nil)
	after := metric(t, r.url, "semroute_pd_fallbacks_total", `reason="no_transfer_params"`)
	if run.errors != 0 || after-before != 6 {
		t.Fatalf("stripped prefill answers: %d failed (%s), %.0f counted", run.errors, run.firstErr, after-before)
	}
	for _, p := range f.prefill {
		p.strip.Store(false)
	}

	// A prefill replica, then a decode replica, killed mid-load.
	for _, kill := range []struct {
		name string
		rep  *tpReplica
	}{{"prefill", f.reps[0]}, {"decode", f.reps[2]}} {
		work := pdWork(24, 3)
		run := sendTruth(r.url, work, 4, func(i int) {
			if i == 8 {
				kill.rep.stop()
			}
		})
		t.Logf("%s replica killed after 8 of %d requests: %d failed (%d of them streams broken off after they began); engine hit ratio %.3f",
			kill.name, len(work), run.errors, run.broken, run.hitRatio())
		if run.errors-run.broken != 0 || kill.name == "prefill" && run.errors != 0 {
			t.Fatalf("%s replica killed: %d failed, %d before their stream began; first: %s", kill.name, run.errors, run.errors-run.broken, run.firstErr)
		}
	}
}

// pdStats is a run's client-side timings: TTFT and inter-token latency
// (the gaps between content chunks after the first), in seconds.
type pdStats struct {
	ttft, itl []float64
	errors    int
	firstErr  string
}

func pctOf(s []float64, q float64) float64 {
	s = append([]float64(nil), s...)
	sort.Float64s(s)
	if len(s) == 0 {
		return 0
	}
	return s[min(int(q*float64(len(s))), len(s)-1)]
}

// sendTimed sends work through url with workers clients and times every
// content chunk of each streamed answer.
func sendTimed(url string, work [][]byte, workers int) *pdStats {
	st := &pdStats{}
	var mu sync.Mutex
	next := make(chan []byte)
	var wg sync.WaitGroup
	client := &http.Client{Timeout: 2 * time.Minute}
	for range workers {
		wg.Go(func() {
			for body := range next {
				start := time.Now()
				resp, err := client.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
				if err != nil || resp.StatusCode != 200 {
					mu.Lock()
					st.errors++
					st.firstErr = cmp.Or(st.firstErr, fmt.Sprint(err, statusOfResp(resp)))
					mu.Unlock()
					if resp != nil {
						resp.Body.Close()
					}
					continue
				}
				var times []time.Time
				sc := bufio.NewScanner(resp.Body)
				sc.Buffer(make([]byte, 1<<20), 1<<20)
				for sc.Scan() {
					if line := sc.Bytes(); bytes.HasPrefix(line, []byte("data: {")) && bytes.Contains(line, []byte(`"content":"`)) {
						times = append(times, time.Now())
					}
				}
				resp.Body.Close()
				mu.Lock()
				if len(times) == 0 {
					st.errors++
					st.firstErr = cmp.Or(st.firstErr, "a stream without content")
				} else {
					st.ttft = append(st.ttft, times[0].Sub(start).Seconds())
					for i := 1; i < len(times); i++ {
						st.itl = append(st.itl, times[i].Sub(times[i-1]).Seconds())
					}
				}
				mu.Unlock()
			}
		})
	}
	for _, b := range work {
		next <- b
	}
	close(next)
	wg.Wait()
	return st
}

func statusOfResp(r *http.Response) string {
	if r == nil {
		return ""
	}
	return r.Status
}

// BenchmarkThirdPartyDisaggregation measures, on the prefill-heavy
// workload (400 requests, 8 clients), through 4 simulators: 2 prefill and
// 2 decode with the default policy (cache-aware) and with round robin,
// every request disaggregated; then disaggregated with the default
// threshold; then aggregated on the same 4 (every replica whole). A
// sub-benchmark a configuration reports the prefill pool's hit ratio from
// the simulators' own prefix-cache counters (disaggregated only), TTFT
// and inter-token latency p50 / p99, the failed requests and the
// prefills sent; a disaggregated configuration whose prefill replicas
// were sent no prefill fails, as it measured nothing of disaggregation
// (TestThirdPartyDisaggregation checks the protocol itself). It logs the
// table. Run with
//
//	SEMROUTE_THIRDPARTY_SIM=/path/to/llm-d-inference-sim SEMROUTE_THIRDPARTY_PD=1 \
//	  go test -run '^$' -bench BenchmarkThirdPartyDisaggregation -benchtime 1x -v -timeout 30m ./cmd/router
//
// SEMROUTE_THIRDPARTY_ROWS keeps some rows, as for BenchmarkThirdPartyTable.
func BenchmarkThirdPartyDisaggregation(b *testing.B) {
	if os.Getenv("SEMROUTE_THIRDPARTY_PD") == "" {
		b.Skip("set SEMROUTE_THIRDPARTY_PD=1 to measure")
	}
	thirdPartyBin(b)
	work := pdWork(400, 7)
	var t strings.Builder
	t.WriteString("\n| configuration | prefill pool hit ratio | TTFT p50 / p99 ms | ITL p50 / p99 ms | failed |\n|---|---:|---|---|---:|\n")
	for _, row := range []struct {
		name, policy string
		minPrefill   int
		aggregated   bool
	}{
		{"disaggregated 2+2, cache-aware prefill (default policy), always", "", -1, false},
		{"disaggregated 2+2, round robin, always", "round_robin", -1, false},
		{"disaggregated 2+2, cache-aware, min_prefill_tokens 256", "", 256, false},
		{"aggregated, the same 4, default policy", "", 0, true},
	} {
		if !tpWanted(row.name) {
			continue
		}
		var st *pdStats
		var hit float64
		var prefills int64
		b.Run(row.name, func(b *testing.B) {
			for range b.N {
				f := startPDFleet(b)
				cfg := f.config(row.policy, row.minPrefill)
				if row.aggregated {
					cfg = strings.NewReplacer("role: prefill", "role: both", "role: decode", "role: both").Replace(cfg)
				}
				r := startRouterYAML(b, cfg)
				hits := func() (h, q float64) {
					for _, rep := range f.reps[:2] {
						h += metric(b, rep.url, "vllm:prefix_cache_hits_total", "")
						q += metric(b, rep.url, "vllm:prefix_cache_queries_total", "")
					}
					return h, q
				}
				h0, q0 := hits()
				st = sendTimed(r.url, work, 8)
				h1, q1 := hits()
				hit = (h1 - h0) / max(q1-q0, 1)
				prefills = f.prefill[0].prefills.Load() + f.prefill[1].prefills.Load()
				b.Logf("%s: prefills %d; first error: %s", row.name, prefills, st.firstErr)
				_ = r.run.stop(time.Second)
				for _, rep := range f.reps {
					rep.stop()
				}
			}
			if !row.aggregated {
				b.ReportMetric(hit, "prefill-hit-ratio")
			}
			b.ReportMetric(1000*pctOf(st.ttft, 0.5), "ttft-p50-ms")
			b.ReportMetric(1000*pctOf(st.ttft, 0.99), "ttft-p99-ms")
			b.ReportMetric(1000*pctOf(st.itl, 0.5), "itl-p50-ms")
			b.ReportMetric(1000*pctOf(st.itl, 0.99), "itl-p99-ms")
			b.ReportMetric(float64(st.errors), "failed")
			b.ReportMetric(float64(prefills), "prefills")
			if !row.aggregated && prefills == 0 {
				b.Fatalf("%s: the prefill replicas were sent no prefill: nothing was disaggregated", row.name)
			}
		})
		if st == nil {
			continue
		}
		hitCell := "–"
		if !row.aggregated {
			hitCell = fmt.Sprintf("%.3f", hit)
		}
		fmt.Fprintf(&t, "| %s | %s | %.0f / %.0f | %.1f / %.1f | %d |\n", row.name, hitCell,
			1000*pctOf(st.ttft, 0.5), 1000*pctOf(st.ttft, 0.99), 1000*pctOf(st.itl, 0.5), 1000*pctOf(st.itl, 0.99), st.errors)
	}
	b.Log(t.String())
}
