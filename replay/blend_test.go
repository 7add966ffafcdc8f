package replay

import (
	"bytes"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// On the blend workload, blending engines reuse documents past the
// prefix (more tokens than prefix engines under any policy), and the
// semantic policy that credits what they reuse saves more than the same
// policy crediting the prefix alone. Virtual time and fixed seeds: the
// figures are exact.
func TestBlendEnginesAndEngineAwareCredit(t *testing.T) {
	reqs := blendTrace(t, GenOptions{Seed: 7, Sessions: 300, Docs: 60})
	prefixOnly := routing.Params{"prefix_only": true}
	runs := []Run{{Policy: "semantic"}, {Label: "semantic-prefix-credit", Policy: "semantic", Params: prefixOnly}}
	cached := func(reuse string) (aware, prefix int64) {
		m := Config{Replicas: 4, BudgetTokens: 20000, Reuse: replica.Reuse{Mode: reuse}}
		sum, err := Replay(reqs, m, runs)
		if err != nil {
			t.Fatal(err)
		}
		return sum.Policies[0].CachedTokens, sum.Policies[1].CachedTokens
	}
	aware, prefix := cached(replica.ReuseBlend)
	plainAware, plainPrefix := cached(replica.ReusePrefix)
	t.Logf("blend engines: aware %d, prefix credit %d; prefix engines: %d, %d", aware, prefix, plainAware, plainPrefix)
	if plainAware != plainPrefix {
		t.Fatalf("on prefix engines the credit changed the run: %d against %d", plainAware, plainPrefix)
	}
	if prefix <= plainPrefix {
		t.Fatalf("blending engines reused %d tokens, prefix engines %d", prefix, plainPrefix)
	}
	if aware <= prefix {
		t.Fatalf("engine-aware credit saved %d tokens, prefix credit %d", aware, prefix)
	}
}

// TestBlendCreditOnLongTailRAG pins docs/engines.md's replay figures for
// issue 18's target: RAG sessions over a long-tail corpus
// (`router gentrace --workload blend --seed 7 --sessions 600 --docs 120
// --zipf-v 20 --agent-share 0`), 4 blending engines of 10,000 tokens: the
// bounds of checkEngineAwareCredit.
func TestBlendCreditOnLongTailRAG(t *testing.T) {
	reqs := blendTrace(t, GenOptions{Seed: 7, Sessions: 600, Docs: 120, ZipfV: 20, AgentShare: -1})
	checkEngineAwareCredit(t, reqs, replica.ReuseBlend, 1.35, false)
}

// TestBlendCreditOnTopicRAG: the same on RAG sessions whose questions
// retrieve by topic, as similar questions retrieve the same documents
// (`... --agent-share 0 --topics 40`): the documents recur together, in
// any order, after any persona.
func TestBlendCreditOnTopicRAG(t *testing.T) {
	reqs := blendTrace(t, GenOptions{Seed: 7, Sessions: 600, Docs: 120, ZipfV: 20, AgentShare: -1, Topics: 40})
	checkEngineAwareCredit(t, reqs, replica.ReuseBlend, 1.35, false)
}

// checkEngineAwareCredit replays reqs on 4 engines of 10,000 tokens that
// reuse as mode says and checks that the semantic policy crediting what
// they reuse saves at least least× the tokens of exact-prefix routing
// (itself crediting the prefix alone, and the llmd and sglang ports), with
// a lower TTFT p50 (or within 2%, with level), a p99 at most 15% above
// theirs, and imbalance ≤ 1.12. Since issue 31 the engines admit a request
// only when its blocks fit beside the running ones, and blend and reuse
// donors by their own code (package enginereuse), not the router's: the
// gains are smaller than when the engines reused what the router credited
// by construction, and the p99 no longer always below exact-prefix
// routing's. Since issue 45 both credits route in seconds, which keeps a
// session with its prefix: donor credit's gain over the prefix's fell
// from 1.38× to 1.19× (least 1.15 for it; 1.35 for blending engines).
// Since issue 46 ties in time go by the pictures' fill, not by count: the
// topic RAG's imbalance rose from 1.051 to 1.102 (the bound from 1.10).
func checkEngineAwareCredit(t *testing.T, reqs []Request, mode string, least float64, level bool) {
	t.Helper()
	prefixOnly := routing.Params{"prefix_only": true}
	runs := []Run{{Policy: "semantic"}, {Label: "semantic-prefix-credit", Policy: "semantic", Params: prefixOnly}, {Policy: "llmd"}, {Policy: "sglang"}}
	m := Config{Replicas: 4, BudgetTokens: 10000, RecordReplies: true, Reuse: replica.Reuse{Mode: mode}}
	sum, err := Replay(reqs, m, runs)
	if err != nil {
		t.Fatal(err)
	}
	aware := sum.Policies[0]
	t.Logf("%s: %d saved, TTFT p50 %.0f p99 %.0f ms, imbalance %.3f", aware.Name, aware.CachedTokens, aware.TTFTP50MS, aware.TTFTP99MS, aware.LoadImbalance)
	if aware.LoadImbalance > 1.12 {
		t.Errorf("imbalance %.3f", aware.LoadImbalance)
	}
	worse := func(a, b float64) bool { return a > b*1.02 || (a >= b && !level) }
	for _, p := range sum.Policies[1:len(runs)] {
		ratio := float64(aware.CachedTokens) / float64(p.CachedTokens)
		t.Logf("%s: %d saved (%.2f×), TTFT p50 %.0f p99 %.0f ms", p.Name, p.CachedTokens, ratio, p.TTFTP50MS, p.TTFTP99MS)
		if ratio < least || worse(aware.TTFTP50MS, p.TTFTP50MS) || aware.TTFTP99MS > 1.15*p.TTFTP99MS {
			t.Errorf("against %s: %.2f× the tokens saved, TTFT p50 %.0f against %.0f, p99 %.0f against %.0f",
				p.Name, ratio, aware.TTFTP50MS, p.TTFTP50MS, aware.TTFTP99MS, p.TTFTP99MS)
		}
	}
}

// blendTrace generates the blend workload with o and reads it as a replay
// does, with segment keys.
func blendTrace(t *testing.T, o GenOptions) []Request {
	t.Helper()
	var buf bytes.Buffer
	o.Workload = "blend"
	if err := GenerateOpenAI(&buf, o); err != nil {
		t.Fatal(err)
	}
	split, _ := blockhash.NewSplitter(blockhash.Options{Segments: true})
	reqs, err := ReadOpenAI(bytes.NewReader(buf.Bytes()), split)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

// TestDonorCreditOnTopicRAG pins docs/engines.md's replay figures for donor
// engines: RAG sessions that retrieve by topic (`router gentrace
// --workload blend --seed 7 --sessions 600 --docs 120 --zipf-v 20
// --agent-share 0 --topics 40`), 4 engines of 10,000 tokens that reuse a
// similar earlier prompt's KV: the bounds of checkEngineAwareCredit, TTFT
// p50 no higher. Virtual time and fixed seeds: the figures are exact.
func TestDonorCreditOnTopicRAG(t *testing.T) {
	reqs := blendTrace(t, GenOptions{Seed: 7, Sessions: 600, Docs: 120, ZipfV: 20, AgentShare: -1, Topics: 40})
	checkEngineAwareCredit(t, reqs, replica.ReuseDonor, 1.15, true)
}
