package main

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/semroute/semroute/internal/numbered"
)

// latencyResult is one target's latency figures in one case.
type latencyResult struct {
	p50, p99 time.Duration // medians over the rounds
	// added50, added99 are the medians over the rounds of the target's
	// p50 and p99 minus the replica's in the same round.
	added50, added99 time.Duration
	errors           int64
}

// run starts the targets, measures each body size and mode o asks for,
// and prints the table to out, then the router's ratios to the plain
// proxy and to nginx.
func run(out io.Writer, o options) error {
	targets, stop, err := startTargets(out, o)
	if err != nil {
		return err
	}
	defer stop()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: 0}}
	defer client.CloseIdleConnections()

	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "body\tmode\ttarget\tp50\tp99\tadded p50\tadded p99\tclients\treq/s\tCPU/req\tTTFT p50 loaded\tTTFT p99 loaded\terrors\t")
	var lines []string
	for _, size := range o.sizes {
		for _, stream := range o.modes {
			lines = append(lines, measureCase(tw, client, targets, size, stream, o)...)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err = fmt.Fprintln(out, "\n"+strings.Join(lines, "\n"))
	return err
}

// measureCase measures the targets with bodies of size bytes, streamed or
// not: latency, then throughput at each client count, each a row per
// target in tw. It returns the lines of the router's ratios.
func measureCase(tw io.Writer, client *http.Client, targets []target, size int, stream bool, o options) []string {
	gen := numbered.New(size, stream)
	mode := "whole"
	if stream {
		mode = "stream"
	}
	urls := make([]string, len(targets))
	for i, t := range targets {
		urls[i] = t.url
	}
	res := measureLatency(client, urls, gen, o.requests, o.rounds)
	var lines []string
	for _, clients := range o.concurrency {
		tp := measureThroughput(client, targets, gen, clients, o)
		for i, t := range targets {
			writeRow(tw, gen.Len(), mode, t.name, clients, i == 0, res[i], tp[i])
		}
		lines = append(lines, ratios(targets, res, tp, gen.Len(), mode, clients, clients == o.concurrency[0])...)
	}
	return lines
}

// writeRow writes one target's row to tw; the replica's (replica) has no
// added latency, and a CPU time not measured is n/a.
func writeRow(tw io.Writer, size int, mode, name string, clients int, replica bool, res latencyResult, tp throughputResult) {
	added50, added99 := "", ""
	if !replica {
		added50 = res.added50.Round(time.Microsecond).String()
		added99 = res.added99.Round(time.Microsecond).String()
	}
	cpu := "n/a"
	if tp.cpuPerReq > 0 {
		cpu = tp.cpuPerReq.Round(time.Microsecond).String()
	}
	fmt.Fprintf(tw, "%d B\t%s\t%s\t%v\t%v\t%s\t%s\t%d\t%.0f\t%s\t%v\t%v\t%d\t\n", size, mode, name,
		res.p50.Round(time.Microsecond), res.p99.Round(time.Microsecond), added50, added99,
		clients, tp.throughput, cpu, tp.ttft50.Round(time.Microsecond), tp.ttft99.Round(time.Microsecond), res.errors+tp.errors)
}

// ratios states the router against the plain proxy and, if measured,
// against nginx: added p99, requests per second and CPU per request.
func ratios(targets []target, res []latencyResult, tp []throughputResult, size int, mode string, clients int, first bool) []string {
	idx := map[string]int{}
	for i, t := range targets {
		idx[t.name] = i
	}
	r := idx["router"]
	var out []string
	if p := idx["plain proxy"]; first {
		ratio := "n/a (the plain proxy added no p99)"
		if res[p].added99 > 0 {
			ratio = fmt.Sprintf("%.2f×", float64(res[r].added99)/float64(res[p].added99))
		}
		out = append(out, fmt.Sprintf("%d B %s: router added p99 ÷ plain proxy's: %s", size, mode, ratio))
	}
	if n, ok := idx["nginx"]; ok && tp[n].cpuPerReq > 0 && tp[n].throughput > 0 {
		line := fmt.Sprintf("%d B %s, %d clients: router ÷ nginx: CPU per request %.2f×, requests/s %.2f×", size, mode, clients,
			float64(tp[r].cpuPerReq)/float64(tp[n].cpuPerReq), tp[r].throughput/tp[n].throughput)
		if res[n].added50 > 0 {
			line += fmt.Sprintf(", added p50 %.2f×", float64(res[r].added50)/float64(res[n].added50))
		}
		out = append(out, line)
	}
	return out
}

func post(client *http.Client, u string, body []byte) error {
	_, err := firstByte(client, u, body)
	return err
}

// firstByte sends one request and returns the time to the first byte
// of its answer's body (its TTFT, streamed or not), after reading it all.
func firstByte(client *http.Client, u string, body []byte) (time.Duration, error) {
	start := time.Now()
	resp, err := client.Post(u+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	var one [1]byte
	_, err = io.ReadFull(resp.Body, one[:])
	first := time.Since(start)
	if err == nil {
		_, err = io.Copy(io.Discard, resp.Body)
	}
	resp.Body.Close()
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %d", resp.StatusCode)
	}
	return first, err
}

// measureLatency sends rounds × n sequential requests to each target,
// interleaved (one to each in turn) so that every target meets the same
// background noise. Each round gives every target a p50 and a p99, and its
// added latency: its own minus the replica's (the first URL's) in that
// round. The result is the median over rounds of each, so that one noisy
// stretch of a shared machine does not decide a tail.
func measureLatency(client *http.Client, urls []string, gen *numbered.Bodies, n, rounds int) []latencyResult {
	res := make([]latencyResult, len(urls))
	for i := 0; i < 50; i++ { // warm up connections
		for _, u := range urls {
			_ = post(client, u, gen.Next())
		}
	}
	var p50, p99, add50, add99 = make([][]time.Duration, len(urls)), make([][]time.Duration, len(urls)),
		make([][]time.Duration, len(urls)), make([][]time.Duration, len(urls))
	for range rounds {
		lat := make([][]time.Duration, len(urls))
		for i := 0; i < n; i++ {
			for t, u := range urls {
				body := gen.Next()
				t0 := time.Now()
				if err := post(client, u, body); err != nil {
					res[t].errors++
					continue
				}
				lat[t] = append(lat[t], time.Since(t0))
			}
		}
		for t := range urls {
			l := lat[t]
			if len(l) == 0 {
				continue
			}
			sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
			p50[t] = append(p50[t], l[len(l)/2])
			p99[t] = append(p99[t], l[min(len(l)-1, len(l)*99/100)])
		}
		if len(p50[0]) == 0 {
			continue
		}
		for t := range urls {
			if len(p50[t]) > 0 {
				add50[t] = append(add50[t], p50[t][len(p50[t])-1]-p50[0][len(p50[0])-1])
				add99[t] = append(add99[t], p99[t][len(p99[t])-1]-p99[0][len(p99[0])-1])
			}
		}
	}
	for t := range urls {
		res[t].p50, res[t].p99 = median(p50[t]), median(p99[t])
		res[t].added50, res[t].added99 = median(add50[t]), median(add99[t])
	}
	return res
}

// median returns the middle of ds (the upper middle of an even count), 0
// for none.
func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// throughputResult is one target's throughput at a client count: the
// medians over the rounds of its requests per second and of the CPU its
// processes spent per request (0: not measured), and the errors.
type throughputResult struct {
	throughput float64
	cpuPerReq  time.Duration
	errors     int64
	// ttft50, ttft99: the medians over the rounds of the time to the
	// answer's first byte under this load.
	ttft50, ttft99 time.Duration
}

// measureThroughput drives each target with clients concurrent clients for
// o.duration, --throughput-rounds times, the targets interleaved within
// each round (each round starting at the next target, so that none always
// runs first) so that they meet the same background noise, and reads each
// target's CPU time from /proc before and after its phase.
func measureThroughput(client *http.Client, targets []target, gen *numbered.Bodies, clients int, o options) []throughputResult {
	out := make([]throughputResult, len(targets))
	tps, cpus := make([][]float64, len(targets)), make([][]time.Duration, len(targets))
	t50s, t99s := make([][]time.Duration, len(targets)), make([][]time.Duration, len(targets))
	for round := range o.tpRounds {
		for n := range targets {
			i := (round + n) % len(targets)
			t := targets[i]
			cpu0, okCPU := cpuTime(t.pids())
			var done, errs atomic.Int64
			start := time.Now()
			deadline := start.Add(o.duration)
			var wg sync.WaitGroup
			firsts := make([][]time.Duration, clients)
			for c := 0; c < clients; c++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(deadline) {
						d, err := firstByte(client, t.url, gen.Next())
						if err != nil {
							errs.Add(1)
							continue
						}
						firsts[c] = append(firsts[c], d)
						done.Add(1)
					}
				}()
			}
			wg.Wait()
			if all := slices.Concat(firsts...); len(all) > 0 {
				slices.Sort(all)
				t50s[i] = append(t50s[i], all[len(all)/2])
				t99s[i] = append(t99s[i], all[min(len(all)-1, len(all)*99/100)])
			}
			elapsed := time.Since(start)
			cpu1, okCPU1 := cpuTime(t.pids())
			tps[i] = append(tps[i], float64(done.Load())/elapsed.Seconds())
			if okCPU && okCPU1 && done.Load() > 0 {
				cpus[i] = append(cpus[i], (cpu1-cpu0)/time.Duration(done.Load()))
			}
			out[i].errors += errs.Load()
		}
	}
	for i := range targets {
		sort.Float64s(tps[i])
		out[i].throughput = tps[i][len(tps[i])/2]
		out[i].cpuPerReq = median(cpus[i])
		out[i].ttft50, out[i].ttft99 = median(t50s[i]), median(t99s[i])
	}
	return out
}
