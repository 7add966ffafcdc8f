package routing

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/matcher"
	"github.com/semroute/semroute/replica"
)

// A donor replica that served a document under one system prompt is
// credited, for the same document under another system prompt and
// question, with the donor's tokens times their similarity, and wins the
// request; a prefix-only replica that served it too is credited nothing;
// a donor replica whose engine asks more similarity than the donor has is
// credited nothing; once the picture evicts the donor, nothing is.
func TestDonorCreditsSimilarPrompt(t *testing.T) {
	now := time.Unix(1000, 0)
	specs := make([]replica.Spec, 4)
	for i := range specs {
		specs[i] = replica.Spec{Name: fmt.Sprint("r", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 9000+i), BudgetTokens: 100000,
			Reuse: replica.Reuse{Mode: replica.ReuseDonor}}
	}
	specs[2].Reuse.MinSimilarity = 0.99 // asks more than a paraphrase gives
	specs[3].Reuse = replica.Reuse{}    // prefix only
	mt, err := matcher.New(matcher.Options{MinSimilarity: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Replicas: specs, Engine: EngineOptions{Now: func() time.Time { return now }, Matcher: mt}})
	if err != nil {
		t.Fatal(err)
	}
	pol, _ := NewPolicy(PolicySpec{Type: "semantic"})
	decide := decider(t, e, pol)
	var doc strings.Builder
	for i := range 400 {
		fmt.Fprintf(&doc, "fact%d ", i)
	}
	first := decide("r1", "system", "You are terse.", "user", doc.String()+" Why?")
	decide("r2", "system", "You are terse.", "user", doc.String()+" Why?")
	decide("r3", "system", "You are terse.", "user", doc.String()+" Why?")
	second := decide("", "system", "You are a patient librarian with long answers.", "user", doc.String()+" How so?")
	for _, c := range second.Candidates {
		switch c.Replica.Name {
		case "r1":
			// The sketches differ by the question's and system prompt's
			// shingles: similarity is high but not 1.
			if c.Reuse < 0.8*float64(first.Tokens) || c.Reuse > float64(first.Tokens) {
				t.Fatalf("r1 credited %v tokens; its donor has %d", c.Reuse, first.Tokens)
			}
		default:
			if c.Reuse != 0 {
				t.Fatalf("%s credited %v tokens (engine %+v)", c.Replica.Name, c.Reuse, c.Replica.Reuse)
			}
		}
	}
	if c := second.Chosen(); c.Replica.Name != "r1" || c.Reason != "donor" {
		t.Fatalf("went to %s (%s); the donor is on r1", c.Replica.Name, c.Reason)
	}

	// The picture evicts r1's blocks (its budget shrinks to nothing): the
	// donor is forgotten with them.
	id := first.Chosen().Replica.ID
	if freed := e.pic.model.Shrink(id, 1<<30); freed == 0 {
		t.Fatal("nothing evicted")
	}
	third := decide("", "system", "You are a third persona.", "user", doc.String()+" When?")
	for _, c := range third.Candidates {
		if c.Replica.Name == "r1" && c.Reuse != 0 {
			t.Fatalf("after eviction r1 is credited %v tokens", c.Reuse)
		}
	}
}

// Feedback on a donor replica learns nothing from more cached tokens than
// the prefix (a donor the engine found), and still from fewer.
func TestDonorFeedbackOnlyBelowThePrefix(t *testing.T) {
	mt, _ := matcher.New(matcher.Options{})
	e, err := New(Options{Replicas: []replica.Spec{{Name: "r0", URL: "http://127.0.0.1:9000", BudgetTokens: 10000,
		Reuse: replica.Reuse{Mode: replica.ReuseDonor}}}, Engine: EngineOptions{Matcher: mt}})
	if err != nil {
		t.Fatal(err)
	}
	pol, _ := NewPolicy(PolicySpec{Type: "semantic"})
	in := e.Prepare(parseChat(t, "system", "You are terse.", "user", strings.Repeat("word ", 500)), "", false)
	in.Policy = pol
	d, err := e.Decide(in, true)
	if err != nil {
		t.Fatal(err)
	}
	c := d.Chosen()
	d.Lease().End(e.Now())
	if got := e.Feedback(d, c, c.Match.Tokens+800); got != 0 {
		t.Fatalf("more than the prefix evicted %d", got)
	}
	if st, _ := e.Picture().Stats(0); st.Budget != 10000 {
		t.Fatalf("budget %d after a donor's tokens, want 10000 unchanged", st.Budget)
	}
	c.Match.Tokens = 400 // as if the picture predicted 400
	if got := e.Feedback(d, c, 0); got == 0 {
		t.Fatal("fewer than the prefix corrected nothing")
	}
}

// A donor replica needs the donor index.
func TestDonorNeedsMatcher(t *testing.T) {
	spec := replica.Spec{Name: "r0", URL: "http://127.0.0.1:9000", Reuse: replica.Reuse{Mode: replica.ReuseDonor}}
	if _, err := New(Options{Replicas: []replica.Spec{spec}}); err == nil {
		t.Fatal("a donor replica without a matcher was accepted")
	}
	e, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.AddReplica(spec); err == nil {
		t.Fatal("a donor replica joined without a matcher")
	}
}

// A donor served under one model is no donor for a request naming another
// (their KV caches are not interchangeable), and still one for a request
// naming the same model.
func TestDonorKeepsModelsApart(t *testing.T) {
	specs := []replica.Spec{
		{Name: "r0", URL: "http://127.0.0.1:9000", BudgetTokens: 100000, Reuse: replica.Reuse{Mode: replica.ReuseDonor}},
		{Name: "r1", URL: "http://127.0.0.1:9001", BudgetTokens: 100000, Reuse: replica.Reuse{Mode: replica.ReuseDonor}},
	}
	mt, err := matcher.New(matcher.Options{MinSimilarity: 0.5})
	if err != nil {
		t.Fatal(err)
	}
	e, err := New(Options{Replicas: specs, Engine: EngineOptions{Matcher: mt}})
	if err != nil {
		t.Fatal(err)
	}
	pol, _ := NewPolicy(PolicySpec{Type: "semantic"})
	var doc strings.Builder
	for i := range 400 {
		fmt.Fprintf(&doc, "fact%d ", i)
	}
	md := modelDecider(t, e, pol)
	decide := func(model, only, system, question string) *Decision {
		t.Helper()
		return md(model, only, "system", system, "user", doc.String()+question)
	}
	decide("model-a", "r1", "You are terse.", " Why?")
	credit := func(d *Decision) float64 {
		for _, c := range d.Candidates {
			if c.Replica.Name == "r1" {
				return c.Reuse
			}
		}
		return -1
	}
	if got := credit(decide("model-b", "", "You are a patient librarian.", " How so?")); got != 0 {
		t.Fatalf("a model-b request credited r1 with %v tokens of a model-a donor", got)
	}
	if got := credit(decide("model-a", "", "You are a second persona.", " When?")); got <= 0 {
		t.Fatalf("a model-a request credited r1 with %v tokens of its model-a donor", got)
	}
}
