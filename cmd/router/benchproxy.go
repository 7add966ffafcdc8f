package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	neturl "net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/internal/httpserve"
	"github.com/semroute/semroute/router"
	"github.com/semroute/semroute/simreplica"
)

// benchOptions shape `router benchproxy`.
type benchOptions struct {
	requests    int           // sequential requests per target per round, for latency
	rounds      int           // latency rounds; the medians over them are reported
	concurrency []int         // client counts of the throughput phases; each is reported
	duration    time.Duration // throughput phase per client count
	sizes       []int         // request body sizes in bytes
	tpRounds    int           // throughput rounds per client count; medians over them are reported
	nginx       string        // nginx binary: "auto" (PATH or /usr/sbin), a path, or "off"
	cpuProfile  string        // file for the router's CPU profile over the whole run; "": none
	modes       []bool        // stream or not, in order
}

// benchResult is one target's figures in one case.
type benchResult struct {
	p50, p99 time.Duration // medians over the rounds
	// added50, added99 are the medians over the rounds of the target's
	// p50 and p99 minus the replica's in the same round.
	added50, added99 time.Duration
	errors           int64
}

func newBenchProxy() *cobra.Command {
	o := benchOptions{}
	var sizes, conc, target, upstream, profile, modes string
	cmd := &cobra.Command{
		Use:   "benchproxy",
		Short: "Measure the latency and CPU the router adds, beside a plain Go reverse proxy and nginx, in front of an instant simulated replica",
		Long: `Starts one simulated replica that answers at once, and in front of it the router, a
plain httputil.ReverseProxy with the router's proxy settings (flushing event streams at
once, pooled buffers), and nginx if it is installed (keep-alive upstream connections, proxy_buffering
off; --nginx), each in its own processes on 127.0.0.1, and drives them all with the same
load generator in this process. Every request is a new prompt (numbered), so the router
records every block. --rounds rounds of sequential requests for latency, interleaved
across the targets so they meet the same background noise (p50, p99, and added latency:
the target's minus the replica's own in the same round; each the median over the
rounds); then, for each --concurrency, --throughput-rounds rounds of --duration each,
the targets interleaved, for requests per second, the CPU time each target's
processes spent per request (from /proc/PID/stat; the replica's own is not counted),
and the time to the answer's first byte under that load (TTFT p50 and p99 loaded).
Bodies of each --sizes, streaming and not. After the table, the router against the
plain proxy (added p99) and against nginx (CPU per request, requests/s, added p50).
Everything shares this machine's cores.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if target != "" {
				return serveBenchTarget(target, upstream, profile, cmd.OutOrStdout(), cmd.InOrStdin())
			}
			for _, c := range strings.Split(conc, ",") {
				var n int
				if _, err := fmt.Sscanf(strings.TrimSpace(c), "%d", &n); err != nil || n < 1 {
					return fmt.Errorf("--concurrency: %q is not a positive count", c)
				}
				o.concurrency = append(o.concurrency, n)
			}
			for _, s := range strings.Split(sizes, ",") {
				var n int
				if _, err := fmt.Sscanf(strings.TrimSpace(s), "%d", &n); err != nil || n < 64 {
					return fmt.Errorf("--sizes: %q is not a byte count ≥ 64", s)
				}
				o.sizes = append(o.sizes, n)
			}
			for _, m := range strings.Split(modes, ",") {
				switch strings.TrimSpace(m) {
				case "whole":
					o.modes = append(o.modes, false)
				case "stream":
					o.modes = append(o.modes, true)
				default:
					return fmt.Errorf("--modes: %q is neither whole nor stream", m)
				}
			}
			if o.requests < 1 || o.rounds < 1 || o.tpRounds < 1 {
				return fmt.Errorf("--requests, --rounds and --throughput-rounds must be at least 1")
			}
			return runBenchProxy(cmd.OutOrStdout(), o)
		},
	}
	f := cmd.Flags()
	f.IntVar(&o.requests, "requests", 5000, "sequential requests per target in each latency round")
	f.IntVar(&o.rounds, "rounds", 5, "latency rounds; p50, p99 and added latency are medians over them")
	f.StringVar(&conc, "concurrency", "8,64", "concurrent client counts of the throughput phases, comma-separated; each is reported")
	f.DurationVar(&o.duration, "duration", 2*time.Second, "one throughput phase (per target, client count and round)")
	f.IntVar(&o.tpRounds, "throughput-rounds", 3, "throughput rounds, the targets interleaved in each; requests/s and CPU per request are medians over them")
	f.StringVar(&o.nginx, "nginx", "auto", `nginx to measure beside the router: "auto" (on PATH or /usr/sbin/nginx, skipped if absent; deploy/bench/install-nginx.sh installs it), a path, or "off"`)
	f.StringVar(&sizes, "sizes", "1024,131072", "request body sizes in bytes, comma-separated")
	f.StringVar(&modes, "modes", "whole,stream", "answers measured, comma-separated: whole (one JSON body) and stream (server-sent events)")
	f.StringVar(&o.cpuProfile, "cpuprofile", "", "write the router process's CPU profile over the whole run to this file (go tool pprof reads it)")
	// The targets run in child processes of this command (see startBenchTarget).
	f.StringVar(&target, "serve-target", "", "internal: serve one target (replica, plain or router) and print its URL")
	f.StringVar(&upstream, "upstream", "", "internal: the replica's URL, for --serve-target plain or router")
	f.StringVar(&profile, "profile", "", "internal: the CPU profile file, for --serve-target router")
	_ = f.MarkHidden("profile")
	_ = f.MarkHidden("serve-target")
	_ = f.MarkHidden("upstream")
	return cmd
}

// benchBody returns a chat request body of at most size bytes whose first
// message starts with uniqueDigits zeros at the returned offset: bodyGen
// numbers each copy there, so that every prompt is new to a cache.
func benchBody(size int, stream bool) (body []byte, at int) {
	pad := strings.Repeat("lorem ipsum dolor sit amet ", size/27+1)
	for {
		b, _ := json.Marshal(map[string]any{"model": "sim-model", "stream": stream, "max_tokens": 8,
			"messages": []map[string]string{{"role": "user", "content": strings.Repeat("0", uniqueDigits) + " " + pad}}})
		if len(b) <= size {
			return b, bytes.Index(b, []byte(`"content":"`)) + len(`"content":"`)
		}
		pad = pad[:len(pad)-(len(b)-size)]
	}
}

const uniqueDigits = 12

// bodyGen hands out copies of a body, each numbered at its offset: every
// request of a benchmark is a new prompt, as the router meets them in the
// worst case (nothing cached, every block recorded). Safe for concurrent
// use.
type bodyGen struct {
	tmpl []byte
	at   int
	n    atomic.Uint64
}

func (g *bodyGen) next() []byte {
	b := bytes.Clone(g.tmpl)
	v := g.n.Add(1)
	for i := g.at + uniqueDigits - 1; i >= g.at; i-- {
		b[i] = byte('0' + v%10)
		v /= 10
	}
	return b
}

// benchTarget is one server under test: where it listens, and the
// processes whose CPU it spends.
type benchTarget struct {
	name, url string
	pids      func() []int
}

func runBenchProxy(out io.Writer, o benchOptions) error {
	var targets []benchTarget
	for _, t := range []struct{ name, role string }{{"replica", "replica"}, {"plain proxy", "plain"}, {"router", "router"}} {
		up := ""
		if len(targets) > 0 {
			up = targets[0].url
		}
		var profile string
		if t.role == "router" {
			profile = o.cpuProfile
		}
		u, pid, stop, err := startBenchTarget(t.role, up, profile)
		if err != nil {
			return fmt.Errorf("starting the %s: %w", t.name, err)
		}
		defer stop()
		targets = append(targets, benchTarget{t.name, u, func() []int { return []int{pid} }})
	}
	if o.nginx != "off" {
		bin, err := findNginx(o.nginx)
		if err != nil {
			return err
		}
		if bin == "" {
			fmt.Fprintln(out, "nginx: not found (deploy/bench/install-nginx.sh installs it); measuring without it")
		} else {
			u, pids, stop, err := startNginx(bin, targets[0].url)
			if err != nil {
				return fmt.Errorf("starting nginx: %w", err)
			}
			defer stop()
			// Beside the router: the comparison the table is read for.
			targets = slices.Insert(targets, 2, benchTarget{"nginx", u, pids})
		}
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: 0}}
	defer client.CloseIdleConnections()

	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "body\tmode\ttarget\tp50\tp99\tadded p50\tadded p99\tclients\treq/s\tCPU/req\tTTFT p50 loaded\tTTFT p99 loaded\terrors\t")
	var ratios []string
	for _, size := range o.sizes {
		for _, stream := range o.modes {
			tmpl, at := benchBody(size, stream)
			gen := &bodyGen{tmpl: tmpl, at: at}
			mode := "whole"
			if stream {
				mode = "stream"
			}
			urls := make([]string, len(targets))
			for i, t := range targets {
				urls[i] = t.url
			}
			res := benchLatency(client, urls, gen, o.requests, o.rounds)
			for _, clients := range o.concurrency {
				tp := benchThroughput(client, targets, gen, clients, o)
				for i, t := range targets {
					added50, added99 := "", ""
					if i > 0 {
						added50 = res[i].added50.Round(time.Microsecond).String()
						added99 = res[i].added99.Round(time.Microsecond).String()
					}
					cpu := "n/a"
					if tp[i].cpuPerReq > 0 {
						cpu = tp[i].cpuPerReq.Round(time.Microsecond).String()
					}
					fmt.Fprintf(tw, "%d B\t%s\t%s\t%v\t%v\t%s\t%s\t%d\t%.0f\t%s\t%v\t%v\t%d\t\n", len(tmpl), mode, t.name,
						res[i].p50.Round(time.Microsecond), res[i].p99.Round(time.Microsecond), added50, added99,
						clients, tp[i].throughput, cpu, tp[i].ttft50.Round(time.Microsecond), tp[i].ttft99.Round(time.Microsecond), res[i].errors+tp[i].errors)
				}
				ratios = append(ratios, benchRatios(targets, res, tp, len(tmpl), mode, clients, clients == o.concurrency[0])...)
			}
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(out, "\n"+strings.Join(ratios, "\n"))
	return err
}

// benchRatios states the router against the plain proxy and, if measured,
// against nginx: added p99, requests per second and CPU per request.
func benchRatios(targets []benchTarget, res []benchResult, tp []benchThroughputResult, size int, mode string, clients int, first bool) []string {
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

// startBenchTarget runs `router benchproxy --serve-target role` as a child
// process and returns the URL it serves. stop closes the child's stdin, which
// ends it, and waits; a child whose parent dies sees the same end of input.
func startBenchTarget(role, upstream, profile string) (url string, pid int, stop func(), err error) {
	exe, err := os.Executable()
	if err != nil {
		return "", 0, nil, err
	}
	cmd := exec.Command(exe, "benchproxy", "--serve-target", role, "--upstream", upstream, "--profile", profile)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return "", 0, nil, err
	}
	outp, err := cmd.StdoutPipe()
	if err != nil {
		return "", 0, nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", 0, nil, err
	}
	stop = func() {
		in.Close()
		waitOrKill(cmd)
	}
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(outp)
		if sc.Scan() {
			line <- sc.Text()
		}
		close(line)
		_, _ = io.Copy(io.Discard, outp)
	}()
	select {
	case u, ok := <-line:
		if ok && strings.HasPrefix(u, "http://") {
			return u, cmd.Process.Pid, stop, nil
		}
		stop()
		return "", 0, nil, fmt.Errorf("the %s process printed %q, not its URL", role, u)
	case <-time.After(30 * time.Second):
		stop()
		return "", 0, nil, fmt.Errorf("the %s process did not start within 30s", role)
	}
}

// waitOrKill waits for cmd, asked to end, for 10 s, then kills it.
func waitOrKill(cmd *exec.Cmd) {
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// serveBenchTarget serves one benchmark target in this process, prints its
// URL, and serves until in ends.
func serveBenchTarget(role, upstream, profile string, out io.Writer, in io.Reader) error {
	var (
		u    string
		stop func()
	)
	switch role {
	case "replica":
		sim, err := simreplica.Start(simreplica.Options{Overhead: -1, PrefillPerToken: -1, InterToken: -1, MaxRunning: 4096, OutputTokens: 8}, "127.0.0.1:0")
		if err != nil {
			return err
		}
		u, stop = sim.URL, func() { _ = sim.Close() }
	case "plain":
		target, err := neturl.Parse(upstream)
		if err != nil || target.Host == "" {
			return fmt.Errorf("--upstream %q is not a URL", upstream)
		}
		t := http.DefaultTransport.(*http.Transport).Clone() // as the router's
		t.MaxIdleConnsPerHost = 256
		plainProxy := &httputil.ReverseProxy{ // the router's proxy settings, without routing
			Rewrite: func(pr *httputil.ProxyRequest) {
				pr.SetURL(target)
				pr.SetXForwarded()
				// The transport reads once more after Content-Length bytes to
				// see the end of the body; the server may close the body as
				// soon as response headers go out (a stream's come at once),
				// and that read's error then closes the upstream connection
				// mid-response. Ending the body at its length avoids the race
				// and still streams it.
				if n := pr.In.ContentLength; n > 0 {
					pr.Out.Body = io.NopCloser(io.LimitReader(pr.In.Body, n))
				}
			},
			FlushInterval: 0, // as the router's
			BufferPool:    router.NewBufferPool(),
			Transport:     t,
			ErrorLog:      log.New(io.Discard, "", 0),
		}
		l, err := httpserve.Serve("127.0.0.1:0", plainProxy, slog.New(slog.DiscardHandler))
		if err != nil {
			return err
		}
		u, stop = l.URL(), func() { _ = l.Stop(5 * time.Second) }
	case "router":
		v := configs.NewViper()
		v.Set("listen", "127.0.0.1:0")
		// The defaults, but for the logs' destination: the request log line
		// is formatted and written, to nowhere.
		v.Set("replicas", []configs.Replica{{Name: "sim", URL: upstream}})
		cfg, err := configs.Decode(v)
		if err != nil {
			return err
		}
		a, err := build(cfg, newLogger(cfg.Log, io.Discard))
		if err != nil {
			return err
		}
		r, err := a.start()
		if err != nil {
			return err
		}
		_, stopFloor := startGCFloor(cfg.Runtime) // as router serve does
		stopProfile, err := startCPUProfile(profile)
		if err != nil {
			_ = r.stop(time.Second)
			return err
		}
		u, stop = r.http.URL(), func() { stopProfile(); _ = r.stop(5 * time.Second); stopFloor() }
	default:
		return fmt.Errorf("--serve-target %q: want replica, plain or router", role)
	}
	defer stop()
	fmt.Fprintln(out, u)
	_, _ = io.Copy(io.Discard, in)
	return nil
}

func benchOnce(client *http.Client, u string, body []byte) error {
	_, err := benchFirstByte(client, u, body)
	return err
}

// benchFirstByte sends one request and returns the time to the first byte
// of its answer's body (its TTFT, streamed or not), after reading it all.
func benchFirstByte(client *http.Client, u string, body []byte) (time.Duration, error) {
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

// benchLatency sends rounds × n sequential requests to each target,
// interleaved (one to each in turn) so that every target meets the same
// background noise. Each round gives every target a p50 and a p99, and its
// added latency: its own minus the replica's (the first URL's) in that
// round. The result is the median over rounds of each, so that one noisy
// stretch of a shared machine does not decide a tail.
func benchLatency(client *http.Client, urls []string, gen *bodyGen, n, rounds int) []benchResult {
	res := make([]benchResult, len(urls))
	for i := 0; i < 50; i++ { // warm up connections
		for _, u := range urls {
			_ = benchOnce(client, u, gen.next())
		}
	}
	var p50, p99, add50, add99 = make([][]time.Duration, len(urls)), make([][]time.Duration, len(urls)),
		make([][]time.Duration, len(urls)), make([][]time.Duration, len(urls))
	for range rounds {
		lat := make([][]time.Duration, len(urls))
		for i := 0; i < n; i++ {
			for t, u := range urls {
				body := gen.next()
				t0 := time.Now()
				if err := benchOnce(client, u, body); err != nil {
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

// benchThroughputResult is one target's throughput at a client count: the
// medians over the rounds of its requests per second and of the CPU its
// processes spent per request (0: not measured), and the errors.
type benchThroughputResult struct {
	throughput float64
	cpuPerReq  time.Duration
	errors     int64
	// ttft50, ttft99: the medians over the rounds of the time to the
	// answer's first byte under this load.
	ttft50, ttft99 time.Duration
}

// benchThroughput drives each target with clients concurrent clients for
// o.duration, --throughput-rounds times, the targets interleaved within
// each round (each round starting at the next target, so that none always
// runs first) so that they meet the same background noise, and reads each
// target's CPU time from /proc before and after its phase.
func benchThroughput(client *http.Client, targets []benchTarget, gen *bodyGen, clients int, o benchOptions) []benchThroughputResult {
	out := make([]benchThroughputResult, len(targets))
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
						d, err := benchFirstByte(client, t.url, gen.next())
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

// cpuTime returns the user and system CPU time the processes pids have
// spent, from /proc/PID/stat (utime and stime, in clock ticks of 1/100 s:
// Linux's USER_HZ); false where /proc cannot tell (not Linux).
func cpuTime(pids []int) (time.Duration, bool) {
	var total time.Duration
	for _, pid := range pids {
		f := procStat(pid)
		if len(f) < 13 {
			return 0, false
		}
		var ut, st int64
		fmt.Sscan(f[11], &ut) // field 14, utime
		fmt.Sscan(f[12], &st) // field 15, stime
		total += time.Duration(ut+st) * 10 * time.Millisecond
	}
	return total, true
}

// findNginx returns the nginx binary to measure: --nginx's path, or with
// "auto" the one on PATH or at /usr/sbin/nginx, or "" when there is none.
func findNginx(flag string) (string, error) {
	if flag != "auto" {
		if _, err := os.Stat(flag); err != nil {
			return "", fmt.Errorf("--nginx %s: %w", flag, err)
		}
		return flag, nil
	}
	if p, err := exec.LookPath("nginx"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/nginx"); err == nil {
		return "/usr/sbin/nginx", nil
	}
	return "", nil
}

// nginxConf is nginx as a user would put it in front of vLLM: keep-alive
// connections to the upstream, no response buffering (streams pass at
// once), request bodies held in memory, no access log (the router's request
// log is off in the benchmark too). %[1]s is the prefix directory, %[2]s
// the listen address, %[3]s the upstream host:port.
const nginxConf = `daemon off;
worker_processes auto;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path %[1]s/body;
    proxy_temp_path %[1]s/proxy;
    fastcgi_temp_path %[1]s/fastcgi;
    uwsgi_temp_path %[1]s/uwsgi;
    scgi_temp_path %[1]s/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    keepalive_requests 1000000;
    upstream replica {
        server %[3]s;
        keepalive 256;
        keepalive_requests 1000000;
    }
    server {
        listen %[2]s;
        location / {
            proxy_pass http://replica;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
`

// startNginx runs nginx in front of upstream on a free port of 127.0.0.1,
// with its own prefix directory; pids lists its master and workers.
func startNginx(bin, upstream string) (url string, pids func() []int, stop func(), err error) {
	dir, err := os.MkdirTemp("", "semroute-nginx")
	if err != nil {
		return "", nil, nil, err
	}
	// nginx's workers run as an unprivileged user when it starts as root:
	// they must reach the body and proxy directories under the prefix.
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", nil, nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	up, err := neturl.Parse(upstream)
	if err != nil {
		return "", nil, nil, err
	}
	conf := filepath.Join(dir, "nginx.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(nginxConf, dir, addr, up.Host)), 0o600); err != nil {
		return "", nil, nil, err
	}
	cmd := exec.Command(bin, "-p", dir, "-c", conf, "-e", filepath.Join(dir, "error.log"))
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return "", nil, nil, err
	}
	stop = func() {
		_ = cmd.Process.Signal(syscall.SIGQUIT) // graceful: the workers end too
		waitOrKill(cmd)
		os.RemoveAll(dir)
	}
	master := cmd.Process.Pid
	pids = func() []int { return append([]int{master}, childPIDs(master)...) }
	for deadline := time.Now().Add(10 * time.Second); ; {
		if c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond); err == nil {
			c.Close()
			return "http://" + addr, pids, stop, nil
		}
		if time.Now().After(deadline) {
			stop()
			return "", nil, nil, fmt.Errorf("nginx did not listen on %s within 10s (see %s/error.log)", addr, dir)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// procStat returns the fields of /proc/PID/stat after the command name
// (field 3, the state, first), or nil. The name may hold spaces and
// parentheses: the fields start after its last ')'.
func procStat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	i := bytes.LastIndexByte(b, ')')
	if err != nil || i < 0 || i+2 > len(b) {
		return nil
	}
	return strings.Fields(string(b[i+2:]))
}

// childPIDs returns the processes whose parent is pid (nginx's workers).
func childPIDs(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		var p int
		if _, err := fmt.Sscan(e.Name(), &p); err != nil {
			continue
		}
		f := procStat(p)
		var ppid int
		if len(f) > 1 {
			fmt.Sscan(f[1], &ppid)
		}
		if ppid == pid {
			out = append(out, p)
		}
	}
	return out
}
