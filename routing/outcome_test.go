package routing

import (
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/servicetime"
)

// held returns a candidate on replica r holding tokens, confirmed.
func held(r *replica.Replica, tokens int) Candidate {
	return Candidate{Replica: r, Match: cachemodel.Match{Tokens: tokens, Confirmed: tokens}, Reason: "match"}
}

// TestPrefixOutcomes classifies constructed decisions, one or more per
// outcome, and checks every classification sums to the prompt.
func TestPrefixOutcomes(t *testing.T) {
	a, b, c := &replica.Replica{Name: "a", ID: 0}, &replica.Replica{Name: "b", ID: 1}, &replica.Replica{Name: "c", ID: 2}
	reported := func(prompt, cached int64) Usage {
		return Usage{OK: true, PromptTokens: prompt, CachedTokens: cached, CachedReported: true}
	}
	with := func(c Candidate, f func(*Candidate)) Candidate { f(&c); return c }
	type want map[PrefixOutcome]int64
	for _, tc := range []struct {
		name   string
		cands  []Candidate // cands[served] served
		served int
		u      Usage
		tokens int // the decision's estimate
		queued bool
		block  int
		want   want
	}{
		{name: "cold", cands: []Candidate{held(a, 0), held(b, 0)}, u: reported(100, 0),
			want: want{PrefixCold: 100}},
		{name: "hit reported", cands: []Candidate{held(a, 64), held(b, 0)}, u: reported(100, 64),
			want: want{PrefixHit: 64, PrefixCold: 36}},
		{name: "hit predicted without a report", cands: []Candidate{held(a, 60), held(b, 0)}, u: Usage{OK: true}, tokens: 100,
			want: want{PrefixHit: 60, PrefixCold: 40}},
		{name: "hit past the prediction", cands: []Candidate{held(a, 20), held(b, 50)}, u: reported(100, 64),
			want: want{PrefixHit: 64, PrefixCold: 36}},
		{name: "hit at most the prompt", cands: []Candidate{held(a, 200)}, u: reported(100, 128),
			want: want{PrefixHit: 100}},
		{name: "evicted", cands: []Candidate{held(a, 80), held(b, 0)}, u: reported(100, 32),
			want: want{PrefixHit: 32, PrefixEvicted: 48, PrefixCold: 20}},
		{name: "waited: the replica short of KV", cands: []Candidate{with(held(a, 80), func(c *Candidate) { c.State.KVShort = true })}, u: reported(100, 32),
			want: want{PrefixHit: 32, PrefixWaited: 48, PrefixCold: 20}},
		{name: "waited: the policy's reason kv", cands: []Candidate{with(held(a, 80), func(c *Candidate) { c.Reason = reasonNoRoom })}, u: reported(100, 32),
			want: want{PrefixHit: 32, PrefixWaited: 48, PrefixCold: 20}},
		{name: "waited: queued in the router", cands: []Candidate{held(a, 80)}, u: reported(100, 32), queued: true,
			want: want{PrefixHit: 32, PrefixWaited: 48, PrefixCold: 20}},
		{name: "waited without a report is a hit", cands: []Candidate{held(a, 80)}, u: Usage{OK: true, PromptTokens: 100}, queued: true,
			want: want{PrefixHit: 80, PrefixCold: 20}},
		{name: "routed away: a turn", cands: []Candidate{with(held(a, 0), func(c *Candidate) { c.Reason = "turn" }), with(held(b, 70), func(c *Candidate) { c.Reason = "turn" })},
			u: reported(100, 0), want: want{PrefixRoutedAway: 70, PrefixCold: 30}},
		{name: "routed away: past the served replica's hit", cands: []Candidate{held(a, 40), held(b, 90)}, u: reported(100, 40),
			want: want{PrefixHit: 40, PrefixRoutedAway: 50, PrefixCold: 10}},
		{name: "routed away past what was lost", cands: []Candidate{held(a, 60), held(b, 90)}, u: reported(100, 20),
			want: want{PrefixHit: 20, PrefixEvicted: 40, PrefixRoutedAway: 30, PrefixCold: 10}},
		{name: "routed away: a failover off the holder", cands: []Candidate{held(a, 70), held(b, 0)}, served: 1, u: reported(100, 0),
			want: want{PrefixRoutedAway: 70, PrefixCold: 30}},
		{name: "routed away for load: slower", cands: []Candidate{with(held(a, 0), func(c *Candidate) { c.TTFT = 0.5 }), with(held(b, 70), func(c *Candidate) { c.TTFT = 2 })},
			u: reported(100, 0), want: want{PrefixRoutedAwayLoad: 70, PrefixCold: 30}},
		{name: "routed away for load: queued", cands: []Candidate{held(a, 0), with(held(b, 70), func(c *Candidate) { c.State = servicetime.State{Queued: 3} })},
			u: reported(100, 0), want: want{PrefixRoutedAwayLoad: 70, PrefixCold: 30}},
		{name: "routed away for load: short of KV", cands: []Candidate{held(a, 0), with(held(b, 70), func(c *Candidate) { c.State.KVShort = true })},
			u: reported(100, 0), want: want{PrefixRoutedAwayLoad: 70, PrefixCold: 30}},
		{name: "routed away for load: spilled", cands: []Candidate{held(a, 0), with(held(b, 70), func(c *Candidate) { c.Tier, c.Reason = 1, reasonSpill })},
			u: reported(100, 0), want: want{PrefixRoutedAwayLoad: 70, PrefixCold: 30}},
		{name: "routed away for load: least_load", cands: []Candidate{with(held(a, 0), func(c *Candidate) { c.Reason = "load" }), with(held(b, 70), func(c *Candidate) { c.Tier, c.Reason = 2, "load" })},
			u: reported(100, 0), want: want{PrefixRoutedAwayLoad: 70, PrefixCold: 30}},
		{name: "routed away: the tie's best ranked holder decides", cands: []Candidate{held(a, 0),
			with(held(b, 70), func(c *Candidate) { c.Tier, c.Reason = 1, "queue" }), with(held(c, 70), func(c *Candidate) { c.Score = 3 })},
			u: reported(100, 0), want: want{PrefixRoutedAway: 70, PrefixCold: 30}},
		{name: "the longest holder decides", cands: []Candidate{held(a, 0),
			with(held(b, 50), func(c *Candidate) { c.Reason = "turn" }), with(held(c, 70), func(c *Candidate) { c.Reason = "queue" })},
			u: reported(100, 0), want: want{PrefixRoutedAwayLoad: 70, PrefixCold: 30}},
		{name: "the estimate without a prompt report", cands: []Candidate{held(a, 0), held(b, 30)}, u: Usage{OK: true}, tokens: 50,
			want: want{PrefixRoutedAway: 30, PrefixCold: 20}},
		{name: "a shortfall under a block is cold", cands: []Candidate{held(a, 270)}, u: reported(270, 256), block: 16,
			want: want{PrefixHit: 256, PrefixCold: 14}},
		{name: "a shortfall of a block is lost", cands: []Candidate{held(a, 272)}, u: reported(300, 256), block: 16,
			want: want{PrefixHit: 256, PrefixEvicted: 16, PrefixCold: 28}},
		{name: "routed away under a block is cold", cands: []Candidate{held(a, 256), held(b, 270)}, u: reported(300, 256), block: 16,
			want: want{PrefixHit: 256, PrefixCold: 44}},
		{name: "a precise decision's own block", cands: []Candidate{held(a, 256), held(b, 270)}, u: reported(300, 256), block: 1,
			want: want{PrefixHit: 256, PrefixCold: 44}},
		{name: "not OK: not classified", cands: []Candidate{held(a, 80)}, u: Usage{PromptTokens: 100, CachedReported: true}, want: want{}},
		{name: "no prompt: not classified", cands: []Candidate{held(a, 0)}, u: Usage{OK: true}, want: want{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := &Decision{Blocks: []blockhash.Block{{Tokens: 16}}, Tokens: tc.tokens, Candidates: tc.cands}
			if strings.HasPrefix(tc.name, "a precise") {
				d.blockTokens = 16
			}
			got := PrefixOutcomes(d, &d.Candidates[tc.served], tc.u, tc.queued, tc.block)
			var exp PrefixTokens
			for o, n := range tc.want {
				exp[o] = n
			}
			if got != exp {
				t.Fatalf("got %v, want %v", named(got), named(exp))
			}
			prompt := tc.u.PromptTokens
			if prompt == 0 {
				prompt = int64(tc.tokens)
			}
			if s := got.Sum(); s != 0 && s != prompt {
				t.Fatalf("outcomes sum to %d, not the prompt's %d", s, prompt)
			}
		})
	}
}

// named spells p by outcome name, for failures.
func named(p PrefixTokens) map[string]int64 {
	m := map[string]int64{}
	for o, n := range p {
		if n != 0 {
			m[PrefixOutcome(o).String()] = n
		}
	}
	return m
}

// TestPrefixOutcomesSumToThePrompt: over random decisions and usages,
// every token is given one outcome, none negative.
func TestPrefixOutcomesSumToThePrompt(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	reps := []*replica.Replica{{Name: "a", ID: 0}, {Name: "b", ID: 1}, {Name: "c", ID: 2}}
	reasons := []string{"match", "miss", "queue", "kv", "spill", "turn", "load"}
	for i := 0; i < 2000; i++ {
		var cands []Candidate
		for _, r := range reps[:1+rng.IntN(len(reps))] {
			c := held(r, rng.IntN(300)-20)
			c.Reason, c.TTFT, c.Tier = reasons[rng.IntN(len(reasons))], rng.Float64(), int64(rng.IntN(2))
			c.State = servicetime.State{Queued: float64(rng.IntN(3)), KVShort: rng.IntN(4) == 0}
			cands = append(cands, c)
		}
		d := &Decision{Blocks: []blockhash.Block{{Tokens: 16}}, Tokens: rng.IntN(250), Candidates: cands, Deferred: rng.IntN(8) == 0}
		u := Usage{OK: rng.IntN(10) > 0, PromptTokens: int64(rng.IntN(250)), CachedTokens: int64(rng.IntN(300) - 20), CachedReported: rng.IntN(3) > 0}
		got := PrefixOutcomes(d, &d.Candidates[rng.IntN(len(cands))], u, rng.IntN(8) == 0, rng.IntN(65))
		prompt := u.PromptTokens
		if prompt == 0 {
			prompt = int64(d.Tokens)
		}
		if !u.OK {
			prompt = 0
		}
		for o, n := range got {
			if n < 0 {
				t.Fatalf("case %d: %s is %d", i, PrefixOutcome(o), n)
			}
		}
		if got.Sum() != prompt {
			t.Fatalf("case %d: outcomes %v sum to %d, not the prompt's %d", i, named(got), got.Sum(), prompt)
		}
	}
}

func TestPrefixOutcomeNames(t *testing.T) {
	seen := map[string]bool{}
	for o := PrefixOutcome(0); o < NumPrefixOutcomes; o++ {
		n := o.String()
		if n == "" || n == "unknown" || seen[n] {
			t.Fatalf("outcome %d named %q", o, n)
		}
		seen[n] = true
	}
	if NumPrefixOutcomes.String() != "unknown" {
		t.Fatal("past the last outcome should be unknown")
	}
}

func BenchmarkPrefixOutcomes(b *testing.B) {
	for _, n := range []int{8, 64, 1024} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			cands := make([]Candidate, n)
			for i := range cands {
				cands[i] = held(&replica.Replica{ID: i}, i*16)
			}
			d := &Decision{Blocks: []blockhash.Block{{Tokens: 16}}, Tokens: 4096, Candidates: cands}
			u := Usage{OK: true, PromptTokens: 4096, CachedTokens: 32, CachedReported: true}
			b.ReportAllocs()
			for b.Loop() {
				_ = PrefixOutcomes(d, &d.Candidates[0], u, false, 16)
			}
		})
	}
}
