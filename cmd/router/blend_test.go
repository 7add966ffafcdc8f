package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/replay"
	"github.com/semroute/semroute/simreplica"
)

// blendWorkload returns the request bodies of `router gentrace --workload
// blend` for sessions sessions, in arrival order, each asking for usage.
func blendWorkload(t *testing.T, sessions int, seed uint64) [][]byte {
	t.Helper()
	var buf bytes.Buffer
	if err := replay.GenerateOpenAI(&buf, replay.GenOptions{Workload: "blend", Seed: seed, Sessions: sessions, Docs: 120}); err != nil {
		t.Fatal(err)
	}
	var out [][]byte
	sc := bufio.NewScanner(&buf)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var line struct {
			Body map[string]any `json:"request"`
		}
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatal(err)
		}
		line.Body["stream_options"] = map[string]any{"include_usage": true}
		b, _ := json.Marshal(line.Body)
		out = append(out, b)
	}
	return out
}

// blendSim is the blending engine of the live runs: the word tokenizer,
// a prefix cache of 768 blocks of 16 tokens, a segment store of
// blendStoreTokens (a few of the workload's 120 documents and 120 tool
// outputs each), and prefill slow enough that reuse shows in time to first
// token.
var blendSim = simreplica.Options{Overhead: time.Millisecond, PrefillPerToken: 20 * time.Microsecond, InterToken: 200 * time.Microsecond,
	OutputTokens: 8, NumBlocks: 768}

const blendStoreTokens = 12000

type blendRun struct {
	name string
	*truthRun
	reused    int64   // tokens the engines reused past the prefix
	imbalance float64 // most prefill tokens computed by a replica ÷ the mean
}

// runBlend sends work through 4 blending replicas behind a router with
// policy, told of the blending (reuse "blend") or not ("prefix").
func runBlend(t *testing.T, name, policy, reuse string, work [][]byte) *blendRun {
	t.Helper()
	sim := blendSim
	sim.Blend = &simreplica.Blend{BudgetTokens: blendStoreTokens}
	d := startTestDemo(t, demoOptions{sim: sim, policy: policy, replicas: 4, picture: "approximate", reuse: reuse})
	run := &blendRun{name: name, truthRun: sendTruth(d.router.url(), work, truthWorkers, nil)}
	var most, sum float64
	for _, s := range d.sims {
		st := s.Stats()
		run.reused += st.ReusedTokens
		c := float64(st.PromptTokens - st.CachedTokens)
		most, sum = max(most, c), sum+c
	}
	run.imbalance = most / (sum / float64(len(d.sims)))
	t.Logf("%s: prompt %d, engines reported %d cached (%d past the prefix), ttft p50 %.1fms p99 %.1fms, imbalance %.3f, errors %d",
		name, run.prompt, run.cached, run.reused, 1e3*run.pct(0.5), 1e3*run.pct(0.99), run.imbalance, run.errors)
	if run.errors > 0 {
		t.Fatalf("%s: %d requests failed", name, run.errors)
	}
	return run
}

// TestE2EBlendCreditReusesMore: over sockets, 4 replicas that blend
// documents and tool results (simreplica.Blend) behind the router. Told
// that the engines blend, the semantic policy sends a request where its
// documents are held, and the engines reuse more tokens than when the same
// router credits the exact prefix alone.
func TestE2EBlendCreditReusesMore(t *testing.T) {
	work := blendWorkload(t, 60, 3)
	aware := runBlend(t, "semantic, blend credit", "semantic", "blend", work)
	prefix := runBlend(t, "semantic, prefix credit", "semantic", "prefix", work)
	if aware.cached <= prefix.cached || aware.reused <= prefix.reused {
		t.Fatalf("blend credit: %d cached (%d reused); prefix credit: %d (%d)", aware.cached, aware.reused, prefix.cached, prefix.reused)
	}
}

// TestE2EBlendTable measures the live table of the README (reuse beyond
// the exact prefix). It takes a minute or two: run it with
//
//	SEMROUTE_BLEND_TABLE=600 go test -run TestE2EBlendTable -v -timeout 30m ./cmd/router
//
// where the number is the workload's sessions.
func TestE2EBlendTable(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("SEMROUTE_BLEND_TABLE"))
	if n == 0 {
		t.Skip("set SEMROUTE_BLEND_TABLE=<sessions> to measure")
	}
	work := blendWorkload(t, n, 7)
	rows := []*blendRun{
		runBlend(t, "semantic (blend credit)", "semantic", "blend", work),
		runBlend(t, "semantic (prefix credit)", "semantic", "prefix", work),
		runBlend(t, "llmd", "llmd", "blend", work),
		runBlend(t, "sglang", "sglang", "blend", work),
		runBlend(t, "round_robin", "round_robin", "blend", work),
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n%d requests\n\n| policy | tokens not computed | of them past the prefix | TTFT p50 | TTFT p99 | imbalance |\n|---|---:|---:|---:|---:|---:|\n", len(work))
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %d | %d | %.1f ms | %.1f ms | %.3f |\n", r.name, r.cached, r.reused, 1e3*r.pct(0.5), 1e3*r.pct(0.99), r.imbalance)
	}
	t.Log(b.String())
}
