package configs

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/semroute/semroute/replica"
)

func TestGoodConfigs(t *testing.T) {
	files, _ := filepath.Glob("testdata/*.good.yaml")
	if len(files) == 0 {
		t.Fatal("no good configs")
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			if _, err := Load(NewViper(), f); err != nil {
				t.Fatal(err)
			}
		})
	}
	c, err := Load(NewViper(), "testdata/full.good.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.Routing.Policy.Type != "least_load" || c.Routing.LoadHalfLife != 0 || c.Health.Fall != 3 || c.Timeouts.FirstByte != time.Second ||
		c.Routing.RecordReplies || c.Routing.KindWeights["user_query"] != 0 ||
		len(c.Routing.Arms) != 2 || *c.Routing.Arms[0].LoadWeight != 0.5 || c.Routing.Arms[1].LoadWeight != nil ||
		c.GRPCListen != "127.0.0.1:9001" || !c.DecisionLog.RawIDs || c.Replicas[0].Weight != 2 || c.Blocks.BytesPerToken != 3 ||
		c.Replicas[0].Spec().Reuse != (replica.Reuse{Mode: replica.ReuseBlend, Recompute: 0.2}) ||
		c.Replicas[1].Spec().Reuse != (replica.Reuse{Mode: replica.ReuseDonor, MinSimilarity: 0.6}) ||
		c.Replicas[0].Spec().Scheduling != replica.SchedulingFCFS || c.Replicas[1].Spec().Scheduling != replica.SchedulingPriority {
		t.Fatalf("decoded %+v", c)
	}
}

// The discovery section's KV events and data-parallel ranks are read, and
// a replica's data-parallel size reaches its spec.
func TestDiscoveryEventsAndRanks(t *testing.T) {
	c, err := Load(NewViper(), "testdata/discovery-events.good.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if d := c.Discovery; d.DataParallelSize != 2 || d.KVEvents.Endpoint != "tcp://{host}:5557" || d.KVEvents.ReplayEndpoint != "tcp://{host}:5600" {
		t.Errorf("discovery: %+v", d)
	}
	if s := c.Replicas[0].Spec(); s.DataParallel.Size != 4 || s.KVEvents.Listen != "tcp://0.0.0.0:6000" {
		t.Errorf("replica: %+v", s)
	}
}

// TestPolicyParamsReachTheSpecs: a policy's params, its older keys and an
// arm's are merged in the documented order.
func TestPolicyParamsReachTheSpecs(t *testing.T) {
	c, err := Load(NewViper(), "testdata/policy-params.good.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if s := c.Routing.PolicySpec(); s.Type != "dynamo" || s.Params["temperature"] != 0.5 || s.Params["overlap_weight"] != 2 || s.Params["load_weight"] != nil {
		t.Errorf("routing.policy: %+v", s)
	}
	if s := c.Routing.ArmSpec(2); s.Params["load_weight"] != 0.3 || s.Params["spill_factor"] != 2.0 {
		t.Errorf("an arm's older key: %+v", s)
	}
	if s := c.Routing.ArmSpec(3); s.Params["load_weight"] != 0.2 || s.Params["spill_factor"] != 3 {
		t.Errorf("an arm's params over its older key: %+v", s)
	}
	if s := c.Routing.ArmSpec(1); s.Params["prefix_weight"] != 5 {
		t.Errorf("llmd's params: %+v", s)
	}
}

func TestBadConfigs(t *testing.T) {
	want := map[string][]string{
		"unknown-key.bad.yaml": {"polcy"},
		"bad-values.bad.yaml": {
			"listen:", "log.level:", "log.format:", "routing.policy:", "routing.load_weight:", "routing.spill_factor:",
			"routing.attempts:", "routing.kind_weights.sytem:", "blocks:", "cache.eviction:", "limits.max_body_bytes:",
			"limits.max_body_bytes_in_flight:", "limits.max_messages:", "replicas[0].url:", "replicas[1].name:", "replicas[1].weight:", "replicas[1].reuse:",
			`replicas[1].scheduling: "lifo" is not fcfs or priority`, "routing.arms[0].policy:", "routing.arms[0].weight:", "routing.arms[1].name:", "runtime.gc_floor_mb:",
		},
		"hostile.bad.yaml": {"grpc.token:", "grpc.tls_cert_file:", "grpc.max_unreleased_decisions:", "grpc.ext_proc_max_buffered_bytes:", "limits.max_json_depth:",
			"cache.default_budget_tokens:", "replicas[0].name:", "replicas[0].url:", "replicas[1].weight:", "replicas[2].reuse:"},
		"bad-duration.bad.yaml":              {"load_half_life"},
		"discovery-events.bad.yaml":          {"discovery.kv_events.topic: must be empty with kv_events.listen", "discovery.data_parallel_size: 300 is not in [0, 256]", "replicas[0].data_parallel_size: -2", "replicas[1].kv_events.replay_endpoint: port 5558 meets the events ports 5557-5558"},
		"bad-yaml.bad.yaml":                  {"parse config"},
		"fleet-without-credentials.bad.yaml": {"cluster:", "no NATS credentials", "insecure: true"},
		"policy-params.bad.yaml": {`routing.policy: policy dynamo: unknown parameter "temprature" (have overlap_weight, temperature)`,
			"routing.arms[0].policy: policy sglang: cache_threshold", "routing.arms[1].policy: policy round_robin takes no parameters",
			`routing.arms[2].policy: unknown routing policy "semantik"`, "cache.eviction: eviction policy kind_weighted: weights"},
	}
	files, _ := filepath.Glob("testdata/*.bad.yaml")
	if len(files) != len(want) {
		t.Fatalf("%d bad configs, %d expectations", len(files), len(want))
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			_, err := Load(NewViper(), f)
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range want[filepath.Base(f)] {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not name %q:\n%v", w, err)
				}
			}
		})
	}
}

func TestDefaultsAndEmbeddedConfigsValidate(t *testing.T) {
	c, err := Decode(NewViper())
	if err != nil {
		t.Fatal(err)
	}
	if c.Routing.Policy.Type != "semantic" || c.Blocks.BlockTokens != 64 || !c.Routing.RecordReplies || c.Routing.RecentWeight != 1 || c.Routing.LoadWeight != 0 || c.Runtime.GCFloorMB != 64 {
		t.Fatalf("defaults %+v", c)
	}
	for name, b := range map[string][]byte{"demo.yaml": DemoYAML, "router.yaml": ExampleYAML} {
		if _, err := LoadBytes(NewViper(), b); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	// The files on disk are the embedded ones.
	for name, b := range map[string][]byte{"demo.yaml": DemoYAML, "router.yaml": ExampleYAML} {
		disk, err := os.ReadFile(name)
		if err != nil || string(disk) != string(b) {
			t.Errorf("%s differs from its embedded copy (%v)", name, err)
		}
	}
}

func TestEnvironmentOverridesFile(t *testing.T) {
	t.Setenv("SEMROUTE_ROUTING_POLICY", "round_robin")
	t.Setenv("SEMROUTE_LIMITS_MAX_MESSAGES", "7")
	c, err := Load(NewViper(), "testdata/full.good.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.Routing.Policy.Type != "round_robin" || c.Limits.MaxMessages != 7 {
		t.Fatalf("env not applied: policy %q, max_messages %d", c.Routing.Policy.Type, c.Limits.MaxMessages)
	}
	t.Setenv("SEMROUTE_ROUTING_ATTEMPTS", "99")
	if _, err := Load(NewViper(), "testdata/full.good.yaml"); err == nil || !strings.Contains(err.Error(), "routing.attempts") {
		t.Fatalf("invalid env value: %v", err)
	}
}

func TestMissingFile(t *testing.T) {
	if _, err := Load(NewViper(), "testdata/nope.yaml"); err == nil || !strings.Contains(err.Error(), "read config") {
		t.Fatalf("err = %v", err)
	}
}

// TestEveryExampleConfigInTheRepository loads and validates every router
// config the repository ships: the files here, the good test files, and
// the router.yaml of every Kubernetes ConfigMap under deploy/.
func TestEveryExampleConfigInTheRepository(t *testing.T) {
	var found int
	check := func(name string, doc []byte) {
		t.Helper()
		found++
		if _, err := LoadBytes(NewViper(), doc); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	err := filepath.WalkDir("..", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "fuzz") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".yaml") || strings.HasSuffix(path, ".bad.yaml") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		switch {
		case strings.Contains(path, "deploy/k8s"):
			// The Deployment sets the gRPC token from a Secret.
			t.Setenv("SEMROUTE_GRPC_TOKEN", "from-the-secret")
			dec := yaml.NewDecoder(bytes.NewReader(b))
			for {
				var obj struct {
					Kind string            `yaml:"kind"`
					Data map[string]string `yaml:"data"`
				}
				if err := dec.Decode(&obj); err == io.EOF {
					break
				} else if err != nil {
					return fmt.Errorf("%s: %w", path, err)
				}
				if obj.Kind == "ConfigMap" && obj.Data["router.yaml"] != "" {
					check(path+" ConfigMap router.yaml", []byte(obj.Data["router.yaml"]))
				}
			}
		case strings.HasPrefix(path, "../configs/"):
			check(path, b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if found < 5 {
		t.Fatalf("found only %d example configs", found)
	}
}

func TestDiffNamesChangedKeys(t *testing.T) {
	a, err := Load(NewViper(), "testdata/full.good.yaml")
	if err != nil {
		t.Fatal(err)
	}
	b := *a
	if d := Diff(a, &b); len(d) != 0 {
		t.Fatalf("identical configs differ in %v", d)
	}
	b.Admin.Token = "rotated"
	b.Limits.MaxBodyBytes++
	b.Replicas = append([]Replica(nil), a.Replicas...)
	b.Replicas[0].Weight = 3
	b.Routing.KindWeights = map[string]float64{"system": 9}
	want := []string{"routing.kind_weights", "limits.max_body_bytes", "admin.token", "replicas"}
	if d := Diff(a, &b); !slices.Equal(d, want) {
		t.Fatalf("diff %v, want %v", d, want)
	}
}

// A config with unknown keys and bad values names them all at once, the
// unknown keys with their paths.
func TestEveryProblemAtOnce(t *testing.T) {
	_, err := LoadBytes(NewViper(), []byte(`
foo: 1
routing:
  policy: semantik
  bar: 2
replicas:
  - {name: a, url: "http://127.0.0.1:1", colour: red}
`))
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{"unknown keys: ", "routing.bar", "replicas[0].colour", "foo", `unknown routing policy "semantik"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q missing from: %v", want, err)
		}
	}
}

// TestTTFTTargets: flow_control.ttft_targets reads durations by objective.
func TestTTFTTargets(t *testing.T) {
	c, err := LoadBytes(NewViper(), []byte("flow_control:\n  priorities: {chat: 10}\n  ttft_targets: {chat: 1500ms, batch: 2m}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.FlowControl.TTFTTargets; got["chat"] != 1500*time.Millisecond || got["batch"] != 2*time.Minute || !c.FlowControl.Enabled {
		t.Fatalf("targets %v, enabled %v", got, c.FlowControl.Enabled)
	}
}

// TestFlowControlOffByDefaultInAFleet: flow control is on by default, off
// by default for a router of a fleet, and as set when set.
func TestFlowControlOffByDefaultInAFleet(t *testing.T) {
	for _, tc := range []struct {
		yaml string
		want bool
	}{
		{"", true},
		{"cluster:\n  urls: [nats://127.0.0.1:4222]\n  insecure: true\n", false},
		{"cluster:\n  urls: [nats://127.0.0.1:4222]\n  insecure: true\nflow_control:\n  enabled: true\n", true},
		{"flow_control:\n  enabled: false\n", false},
	} {
		c, err := LoadBytes(NewViper(), []byte(tc.yaml))
		if err != nil {
			t.Fatal(err)
		}
		if c.FlowControl.Enabled != tc.want {
			t.Errorf("%q: flow control %v, want %v", tc.yaml, c.FlowControl.Enabled, tc.want)
		}
	}
}

// A bad value from a SEMROUTE_* variable is reported with the variable's
// name, which no file holds.
func TestBadEnvValueNamesItsVariable(t *testing.T) {
	t.Setenv("SEMROUTE_ROUTING_ATTEMPTS", "abc")
	_, err := LoadBytes(NewViper(), []byte("listen: 127.0.0.1:0\n"))
	if err == nil || !strings.Contains(err.Error(), "SEMROUTE_ROUTING_ATTEMPTS") || !strings.Contains(err.Error(), "routing.attempts") {
		t.Fatalf("got %v", err)
	}
}

// A YAML syntax error names its own line, not the one before it (go-yaml
// v3's count for many errors), and shows none of the config's text.
func TestYAMLErrorNamesItsLine(t *testing.T) {
	for doc, want := range map[string]string{
		"log:\n  level: info\n  format: \"json\n":                     "[3:11]",
		"listen: x\nlog:\n  level: [info, secret-ish\nreplicas: []\n": "[4:1]",
		"listen: x\nlog: 1\n\tlevel: info\n":                          "[3:1]",
	} {
		_, err := LoadBytes(NewViper(), []byte(doc))
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "secret-ish") {
			t.Errorf("%q: %v, want %s and no text of the config", doc, err, want)
		}
	}
}

// A replica URL without its scheme says what to write (url.Parse says
// "first path segment in URL cannot contain colon"), and the precise
// tokenizer mode's old name runs, and is named, as the docs name it.
func TestRoughEdgesOperatorsMet(t *testing.T) {
	_, err := LoadBytes(NewViper(), []byte("replicas:\n  - {name: a, url: \"10.0.0.5:8000\"}\n"))
	if err == nil || !strings.Contains(err.Error(), "replicas[0].url: no scheme: write it as http://host:port") || strings.Contains(err.Error(), "first path segment") {
		t.Errorf("a URL without a scheme: %v", err)
	}
	c, err := LoadBytes(NewViper(), []byte("tokenizer: {mode: replica}\n"))
	if err != nil || c.Tokenizer.Mode != "auto" {
		t.Errorf("tokenizer.mode replica: %v, mode %q", err, c.Tokenizer.Mode)
	}
}
