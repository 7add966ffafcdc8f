package routing

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/replica"
)

// A blending replica that served a tool output is credited for it after
// another system prompt, less its recompute share, and wins the request;
// a prefix-only replica is credited nothing for the same blocks, and
// PrefixOnly turns the credit off.
func TestBlendCreditsSegmentsBeyondThePrefix(t *testing.T) {
	for _, prefixOnly := range []bool{false, true} {
		now := time.Unix(1000, 0)
		specs := make([]replica.Spec, 4)
		for i := range specs {
			specs[i] = replica.Spec{Name: fmt.Sprint("r", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 9000+i),
				Reuse: replica.Reuse{Mode: replica.ReuseBlend, Recompute: 0.2}}
		}
		specs[3].Reuse = replica.Reuse{} // prefix only
		e, err := New(Options{Replicas: specs, Engine: EngineOptions{Now: func() time.Time { return now }}})
		if err != nil {
			t.Fatal(err)
		}
		pol, _ := NewPolicy(PolicySpec{Type: "semantic", Params: Params{"prefix_only": prefixOnly}})
		decide := decider(t, e, pol)
		out := strings.Repeat("search result: the river delta floods each spring. ", 60) // ~3 KB
		first := decide("r1", "system", "You are terse.", "tool", out, "user", "summarise")
		served := first.Chosen().Replica
		decide("r3", "system", "You are terse.", "tool", out, "user", "summarise") // prefix only: nothing kept
		second := decide("", "system", "You are a patient librarian with long answers.", "tool", out, "user", "and then?")
		var reuse float64
		for _, c := range second.Candidates {
			switch {
			case c.Replica == served:
				reuse = c.Reuse
			case c.Reuse != 0:
				t.Fatalf("%s credited %v tokens it never served", c.Replica.Name, c.Reuse)
			}
		}
		outTokens := 0
		for _, b := range first.Blocks {
			if b.Kind.String() == "tool_output" {
				outTokens += int(b.Tokens)
			}
		}
		if want := float64(outTokens) * 0.8; reuse < want-1 || reuse > want+1 {
			t.Fatalf("credit %v, want %v (0.8 of the tool output's %d tokens)", reuse, want, outTokens)
		}
		c := second.Chosen()
		if prefixOnly {
			if c.Reason == "blend" {
				t.Fatal("PrefixOnly still credited the blend")
			}
			continue
		}
		if c.Replica != served || c.Reason != "blend" {
			t.Fatalf("went to %s (%s); the tool output is on %s", c.Replica.Name, c.Reason, served.Name)
		}
	}
}

// decider returns a func that routes a chat of msgs (role, content, ...)
// with pol on e, on the replica named only if set, and ends it.
func decider(t *testing.T, e *Engine, pol Policy) func(only string, msgs ...string) *Decision {
	decide := modelDecider(t, e, pol)
	return func(only string, msgs ...string) *Decision {
		t.Helper()
		return decide("", only, msgs...)
	}
}

// modelDecider is decider for requests naming a model ("" for none).
func modelDecider(t *testing.T, e *Engine, pol Policy) func(model, only string, msgs ...string) *Decision {
	return func(model, only string, msgs ...string) *Decision {
		t.Helper()
		in := e.Prepare(parseChat(t, msgs...), "", false)
		in.Policy, in.Model = pol, model
		if only != "" {
			in.Allow = func(r *replica.Replica) bool { return r.Name == only }
		}
		d, err := e.Decide(in, true)
		if err != nil {
			t.Fatal(err)
		}
		d.Lease().End(e.Now())
		return d
	}
}
