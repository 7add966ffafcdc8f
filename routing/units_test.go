package routing

import (
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
)

// An engine whose template renders no tool schemas (llm-d's simulator) and
// counts 0.6 engine tokens per estimated token of the rest: once requests
// with tools and without were seen, a cached tools prefix is worth about
// nothing in the engine's unit, the rest 0.6, and a prompt is counted as
// the engine counts it.
func TestToolsHaveAUnitOfTheirOwn(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	tools := []any{map[string]any{"type": "function", "function": map[string]any{"name": "search",
		"description": strings.Repeat("searches the corpus for documents about the question ", 20)}}}
	body := func(i int, withTools bool) *blockhash.Request {
		b := map[string]any{"model": "m", "messages": []map[string]string{{"role": "user",
			"content": strings.Repeat(fmt.Sprintf("question %d is about something else. ", i), 5+i%17)}}}
		if withTools {
			b["tools"] = tools
		}
		data, _ := json.Marshal(b)
		req, err := blockhash.ParseChat(data, blockhash.Limits{})
		if err != nil {
			t.Fatal(err)
		}
		return req
	}
	for i := range 80 {
		d, err := f.decide(body(i, i%2 == 0), "", false)
		if err != nil {
			t.Fatal(err)
		}
		f.e.ObserveUsage("m", d, int(math.Round(0.6*d.est.other)))
	}
	s := f.e.units.scales("m")
	if s.tools > 0.1 || math.Abs(s.other-0.6) > 0.03 {
		t.Fatalf("learned tools %.3f, other %.3f; want about 0 and 0.6", s.tools, s.other)
	}
	d, err := f.decide(body(3, true), "", false)
	if err != nil {
		t.Fatal(err)
	}
	var toolTokens int
	for _, b := range d.Blocks {
		if b.Kind == blockhash.KindTools {
			toolTokens += int(b.Tokens)
		}
	}
	if toolTokens > len(d.Blocks) {
		t.Fatalf("the tools count %d engine tokens, an engine that renders none", toolTokens)
	}

	// Tools always in the same share cannot be told apart: one ratio.
	g := newFixture(t, 2, "semantic")
	for range 40 {
		d, _ := g.decide(body(3, true), "", false)
		g.e.ObserveUsage("m", d, int(0.6*(d.est.tools+d.est.other)))
	}
	if s := g.e.units.scales("m"); s.tools != s.other || math.Abs(s.other-0.6) > 0.01 {
		t.Fatalf("collinear requests: %+v", s)
	}
}

// Attack 9 of issue 30: a replica that reports tiny prompt_tokens, or huge
// ones, request after request, moves the learned unit no further than its
// bounds, and slowly: a report moves it by a factor of at most 16^(1/8).
func TestUnitsBoundedAgainstAReplica(t *testing.T) {
	var u units
	prev := 1.0
	for i := range 200 {
		u.observe("m", 0, 0, 1000, 1)
		s := u.scale("m")
		if s < minRatio || s > prev || s < prev/math.Pow(16, 1.0/8)-1e-9 {
			t.Fatalf("report %d moved the unit from %v to %v", i+1, prev, s)
		}
		prev = s
	}
	if prev > minRatio*1.01 {
		t.Fatalf("unit %v after 200 tiny reports, want about the bound %v", prev, minRatio)
	}
	for range 200 {
		u.observe("m", 0, 0, 1000, 1<<30)
	}
	if s := u.scale("m"); s > maxRatio || s < maxRatio*0.99 {
		t.Fatalf("unit %v after huge reports, want about the bound %v", s, maxRatio)
	}
	for i := range 200 {
		u.observe("t", 0, float64(100+i%7*100), 1000, 1)
	}
	if sc := u.scales("t"); sc.other < minRatio || sc.tools > maxRatio {
		t.Fatalf("fit %+v out of bounds", sc)
	}
}

// Attack 9 of issue 30 in a fleet: one replica of three reporting tiny
// prompt_tokens, as often as the others report, moves neither the model's
// unit nor its tools fit from what the two honest ones say (0.6 engine
// tokens per estimated one, tool schemas rendered as nothing); one of two
// moves the unit no more than halfway, in log space, and not at all once
// it left the pool.
func TestUnitsOneReplicaCannotDominate(t *testing.T) {
	var u units
	for i := range 600 {
		tools, other := float64(i%5*200), float64(500+i%7*150)
		switch i % 3 {
		case 2:
			u.observe("m", 2, tools, other, 1)
		default:
			u.observe("m", i%3, tools, other, int(math.Round(0.6*other)))
		}
		u.observe("n", 0, 0, other, int(math.Round(0.6*other)))
		u.observe("n", 1, 0, other, 1)
	}
	s := u.scales("m")
	if s.tools > 0.1 || math.Abs(s.other-0.6) > 0.05 {
		t.Fatalf("one lying replica of three moved the fit to tools %.3f, other %.3f; want about 0 and 0.6", s.tools, s.other)
	}
	if r := u.scale("m"); r < 0.3 || r > 0.6 {
		t.Fatalf("one lying replica of three moved the unit to %v, want the honest replicas' range", r)
	}
	if r, half := u.scale("n"), math.Sqrt(0.6*minRatio); math.Abs(r-half) > 0.01 {
		t.Fatalf("one lying replica of two: unit %v, want %v (halfway to the bound)", r, half)
	}
	u.forget(1) // the liar left the pool
	if r := u.scale("n"); math.Abs(r-0.6) > 0.01 {
		t.Fatalf("the liar left, the unit is %v, want the honest replica's 0.6", r)
	}
}

// Through the engine: a request's usage is learned on the replica that
// served it (Commit), so that one of three replicas reporting tiny
// prompt_tokens for every request it serves leaves the model's unit where
// the other two put it.
func TestUsageLearnedOnTheServingReplica(t *testing.T) {
	f := newFixture(t, 3, "round_robin")
	reps := f.pool.Replicas()
	for i := range 300 {
		d, err := f.decide(parseChat(t, "user", strings.Repeat(fmt.Sprintf("request %d asks again. ", i), 20)), "", false)
		if err != nil {
			t.Fatal(err)
		}
		var c *Candidate
		for k := range d.Candidates {
			if d.Candidates[k].Replica == reps[i%3] {
				c = &d.Candidates[k]
			}
		}
		f.e.Commit(d, c)
		reported := int(math.Round(0.6 * d.est.other))
		if i%3 == 2 {
			reported = 1
		}
		f.e.ObserveUsage("m", d, reported)
		d.Lease().End(f.e.Now())
		d.Lease().EngineDone(f.e.Now())
	}
	if s := f.e.TokenScale("m"); math.Abs(s-0.6) > 0.01 {
		t.Fatalf("one lying replica of three moved the unit to %v, want the others' 0.6", s)
	}
}
