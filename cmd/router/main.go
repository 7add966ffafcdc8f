// Command router is semroute: a KV-cache-aware load-balancing router for
// OpenAI-compatible inference replicas.
//
//	router serve --config router.yaml   run in front of real replicas
//	router demo                         run in front of built-in simulated replicas
//	router sim --listen ADDR            run one simulated replica
//	router version                      print version, commit and Go version
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/viper"

	"github.com/semroute/semroute/apikey"
	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/router"
	"github.com/semroute/semroute/simreplica"
)

// version and commitFlag are set at build time with -ldflags
// "-X main.version=v1.2.3 -X main.commitFlag=abc123" (make build and make
// image do); where they are not (go install ...@v1.2.3), buildInfo reports
// what the Go toolchain recorded instead (see stamp).
var (
	version    = "dev"
	commitFlag = ""
)

func main() {
	if err := newRoot().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "router:", err)
		os.Exit(1)
	}
}

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:           "router",
		Short:         "semroute: a KV-cache-aware router for OpenAI-compatible inference replicas",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newServe(), newDemo(), newSim(), newReplay(), newGenTrace(), newVersion(), newHashKey())
	return root
}

// signalContext is cancelled by SIGINT or SIGTERM.
func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}

func newServe() *cobra.Command {
	var path, cpuProfile string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Route requests to the replicas in the config",
		Long: `Route requests to the replicas in the config file (--config; configs/router.yaml
is an example with every key and its default).

Every key can also be set by an environment variable: SEMROUTE_ and the key's
path in capitals, dots as underscores (SEMROUTE_ROUTING_POLICY=round_robin,
SEMROUTE_LIMITS_MAX_BODY_BYTES=8388608, SEMROUTE_CLUSTER_PASSWORD=...). The
file is read first, then the variables, then the flags, each overriding the
one before. SEMROUTE_CONFIG names the file when --config is not given.

The file is watched: when it changes, the replicas, the routing policy and its
parameters and arms, admin.token, grpc.token and every limits.* key apply at
once; a change to any other key is logged as needing a restart
(semroute_config_reloads_total{result="restart_required"}, and pending_restart
in GET /admin/config). An invalid file is refused, logged and counted
({result="failed"}); the config before it keeps serving.

SIGTERM or SIGINT stops accepting, lets requests in flight finish for
timeouts.shutdown_grace, and exits.`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if path == "" {
				path = os.Getenv("SEMROUTE_CONFIG")
			}
			newViper := func() *viper.Viper {
				v := configs.NewViper()
				for _, k := range []string{"listen", "grpc-listen"} {
					_ = v.BindPFlag(strings.ReplaceAll(k, "-", "_"), cmd.Flags().Lookup(k)) // both flags exist
				}
				return v
			}
			cfg, err := configs.Load(newViper(), path)
			if err == nil {
				err = cfg.CheckServable()
			}
			if err != nil && path == "" {
				return fmt.Errorf("no config file: give --config FILE (or SEMROUTE_CONFIG; configs/router.yaml is an example); without one, %w", err)
			}
			if err != nil {
				return err
			}
			stopProfile, err := startCPUProfile(cpuProfile)
			if err != nil {
				return err
			}
			defer stopProfile()
			log := newLogger(cfg.Log, os.Stderr)
			a, err := build(cfg, log)
			if err != nil {
				return err
			}
			a.path, a.viper = path, newViper
			r, err := a.start()
			if err != nil {
				return err
			}
			floor, stopFloor := startGCFloor(cfg.Runtime)
			defer stopFloor()
			log.Info("semroute listening", "addr", r.http.Addr, "grpc", r.grpcAddr(), "replicas", len(cfg.Replicas), "policy", cfg.Routing.Policy.Type, "gc_floor", floor)
			ctx, stop := signalContext()
			defer stop()
			<-ctx.Done()
			log.Info("shutting down", "grace", cfg.Timeouts.ShutdownGrace)
			return r.stop(cfg.Timeouts.ShutdownGrace)
		},
	}
	cmd.Flags().StringVar(&path, "config", "", "YAML config file, watched and reloaded (default $SEMROUTE_CONFIG)")
	cmd.Flags().String("listen", "127.0.0.1:8080", "address to serve the OpenAI API on")
	cmd.Flags().String("grpc-listen", "", "address to serve the gRPC Route API on (default: the config's; empty: off)")
	cmd.Flags().StringVar(&cpuProfile, "cpuprofile", "", "write this process's CPU profile to this file until it exits (go tool pprof reads it)")
	return cmd
}

func newDemo() *cobra.Command {
	var o demoOptions
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the router in front of built-in simulated replicas",
		RunE: func(cmd *cobra.Command, _ []string) error {
			d, err := startDemo(o, os.Stderr)
			if err != nil {
				return err
			}
			_, stopFloor := startGCFloor(d.app.cfg.Runtime)
			defer stopFloor()
			printExample(cmd.OutOrStdout(), d)
			ctx, stop := signalContext()
			defer stop()
			<-ctx.Done()
			return d.close()
		},
	}
	cmd.Flags().StringVar(&o.listen, "listen", "127.0.0.1:8080", "address to serve the OpenAI API on")
	cmd.Flags().IntVar(&o.replicas, "replicas", 4, "number of simulated replicas")
	cmd.Flags().StringSliceVar(&o.models, "models", nil, "models the simulated replicas serve, in turn (replica i serves models[i mod len]); default sim-model")
	cmd.Flags().IntVar(&o.routers, "routers", 1, "number of routers sharing one picture over an embedded NATS server, behind a round-robin front on --listen")
	cmd.Flags().StringVar(&o.picture, "picture", "events", "how the router knows the replicas' caches: events (precise: the engine's tokens from /tokenize and its KV events over ZMQ) or approximate (estimated tokens, corrected by reported hits)")
	cmd.Flags().StringVar(&o.reuse, "reuse", "", "the simulated engines' reuse beyond the exact prefix: prefix (default), blend (documents and tool results reused wherever they appear, as CacheBlend) or donor (a similar earlier prompt's cached KV, as SGLang's SemanticPrefixProvider), told to the router")
	cmd.Flags().StringVar(&o.config, "config", "", "YAML config overriding the embedded demo config")
	cmd.Flags().StringVar(&o.policy, "policy", "", "routing policy (default: the config's)")
	cmd.Flags().StringVar(&o.grpcListen, "grpc-listen", "", "address to serve the gRPC Route API on (empty: off)")
	cmd.Flags().StringVar(&o.decisionLog, "decision-log", "", "write the decision log to this file")
	cmd.Flags().StringVar(&o.pd, "pd", "", "prefill/decode disaggregation, P:D: the first P simulated replicas prefill, the next D decode (e.g. 2:2; overrides --replicas)")
	cmd.Flags().DurationVar(&o.sim.InterToken, "sim-inter-token", 0, "simulated replicas: time per output token (default 2ms)")
	cmd.Flags().IntVar(&o.sim.OutputTokens, "sim-output-tokens", 0, "simulated replicas: output length when max_tokens is absent (default 16)")
	cmd.Flags().StringVar(&o.sim.Scheduling, "sim-scheduling", "", "simulated replicas: scheduling policy, fcfs (default) or priority (vLLM's --scheduling-policy), told to the router (replicas[].scheduling)")
	return cmd
}

func newSim() *cobra.Command {
	var (
		o                       simreplica.Options
		listen                  string
		kvEvents, kvReplay, top string
		dpSize                  int
	)
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Run one simulated OpenAI-compatible replica with a prefix cache",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if kvEvents != "" {
				o.KVEvents = &kvevents.PublisherOptions{Endpoint: kvEvents, ReplayEndpoint: kvReplay, Topic: top}
			}
			if dpSize > 1 {
				return runSimRanks(cmd, o, dpSize, listen)
			}
			r, err := simreplica.Start(o, listen)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "simulated replica serving %s at %s\n", r.Options().Model, r.URL)
			if pub, rep := r.KVEventsEndpoints(); pub != "" {
				fmt.Fprintf(cmd.OutOrStdout(), "KV events published at %s (replay %s)\n", pub, rep)
			}
			return serveUntilSignal(r.Shutdown, r.Server.Close)
		},
	}
	f := cmd.Flags()
	f.StringVar(&listen, "listen", "127.0.0.1:8000", "address to listen on")
	f.StringVar(&o.Model, "model", "sim-model", "served model name")
	f.IntVar(&o.BlockSize, "block-size", 16, "tokens per cache block")
	f.IntVar(&o.NumBlocks, "num-blocks", 16384, "cache capacity in blocks")
	f.IntVar(&o.BytesPerToken, "bytes-per-token", 4, "tokenizer estimate")
	f.IntVar(&o.MaxRunning, "max-running", 64, "maximum running sequences; more wait")
	f.DurationVar(&o.Overhead, "overhead", 2*time.Millisecond, "fixed part of time to first token")
	f.DurationVar(&o.PrefillPerToken, "prefill-per-token", 20*time.Microsecond, "time per uncached prompt token")
	f.DurationVar(&o.InterToken, "inter-token", 2*time.Millisecond, "time per output token after the first")
	f.IntVar(&o.OutputTokens, "output-tokens", 16, "output length when max_tokens is absent")
	f.IntVar(&o.MaxOutputTokens, "max-output-tokens", 4096, "largest max_tokens accepted")
	f.StringVar(&o.Tokenizer, "tokenizer", "words", "words (word pieces with a chat template, about 5-6 bytes a token) or bytes (--bytes-per-token bytes a token)")
	f.StringVar(&o.Scheduling, "scheduling", "fcfs", "scheduling policy, as vLLM's --scheduling-policy: fcfs, or priority (the body's priority, lower first; the least important preempted when the KV cache runs out)")
	f.StringVar(&kvEvents, "kv-events", "", "publish vLLM KV events over ZMQ at this endpoint (e.g. tcp://127.0.0.1:5557); empty: off")
	f.StringVar(&kvReplay, "kv-events-replay", "", "the KV events replay endpoint (e.g. tcp://127.0.0.1:5558)")
	f.StringVar(&top, "kv-events-topic", "kv-events", "the KV events topic")
	f.IntVar(&dpSize, "data-parallel-size", 1, "data-parallel ranks behind the address, as vLLM's --data-parallel-size: each its own cache, a request's rank read from X-data-parallel-rank, rank k's KV events ports k higher")
	return cmd
}

// runSimRanks serves a simulated engine of size data-parallel ranks
// until a signal.
func runSimRanks(cmd *cobra.Command, o simreplica.Options, size int, listen string) error {
	r, err := simreplica.StartDataParallel(o, size, listen)
	if err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "simulated replica serving %s at %s with %d data-parallel ranks\n", o.Model, r.URL, size)
	for k := range size {
		if pub, rep := r.Rank(k).KVEventsEndpoints(); pub != "" {
			fmt.Fprintf(cmd.OutOrStdout(), "rank %d: KV events published at %s (replay %s)\n", k, pub, rep)
		}
	}
	return serveUntilSignal(r.Shutdown, r.Close)
}

// serveUntilSignal waits for a signal, then stops a simulated replica:
// shutdown given 10 s to finish what is in flight, then closeKV.
func serveUntilSignal(shutdown func(context.Context) error, closeKV func() error) error {
	ctx, stop := signalContext()
	defer stop()
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return errors.Join(shutdown(sctx), closeKV())
}

func newVersion() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version, commit and Go version",
		Run: func(cmd *cobra.Command, _ []string) {
			ver, commit, gov := buildInfo()
			fmt.Fprintf(cmd.OutOrStdout(), "semroute %s commit %s %s\n", ver, commit, gov)
		},
	}
}

func newHashKey() *cobra.Command {
	var tenant string
	c := &cobra.Command{
		Use:   "hashkey",
		Short: "Print the SHA-256 of an API key read from standard input, for auth.api_keys_file",
		Long: `Print the SHA-256 of an API key read from the first line of standard input, as
auth.api_keys_file stores it:

  printf '%s' "$KEY" | router hashkey

The file then lists it with the tenant its requests count for:

  keys:
    - {name: team-a, tenant: acme, sha256: <what this printed>}

With --tenant NAME it prints instead the label the tenant's requests have
in semroute_tenant_requests_total under metrics.tenant_labels: hash.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if tenant != "" {
				fmt.Fprintln(cmd.OutOrStdout(), router.TenantLabel(router.TenantHash, tenant))
				return nil
			}
			line, err := bufio.NewReader(io.LimitReader(cmd.InOrStdin(), 4096)).ReadString('\n')
			if err != nil && !errors.Is(err, io.EOF) {
				return err
			}
			key := strings.TrimRight(line, "\r\n")
			if key == "" {
				return errors.New("no key on standard input")
			}
			fmt.Fprintln(cmd.OutOrStdout(), apikey.Hash(key))
			return nil
		},
	}
	c.Flags().StringVar(&tenant, "tenant", "", "print this tenant's label in the metrics instead (metrics.tenant_labels: hash)")
	return c
}
