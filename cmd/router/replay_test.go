package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func runCLI(t *testing.T, args ...string) string {
	t.Helper()
	out, err := runCLIErr(t, args...)
	if err != nil {
		t.Fatalf("router %s: %v", strings.Join(args, " "), err)
	}
	return out
}

// runCLIErr runs the router's command line with args and returns what it
// printed and its error.
func runCLIErr(t *testing.T, args ...string) (string, error) {
	t.Helper()
	root := newRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), err
}

func TestCLIGentraceAndReplay(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(dir, "t.jsonl")
	runCLI(t, "gentrace", "--out", trace, "--sessions", "40", "--docs", "20")
	out := runCLI(t, "replay", "--format", "openai", "--trace", trace, "--replicas", "4", "--budget-tokens", "50000",
		"--policies", "semantic,round_robin,sglang", "--ablations", "--matcher", "--out", filepath.Join(dir, "rep"))
	for _, name := range []string{"| semantic |", "| round_robin |", "| sglang |", "| semantic-unit-weights |", "| semantic-no-copy |", "| semantic-tokens |", "| semantic+matcher |", "| pooled |", "| infinite |"} {
		if !strings.Contains(out, name) {
			t.Errorf("output lacks %s:\n%s", name, out)
		}
	}
	var sum struct {
		Replicas     int   `json:"replicas"`
		BudgetTokens int64 `json:"budget_tokens"`
		Policies     []struct {
			Name         string  `json:"name"`
			Requests     int     `json:"requests"`
			TokenHitRate float64 `json:"token_hit_rate"`
		} `json:"policies"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "rep", "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &sum); err != nil || sum.Replicas != 4 || sum.BudgetTokens != 50000 || len(sum.Policies) != 7 || sum.Policies[0].Requests == 0 {
		t.Fatalf("summary %+v, %v", sum, err)
	}
}

func TestCLIReplayMooncakeAndErrors(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(dir, "m.jsonl")
	os.WriteFile(trace, []byte(`{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 10, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}
`), 0o600)
	out := runCLI(t, "replay", "--trace", trace, "--policies", "dynamo,llmd,aibrix", "--out", filepath.Join(dir, "r"))
	if !strings.Contains(out, "| dynamo |") || !strings.Contains(out, "2 requests (mooncake format)") {
		t.Fatalf("output:\n%s", out)
	}
	pf := filepath.Join(dir, "runs.yaml")
	os.WriteFile(pf, []byte("- {label: dynamo-t05, type: dynamo, params: {temperature: 0.5, overlap_weight: 2}}\n- {type: llm-d, params: {kv_weight: 0}}\n"), 0o600)
	out = runCLI(t, "replay", "--trace", trace, "--policies", "", "--policy-file", pf, "--out", filepath.Join(dir, "pf"))
	if !strings.Contains(out, "| dynamo-t05 |") || !strings.Contains(out, "| llm-d |") || strings.Contains(out, "| semantic |") {
		t.Fatalf("--policy-file runs:\n%s", out)
	}
	badFile := filepath.Join(dir, "bad.yaml")
	os.WriteFile(badFile, []byte("- {type: dynamo, params: {temprature: 0.5}}\n"), 0o600)
	for _, args := range [][]string{
		{"replay", "--trace", trace, "--policy-file", badFile},
		{"replay", "--trace", trace, "--format", "csv"},
		{"replay", "--trace", filepath.Join(dir, "missing")},
		{"replay", "--trace", trace, "--policies", "nope"},
		{"replay", "--trace", trace, "--eviction", "nope"},
		{"replay", "--trace", trace, "--replicas", "-1"},
	} {
		root := newRoot()
		root.SetArgs(append(args, "--out", filepath.Join(dir, "x")))
		root.SetOut(new(bytes.Buffer))
		if err := root.Execute(); err == nil {
			t.Errorf("router %v succeeded", args)
		}
	}
}

func TestCLIReplayPictures(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(dir, "m.jsonl")
	os.WriteFile(trace, []byte(`{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 10, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 20, "input_length": 700, "output_length": 5, "hash_ids": [0, 2]}
`), 0o600)
	out := runCLI(t, "replay", "--trace", trace, "--policies", "semantic,round_robin", "--picture", "approximate,events",
		"--requests", "2", "--out", filepath.Join(dir, "r"))
	for _, want := range []string{"| semantic/approximate |", "| semantic/events |", "| round_robin/events |", "| prediction error |", "2 requests (mooncake format)"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "r", "runs", "semantic_events.csv")); err != nil {
		t.Error(err)
	}
	root := newRoot()
	root.SetArgs([]string{"replay", "--trace", trace, "--picture", "approximate,exact", "--out", filepath.Join(dir, "x")})
	root.SetOut(new(bytes.Buffer))
	root.SetErr(new(bytes.Buffer))
	if err := root.Execute(); err == nil || !strings.Contains(err.Error(), `unknown picture mode "exact"`) {
		t.Errorf("--picture approximate,exact: %v", err)
	}
}

// TestCLIReplayClasses: --class, repeated, makes a mixed fleet whose
// counts make the replicas (or must match --replicas and --pd), and the
// report names the classes.
func TestCLIReplayClasses(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(dir, "m.jsonl")
	os.WriteFile(trace, []byte(`{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 10, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 20, "input_length": 700, "output_length": 5, "hash_ids": [2, 3]}
`), 0o600)
	out := runCLI(t, "replay", "--trace", trace, "--policies", "round_robin", "--max-running", "32", "--out", filepath.Join(dir, "r"),
		"--class", "name=fast,count=2", "--class", "name=slow,count=1,prefill_per_token=300us,budget_tokens=50000")
	for _, want := range []string{"3 replicas in 2 classes", "fast ×2 (replicas 0–1): prefill 5.0 ms + 100 µs/token, 20 ms/output token, 32 running max, 1000000 tokens",
		"slow ×1 (replicas 2–2): prefill 5.0 ms + 300 µs/token, 20 ms/output token, 32 running max, 50000 tokens", "- round_robin: fast 2,"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	var sum struct {
		Replicas int `json:"replicas"`
		Model    struct {
			Fleet []struct {
				Name  string `json:"name"`
				Count int    `json:"count"`
			} `json:"fleet"`
		} `json:"model"`
		Policies []struct {
			Classes []struct {
				Name     string `json:"name"`
				Requests int    `json:"requests"`
			} `json:"classes"`
		} `json:"policies"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "r", "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &sum); err != nil || sum.Replicas != 3 || len(sum.Model.Fleet) != 2 || sum.Model.Fleet[1].Name != "slow" ||
		len(sum.Policies[0].Classes) != 2 || sum.Policies[0].Classes[0].Requests+sum.Policies[0].Classes[1].Requests != 3 {
		t.Fatalf("summary %+v, %v", sum, err)
	}
	for _, tc := range []struct {
		args []string
		err  string
	}{
		{[]string{"--class", "count=2", "--replicas", "3"}, "classes count 2 replicas, the fleet has 3"},
		{[]string{"--class", "count=2", "--pd", "1:2"}, "classes count 2 replicas, the fleet has 3"},
		{[]string{"--class", "count=2,speed=3"}, `--class: class "count=2,speed=3": unknown key "speed"`},
	} {
		_, err := runCLIErr(t, append([]string{"replay", "--trace", trace, "--policies", "round_robin", "--out", filepath.Join(dir, "e")}, tc.args...)...)
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%v: error %v, want one saying %q", tc.args, err, tc.err)
		}
	}
	runCLI(t, "replay", "--trace", trace, "--policies", "round_robin", "--out", filepath.Join(dir, "pd"), "--class", "count=1", "--class", "count=2,prefill_per_token=50us", "--pd", "1:2")
}
