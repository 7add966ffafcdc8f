package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/router"
	"github.com/semroute/semroute/simreplica"
)

// benchOptions shape `router benchproxy`.
type benchOptions struct {
	requests    int           // sequential requests per target per round, for latency
	rounds      int           // latency rounds; the medians over them are reported
	concurrency []int         // client counts tried for throughput; the best is reported
	duration    time.Duration // throughput phase per client count
	sizes       []int         // request body sizes in bytes
}

// benchResult is one target's figures in one case.
type benchResult struct {
	p50, p99 time.Duration // medians over the rounds
	// added50, added99 are the medians over the rounds of the target's
	// p50 and p99 minus the replica's in the same round.
	added50, added99 time.Duration
	throughput       float64 // the highest requests per second over the client counts
	atClients        int     // the client count that reached it
	errors           int64
}

func newBenchProxy() *cobra.Command {
	o := benchOptions{}
	var sizes, conc, target, upstream string
	cmd := &cobra.Command{
		Use:   "benchproxy",
		Short: "Measure the latency the router adds over a plain reverse proxy, in front of an instant simulated replica",
		Long: `Starts one simulated replica that answers at once, the router in front of it, and a
plain httputil.ReverseProxy in front of it, each in its own process on 127.0.0.1 (as
they would run in production: one's garbage collection does not pause another), and
drives each with the same load generator in this process (the plain proxy has the
router's proxy settings: immediate flushing and pooled buffers): --rounds rounds of
sequential requests for latency, interleaved across the three so they meet the same
background noise (p50, p99, and added latency: the proxy's minus the replica's own in
the same round; each the median over the rounds), then concurrent clients for
throughput (the best over --concurrency). Bodies of each --sizes, streaming and not.
After each case, the router's added p99 as a multiple of the plain proxy's.
Everything shares this machine's cores.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if target != "" {
				return serveBenchTarget(target, upstream, cmd.OutOrStdout(), cmd.InOrStdin())
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
			if o.requests < 1 || o.rounds < 1 {
				return fmt.Errorf("--requests and --rounds must be at least 1")
			}
			return runBenchProxy(cmd.OutOrStdout(), o)
		},
	}
	f := cmd.Flags()
	f.IntVar(&o.requests, "requests", 5000, "sequential requests per target in each latency round")
	f.IntVar(&o.rounds, "rounds", 5, "latency rounds; p50, p99 and added latency are medians over them")
	f.StringVar(&conc, "concurrency", "8,32,128", "concurrent client counts to try for throughput, comma-separated; the best is reported")
	f.DurationVar(&o.duration, "duration", 2*time.Second, "throughput phase per client count")
	f.StringVar(&sizes, "sizes", "1024,131072", "request body sizes in bytes, comma-separated")
	// The targets run in child processes of this command (see startBenchTarget).
	f.StringVar(&target, "serve-target", "", "internal: serve one target (replica, plain or router) and print its URL")
	f.StringVar(&upstream, "upstream", "", "internal: the replica's URL, for --serve-target plain or router")
	_ = f.MarkHidden("serve-target")
	_ = f.MarkHidden("upstream")
	return cmd
}

func benchBody(size int, stream bool) []byte {
	pad := strings.Repeat("lorem ipsum dolor sit amet ", size/27+1)
	for {
		b, _ := json.Marshal(map[string]any{"model": "sim-model", "stream": stream, "max_tokens": 8,
			"messages": []map[string]string{{"role": "user", "content": pad}}})
		if len(b) <= size {
			return b
		}
		pad = pad[:len(pad)-(len(b)-size)]
	}
}

func runBenchProxy(out io.Writer, o benchOptions) error {
	var targets []struct{ name, url string }
	for _, t := range []struct{ name, role string }{{"replica", "replica"}, {"plain proxy", "plain"}, {"router", "router"}} {
		up := ""
		if len(targets) > 0 {
			up = targets[0].url
		}
		u, stop, err := startBenchTarget(t.role, up)
		if err != nil {
			return fmt.Errorf("starting the %s: %w", t.name, err)
		}
		defer stop()
		targets = append(targets, struct{ name, url string }{t.name, u})
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: 0}}
	defer client.CloseIdleConnections()

	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "body\tmode\ttarget\tp50\tp99\tadded p50\tadded p99\tbest req/s\tat clients\terrors\t")
	var ratios []string
	for _, size := range o.sizes {
		for _, stream := range []bool{false, true} {
			body := benchBody(size, stream)
			mode := "whole"
			if stream {
				mode = "stream"
			}
			urls := make([]string, len(targets))
			for i, t := range targets {
				urls[i] = t.url
			}
			res := benchLatency(client, urls, body, o.requests, o.rounds)
			for i, t := range targets {
				var errs int64
				res[i].throughput, res[i].atClients, errs = benchThroughput(client, t.url, body, o)
				res[i].errors += errs // latency and throughput phases together
			}
			for i, t := range targets {
				added50, added99 := "", ""
				if i > 0 {
					added50 = res[i].added50.Round(time.Microsecond).String()
					added99 = res[i].added99.Round(time.Microsecond).String()
				}
				fmt.Fprintf(tw, "%d B\t%s\t%s\t%v\t%v\t%s\t%s\t%.0f\t%d\t%d\t\n", len(body), mode, t.name,
					res[i].p50.Round(time.Microsecond), res[i].p99.Round(time.Microsecond), added50, added99, res[i].throughput, res[i].atClients, res[i].errors)
			}
			ratio := "n/a (the plain proxy added no p99)"
			if res[1].added99 > 0 {
				ratio = fmt.Sprintf("%.2f×", float64(res[2].added99)/float64(res[1].added99))
			}
			ratios = append(ratios, fmt.Sprintf("router added p99 / plain proxy added p99, %d B %s: %s", len(body), mode, ratio))
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(out, "\n"+strings.Join(ratios, "\n"))
	return err
}

// startBenchTarget runs `router benchproxy --serve-target role` as a child
// process and returns the URL it serves. stop closes the child's stdin, which
// ends it, and waits; a child whose parent dies sees the same end of input.
func startBenchTarget(role, upstream string) (url string, stop func(), err error) {
	exe, err := os.Executable()
	if err != nil {
		return "", nil, err
	}
	cmd := exec.Command(exe, "benchproxy", "--serve-target", role, "--upstream", upstream)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return "", nil, err
	}
	outp, err := cmd.StdoutPipe()
	if err != nil {
		return "", nil, err
	}
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop = func() {
		in.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
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
			return u, stop, nil
		}
		stop()
		return "", nil, fmt.Errorf("the %s process printed %q, not its URL", role, u)
	case <-time.After(30 * time.Second):
		stop()
		return "", nil, fmt.Errorf("the %s process did not start within 30s", role)
	}
}

// serveBenchTarget serves one benchmark target in this process, prints its
// URL, and serves until in ends.
func serveBenchTarget(role, upstream string, out io.Writer, in io.Reader) error {
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
		target, err := url.Parse(upstream)
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
			FlushInterval: -1,
			BufferPool:    router.NewBufferPool(),
			Transport:     t,
			ErrorLog:      log.New(io.Discard, "", 0),
		}
		l, err := serve("127.0.0.1:0", plainProxy, slog.New(slog.DiscardHandler))
		if err != nil {
			return err
		}
		u, stop = l.url(), func() { _ = l.stop(5 * time.Second) }
	case "router":
		v := configs.NewViper()
		v.Set("listen", "127.0.0.1:0")
		v.Set("log.level", "error")
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
		u, stop = r.http.url(), func() { _ = r.stop(5 * time.Second); stopFloor() }
	default:
		return fmt.Errorf("--serve-target %q: want replica, plain or router", role)
	}
	defer stop()
	fmt.Fprintln(out, u)
	_, _ = io.Copy(io.Discard, in)
	return nil
}

func benchOnce(client *http.Client, u string, body []byte) error {
	resp, err := client.Post(u+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %d", resp.StatusCode)
	}
	return err
}

// benchLatency sends rounds × n sequential requests to each target,
// interleaved (one to each in turn) so that every target meets the same
// background noise. Each round gives every target a p50 and a p99, and its
// added latency: its own minus the replica's (the first URL's) in that
// round. The result is the median over rounds of each, so that one noisy
// stretch of a shared machine does not decide a tail.
func benchLatency(client *http.Client, urls []string, body []byte, n, rounds int) []benchResult {
	res := make([]benchResult, len(urls))
	for i := 0; i < 50; i++ { // warm up connections
		for _, u := range urls {
			_ = benchOnce(client, u, body)
		}
	}
	var p50, p99, add50, add99 = make([][]time.Duration, len(urls)), make([][]time.Duration, len(urls)),
		make([][]time.Duration, len(urls)), make([][]time.Duration, len(urls))
	for range rounds {
		lat := make([][]time.Duration, len(urls))
		for i := 0; i < n; i++ {
			for t, u := range urls {
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

// benchThroughput returns the best requests per second over the client
// counts, the count that reached it, and the errors.
func benchThroughput(client *http.Client, u string, body []byte, o benchOptions) (best float64, at int, errors int64) {
	for _, clients := range o.concurrency {
		var done, errs atomic.Int64
		deadline := time.Now().Add(o.duration)
		var wg sync.WaitGroup
		for c := 0; c < clients; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(deadline) {
					if err := benchOnce(client, u, body); err != nil {
						errs.Add(1)
						continue
					}
					done.Add(1)
				}
			}()
		}
		wg.Wait()
		if tp := float64(done.Load()) / o.duration.Seconds(); tp > best {
			best, at = tp, clients
		}
		errors += errs.Load()
	}
	return best, at, errors
}
