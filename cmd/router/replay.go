package main

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/semroute/semroute/eviction"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
	"go.yaml.in/yaml/v3"

	"github.com/spf13/cobra"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/matcher"
	"github.com/semroute/semroute/replay"
)

// replayOptions are `router replay`'s flags.
type replayOptions struct {
	trace, format, out, policies string
	pictures                     string
	routers                      int
	syncs                        string
	syncDelay                    time.Duration
	sample                       int // the trace's first requests replayed; 0: all
	blockTokens                  int // 0: the format's default
	m                            replay.Config
	seed                         uint64
	ablate, withMatcher          bool
	semantic                     routing.PrefixCostParams
	policyFile                   string
	evictionParams               string // JSON; "": none
	flowControl                  bool
	pd                           string   // "P:D"; "": not disaggregated
	classes                      []string // --class, one replica class each
}

func newReplay() *cobra.Command {
	var o replayOptions
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Replay a trace through simulated replicas under several routing policies",
		Long: `Replay a trace through simulated replicas, in virtual time, under every listed
routing policy side by side, with the pooled (one cache of the fleet's whole budget) and
infinite-cache references, and write summary.json, summary.md, a CSV per run and
report.html to --out.`,
		RunE: func(cmd *cobra.Command, _ []string) error { return o.run(cmd) },
	}
	o.register(cmd)
	return cmd
}

// run replays the trace under every run the flags ask for, writes the
// report to o.out and prints its summary.
func (o *replayOptions) run(cmd *cobra.Command) error {
	if _, err := replay.ParseFormat(o.format); err != nil {
		return err
	}
	if o.evictionParams != "" {
		if err := json.Unmarshal([]byte(o.evictionParams), &o.m.EvictionParams); err != nil {
			return fmt.Errorf("--eviction-params: %w", err)
		}
	}
	if err := o.fleet(cmd.Flags().Changed); err != nil {
		return err
	}
	reqs, arms, err := o.readTrace(cmd.Flags().Changed)
	if err != nil {
		return err
	}
	if o.sample > 0 && o.sample < len(reqs) {
		reqs = reqs[:o.sample]
	}
	if o.blockTokens == 0 {
		o.blockTokens = blockhash.DefaultBlockTokens
	}
	o.m.BlockTokens = o.blockTokens
	o.m.Seed = o.seed
	if err := o.disaggregate(cmd.Flags().Changed); err != nil {
		return err
	}
	o.m.Params = map[string]routing.Params{"semantic": {"load_weight": o.semantic.LoadWeight, "recent_weight": o.semantic.RecentWeight,
		"spill_factor": o.semantic.SpillFactor, "spill_margin_tokens": o.semantic.SpillMarginTokens}}
	x, err := o.matrix()
	if err != nil {
		return err
	}
	runs := x.Runs(&o.m)
	sum, err := replay.Replay(reqs, o.m, runs)
	if err != nil {
		return err
	}
	sum.Trace, sum.Format, sum.Arms = o.trace, o.format, arms
	if err := sum.Write(o.out); err != nil {
		return err
	}
	if err := sum.Markdown(cmd.OutOrStdout()); err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "\nwrote %s/summary.json, summary.md, report.html and runs/*.csv\n", o.out)
	return nil
}

// readTrace reads the trace in its format, and for a decision log its
// arms' statistics and its replicas (and their budgets, unless
// --budget-tokens was given: changed tells which flags were). It sets the
// format's default block size when --block-tokens is not given.
func (o *replayOptions) readTrace(changed func(flag string) bool) ([]replay.Request, []replay.ArmStats, error) {
	f, err := os.Open(o.trace)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	switch o.format {
	case "decisions":
		t, err := replay.ReadDecisions(f)
		if err != nil {
			return nil, nil, err
		}
		o.m.ReplicaNames = t.Replicas
		if !changed("budget-tokens") && len(o.m.Classes) == 0 {
			o.m.Budgets = t.Budgets
		}
		return t.Requests, t.Arms, nil
	case "mooncake":
		o.blockTokens = cmp.Or(o.blockTokens, 512)
		reqs, err := replay.ReadMooncake(f, o.blockTokens)
		return reqs, nil, err
	case "openai":
		o.blockTokens = cmp.Or(o.blockTokens, blockhash.DefaultBlockTokens)
		s, err := blockhash.NewSplitter(blockhash.Options{BlockTokens: o.blockTokens, Segments: o.m.Reuse.Blend()})
		if err != nil {
			return nil, nil, err
		}
		reqs, err := replay.ReadOpenAI(f, s)
		return reqs, nil, err
	}
	return nil, nil, nil // replay.ParseFormat has refused any other
}

// fleet makes the replicas the --class flags' classes, if any: their
// counts then make the fleet, unless --replicas is given too, which must
// then be their total (changed tells which flags were).
func (o *replayOptions) fleet(changed func(flag string) bool) error {
	for _, c := range o.classes {
		rc, err := replay.ParseClass(c)
		if err != nil {
			return fmt.Errorf("--class: %w", err)
		}
		o.m.Classes = append(o.m.Classes, rc)
	}
	if len(o.m.Classes) > 0 && !changed("replicas") {
		o.m.Replicas = 0 // the classes' total
	}
	return nil
}

// disaggregate makes the replicas --pd's P prefill and D decode replicas;
// without --pd it refuses the flags of disaggregation (changed tells which
// flags were given).
func (o *replayOptions) disaggregate(changed func(flag string) bool) error {
	if o.pd == "" {
		for _, f := range []string{"transfer-latency", "transfer-per-token", "min-prefill-tokens"} {
			if changed(f) {
				return fmt.Errorf("--%s without --pd: the replicas are not disaggregated", f)
			}
		}
		return nil
	}
	p, d, err := parsePD(o.pd)
	if err != nil {
		return err
	}
	if o.flowControl || o.routers > 1 {
		return errors.New("--pd is replayed with one router and no flow control")
	}
	if changed("replicas") && o.m.Replicas != p+d {
		return fmt.Errorf("--pd %s is %d replicas, --replicas %d", o.pd, p+d, o.m.Replicas)
	}
	o.m.Replicas, o.m.Roles = p+d, pdRoles(p, d)
	return nil
}

// matrix returns the runs to compare: the policies, --policy-file's
// runs, and their variants (ablations, matcher, picture modes, routers,
// flow control). With --matcher the replay's matcher is the reference
// one with its default options.
func (o *replayOptions) matrix() (*replay.Matrix, error) {
	modes, err := replay.ParsePictures(o.pictures)
	if err != nil {
		return nil, err
	}
	x := &replay.Matrix{Ablations: o.ablate, PrefixCredit: o.m.Reuse.Blend() || o.m.Reuse.Donor(), Matcher: o.withMatcher,
		Pictures: modes, Routers: o.routers, Syncs: strings.Split(o.syncs, ","), SyncDelay: o.syncDelay, FlowControl: o.flowControl}
	for _, p := range strings.Split(o.policies, ",") {
		if p = strings.TrimSpace(p); p != "" {
			x.Policies = append(x.Policies, p)
		}
	}
	if o.policyFile != "" {
		if x.Extra, err = readPolicyFile(o.policyFile); err != nil {
			return nil, err
		}
	}
	if o.withMatcher {
		o.m.Matcher = func() routing.Matcher {
			mm, err := matcher.New(matcher.Options{})
			if err != nil {
				panic(err) // default options are valid
			}
			return mm
		}
	}
	return x, nil
}

// register defines cmd's flags (`router replay`'s) into o.
func (o *replayOptions) register(cmd *cobra.Command) {
	f, m := cmd.Flags(), &o.m
	f.StringVar(&o.trace, "trace", "", "trace file (JSONL)")
	f.StringVar(&o.format, "format", "mooncake", "trace format: mooncake, openai, or decisions (a router decision log)")
	f.StringVar(&o.out, "out", "replay-out", "directory for the report")
	f.StringVar(&o.policies, "policies", strings.Join(routing.PolicyNames(), ","), "routing policies to compare with their default parameters, comma-separated (empty: none but --policy-file's)")
	f.StringVar(&o.policyFile, "policy-file", "", "a YAML list of further runs, each a policy with its own parameters as config's routing.policy takes them: - {label: dynamo-t05, type: dynamo, params: {temperature: 0.5}}")
	f.IntVar(&o.blockTokens, "block-tokens", 0, "tokens per block (default 512 for mooncake, 64 for openai)")
	f.IntVar(&m.Replicas, "replicas", replay.DefaultReplicas, "replicas")
	f.Int64Var(&m.BudgetTokens, "budget-tokens", replay.DefaultBudgetTokens, "KV cache per replica, tokens")
	f.StringArrayVar(&o.classes, "class", nil, "a class of replicas in a mixed fleet, repeated for each class: count=N and any of name, prefill_overhead, prefill_per_token, inter_token, max_running, budget_tokens, comma-separated (count=4,prefill_per_token=300us,budget_tokens=200000); a field left out takes its flag's value; the classes' counts make the replicas")
	f.IntVar(&m.MaxRunning, "max-running", replay.DefaultMaxRunning, "running sequences per replica; more wait")
	f.DurationVar(&m.PrefillOverhead, "prefill-overhead", replay.DefaultPrefillOverhead, "fixed prefill time per request")
	f.DurationVar(&m.PrefillPerToken, "prefill-per-token", replay.DefaultPrefillPerToken, "prefill time per uncached token")
	f.DurationVar(&m.InterToken, "inter-token", replay.DefaultInterToken, "decode time per output token")
	f.StringVar(&m.Eviction, "eviction", eviction.Default, "replicas' eviction policy")
	f.StringVar(&o.evictionParams, "eviction-params", "", `the eviction policy's parameters as a JSON object, as config's cache.eviction params: '{"size_exponent": 0.5}'`)
	f.Float64Var(&m.Speedup, "speedup", 1, "divide arrival times by this")
	f.DurationVar(&m.SpreadTies, "spread-ties", 0, "spread requests that share one millisecond evenly over this span or up to the next, as a trace whose timestamps were bucketed to it (the Mooncake conversation trace: about 3s); 0 replays them at once; at most 1h")
	f.BoolVar(&m.RecordReplies, "record-replies", true, "cache a reply's blocks when its request finishes (openai traces)")
	f.BoolVar(&m.SharedActive, "shared-active", false, "count blocks shared by running requests once in KV load (cascade attention)")
	f.Uint64Var(&o.seed, "seed", 1, "seed of the randomised policies")
	f.Float64Var(&o.semantic.LoadWeight, "load-weight", routing.DefaultLoadWeight, "semantic: weight of queued tokens")
	f.Float64Var(&o.semantic.RecentWeight, "recent-weight", routing.DefaultRecentWeight, "semantic: share of recently finished prefill counted as load (negative for none)")
	f.Float64Var(&o.semantic.SpillFactor, "spill-factor", routing.DefaultSpillFactor, "semantic: skip replicas above this × mean load + margin")
	f.Float64Var(&o.semantic.SpillMarginTokens, "spill-margin-tokens", routing.DefaultSpillMarginTokens, "semantic: see --spill-factor")
	f.DurationVar(&m.LoadHalfLife, "load-half-life", replica.DefaultHalfLife, "half-life of the recent-work signal")
	f.BoolVar(&o.withMatcher, "matcher", false, "also run the semantic policy with the MinHash semantic matcher (useful on openai traces)")
	f.BoolVar(&o.ablate, "ablations", false, "also run the semantic policy with unit kind weights and with load ignored")
	f.StringVar(&o.pictures, "picture", "", "picture modes, comma-separated ("+strings.Join(replay.PictureModes, ",")+
		"): how the router's picture learns what each replica's engine cache (simulated apart) holds; several run every policy once per mode side by side; "+
		"empty: feedback, the live router's default for engines without KV events")
	f.IntVar(&o.routers, "routers", 1, "send each request to one of this many routers at random, as a Kubernetes Service would, and compare with one router (needs a picture mode; default approximate)")
	f.StringVar(&o.syncs, "sync", "none,shared", "with --routers: whether the routers share their pictures and load (none, shared; comma-separated to compare)")
	f.DurationVar(&o.syncDelay, "sync-delay", 5*time.Millisecond, "with --sync shared: the time a router's change takes to reach the others")
	f.BoolVar(&o.flowControl, "flow-control", false, "also run each policy with the router's queue (flow_control): a request whose replica would queue it waits in the router instead, as the live router does; labelled policy/flow-control")
	f.StringVar(&o.pd, "pd", "", "P:D: P prefill replicas and D decode replicas, each request disaggregated as the live router does it (replicas[].role); the replicas are then P+D")
	f.DurationVar(&m.TransferLatency, "transfer-latency", replay.DefaultTransferLatency, "with --pd: a KV transfer's fixed time (0: the default)")
	f.DurationVar(&m.TransferPerToken, "transfer-per-token", replay.DefaultTransferPerToken, "with --pd: a KV transfer's time per token moved (0: the default)")
	f.IntVar(&m.MinPrefillTokens, "min-prefill-tokens", replay.DefaultMinPrefillTokens, "with --pd: a request its decode replica would compute less of than this many tokens is not disaggregated (disaggregation.min_prefill_tokens); negative: every request is")
	f.IntVar(&o.sample, "requests", 0, "replay only the first this many requests of the trace (0: all)")
	f.StringVar(&m.Reuse.Mode, "reuse", replica.ReusePrefix, "the engines' reuse beyond the exact prefix: prefix, blend (position-independent segments, as CacheBlend) or donor (a similar earlier prompt's cached KV, as SGLang's SemanticPrefixProvider; openai traces only); with blend or donor, also runs semantic-prefix-credit, the semantic policy crediting the exact prefix alone")
	f.Float64Var(&m.Reuse.MinSimilarity, "donor-similarity", replica.DefaultMinSimilarity, "--reuse donor: least similarity of a donor the engines reuse, in (0, 1]")
	f.Float64Var(&m.Reuse.Recompute, "recompute", replica.DefaultRecompute, "--reuse blend: share of a reused segment's tokens the engine computes again")
	f.Int64Var(&m.Reuse.BudgetTokens, "reuse-budget-tokens", 0, "--reuse blend: tokens of segments each engine keeps for blending (0: --budget-tokens)")
	_ = cmd.MarkFlagRequired("trace")
}

func newGenTrace() *cobra.Command {
	var (
		o   replay.GenOptions
		out string
	)
	cmd := &cobra.Command{
		Use:   "gentrace",
		Short: "Write a synthetic openai-format trace (RAG, chat and agent sessions, or agentic tool loops)",
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.ZipfS <= 1 || o.ZipfV < 1 { // before the file is emptied
				return fmt.Errorf("--zipf-s %v must be > 1 and --zipf-v %v ≥ 1", o.ZipfS, o.ZipfV)
			}
			f, err := os.Create(out)
			if err != nil {
				return err
			}
			if o.AgentShare == 0 {
				o.AgentShare = -1 // none, not the default
			}
			if err := replay.GenerateOpenAI(f, o); err != nil {
				f.Close()
				return err
			}
			if err := f.Close(); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "wrote %s\n", out)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&out, "out", "openai_trace.jsonl", "file to write")
	f.Uint64Var(&o.Seed, "seed", 1, "random seed")
	f.IntVar(&o.Sessions, "sessions", 2000, "sessions")
	f.Float64Var(&o.Rate, "rate", 2, "new sessions per second")
	f.IntVar(&o.Tenants, "tenants", 8, "tenants, each with its own system prompt and tools")
	f.IntVar(&o.Docs, "docs", 300, "documents in the retrieval corpus (blend: also the pool of tool outputs; agentic: the pool of recurring tool outputs)")
	f.Float64Var(&o.ZipfS, "zipf-s", 1.1, "blend, agentic: Zipf exponent of the documents' and tool outputs' popularity (> 1)")
	f.Float64Var(&o.ZipfV, "zipf-v", 2, "blend, agentic: Zipf offset (≥ 1): P(k) ∝ (v + k)^−s; larger flattens the head")
	f.Float64Var(&o.AgentShare, "agent-share", 0.3, "blend: share of sessions that are agents rather than RAG (0: none)")
	f.IntVar(&o.Topics, "topics", 0, "blend: RAG turns retrieve the 2–4 documents of a topic drawn Zipf from this many (one swapped a quarter of the time), as similar questions retrieve the same documents; 0: each turn draws its own")
	f.StringVar(&o.Workload, "workload", "mixed", "mixed (RAG, chats and agents), blend (documents and tool outputs that recur after other prefixes and in other orders), or agentic (multi-step tool loops of 3–12 steps over chat completions, the Responses API and the Messages API, each line's api naming its API; --docs recurring tool outputs drawn with --zipf-s and --zipf-v); see replay.GenOptions")
	f.StringSliceVar(&o.APIs, "apis", nil, "agentic: the APIs sessions speak, comma-separated, each session one at random: chat, responses, messages (default all three)")
	f.Float64Var(&o.ThinkSeconds, "think-seconds", 20, "mean time between a session's turns (not agentic: its steps follow their replies' decode and tools' times)")
	return cmd
}

// policyRun is one entry of a --policy-file.
type policyRun struct {
	Label  string         `yaml:"label"`
	Type   string         `yaml:"type"`
	Params routing.Params `yaml:"params"`
}

// readPolicyFile reads a --policy-file: a YAML list of runs, each checked
// by building its policy.
func readPolicyFile(path string) ([]replay.Run, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var prs []policyRun
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&prs); err != nil {
		return nil, fmt.Errorf("--policy-file %s: %w", path, err)
	}
	runs := make([]replay.Run, 0, len(prs))
	for i, pr := range prs {
		if _, err := routing.NewPolicy(routing.PolicySpec{Type: pr.Type, Params: pr.Params}); err != nil {
			return nil, fmt.Errorf("--policy-file %s: run %d: %w", path, i, err)
		}
		params := pr.Params
		if params == nil {
			params = routing.Params{} // its own defaults, not the semantic flags'
		}
		runs = append(runs, replay.Run{Label: cmp.Or(pr.Label, pr.Type), Policy: pr.Type, Params: params})
	}
	return runs, nil
}
