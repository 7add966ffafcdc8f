// Command benchproxy measures the latency, throughput and CPU per request
// the router adds, beside a plain Go reverse proxy and nginx, in front of
// an instant simulated replica (BENCHMARKS.md):
//
//	go run ./cmd/benchproxy [--sizes 1024,131072] [--modes whole,stream] [--concurrency 8,64] ...
//
// The router measured is the router binary as it is deployed, `router
// serve`: --router names one, or it is built from this module's
// cmd/router.
package main

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
)

func main() {
	if err := newCommand().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "benchproxy:", err)
		os.Exit(1)
	}
}

// options shape a run of the benchmark.
type options struct {
	requests    int           // sequential requests per target per round, for latency
	rounds      int           // latency rounds; the medians over them are reported
	concurrency []int         // client counts of the throughput phases; each is reported
	duration    time.Duration // throughput phase per client count
	sizes       []int         // request body sizes in bytes
	tpRounds    int           // throughput rounds per client count; medians over them are reported
	nginx       string        // nginx binary: "auto" (PATH or /usr/sbin), a path, or "off"
	cpuProfile  string        // file for the router's CPU profile over the whole run; "": none
	modes       []bool        // stream or not, in order
	router      string        // the router binary; "": built from this module (go build)
}

func newCommand() *cobra.Command {
	o := options{}
	var sizes, conc, target, upstream, modes string
	cmd := &cobra.Command{
		Use:   "benchproxy",
		Short: "Measure the latency and CPU the router adds, beside a plain Go reverse proxy and nginx, in front of an instant simulated replica",
		Long: `Starts one simulated replica that answers at once, and in front of it the router (the
router binary serving, router serve, at its defaults: --router, or built from this module),
a plain httputil.ReverseProxy with the router's proxy settings (flushing event streams at
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
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if target != "" {
				return serveTarget(target, upstream, cmd.OutOrStdout(), cmd.InOrStdin())
			}
			var err error
			if o.concurrency, err = parseCounts("--concurrency", conc, 1, "a positive count"); err != nil {
				return err
			}
			if o.sizes, err = parseCounts("--sizes", sizes, 64, "a byte count ≥ 64"); err != nil {
				return err
			}
			if o.modes, err = parseModes(modes); err != nil {
				return err
			}
			if o.requests < 1 || o.rounds < 1 || o.tpRounds < 1 {
				return fmt.Errorf("--requests, --rounds and --throughput-rounds must be at least 1")
			}
			return run(cmd.OutOrStdout(), o)
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
	f.StringVar(&o.cpuProfile, "cpuprofile", "", "write the router process's CPU profile over the whole run to this file (router serve --cpuprofile; go tool pprof reads it)")
	f.StringVar(&o.router, "router", "", "the router binary to measure (make build: bin/router); empty: go build "+routerPackage+" into a temporary directory (run from within this module)")
	// The replica and the plain proxy run in child processes of this
	// command (see startChild).
	f.StringVar(&target, "serve-target", "", "internal: serve one target (replica or plain) and print its URL")
	f.StringVar(&upstream, "upstream", "", "internal: the replica's URL, for --serve-target plain")
	_ = f.MarkHidden("serve-target")
	_ = f.MarkHidden("upstream")
	return cmd
}

// parseCounts parses flag's comma-separated list of counts, each at
// least least; what says what a count is, for the error.
func parseCounts(flag, list string, least int, what string) ([]int, error) {
	var counts []int
	for _, c := range strings.Split(list, ",") {
		var n int
		if _, err := fmt.Sscanf(strings.TrimSpace(c), "%d", &n); err != nil || n < least {
			return nil, fmt.Errorf("%s: %q is not %s", flag, c, what)
		}
		counts = append(counts, n)
	}
	return counts, nil
}

// parseModes parses --modes: whole and stream, comma-separated, as
// whether each streams.
func parseModes(list string) ([]bool, error) {
	var modes []bool
	for _, m := range strings.Split(list, ",") {
		switch strings.TrimSpace(m) {
		case "whole":
			modes = append(modes, false)
		case "stream":
			modes = append(modes, true)
		default:
			return nil, fmt.Errorf("--modes: %q is neither whole nor stream", m)
		}
	}
	return modes, nil
}
