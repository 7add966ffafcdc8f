package main

import (
	"bufio"
	"bytes"
	"cmp"
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
func blendWorkload(t testing.TB, o replay.GenOptions) [][]byte {
	t.Helper()
	o.Workload = "blend"
	var out [][]byte
	for _, l := range genWorkload(t, o) {
		l.Body["stream_options"] = map[string]any{"include_usage": true}
		b, _ := json.Marshal(l.Body)
		out = append(out, b)
	}
	return out
}

// traceLine is a line of a generated trace (replay.GenerateOpenAI).
type traceLine struct {
	Session string         `json:"session_id"`
	API     string         `json:"api"`
	Body    map[string]any `json:"request"`
}

// genWorkload returns the lines of the trace replay.GenerateOpenAI makes
// with o, in arrival order.
func genWorkload(t testing.TB, o replay.GenOptions) []traceLine {
	t.Helper()
	var buf bytes.Buffer
	if err := replay.GenerateOpenAI(&buf, o); err != nil {
		t.Fatal(err)
	}
	var out []traceLine
	sc := bufio.NewScanner(&buf)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		var line traceLine
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatal(err)
		}
		out = append(out, line)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// blendSim is the blending engine of the live runs: the word tokenizer,
// a prefix cache of 420 blocks of 16 tokens and a segment store of as many
// tokens (6,720: about 19 of the workload's 120 documents of 350 tokens on
// average), and prefill slow enough that reuse shows in time to first
// token. The cache is the replay's --budget-tokens 10000 in engine tokens:
// the router estimates 4 bytes a token, where this tokenizer makes 6 on
// the workload.
var blendSim = simreplica.Options{Overhead: time.Millisecond, PrefillPerToken: 50 * time.Microsecond, InterToken: 200 * time.Microsecond,
	OutputTokens: 8, NumBlocks: 420}

const blendStoreTokens = 420 * 16

// blendGen is the live runs' workload: RAG sessions only over a long-tail
// corpus (see docs/replay.md's table for the same in replay).
var blendGen = replay.GenOptions{Docs: 120, ZipfV: 20, AgentShare: -1}

type blendRun struct {
	name string
	*truthRun
	reused    int64   // tokens the engines reused past the prefix
	imbalance float64 // most prefill tokens computed by a replica ÷ the mean
}

// runBlend sends work through 4 blending replicas behind a router with
// policy, told of the blending (reuse "blend") or not ("prefix").
func runBlend(t *testing.T, name, policy, reuse string, work [][]byte) *blendRun {
	return runReuse(t, "blend", "approximate", name, policy, reuse, work)
}

// runReuse sends work through 4 replicas whose engines reuse as engine
// says ("blend" or "donor") behind a router with policy and its picture in
// mode picture, told that the engines reuse so (reuse = engine) or the
// exact prefix alone ("prefix").
func runReuse(t testing.TB, engine, picture, name, policy, reuse string, work [][]byte) *blendRun {
	t.Helper()
	return runReuseN(t, truthWorkers, engine, picture, name, policy, reuse, work)
}

// runReuseN is runReuse with workers requests in flight.
func runReuseN(t testing.TB, workers int, engine, picture, name, policy, reuse string, work [][]byte) *blendRun {
	t.Helper()
	sim := blendSim
	switch engine {
	case "blend":
		sim.Blend = &simreplica.Blend{BudgetTokens: blendStoreTokens}
	case "donor":
		sim.Donor = &simreplica.Donor{}
	default:
		t.Fatalf("engine %q", engine)
	}
	o := demoOptions{sim: sim, policy: policy, replicas: 4, picture: picture, reuse: reuse}
	return runLive(t, o, name, func(url string) *truthRun { return sendTruth(url, work, workers, nil) })
}

// runLive starts the demo o, its replicas simulated, sends a workload
// through its router with send, and measures what the engines reported:
// send's figures, the tokens they reused past the prefix and the
// imbalance of the prefill work they computed. It fails t if a request
// failed.
func runLive(t testing.TB, o demoOptions, name string, send func(url string) *truthRun) *blendRun {
	t.Helper()
	d := startTestDemo(t, o)
	if o.picture == "events" {
		waitSubscribed(t, d)
	}
	run := &blendRun{name: name, truthRun: send(d.router.URL())}
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
		t.Fatalf("%s: %d requests failed (the first: %s)", name, run.errors, run.firstErr)
	}
	return run
}

// TestE2EBlendCreditReusesMore: over sockets, 4 replicas that blend
// documents and tool results (simreplica.Blend) behind the router. Told
// that the engines blend, the semantic policy sends a request where its
// documents are held, and the engines reuse at least 1.1× the tokens they
// reuse when the same router credits the exact prefix alone.
func TestE2EBlendCreditReusesMore(t *testing.T) {
	g := blendGen
	g.Seed, g.Sessions = 3, 60
	work := blendWorkload(t, g)
	aware := runBlend(t, "semantic, blend credit", "semantic", "blend", work)
	prefix := runBlend(t, "semantic, prefix credit", "semantic", "prefix", work)
	// Measured 1.30–1.6× (4 runs); 1.1× leaves room for the scheduling
	// noise of 4 requests at a time.
	if float64(aware.cached) < 1.1*float64(prefix.cached) || aware.reused <= prefix.reused {
		t.Fatalf("blend credit: %d cached (%d reused); prefix credit: %d (%d)", aware.cached, aware.reused, prefix.cached, prefix.reused)
	}
}

// TestE2EBlendCreditPrecise: the same in precise mode, where the router
// routes on the engine's tokens and its KV events, and finds documents by
// the segment keys of the engine's token blocks (SetTokenSegments).
func TestE2EBlendCreditPrecise(t *testing.T) {
	g := blendGen
	g.Seed, g.Sessions = 3, 60
	work := blendWorkload(t, g)
	aware := runReuse(t, "blend", "events", "precise, blend credit", "semantic", "blend", work)
	prefix := runReuse(t, "blend", "events", "precise, prefix credit", "semantic", "prefix", work)
	if float64(aware.cached) < 1.1*float64(prefix.cached) || aware.reused <= prefix.reused {
		t.Fatalf("blend credit: %d cached (%d reused); prefix credit: %d (%d)", aware.cached, aware.reused, prefix.cached, prefix.reused)
	}
}

// BenchmarkE2EBlendTable measures the live table of
// docs/reuse-beyond-prefix.md (reuse beyond the exact prefix), a
// sub-benchmark a policy reporting the tokens the engines did not compute,
// those of them past the prefix, TTFT p50 and p99 at the client and the
// imbalance of prefill work; then it logs the table. One run takes a
// minute or two: run it with
//
//	SEMROUTE_BLEND_TABLE=600 go test -run '^$' -bench BenchmarkE2EBlendTable -benchtime 1x -v -timeout 30m ./cmd/router
//
// where the number is the workload's sessions (-v for the table); SEMROUTE_BLEND_AGENTS and
// SEMROUTE_BLEND_ZIPF_V set the workload's agent share (negative: none) and
// Zipf offset, SEMROUTE_BLEND_PICTURE the router's picture (approximate or
// events), SEMROUTE_BLEND_ENGINE the engines' reuse (blend or donor) and
// SEMROUTE_BLEND_TOPICS the workload's retrieval topics (GenOptions.Topics).
func BenchmarkE2EBlendTable(b *testing.B) {
	n, _ := strconv.Atoi(os.Getenv("SEMROUTE_BLEND_TABLE"))
	if n == 0 {
		b.Skip("set SEMROUTE_BLEND_TABLE=<sessions> to measure")
	}
	g := blendGen
	g.Seed, g.Sessions = 7, n
	if v, err := strconv.ParseFloat(os.Getenv("SEMROUTE_BLEND_AGENTS"), 64); err == nil {
		g.AgentShare = v
	}
	if v, err := strconv.ParseFloat(os.Getenv("SEMROUTE_BLEND_ZIPF_V"), 64); err == nil {
		g.ZipfV = v
	}
	if v, err := strconv.Atoi(os.Getenv("SEMROUTE_BLEND_TOPICS")); err == nil {
		g.Topics = v
	}
	work := blendWorkload(b, g)
	pic := cmp.Or(os.Getenv("SEMROUTE_BLEND_PICTURE"), "approximate")
	eng := cmp.Or(os.Getenv("SEMROUTE_BLEND_ENGINE"), "blend")
	rows := []struct{ name, policy, reuse string }{
		{"semantic (" + eng + " credit)", "semantic", eng},
		{"semantic (prefix credit)", "semantic", "prefix"},
		{"llmd", "llmd", eng},
		{"sglang", "sglang", eng},
		{"round_robin", "round_robin", eng},
	}
	runs := make([]*blendRun, len(rows)) // the last run of each row
	for i, row := range rows {
		b.Run(row.name, func(b *testing.B) {
			var r *blendRun
			for range b.N {
				r = runReuse(b, eng, pic, row.name, row.policy, row.reuse, work)
			}
			b.ReportMetric(float64(r.cached), "tokens-not-computed")
			b.ReportMetric(float64(r.reused), "past-prefix-tokens")
			b.ReportMetric(1e3*r.pct(0.5), "ttft-p50-ms")
			b.ReportMetric(1e3*r.pct(0.99), "ttft-p99-ms")
			b.ReportMetric(r.imbalance, "imbalance")
			runs[i] = r
		})
	}
	var t strings.Builder
	fmt.Fprintf(&t, "\n%d requests\n\n| policy | tokens not computed | of them past the prefix | TTFT p50 | TTFT p99 | imbalance |\n|---|---:|---:|---:|---:|---:|\n", len(work))
	for _, r := range runs {
		if r != nil {
			fmt.Fprintf(&t, "| %s | %d | %d | %.1f ms | %.1f ms | %.3f |\n", r.name, r.cached, r.reused, 1e3*r.pct(0.5), 1e3*r.pct(0.99), r.imbalance)
		}
	}
	b.Log(t.String())
}

// TestE2EDonorCreditReusesMore: over sockets, 4 replicas whose engines
// reuse a similar earlier prompt's KV (simreplica.Donor) behind the router,
// on RAG turns that retrieve by topic. Told that the engines take donors,
// the semantic policy sends a request where a similar prompt is held, and
// the engines reuse more than when the same router credits the exact prefix
// alone.
func TestE2EDonorCreditReusesMore(t *testing.T) {
	g := blendGen
	g.Seed, g.Sessions, g.Topics = 3, 60, 10
	work := blendWorkload(t, g)
	// One request at a time: with several in flight the two runs' orders
	// differ from run to run, and the ratio with them (1.08 to 1.41 of
	// the prefix credit's at 4 in flight).
	aware := runReuseN(t, 1, "donor", "approximate", "semantic, donor credit", "semantic", "donor", work)
	prefix := runReuseN(t, 1, "donor", "approximate", "semantic, prefix credit", "semantic", "prefix", work)
	if float64(aware.cached) < 1.1*float64(prefix.cached) || aware.reused <= prefix.reused {
		t.Fatalf("donor credit: %d cached (%d from donors); prefix credit: %d (%d)", aware.cached, aware.reused, prefix.cached, prefix.reused)
	}
}
