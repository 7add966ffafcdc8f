package routing

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/internal/benchdata"
	"github.com/semroute/semroute/replica"
)

type fixture struct {
	e     *Engine
	model *cachemodel.Model // the picture's block model, read by the tests
	pool  *replica.Pool
	pol   Policy
	now   time.Time
}

func newFixture(t testing.TB, replicas int, policy string) *fixture {
	t.Helper()
	f := &fixture{now: time.Unix(1000, 0)}
	specs := make([]replica.Spec, replicas)
	for i := range specs {
		specs[i] = replica.Spec{Name: fmt.Sprint("r", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 9000+i)}
	}
	pol, err := NewPolicy(PolicySpec{Type: policy})
	if err != nil {
		t.Fatal(err)
	}
	f.e, err = New(Options{Replicas: specs, LoadHalfLife: 10 * time.Second,
		Engine: EngineOptions{Now: func() time.Time { return f.now }}})
	if err != nil {
		t.Fatal(err)
	}
	f.model, f.pool, f.pol = f.e.pic.model, f.e.Pool(), pol
	return f
}

// decide prepares req and decides it under the fixture's policy.
func (f *fixture) decide(req *blockhash.Request, session string, record bool) (*Decision, error) {
	in := f.e.Prepare(req, session, false)
	in.Policy = f.pol
	return f.e.Decide(in, record)
}

// parseChat parses a chat of role, content pairs.
func parseChat(t testing.TB, msgs ...string) *blockhash.Request {
	return benchdata.ParseChat(t, msgs...)
}

func TestDecideSharedPrefixStaysUntilHot(t *testing.T) {
	f := newFixture(t, 4, "semantic")
	sys := strings.Repeat("shared system prompt. ", 200)
	var first string
	spread := map[string]bool{}
	for i := 0; i < 16; i++ {
		// Nothing finishes: every request's prefill stays pending.
		d, err := f.decide(parseChat(t, "system", sys, "user", fmt.Sprint("q", i)), "", true)
		if err != nil {
			t.Fatal(err)
		}
		c := d.Chosen()
		switch {
		case i == 0:
			first = c.Replica.Name
			if c.Reason != "miss" {
				t.Fatalf("first reason %q", c.Reason)
			}
		case i < 8: // a burst goes where its prefix is, while the prefix is not hot
			if c.Replica.Name != first || c.Match.Tokens == 0 {
				t.Fatalf("request %d went to %s (%s), first to %s", i, c.Replica.Name, c.Reason, first)
			}
		default: // 8 uses and all the traffic: load decides and the prefix is replicated
			spread[c.Replica.Name] = true
		}
	}
	if len(spread) < 3 {
		t.Fatalf("a hot prefix kept traffic on %v", spread)
	}
}

func TestDecideDryRunRecordsNothing(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	req := parseChat(t, "user", strings.Repeat("x", 1000))
	d, err := f.decide(req, "", false)
	if err != nil {
		t.Fatal(err)
	}
	if got := f.model.Match(d.Blocks, nil, nil); got[0].Blocks+got[1].Blocks != 0 {
		t.Fatalf("dry run recorded blocks: %+v", got)
	}
	if l := d.Chosen().Replica.Load(f.now); l.InFlight != 0 {
		t.Fatalf("dry run counted load: %+v", l)
	}
}

// TestRecycleKeepsTheChoice: recycling a decision's candidate list leaves
// its ranking intact, and a later decision gets a list with nothing left
// over from the recycled one.
func TestRecycleKeepsTheChoice(t *testing.T) {
	f := newFixture(t, 4, "semantic")
	req := parseChat(t, "user", strings.Repeat("x", 1000))
	d, err := f.decide(req, "", false)
	if err != nil {
		t.Fatal(err)
	}
	chosen, ranked := d.Chosen().Replica.Name, len(d.Ranked)
	for i := range d.Candidates {
		d.Candidates[i].Score, d.Candidates[i].Reason = 1e9, "stale"
	}
	f.e.Recycle(d)
	f.e.Recycle(d) // twice is harmless
	if d.Candidates != nil || d.Chosen().Replica.Name != chosen || len(d.Ranked) != ranked {
		t.Fatalf("after Recycle: candidates %v, chosen %s (was %s), %d ranked (was %d)", d.Candidates, d.Chosen().Replica.Name, chosen, len(d.Ranked), ranked)
	}
	for range 20 { // the pool may or may not hand the list back; neither may leak
		c := newCandidates(4)
		for i := range c {
			if c[i] != (Candidate{}) {
				t.Fatalf("a reused candidate list holds %+v", c[i])
			}
		}
	}
}

// TestRecycledBlocks: Recycle takes back only the block lists the engine
// made (Input's and LearnReply's), so blocks a caller passed in stay its
// own, and later decisions built from recycled lists hash what a fresh
// split would.
func TestRecycledBlocks(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	split := func(req *blockhash.Request) []blockhash.Block { return f.e.Splitter().Split(nil, req) }
	mine := split(parseChat(t, "system", strings.Repeat("caller's own ", 200), "user", "hi"))
	want := slices.Clone(mine)
	d, err := f.e.Decide(Request{Blocks: mine, Policy: f.pol}, true)
	if err != nil {
		t.Fatal(err)
	}
	f.e.LearnReply(d, d.Chosen().Replica, []byte(strings.Repeat("a reply ", 100)))
	d.Lease().End(f.e.Now())
	f.e.Recycle(d)
	if len(d.Blocks) != len(want) {
		t.Fatalf("Recycle dropped the caller's blocks: %d left of %d", len(d.Blocks), len(want))
	}
	for i := range 50 {
		req := parseChat(t, "user", strings.Repeat(fmt.Sprint("turn ", i, " "), 30+i*7))
		d, err := f.decide(req, "", true)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(d.Blocks, split(req)) {
			t.Fatalf("decision %d: blocks differ from a fresh split", i)
		}
		reply := f.e.LearnReply(d, d.Chosen().Replica, []byte(strings.Repeat("r", 50*i+1)))
		chain := slices.Concat(d.Blocks, reply)
		if got := f.model.Match(chain, nil, nil); got[d.Chosen().Replica.ID].Blocks != len(chain) {
			t.Fatalf("decision %d: the reply's chain is not cached: %+v", i, got)
		}
		d.Lease().End(f.e.Now())
		f.e.Recycle(d)
		if d.Blocks != nil {
			t.Fatalf("decision %d: Recycle kept the pooled blocks", i)
		}
	}
	if !slices.Equal(mine, want) {
		t.Fatal("recycled lists were written over the caller's blocks")
	}
}

func TestCommitAndDoneBalanceLoad(t *testing.T) {
	f := newFixture(t, 1, "semantic")
	d, _ := f.decide(parseChat(t, "user", strings.Repeat("y", 4000)), "", true)
	c := d.Chosen()
	if l := c.Replica.Load(f.now); l.InFlight != 1 || l.PendingTokens != 1000 || l.ActiveTokens != 1000 || l.RecentTokens != 0 {
		t.Fatalf("after commit: %+v", l)
	}
	d.Lease().FirstToken(f.e.Now())
	if l := c.Replica.Load(f.now); l.InFlight != 1 || l.PendingTokens != 0 || l.ActiveTokens != 1000 || l.RecentTokens != 1000 {
		t.Fatalf("after prefill: %+v", l)
	}
	d.Lease().End(f.e.Now())
	if l := c.Replica.Load(f.now); l.InFlight != 0 || l.PendingTokens != 0 || l.RecentTokens != 1000 {
		t.Fatalf("at done: %+v", l)
	}
	f.now = f.now.Add(10 * time.Second) // one half-life
	if l := c.Replica.Load(f.now); l.InFlight != 0 || l.PendingTokens != 0 || math.Abs(l.RecentTokens-500) > 1e-6 {
		t.Fatalf("after done: %+v", l)
	}
}

func TestLearnReplyMatchesNextTurn(t *testing.T) {
	f := newFixture(t, 3, "semantic")
	turn1 := parseChat(t, "system", "be brief", "user", strings.Repeat("tell me about caching. ", 30))
	d, _ := f.decide(turn1, "s", true)
	r := d.Chosen().Replica
	reply := strings.Repeat("Caching keeps computed state. ", 40)
	f.e.LearnReply(d, r, blockhash.AssistantText(reply, nil))
	d.Lease().End(f.e.Now())

	turn2 := parseChat(t, "system", "be brief", "user", strings.Repeat("tell me about caching. ", 30),
		"assistant", reply, "user", "and eviction?")
	d2, _ := f.decide(turn2, "s", false)
	c := d2.Chosen()
	if c.Replica != r {
		t.Fatalf("turn 2 went to %s, turn 1 to %s", c.Replica.Name, r.Name)
	}
	if c.Match.Blocks != len(d2.Blocks)-1 {
		t.Fatalf("matched %d of %d blocks; want all but the new question", c.Match.Blocks, len(d2.Blocks))
	}
}

func TestDecideNoReplica(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	for _, r := range f.pool.Replicas() {
		r.Drain()
	}
	if _, err := f.decide(parseChat(t, "user", "x"), "", true); !errors.Is(err, ErrNoReplica) {
		t.Fatalf("err = %v", err)
	}
	if _, err := f.e.Decide(Request{Policy: LeastLoad{}}, true); !errors.Is(err, ErrNoReplica) {
		t.Fatalf("a request without a prompt: err = %v", err)
	}
	f.pool.Replicas()[1].Undrain()
	d, err := f.decide(parseChat(t, "user", "x"), "", true)
	if err != nil || d.Chosen().Replica.Name != "r1" {
		t.Fatalf("with r1 back: %v", err)
	}
}

func TestSessionKey(t *testing.T) {
	bl := []blockhash.Block{{Hash: 42}}
	if SessionKey("", "", bl) != 42 {
		t.Error("no session: want the first block's hash")
	}
	if SessionKey("a", "u", bl) == SessionKey("b", "u", bl) {
		t.Error("session id ignored")
	}
	if SessionKey("", "u", bl) != SessionKey("", "u", nil) {
		t.Error("user ignored")
	}
}

func TestSharedActiveCountsSharedBlocksOnce(t *testing.T) {
	for _, shared := range []bool{false, true} {
		f := newFixture(t, 1, "semantic")
		f.e.o.SharedActive = shared
		if shared {
			f.e.pic.active = &active{by: map[int]map[uint64]int32{}}
		}
		sys := strings.Repeat("s", 4000) // 1,000 tokens in 16 blocks
		d1, _ := f.decide(parseChat(t, "system", sys, "user", strings.Repeat("a", 400)), "", true)
		d2, _ := f.decide(parseChat(t, "system", sys, "user", strings.Repeat("b", 400)), "", true)
		r := d1.Chosen().Replica
		want := 2200.0 // 2 × (1,000 + 100)
		if shared {
			want = 1200 // the system prompt once
		}
		if got := r.Load(f.now).ActiveTokens; got != want {
			t.Fatalf("shared=%v: active %v, want %v", shared, got, want)
		}
		d1.Lease().End(f.e.Now())
		if got := r.Load(f.now).ActiveTokens; got != 1100 {
			t.Fatalf("shared=%v: after one ends, active %v, want 1100", shared, got)
		}
		d2.Lease().End(f.e.Now())
		if got := r.Load(f.now).ActiveTokens; got != 0 {
			t.Fatalf("shared=%v: after both end, active %v", shared, got)
		}
	}
}

// TestHotAfterHotUsesRequests: with replies learned, a prefix is hot after
// HotUses requests (8 by default), not after half as many: learning a
// reply does not count its request again.
func TestHotAfterHotUsesRequests(t *testing.T) {
	f := newFixture(t, 4, "semantic")
	sys := strings.Repeat("a shared system prompt that every request carries. ", 40)
	for i := 1; i <= 8; i++ {
		d, err := f.decide(parseChat(t, "system", sys, "user", fmt.Sprint("question ", i)), "", true)
		if err != nil {
			t.Fatal(err)
		}
		in := f.e.view(d)
		if hot := in.Hot.Blocks > 0; hot != (i >= 8) { // i uses so far, this request included
			t.Fatalf("request %d: hot %v (%d blocks)", i, hot, in.Hot.Blocks)
		}
		c := d.Chosen()
		f.e.LearnReply(d, c.Replica, []byte(fmt.Sprint("the answer to question ", i)))
		d.Lease().End(f.e.Now())
		f.now = f.now.Add(100 * time.Millisecond)
	}
	d, err := f.decide(parseChat(t, "system", sys, "user", "question 9"), "", false)
	if err != nil {
		t.Fatal(err)
	}
	if f.e.view(d).Hot.Blocks == 0 {
		t.Fatal("not hot after 8 requests")
	}
}

// TestTokensInTheEnginesUnit: once the engine reports prompt tokens for a
// model, the engine's estimates for that model are scaled to its unit
// (blocks, matches, replies), other models and token-id prompts are not,
// and client-chosen model names cannot grow the table without bound.
func TestTokensInTheEnginesUnit(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	prompt := strings.Repeat("engine tokens are not four bytes each. ", 100)
	d, err := f.decide(parseChat(t, "user", prompt), "", true)
	if err != nil {
		t.Fatal(err)
	}
	estimated := d.Tokens
	d.Lease().End(f.e.Now())
	for range 40 { // the engine counts 0.6 of the estimate
		f.e.ObserveUsage("m", d, estimated*6/10)
	}
	if s := f.e.TokenScale("m"); math.Abs(s-0.6) > 0.01 {
		t.Fatalf("learned scale %v, want 0.6", s)
	}
	if s := f.e.TokenScale("other"); s != 1 {
		t.Fatalf("an unseen model scales by %v", s)
	}
	d2, err := f.decide(parseChat(t, "user", prompt), "", false)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := d2.Tokens, estimated*6/10; math.Abs(float64(got-want)) > float64(len(d2.Blocks)) {
		t.Fatalf("scaled prompt %d tokens, want about %d", got, want)
	}
	if m := d2.Chosen().Match; m.Tokens != d2.Tokens {
		t.Fatalf("the whole prompt matched %d of %d engine tokens", m.Tokens, d2.Tokens)
	}
	ids, _ := blockhash.ParseCompletion([]byte(`{"model":"m","prompt":[1,2,3,4,5,6,7,8]}`), blockhash.Limits{})
	in := f.e.Prepare(ids, "", false)
	if in.Blocks[0].Tokens != 8 {
		t.Fatalf("token ids scaled to %d", in.Blocks[0].Tokens)
	}
	in.Policy = f.pol
	di, err := f.e.Decide(in, false)
	if err != nil {
		t.Fatal(err)
	}
	for range 40 { // exact counts teach nothing: the ratio stays
		f.e.ObserveUsage("m", di, 8)
	}
	if s := f.e.TokenScale("m"); math.Abs(s-0.6) > 0.01 {
		t.Fatalf("token-id requests moved the learned scale to %v", s)
	}
	for i := range maxModels + 10 {
		f.e.ObserveUsage(fmt.Sprint("model-", i), d, 100)
	}
	if n := len(*f.e.units.models.Load()); n != maxModels {
		t.Fatalf("%d models learned, cap %d", n, maxModels)
	}
}

// When passive ejection has taken out every replica, requests go to the
// ones ejected for soft failures that still pass their health checks
// rather than failing; while any replica is in rotation, the ejected are
// not candidates; a replica ejected for a hard failure, down by its active
// checks or draining is never taken.
func TestDecideAllEjectedPanics(t *testing.T) {
	f := newFixture(t, 4, "semantic")
	reps := f.pool.Replicas()
	ej := replica.Ejection{Base: time.Minute, Consecutive: 1, MinVolume: 1, MinSources: 1}
	reps[3].Fail(f.now, ej) // refused a connection: really down
	reps[0].Strike(f.now, ej, 0)
	reps[1].Strike(f.now, ej, 0)
	d, err := f.decide(parseChat(t, "user", "x"), "", false)
	if err != nil || len(d.Candidates) != 1 || d.Chosen().Replica != reps[2] {
		t.Fatalf("two of three ejected: %v, %d candidates", err, len(d.Candidates))
	}
	reps[2].Strike(f.now, ej, 0)
	d, err = f.decide(parseChat(t, "user", "x"), "", false)
	if err != nil || len(d.Candidates) != 3 {
		t.Fatalf("all ejected: %v; want the three ejected for strikes as candidates", err)
	}
	for _, c := range d.Candidates {
		if c.Replica == reps[3] {
			t.Fatal("the replica ejected for a refused connection is a candidate")
		}
	}
	reps[0].Drain()
	reps[1].Checked(false, 1, 1)
	d, err = f.decide(parseChat(t, "user", "x"), "", false)
	if err != nil || len(d.Candidates) != 1 || d.Chosen().Replica != reps[2] {
		t.Fatalf("all ejected, one draining, one down: %v; want r2 alone", err)
	}
	reps[2].Drain()
	if _, err := f.decide(parseChat(t, "user", "x"), "", false); !errors.Is(err, ErrNoReplica) {
		t.Fatalf("none usable: err = %v", err)
	}
}
