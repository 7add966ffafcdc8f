package replay

import (
	"bufio"
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/routing"
)

// agenticLine is what the tests read of an agentic trace's line.
type agenticLine struct {
	TimestampMS  int64           `json:"timestamp_ms"`
	SessionID    string          `json:"session_id"`
	TenantID     string          `json:"tenant_id"`
	API          string          `json:"api"`
	Request      json.RawMessage `json:"request"`
	OutputTokens int             `json:"output_tokens"`
}

// agenticTrace generates the agentic workload with o and returns its text
// and its lines.
func agenticTrace(t *testing.T, o GenOptions) ([]byte, []agenticLine) {
	t.Helper()
	var buf bytes.Buffer
	o.Workload = "agentic"
	if err := GenerateOpenAI(&buf, o); err != nil {
		t.Fatal(err)
	}
	var lines []agenticLine
	sc := bufio.NewScanner(bytes.NewReader(buf.Bytes()))
	sc.Buffer(nil, maxLine)
	for sc.Scan() {
		var l agenticLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, l)
	}
	return buf.Bytes(), lines
}

// agenticEndpoints are the endpoints of the agentic workload's APIs.
var agenticEndpoints = map[string]blockhash.Endpoint{"chat": blockhash.Chat, "responses": blockhash.Responses, "messages": blockhash.Messages}

// TestGenerateAgenticShape: the agentic workload is deterministic; its
// sessions speak the three APIs, each a tenant's task of 3–12 steps whose
// bodies parse as their API's; a tenant's tools are 12–30 schemas of
// 2,000–5,000 tokens, its sessions spread over the APIs; tool outputs
// are 20–3,000 tokens, some of them recurring across sessions; a step
// follows the one before by its reply's decode time and the tool's time
// (at most 10 s).
func TestGenerateAgenticShape(t *testing.T) {
	o := GenOptions{Seed: 5, Sessions: 40, Tenants: 3}
	text, lines := agenticTrace(t, o)
	again, _ := agenticTrace(t, o)
	if !bytes.Equal(text, again) {
		t.Fatal("the same seed gave two traces")
	}
	sessions := map[string][]agenticLine{}
	apisOf := map[string]map[string]bool{}  // tenant → the APIs its sessions speak
	outputs := map[string]map[string]bool{} // tool output → the sessions it came in
	for _, l := range lines {
		if s := sessions[l.SessionID]; len(s) > 0 && (s[0].API != l.API || s[0].TenantID != l.TenantID) {
			t.Fatalf("session %s speaks %s and %s, or is of tenants %s and %s", l.SessionID, s[0].API, l.API, s[0].TenantID, l.TenantID)
		}
		sessions[l.SessionID] = append(sessions[l.SessionID], l)
		if apisOf[l.TenantID] == nil {
			apisOf[l.TenantID] = map[string]bool{}
		}
		apisOf[l.TenantID][l.API] = true
		checkAgenticBody(t, l, outputs)
	}
	for _, steps := range sessions {
		checkAgenticSteps(t, steps)
	}
	for tenant, apis := range apisOf {
		if len(apis) != 3 {
			t.Errorf("tenant %s's sessions speak %v, not all three APIs", tenant, apis)
		}
	}
	recurring := 0
	for _, in := range outputs {
		if len(in) > 1 {
			recurring++
		}
	}
	if recurring == 0 {
		t.Error("no tool output recurs across sessions")
	}
}

// checkAgenticSteps checks a session's steps: 3–12, each following the
// one before by its reply's decode time (20 ms a token) and at most 10 s
// of the tool's.
func checkAgenticSteps(t *testing.T, steps []agenticLine) {
	t.Helper()
	if n := len(steps); n < 3 || n > 12 {
		t.Errorf("session %s has %d steps", steps[0].SessionID, n)
	}
	for k := 1; k < len(steps); k++ {
		gap := float64(steps[k].TimestampMS-steps[k-1].TimestampMS) / 1000
		decode := float64(steps[k-1].OutputTokens) * 0.02
		if gap < decode-0.002 || gap > decode+10.002 {
			t.Errorf("session %s: step %d follows %.3f s after a reply of %d tokens", steps[0].SessionID, k, gap, steps[k-1].OutputTokens)
		}
	}
}

// checkAgenticBody parses l's body as its API's and checks its tools and
// tool outputs, noting each output's session in outputs.
func checkAgenticBody(t *testing.T, l agenticLine, outputs map[string]map[string]bool) {
	t.Helper()
	ep, ok := agenticEndpoints[l.API]
	if !ok {
		t.Fatalf("line of session %s: api %q", l.SessionID, l.API)
	}
	req, err := blockhash.Parse(ep, l.Request, blockhash.Limits{})
	if err != nil {
		t.Fatalf("session %s: %s body: %v", l.SessionID, l.API, err)
	}
	defer req.Recycle()
	if req.Parts[0].Role != blockhash.RoleTools {
		t.Fatalf("session %s: the prompt does not start with tools", l.SessionID)
	}
	var tools []json.RawMessage
	if err := json.Unmarshal(req.Parts[0].Text, &tools); err != nil {
		t.Fatal(err)
	}
	if n, tokens := len(tools), estTokens(req.Parts[0].Text); n < 12 || n > 30 || tokens < 2000 || tokens > 5000 {
		t.Errorf("tenant %s: %d tools of %d tokens", l.TenantID, n, tokens)
	}
	for _, p := range req.Parts {
		if p.Role != blockhash.RoleTool {
			continue
		}
		if tokens := estTokens(p.Text); tokens < 15 || tokens > 3100 {
			t.Errorf("session %s: a tool output of %d tokens", l.SessionID, tokens)
		}
		if outputs[string(p.Text)] == nil {
			outputs[string(p.Text)] = map[string]bool{}
		}
		outputs[string(p.Text)][l.SessionID] = true
	}
}

// estTokens is the router's estimate of text's tokens.
func estTokens(text []byte) int { return len(text) / blockhash.DefaultBytesPerToken }

// TestAgenticAPIsRenderOnePrompt: the same sessions spoken in chat
// completions, the Responses API or the Messages API are read into the
// same blocks, and each step but a session's last has its reply (the next
// step's tool call) linked, in every API: blockhash reads all three as the
// chat the engine renders, so a tenant's prefix is one in all of them.
func TestAgenticAPIsRenderOnePrompt(t *testing.T) {
	var read [][]Request
	for _, api := range []string{"chat", "responses", "messages"} {
		text, _ := agenticTrace(t, GenOptions{Seed: 9, Sessions: 12, Tenants: 2, APIs: []string{api}})
		reqs, err := ReadOpenAI(bytes.NewReader(text), splitter(t))
		if err != nil {
			t.Fatalf("%s: %v", api, err)
		}
		checkRepliesLinked(t, api, reqs)
		read = append(read, reqs)
	}
	same := func(a, b []blockhash.Block) bool {
		return slices.EqualFunc(a, b, func(x, y blockhash.Block) bool { return x.Hash == y.Hash && x.Tokens == y.Tokens && x.Kind == y.Kind })
	}
	for _, other := range read[1:] {
		if len(other) != len(read[0]) {
			t.Fatalf("%d requests against %d", len(other), len(read[0]))
		}
		for i := range other {
			a, b := read[0][i], other[i]
			if a.Session != b.Session || a.Tokens != b.Tokens || !same(a.Blocks, b.Blocks) || !same(a.Reply, b.Reply) {
				t.Fatalf("request %d (session %s): %d tokens in %d blocks in chat, %d in %d in another API", i, a.Session, a.Tokens, len(a.Blocks), b.Tokens, len(b.Blocks))
			}
		}
	}
}

// checkRepliesLinked checks that every request of reqs (read from a
// trace in api) but its session's last has a reply.
func checkRepliesLinked(t *testing.T, api string, reqs []Request) {
	t.Helper()
	last := map[string]int{}
	for i, r := range reqs {
		last[r.Session] = i
	}
	for i, r := range reqs {
		if final := last[r.Session] == i; (r.Reply == nil) != final {
			t.Errorf("%s: request %d of session %s (its last: %v) has a reply of %d blocks", api, i, r.Session, final, len(r.Reply))
		}
	}
}

func TestReadOpenAIAPIField(t *testing.T) {
	for _, c := range []struct {
		line string
		ok   bool
	}{
		{`{"timestamp_ms": 0, "api": "responses", "request": {"model": "m", "input": "hi"}}`, true},
		{`{"timestamp_ms": 0, "api": "messages", "request": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}}`, true},
		{`{"timestamp_ms": 0, "api": "completions", "request": {"model": "m", "prompt": "hi"}}`, true},
		{`{"timestamp_ms": 0, "api": "chat", "request": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}`, true},
		{`{"timestamp_ms": 0, "api": "chat", "request": {"model": "m", "input": "hi"}}`, false},       // not a chat body
		{`{"timestamp_ms": 0, "api": "embeddings", "request": {"model": "m", "input": "hi"}}`, false}, // no such API
	} {
		if _, err := ReadOpenAI(strings.NewReader(c.line), splitter(t)); (err == nil) != c.ok {
			t.Errorf("%s: err = %v", c.line, err)
		}
	}
}

// TestAgenticReplayEveryPolicy replays a small agentic trace (6 tenants,
// their sessions spread over the three APIs) on 4 replicas under every
// built-in policy. Every policy routes every request; the infinite cache
// finds the tenant's tools (and system prompt) cached for the first step
// of every session whose tenant had spoken only other APIs before: the
// prefix is one over the APIs. The default policy finds them cached too,
// for at least 90% of those sessions (a replica it sends one to holds the
// prefix already), and hits at least as many tokens as round robin and
// random. Virtual time and fixed seeds: the figures are exact; the test
// logs them.
func TestAgenticReplayEveryPolicy(t *testing.T) {
	text, lines := agenticTrace(t, GenOptions{Seed: 7, Sessions: 80, Tenants: 6})
	split, _ := blockhash.NewSplitter(blockhash.Options{})
	reqs, err := ReadOpenAI(bytes.NewReader(text), split)
	if err != nil {
		t.Fatal(err)
	}
	var runs []Run
	for _, p := range routing.PolicyNames() {
		runs = append(runs, Run{Policy: p})
	}
	m := Config{Replicas: 4, BudgetTokens: 40_000, RecordReplies: true, Seed: 1}
	sum, err := Replay(reqs, m, runs)
	if err != nil {
		t.Fatal(err)
	}
	firsts := crossAPIFirsts(reqs, lines)
	if len(firsts) < 3 {
		t.Fatalf("%d sessions open their tenant's prefix in a new API; the test needs more", len(firsts))
	}
	byName := map[string]*Result{}
	for _, r := range append(slices.Clone(sum.Policies), sum.Infinite) {
		byName[r.Name] = r
		hits := prefixHits(r, reqs, firsts)
		t.Logf("%-16s hit ratio %.3f, TTFT p50 %6.0f ms p99 %6.0f ms, tenant prefix cached for %d of %d sessions in a new API",
			r.Name, r.TokenHitRate, r.TTFTP50MS, r.TTFTP99MS, hits, len(firsts))
		if r.Requests != len(reqs) {
			t.Errorf("%s routed %d of %d requests", r.Name, r.Requests, len(reqs))
		}
		if r == sum.Infinite && hits != len(firsts) || r.Name == "semantic" && 10*hits < 9*len(firsts) {
			t.Errorf("%s: the tenant's prefix cached for %d of the %d sessions that opened it in a new API", r.Name, hits, len(firsts))
		}
	}
	for _, base := range []string{"round_robin", "random"} {
		if byName["semantic"].CachedTokens < byName[base].CachedTokens {
			t.Errorf("semantic hit %d tokens, %s %d", byName["semantic"].CachedTokens, base, byName[base].CachedTokens)
		}
	}
}

// crossAPIFirsts returns the indices in reqs of the first steps of the
// sessions whose tenant had sessions before, all in other APIs than
// theirs; lines give each session's API.
func crossAPIFirsts(reqs []Request, lines []agenticLine) []int {
	api := map[string]string{}
	for _, l := range lines {
		api[l.SessionID] = l.API
	}
	started := map[string]bool{}
	seen := map[string]map[string]bool{} // tenant → the APIs of its sessions so far
	var out []int
	for i, r := range reqs {
		if started[r.Session] {
			continue
		}
		started[r.Session] = true
		apis := seen[r.Tenant]
		if apis == nil {
			apis = map[string]bool{}
			seen[r.Tenant] = apis
		}
		if len(apis) > 0 && !apis[api[r.Session]] {
			out = append(out, i)
		}
		apis[api[r.Session]] = true
	}
	return out
}

// prefixHits counts the requests of reqs at indices that found at least
// their tenant's prefix cached in run r.
func prefixHits(r *Result, reqs []Request, indices []int) int {
	hits := 0
	for _, i := range indices {
		if r.rows[i].cachedTokens >= prefixTokens(reqs[i]) {
			hits++
		}
	}
	return hits
}

// prefixTokens returns the tokens of r's leading tool and system blocks:
// its tenant's prefix.
func prefixTokens(r Request) int {
	n := 0
	for _, b := range r.Blocks {
		if b.Kind != blockhash.KindTools && b.Kind != blockhash.KindSystem {
			break
		}
		n += int(b.Tokens)
	}
	return n
}
