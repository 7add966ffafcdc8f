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

// A replica that reports tiny prompt_tokens, or huge ones, request after
// request, moves the learned unit no further than its bounds.
func TestUnitsBoundedAgainstAReplica(t *testing.T) {
	var u units
	for range 200 {
		u.observe("m", 0, 1000, 1)
	}
	if s := u.scale("m"); s != minRatio {
		t.Fatalf("unit %v after tiny reports, want the bound %v", s, minRatio)
	}
	for range 200 {
		u.observe("m", 0, 1000, 1<<30)
	}
	if s := u.scale("m"); s > maxRatio {
		t.Fatalf("unit %v after huge reports, want at most %v", s, maxRatio)
	}
	for range 200 {
		u.observe("t", 500, 1000, 1)
	}
	if sc := u.scales("t"); sc.other < minRatio || sc.tools > maxRatio {
		t.Fatalf("fit %+v out of bounds", sc)
	}
}
