//go:build unix

package router

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/semroute/semroute/internal/numbered"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
	"github.com/semroute/semroute/simreplica"
	"github.com/semroute/semroute/tokenizer"
)

// BenchmarkPreciseCPU measures the router's CPU per request in estimate
// mode and in precise mode (each new body also sent to the replica's
// /tokenize), side by side: two routers, one per mode, each in a process
// of its own (this test binary again, TestPreciseCPUChild), in front of
// one instant simulated replica in this process (which also answers
// /tokenize; one listener per router, counting the connections made to
// it), driven by 8 clients here with unique 1 KB chat prompts, as
// `router benchproxy` drives its router. Each of the b.N rounds runs a
// phase of preciseCPUPhase against each router, the two alternating so
// that they meet the same background load; a router's CPU is its own
// process's (getrusage, user and system), so neither the replica's nor
// the clients' is counted. It reports each mode's CPU per request over
// the rounds (and its system time, the kernel's part) and precise's over estimate's, that ratio's median over the
// rounds (the steadier figure on a machine shared with other work), and
// the connections each router made to its
// replica per request (a router that reuses its connections makes none
// once warm). Run it alone, e.g.:
//
//	go test -run '^$' -bench PreciseCPU -benchtime 5x ./router
//
// SEMROUTE_PRECISE_CPU_PROFILE=/tmp/p writes each router's CPU profile
// over the whole run to /tmp/p.estimate and /tmp/p.precise.
func BenchmarkPreciseCPU(b *testing.B) {
	const clients = 8
	modes := []string{"estimate", "precise"}
	children := make([]*cpuChild, len(modes))
	conns := make([]atomic.Int64, len(modes)) // connections made to each mode's replica
	for i, m := range modes {
		sim, err := simreplica.New(simreplica.Options{Overhead: -1, PrefillPerToken: -1, InterToken: -1, MaxRunning: 4096, OutputTokens: 8})
		if err != nil {
			b.Fatal(err)
		}
		ts := httptest.NewUnstartedServer(sim)
		ts.Config.ConnState = func(_ net.Conn, s http.ConnState) {
			if s == http.StateNew {
				conns[i].Add(1)
			}
		}
		ts.Start()
		defer ts.Close()
		if children[i], err = startCPUChild(m, ts.URL); err != nil {
			b.Fatal(err)
		}
		defer children[i].stop()
	}
	// Every prompt new, as benchproxy's: every request is tokenized and
	// records its blocks.
	gen := numbered.New(1024, false)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024}}
	defer client.CloseIdleConnections()
	// A warm-up phase each: connections made, heaps grown.
	for _, c := range children {
		if _, err := c.load(client, gen, clients, preciseCPUPhase/4); err != nil {
			b.Fatal(err)
		}
	}
	cpu, sys := make([]time.Duration, len(modes)), make([]time.Duration, len(modes))
	reqs, dials := make([]int64, len(modes)), make([]int64, len(modes))
	var ratios []float64 // precise's CPU per request over estimate's, each round
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var round [2]float64
		for k := range children {
			k := (k + i) % len(children) // each mode first in every other round
			c := children[k]
			before, sys0, err := c.cpu()
			if err != nil {
				b.Fatal(err)
			}
			conns0 := conns[k].Load()
			n, err := c.load(client, gen, clients, preciseCPUPhase)
			if err != nil {
				b.Fatal(err)
			}
			after, sys1, err := c.cpu()
			if err != nil {
				b.Fatal(err)
			}
			cpu[k] += after - before
			sys[k] += sys1 - sys0
			reqs[k] += n
			round[k] = float64(after-before) / float64(max(n, 1))
			dials[k] += conns[k].Load() - conns0
		}
		ratios = append(ratios, round[1]/round[0])
	}
	b.StopTimer()
	per := make([]float64, len(modes))
	for k, m := range modes {
		if reqs[k] == 0 {
			b.Fatalf("%s: no request answered", m)
		}
		per[k] = float64(cpu[k].Microseconds()) / float64(reqs[k])
		b.ReportMetric(per[k], m+"-µs-cpu/req")
		b.ReportMetric(float64(sys[k].Microseconds())/float64(reqs[k]), m+"-µs-sys/req")
		b.ReportMetric(float64(reqs[k])/(float64(b.N)*preciseCPUPhase.Seconds()), m+"-req/s")
		b.ReportMetric(float64(dials[k])/float64(reqs[k]), m+"-conns/req")
	}
	b.ReportMetric(per[1]/per[0], "precise/estimate")
	slices.Sort(ratios)
	b.ReportMetric(ratios[len(ratios)/2], "median-round-precise/estimate")
}

// preciseCPUPhase is one phase of BenchmarkPreciseCPU against one router:
// SEMROUTE_PRECISE_CPU_PHASE (a duration), else 1 s. Shorter phases, more
// rounds, put the two routers under more alike background load.
var preciseCPUPhase = func() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("SEMROUTE_PRECISE_CPU_PHASE")); err == nil && d > 0 {
		return d
	}
	return time.Second
}()

// cpuChild is a router serving in a child process.
type cpuChild struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
	url string
}

// startCPUChild runs TestPreciseCPUChild in a child process: a router in
// mode (estimate or precise) in front of upstream.
func startCPUChild(mode, upstream string) (*cpuChild, error) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestPreciseCPUChild$", "-test.bench=^$", "-test.count=1")
	cmd.Env = append(os.Environ(), "SEMROUTE_PRECISE_CPU_CHILD="+mode+" "+upstream)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &cpuChild{cmd: cmd, in: in, out: bufio.NewScanner(out)}
	line, err := c.line()
	if err != nil || !strings.HasPrefix(line, "http://") {
		c.stop()
		return nil, fmt.Errorf("the %s router printed %q (%v), not its URL", mode, line, err)
	}
	c.url = line
	return c, nil
}

// line reads the child's next line of output, skipping the test
// framework's.
func (c *cpuChild) line() (string, error) {
	for c.out.Scan() {
		if l := c.out.Text(); strings.HasPrefix(l, "http://") || strings.HasPrefix(l, "cpu ") {
			return l, nil
		}
	}
	return "", fmt.Errorf("the child ended: %v", c.out.Err())
}

// cpu returns the CPU time the child's process has spent so far, and the
// part of it in the kernel.
func (c *cpuChild) cpu() (all, sys time.Duration, err error) {
	if _, err := io.WriteString(c.in, "cpu\n"); err != nil {
		return 0, 0, err
	}
	l, err := c.line()
	if err != nil {
		return 0, 0, err
	}
	var user, kernel int64
	if _, err := fmt.Sscanf(l, "cpu %d %d", &user, &kernel); err != nil {
		return 0, 0, err
	}
	return time.Duration(user + kernel), time.Duration(kernel), nil
}

func (c *cpuChild) stop() {
	c.in.Close()
	done := make(chan struct{})
	go func() { _ = c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = c.cmd.Process.Kill()
		<-done
	}
}

// load sends new chat bodies to the child from clients clients for d and
// returns the requests answered 200.
func (c *cpuChild) load(client *http.Client, gen *numbered.Bodies, clients int, d time.Duration) (int64, error) {
	var (
		done     atomic.Int64
		firstErr atomic.Value
		wg       sync.WaitGroup
	)
	end := time.Now().Add(d)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(end) {
				req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, c.url+"/v1/chat/completions", bytes.NewReader(gen.Next()))
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					firstErr.CompareAndSwap(nil, fmt.Errorf("status %d", resp.StatusCode))
					return
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	if err, _ := firstErr.Load().(error); err != nil {
		return 0, err
	}
	return done.Load(), nil
}

// TestPreciseCPUChild is BenchmarkPreciseCPU's router, run only in the
// benchmark's child processes: it serves a router in the mode its
// environment names, in front of the upstream it names, as the binary's
// defaults make one (the semantic policy, metrics, the request log line
// formatted to nowhere), prints its URL, answers each "cpu" line on its
// input with the CPU its process has spent, and ends with its input.
func TestPreciseCPUChild(t *testing.T) {
	env := os.Getenv("SEMROUTE_PRECISE_CPU_CHILD")
	if env == "" {
		t.Skip("run by BenchmarkPreciseCPU")
	}
	mode, upstream, _ := strings.Cut(env, " ")
	e, err := routing.New(routing.Options{Replicas: []replica.Spec{{Name: "sim", URL: upstream}}})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := routing.NewPolicy(routing.PolicySpec{Type: "semantic"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	co := CoreOptions{Engine: e, Arms: []Arm{{Name: "default", Policy: pol, Weight: 1}}, Metrics: m}
	if mode == "precise" {
		tok, err := tokenizer.New(tokenizer.Options{URL: upstream})
		if err != nil {
			t.Fatal(err)
		}
		co.Tokenizer, co.BlockTokens = tok, 16
	}
	core, err := NewCore(co)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := NewServer(ServerOptions{Core: core, RecordReplies: true, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	defer ts.Close()
	if prefix := os.Getenv("SEMROUTE_PRECISE_CPU_PROFILE"); prefix != "" {
		f, err := os.Create(prefix + "." + mode)
		if err != nil {
			t.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		defer pprof.StopCPUProfile()
	}
	fmt.Println(ts.URL)
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if sc.Text() == "cpu" {
			var ru syscall.Rusage
			if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
				t.Fatal(err)
			}
			fmt.Printf("cpu %d %d\n", ru.Utime.Nano(), ru.Stime.Nano())
		}
	}
}
