package routing

import (
	"strings"
	"testing"

	"github.com/semroute/semroute/replica"
)

// A budget the engine reports after a feedback correction is the new base
// of the corrections: a replica at 262,144 tokens corrected once, then
// reporting 4,000,000, is not held to four times the old budget.
func TestReportedBudgetResetsFeedbackBase(t *testing.T) {
	e, err := New(Options{Replicas: []replica.Spec{{Name: "r0", URL: "http://127.0.0.1:9000", BudgetTokens: 262144}}})
	if err != nil {
		t.Fatal(err)
	}
	pol, _ := NewPolicy(PolicySpec{Type: "semantic"})
	decide := func() (*Decision, *Candidate) {
		in := e.Prepare(parseChat(t, "system", "You are terse.", "user", strings.Repeat("word ", 500)), "", false)
		in.Policy = pol
		d, err := e.Decide(in, true)
		if err != nil {
			t.Fatal(err)
		}
		d.Lease().End(e.Now())
		return d, d.Chosen()
	}
	d, c := decide()
	c.Match.Tokens = 400 // the picture predicted 400, the engine found none
	if e.Feedback(d, c, 0) == 0 {
		t.Fatal("the first correction evicted nothing")
	}
	if st, _ := e.Picture().Stats(0); st.Budget >= 262144 {
		t.Fatalf("budget %d after an over-prediction, want below 262144", st.Budget)
	}
	e.Picture().SetBudget(0, 4_000_000)
	d, c = decide()
	c.Match.Tokens = 0 // the engine found 800 tokens the picture did not predict
	e.Feedback(d, c, 800)
	if st, _ := e.Picture().Stats(0); st.Budget < 4_000_000 {
		t.Fatalf("budget %d after the engine reported 4,000,000 and a correction upwards, want at least that", st.Budget)
	}
}

// budgetSeen is a policy that records the budget the view gives it.
type budgetSeen struct{ got int64 }

func (*budgetSeen) Name() string { return "budget_seen" }
func (b *budgetSeen) Score(in *View, cands []Candidate) {
	for i := range cands {
		b.got = in.Budget(&cands[i])
	}
}

// TestViewBudgetIsTheCapacity: the budget a policy sees is the engine's KV
// capacity as reported, not the picture's budget as feedback corrected it
// (vllm:kv_cache_usage_perc is a share of the former).
func TestViewBudgetIsTheCapacity(t *testing.T) {
	f := newFixture(t, 1, "semantic")
	f.e.Picture().SetBudget(0, 100_000)
	f.e.pic.correct(0, 200_000)                                                         // the engine reported far fewer cached tokens than predicted
	if st, _ := f.e.Picture().Stats(0); st.Budget != 75_000 || st.Capacity != 100_000 { // 100,000 − 200,000/8
		t.Fatalf("after a correction: budget %d, capacity %d", st.Budget, st.Capacity)
	}
	p := &budgetSeen{}
	in := f.e.Prepare(parseChat(t, "user", "hello"), "s", false)
	in.Policy = p
	if _, err := f.e.Decide(in, false); err != nil {
		t.Fatal(err)
	}
	if p.got != 100_000 {
		t.Fatalf("the policy saw a budget of %d, want the capacity 100000", p.got)
	}
}
