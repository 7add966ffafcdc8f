package routing

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/replica"
)

func cands(n int) []Candidate {
	out := make([]Candidate, n)
	for i := range out {
		out[i].Replica = &replica.Replica{Name: fmt.Sprint("r", i), ID: i}
	}
	return out
}

// TestSemanticNoRoom: a replica whose engine has no free KV for the
// request's blocks is predicted to wait for room (reason "kv"): on the
// prior's times, longer than computing its prefix elsewhere.
func TestSemanticNoRoom(t *testing.T) {
	p, _ := NewPolicy(PolicySpec{Type: "semantic"})
	in := &View{Tokens: 1000, Weighted: 1000, budgets: []int64{10_000, 10_000}}
	for _, tc := range []struct {
		usage float64
		want  string
	}{
		{0.95, "kv"},   // 500 free, 1000 to allocate
		{0.91, "kv"},   // 900 free
		{0.5, "match"}, // 5000 free
		{0, "match"},   // no usage reported: no verdict
	} {
		cs := cands(2)
		cs[0].Match = cachemodel.Match{Blocks: 10, Tokens: 900, Weighted: 900}
		cs[0].Load.KVUsage = tc.usage
		cs[1].Replica.ID = 1
		p.Score(in, cs)
		if cs[0].Reason != tc.want || (cs[0].Score > cs[1].Score) != (tc.want == "kv") {
			t.Errorf("usage %v: reason %s, cost %.1f ms against %.1f; want %s", tc.usage, cs[0].Reason, cs[0].Score, cs[1].Score, tc.want)
		}
	}
}

// TestSemanticNoRoomTokens: under the token formula (load_weight above 0), a
// replica whose engine has no free KV for the request's blocks is ranked
// after the others however long its prefix, with reason "kv".
func TestSemanticNoRoomTokens(t *testing.T) {
	p, _ := NewPolicy(PolicySpec{Type: "semantic", Params: Params{"load_weight": 0.1}})
	in := &View{Tokens: 1000, Weighted: 1000, budgets: []int64{10_000, 10_000}}
	for _, tc := range []struct {
		usage float64
		want  string
	}{
		{0.95, "kv"},   // 500 free, 1000 to allocate
		{0.91, "kv"},   // 900 free
		{0.5, "match"}, // 5000 free
		{0, "match"},   // no usage reported: no verdict
	} {
		cs := cands(2)
		cs[0].Match = cachemodel.Match{Blocks: 10, Tokens: 900, Weighted: 900}
		cs[0].Load.KVUsage = tc.usage
		cs[1].Replica.ID = 1
		p.Score(in, cs)
		if cs[0].Reason != tc.want || (cs[0].Tier == 1) != (tc.want == "kv") {
			t.Errorf("usage %v: reason %s, tier %d; want %s", tc.usage, cs[0].Reason, cs[0].Tier, tc.want)
		}
	}
}

func TestSemanticCost(t *testing.T) {
	p, err := NewPolicy(PolicySpec{Type: "semantic", Params: Params{"load_weight": 1, "recent_weight": 0.5}})
	if err != nil {
		t.Fatal(err)
	}
	in := &View{Tokens: 1000, Weighted: 1000}
	cases := []struct {
		name    string
		match   []float64 // weighted matched tokens per replica
		pending []float64
		recent  []float64
		want    []float64
		reasons []string
		hot     float64
	}{
		{"miss goes by load", []float64{0, 0, 0}, []float64{300, 100, 200}, []float64{0, 0, 0},
			[]float64{1300, 1100, 1200}, []string{"miss", "miss", "miss"}, 0},
		{"match beats load", []float64{800, 0, 0}, []float64{500, 0, 0}, []float64{0, 0, 0},
			[]float64{700, 1000, 1000}, []string{"match", "miss", "miss"}, 0},
		{"recent work counts half", []float64{0, 0}, []float64{0, 0}, []float64{1000, 0},
			[]float64{1500, 1000}, []string{"miss", "miss"}, 0},
		// mean 3000: the limit is 2×3000+2048 = 8048 < 9000.
		{"spill", []float64{1000, 0, 0}, []float64{9000, 0, 0}, []float64{0, 0, 0},
			[]float64{9000, 1000, 1000}, []string{"spill", "miss", "miss"}, 0},
		{"hot prefix counts everywhere", []float64{600, 0, 0}, []float64{300, 0, 0}, []float64{0, 0, 0},
			[]float64{700, 500, 500}, []string{"match", "hot", "hot"}, 500},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in.Hot = cachemodel.Match{}
			if tc.hot > 0 {
				in.Hot = cachemodel.Match{Blocks: 1, Tokens: int(tc.hot), Weighted: tc.hot}
			}
			cs := cands(len(tc.match))
			for i := range cs {
				cs[i].Match = cachemodel.Match{Weighted: tc.match[i], Blocks: int(tc.match[i])}
				cs[i].Load = replica.Load{PendingTokens: tc.pending[i], RecentTokens: tc.recent[i]}
			}
			p.Score(in, cs)
			for i := range cs {
				if math.Abs(cs[i].Score-tc.want[i]) > 1e-6 || cs[i].Reason != tc.reasons[i] {
					t.Errorf("replica %d: score %v (%s), want %v (%s)", i, cs[i].Score, cs[i].Reason, tc.want[i], tc.reasons[i])
				}
				if spilled := cs[i].Reason == "spill"; (cs[i].Tier == 1) != spilled {
					t.Errorf("replica %d: tier %d, reason %s", i, cs[i].Tier, cs[i].Reason)
				}
			}
		})
	}
}

func TestNewPolicyValidates(t *testing.T) {
	if _, err := NewPolicy(PolicySpec{Type: "nope"}); err == nil {
		t.Error("unknown policy accepted")
	}
	if _, err := NewPolicy(PolicySpec{Type: "semantic", Params: Params{"spill_factor": 0.5}}); err == nil {
		t.Error("spill factor below 1 accepted")
	}
	for _, n := range PolicyNames() {
		p, err := NewPolicy(PolicySpec{Type: n})
		if err != nil || p.Name() != n {
			t.Errorf("NewPolicy(%q) = %v, %v", n, p, err)
		}
	}
}

func TestRoundRobinCycles(t *testing.T) {
	p, _ := NewPolicy(PolicySpec{Type: "round_robin"})
	var got []string
	for i := 0; i < 6; i++ {
		cs := cands(3)
		p.Score(nil, cs)
		got = append(got, rank(cs, 0, 1)[0].Replica.Name)
	}
	want := "[r0 r1 r2 r0 r1 r2]"
	if fmt.Sprint(got) != want {
		t.Fatalf("order %v, want %s", got, want)
	}
}

// Two sets of candidates taken in turn (a disaggregated request's decode
// replicas, then its prefill replicas) each go round all their members.
func TestRoundRobinCyclesEachSet(t *testing.T) {
	p, _ := NewPolicy(PolicySpec{Type: "round_robin"})
	var decode, prefill []string
	for i := 0; i < 4; i++ {
		cs := cands(4)
		d := cs[2:]
		p.Score(nil, d)
		decode = append(decode, rank(d, 0, 1)[0].Replica.Name)
		pre := cs[:2]
		p.Score(nil, pre)
		prefill = append(prefill, rank(pre, 0, 1)[0].Replica.Name)
	}
	if fmt.Sprint(decode) != "[r2 r3 r2 r3]" || fmt.Sprint(prefill) != "[r0 r1 r0 r1]" {
		t.Fatalf("decode %v, prefill %v: each set in turn", decode, prefill)
	}
}

func TestLeastLoadPrefersFewerInFlight(t *testing.T) {
	cs := cands(3)
	cs[0].Load = replica.Load{InFlight: 2}
	cs[1].Load = replica.Load{InFlight: 1, PendingTokens: 5000}
	cs[2].Load = replica.Load{InFlight: 1, PendingTokens: 10}
	LeastLoad{}.Score(nil, cs)
	top := rank(cs, 0, 3)
	if top[0].Replica.Name != "r2" || top[1].Replica.Name != "r1" || top[2].Replica.Name != "r0" {
		t.Fatalf("order %s %s %s", top[0].Replica.Name, top[1].Replica.Name, top[2].Replica.Name)
	}
}

func TestRankTiesByRendezvous(t *testing.T) {
	// With every score equal the winner depends on the key, spreads over
	// replicas, and does not depend on the candidates' order.
	wins := map[string]int{}
	for key := uint64(0); key < 400; key++ {
		a, b := cands(4), cands(4)
		b[0], b[3] = b[3], b[0]
		wa, wb := rank(a, key, 1)[0].Replica.Name, rank(b, key, 1)[0].Replica.Name
		if wa != wb {
			t.Fatalf("key %d: winner depends on order (%s vs %s)", key, wa, wb)
		}
		wins[wa]++
	}
	for name, n := range wins {
		if n < 60 {
			t.Errorf("%s won %d of 400 ties: %v", name, n, wins)
		}
	}
	if len(wins) != 4 {
		t.Errorf("ties went to %d replicas: %v", len(wins), wins)
	}
}

func TestRankOrdersTopK(t *testing.T) {
	cs := cands(5)
	for i, s := range []float64{5, 1, 4, 2, 3} {
		cs[i].Score = s
	}
	top := rank(cs, 7, 3)
	for i, want := range []float64{1, 2, 3} {
		if top[i].Score != want {
			t.Fatalf("position %d: score %v, want %v", i, top[i].Score, want)
		}
	}
	for i, want := range []float64{5, 1, 4, 2, 3} {
		if cs[i].Score != want {
			t.Fatalf("rank reordered its input: position %d has score %v, want %v", i, cs[i].Score, want)
		}
	}
	if n := len(rank(cs, 7, 9)); n != 5 {
		t.Fatalf("rank of 5 for the best 9 gave %d", n)
	}
}

// TestRankMatchesSort holds rank to its definition: the first k of all
// candidates sorted by rounded score, then by rendezvous weight, highest
// first; and cands untouched.
func TestRankMatchesSort(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 2000 {
		n, k := 1+rng.IntN(40), 1+rng.IntN(6)
		cs := cands(n)
		for i := range cs {
			cs[i].Tier = int64(rng.IntN(2))
			cs[i].Score = float64(rng.IntN(5)) + rng.Float64()*0.4 // many ties after rounding
		}
		key := rng.Uint64()
		want := append([]Candidate(nil), cs...)
		sort.SliceStable(want, func(a, b int) bool {
			if want[a].Tier != want[b].Tier {
				return want[a].Tier < want[b].Tier
			}
			sa, sb := math.Round(want[a].Score), math.Round(want[b].Score)
			if sa != sb {
				return sa < sb
			}
			return rendezvous(key, want[a].Replica.Name) > rendezvous(key, want[b].Replica.Name)
		})
		before := fmt.Sprint(cs)
		got := rank(cs, key, k)
		if len(got) != min(k, n) {
			t.Fatalf("trial %d: %d ranked, want %d", trial, len(got), min(k, n))
		}
		for i := range got {
			if got[i].Replica != want[i].Replica {
				t.Fatalf("trial %d: position %d is %s, want %s", trial, i, got[i].Replica.Name, want[i].Replica.Name)
			}
		}
		if fmt.Sprint(cs) != before {
			t.Fatalf("trial %d: rank changed its input", trial)
		}
	}
}

func TestRandomSpreads(t *testing.T) {
	rp, _ := NewSeededPolicy(PolicySpec{Type: "random"}, 1)
	wins := map[string]int{}
	for i := 0; i < 400; i++ {
		cs := cands(4)
		rp.Score(nil, cs)
		wins[rank(cs, 1, 1)[0].Replica.Name]++
	}
	if len(wins) != 4 {
		t.Fatalf("random used %d replicas: %v", len(wins), wins)
	}
}

// TestRankByTierThenScore: a lower tier wins whatever the scores, and a
// score difference under one unit is a tie left to the rendezvous weight.
func TestRankByTierThenScore(t *testing.T) {
	cs := cands(3)
	cs[0].Tier, cs[0].Score = 1, 0
	cs[1].Tier, cs[1].Score = 0, 1e12
	cs[2].Tier, cs[2].Score = 0, 1e12+0.4
	got := rank(cs, 7, 3)
	if got[2].Replica != cs[0].Replica {
		t.Fatalf("tier 1 ranked %s before a tier 0", got[0].Replica.Name)
	}
	for key := uint64(0); key < 64; key++ { // the two tier-0 scores tie: both must win for some key
		if rank(cs, key, 1)[0].Replica == cs[2].Replica {
			return
		}
	}
	t.Fatal("a 0.4 score difference was not a tie")
}

// TestSemanticTooLong: a replica whose whole KV cache is smaller than the
// request is ranked after every other, however long its prefix, under
// either formula.
func TestSemanticTooLong(t *testing.T) {
	for _, params := range []Params{nil, {"load_weight": 0.1}} {
		p, _ := NewPolicy(PolicySpec{Type: "semantic", Params: params})
		in := &View{Tokens: 9000, Weighted: 9000, budgets: []int64{8192, 65536, 65536}}
		cs := cands(3)
		cs[0].Match = cachemodel.Match{Blocks: 100, Tokens: 8000, Weighted: 8000}
		cs[1].Load.InFlight, cs[1].State.Queued = 50, 10 // busy, but it fits
		p.Score(in, cs)
		if cs[0].Reason != "too_long" || cs[0].Tier <= cs[1].Tier || cs[0].Tier <= cs[2].Tier {
			t.Errorf("%v: %s tier %d, others %d and %d", params, cs[0].Reason, cs[0].Tier, cs[1].Tier, cs[2].Tier)
		}
	}
}

// TestSemanticRoomForWhatRunsThere: the blocks of a replica's matched
// prefix that requests running there hold need no free room: a request
// whose whole prompt is over the engine's free KV, but whose new blocks
// fit, is not ranked as waiting for room; once those requests end, it is.
func TestSemanticRoomForWhatRunsThere(t *testing.T) {
	e, err := New(Options{Replicas: []replica.Spec{{Name: "r0", URL: "http://127.0.0.1:9000", BudgetTokens: 10_000},
		{Name: "r1", URL: "http://127.0.0.1:9001", BudgetTokens: 10_000}}})
	if err != nil {
		t.Fatal(err)
	}
	var blocks []blockhash.Block
	for i := range 10 {
		blocks = append(blocks, blockhash.Block{Hash: uint64(1000 + i), Tokens: 100})
	}
	_, pins := e.pic.model.Commit(0, blocks[:9], 1) // a running request holds 900 tokens of it
	p, _ := NewPolicy(PolicySpec{Type: "semantic"})
	in := &View{Blocks: blocks, Tokens: 1000, Weighted: 1000, budgets: []int64{10_000, 10_000}, e: e}
	score := func() string {
		cs := []Candidate{{Replica: e.Pool().Replicas()[0]}, {Replica: e.Pool().Replicas()[1]}}
		cs[0].Match = cachemodel.Match{Blocks: 9, Tokens: 900, Weighted: 900}
		cs[0].Load.KVUsage = 0.95 // 500 free: the whole prompt does not fit, its 100 new tokens do
		p.Score(in, cs)
		return cs[0].Reason
	}
	if got := score(); got != "match" {
		t.Fatalf("with its prefix held by a running request: reason %s, want match", got)
	}
	e.pic.model.Done(0, blocks[:9], pins, 2)
	if got := score(); got != "kv" {
		t.Fatalf("with nothing running there: reason %s, want kv", got)
	}
}
