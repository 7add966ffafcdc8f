package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// jsSDK readies OpenAI's official JS SDK (testdata/sdk-js, its version
// locked) in a directory of its own, or skips t when node and npm are not
// here or the package cannot be had. SEMROUTE_JS_SDK=require (.ci/run sets
// it where node is) makes those failures.
func jsSDK(t *testing.T) string {
	t.Helper()
	required := os.Getenv("SEMROUTE_JS_SDK") == "require"
	skip := func(format string, args ...any) {
		t.Helper()
		if required {
			t.Fatalf(format, args...)
		}
		t.Skipf(format+" (SEMROUTE_JS_SDK=require makes this a failure)", args...)
	}
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			skip("the JS SDK check needs %s: %v", tool, err)
		}
	}
	dir := t.TempDir()
	for _, f := range []string{"package.json", "package-lock.json", "agent.mjs"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "testdata", "sdk-js", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund", "--loglevel=error")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		skip("npm ci: %v: %s", err, out)
	}
	return dir
}

// jsAgentRun is what testdata/sdk-js/agent.mjs prints.
type jsAgentRun struct {
	Chain, Streamed []struct {
		Replica                string
		Matched, Input, Cached int64
		ID                     string
	}
	Final []struct {
		ID, Text, Status string
		Output           int
	}
	ResponsesTools, ChatTools []struct {
		Name string
		Args map[string]any
	}
}

// OpenAI's official JS SDK, unchanged (openai 7.59.0), against the demo in
// precise mode and two routers behind a round-robin front: a 20-turn
// previous_response_id chain whole and streamed, predicted within 10% of
// the engine's cached tokens from the third turn; the SDK's own
// responses.stream(...).finalResponse() continuing a chain; and tool loops
// of 5 steps over the Responses API and chat.
func TestOfficialJSSDK(t *testing.T) {
	dir := jsSDK(t)
	forAgentSetups(t, func(t *testing.T, d *demo) {
		cmd := exec.Command("node", "agent.mjs", d.router.URL()+"/v1", d.sims[0].Options().Model)
		cmd.Dir = dir
		out, err := cmd.Output()
		if err != nil {
			var stderr []byte
			if ee, ok := err.(*exec.ExitError); ok {
				stderr = ee.Stderr
			}
			t.Fatalf("node agent.mjs: %v\n%s", err, stderr)
		}
		var run jsAgentRun
		if err := json.Unmarshal(out, &run); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		for name, turns := range map[string][]chainTurn{"chain": jsTurns(run.Chain), "streamed": jsTurns(run.Streamed)} {
			if len(turns) != 20 {
				t.Fatalf("%s: %d turns", name, len(turns))
			}
			checkPredicted(t, name, 0.1, turns)
		}
		for i, f := range run.Final {
			if f.Text == "" || f.Status != "completed" || f.Output != 1 {
				t.Errorf("finalResponse %d: %+v", i, f)
			}
		}
		if len(run.Final) != 3 || len(run.ResponsesTools) != 5 || len(run.ChatTools) != 5 {
			t.Fatalf("final %d, Responses tool steps %d, chat tool steps %d", len(run.Final), len(run.ResponsesTools), len(run.ChatTools))
		}
		for _, s := range append(run.ResponsesTools, run.ChatTools...) {
			if s.Name != "read_file" || s.Args["path"] == nil {
				t.Errorf("a tool step called %s with %v", s.Name, s.Args)
			}
		}
	})
}

// jsTurns turns agent.mjs's turns into chainTurns.
func jsTurns(in []struct {
	Replica                string
	Matched, Input, Cached int64
	ID                     string
}) []chainTurn {
	out := make([]chainTurn, len(in))
	for i, c := range in {
		out[i] = chainTurn{api: "responses", replica: c.Replica, matched: int(c.Matched), prompt: c.Input, cached: c.Cached, responseID: c.ID}
	}
	return out
}
