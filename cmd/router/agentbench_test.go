package main

import (
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/replay"
	"github.com/semroute/semroute/routing"
	"github.com/semroute/semroute/simreplica"
)

// agenticSim is the engine of the live agentic runs: the word tokenizer
// (about 6 bytes a token on the workload, where the router estimates 4),
// a KV cache of 1,200 blocks of 16 tokens (19,200 tokens: about four of
// the workload's tenant prefixes of tools and system prompt, fewer than
// the 8 tenants' and the sessions in flight need, so that capacity binds
// and where a session goes matters), prefill slow enough that hits show
// in time to first token, and short answers.
var agenticSim = simreplica.Options{Overhead: time.Millisecond, PrefillPerToken: 50 * time.Microsecond, InterToken: 200 * time.Microsecond,
	OutputTokens: 8, NumBlocks: 1200}

// agenticMaxTokens is the answer length of the live runs' requests: the
// replies the trace records are not what the simulated engine writes, so
// decoding them at length would only make the runs longer.
const agenticMaxTokens = 8

// agenticPaths are the paths of the agentic workload's APIs.
var agenticPaths = map[string]string{"chat": chatPath, "responses": "/v1/responses", "messages": "/v1/messages"}

// agenticWorkload returns the sessions of `router gentrace --workload
// agentic` with o, in the order they start, each a session's steps in
// order, every body streamed, asking for usage and for agenticMaxTokens
// tokens in its API's terms.
func agenticWorkload(t testing.TB, o replay.GenOptions) [][]liveRequest {
	t.Helper()
	o.Workload = "agentic"
	index := map[string]int{}
	var out [][]liveRequest
	for _, l := range genWorkload(t, o) {
		path, ok := agenticPaths[l.API]
		if !ok {
			t.Fatalf("session %s: api %q", l.Session, l.API)
		}
		switch l.API {
		case "chat":
			l.Body["stream_options"] = map[string]any{"include_usage": true}
			l.Body["max_tokens"] = agenticMaxTokens
		case "responses":
			l.Body["max_output_tokens"] = agenticMaxTokens
		case "messages":
			l.Body["max_tokens"] = agenticMaxTokens
		}
		b, _ := json.Marshal(l.Body)
		i, ok := index[l.Session]
		if !ok {
			i = len(out)
			index[l.Session] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], liveRequest{path, b})
	}
	return out
}

// agenticWorkers is how many sessions the live runs keep going at once.
const agenticWorkers = 8

// BenchmarkSimAgentic sends the agentic workload (replay.GenOptions
// Workload "agentic": tool loops over chat completions, the Responses API
// and the Messages API) live over sockets through the router in front of 4
// simulated replicas (agenticSim), agenticWorkers sessions at a time, each
// session's steps one after the other, under every registered policy, the
// default (semantic) first: a sub-benchmark a policy, reporting the
// engines' hit ratio (cached ÷ prompt tokens from each API's usage), TTFT
// p50 and p99 at the client (the first streamed event) and the imbalance
// of prefill work; then it logs the table. Run it with
//
//	SEMROUTE_AGENTIC=40 go test -run '^$' -bench BenchmarkSimAgentic -benchtime 1x -v -timeout 30m ./cmd/router
//
// where the number is the workload's sessions (-v for the table).
// SEMROUTE_AGENTIC_POLICIES (comma-separated) runs a subset, and
// SEMROUTE_AGENTIC_PICTURE sets the router's picture (approximate, the
// default, or events).
func BenchmarkSimAgentic(b *testing.B) {
	n, _ := strconv.Atoi(os.Getenv("SEMROUTE_AGENTIC"))
	if n == 0 {
		b.Skip("set SEMROUTE_AGENTIC=<sessions> to measure")
	}
	work := agenticWorkload(b, replay.GenOptions{Seed: 7, Sessions: n})
	policies := routing.PolicyNames()
	if v := os.Getenv("SEMROUTE_AGENTIC_POLICIES"); v != "" {
		policies = strings.Split(v, ",")
	}
	pic := cmp.Or(os.Getenv("SEMROUTE_AGENTIC_PICTURE"), "approximate")
	runs := make([]*blendRun, len(policies)) // the last run of each policy
	for i, pol := range policies {
		b.Run(pol, func(b *testing.B) {
			var r *blendRun
			for range b.N {
				o := demoOptions{sim: agenticSim, policy: pol, replicas: 4, picture: pic}
				r = runLive(b, o, pol, func(url string) *truthRun { return sendSessions(url, work, agenticWorkers, nil) })
			}
			b.ReportMetric(r.hitRatio(), "hit-ratio")
			b.ReportMetric(1e3*r.pct(0.5), "ttft-p50-ms")
			b.ReportMetric(1e3*r.pct(0.99), "ttft-p99-ms")
			b.ReportMetric(r.imbalance, "imbalance")
			runs[i] = r
		})
	}
	requests := 0
	for _, s := range work {
		requests += len(s)
	}
	var t strings.Builder
	fmt.Fprintf(&t, "\n%d sessions, %d requests, picture %s\n\n| policy | engine hit ratio | TTFT p50 | TTFT p99 | imbalance |\n|---|---:|---:|---:|---:|\n", len(work), requests, pic)
	for _, r := range runs {
		if r != nil {
			fmt.Fprintf(&t, "| %s | %.3f | %.1f ms | %.1f ms | %.3f |\n", r.name, r.hitRatio(), 1e3*r.pct(0.5), 1e3*r.pct(0.99), r.imbalance)
		}
	}
	b.Log(t.String())
}
