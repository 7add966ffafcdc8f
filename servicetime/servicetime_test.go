package servicetime

import (
	"math"
	"math/rand/v2"
	"testing"
)

// engine is a synthetic engine: ttft = overhead + perToken × uncached +
// perAhead × ahead, each output token after the first perOutput +
// perBatch × batch, with ±5% noise.
type engine struct{ overhead, perToken, perAhead, perOutput, perBatch float64 }

func (e engine) sample(rng *rand.Rand, streamed bool) Sample {
	s := Sample{Uncached: float64(rng.IntN(4000)), Ahead: float64(rng.IntN(3000)), Batch: float64(1 + rng.IntN(8)), Output: 1 + rng.IntN(200)}
	noise := func() float64 { return 1 + 0.1*(rng.Float64()-0.5) }
	ttft := (e.overhead + e.perToken*s.Uncached + e.perAhead*s.Ahead) * noise()
	s.Total = ttft + float64(s.Output-1)*(e.perOutput+e.perBatch*s.Batch)*noise()
	if streamed {
		s.TTFT = ttft
	}
	return s
}

func near(t *testing.T, name string, got, want, tol float64) {
	t.Helper()
	if math.Abs(got-want) > tol {
		t.Errorf("%s = %.6g, want %.6g ± %.2g", name, got, want, tol)
	}
}

func TestLearnsAnEngineFromItsAnswers(t *testing.T) {
	for _, streamed := range []bool{true, false} {
		e := engine{overhead: 0.020, perToken: 0.002, perAhead: 0, perOutput: 0.010, perBatch: 0.001}
		rng := rand.New(rand.NewPCG(1, 2))
		var m Model
		for range 400 {
			m.Observe(e.sample(rng, streamed))
		}
		p := m.Params()
		if p.Samples != 400 {
			t.Fatalf("samples %d", p.Samples)
		}
		near(t, "PerToken", p.PerToken, e.perToken, 0.0002)
		near(t, "PerAhead", p.PerAhead, e.perAhead, 0.0002)
		near(t, "PerOutput", p.PerOutput, e.perOutput, 0.002)
		near(t, "PerOutputBatch", p.PerOutputBatch, e.perBatch, 0.0005)
		// The prediction of a typical request is within 5%.
		want := e.overhead + e.perToken*2000 + e.perAhead*1000
		got := p.TTFT(State{Ahead: 1000}, 2000)
		if math.Abs(got/want-1) > 0.05 {
			t.Errorf("streamed %v: predicted %.4f s, engine %.4f s", streamed, got, want)
		}
	}
}

func TestTellsAFastReplicaFromASlowOne(t *testing.T) {
	fast := engine{overhead: 0.005, perToken: 0.0005, perAhead: 0.0005, perOutput: 0.003}
	slow := engine{overhead: 0.015, perToken: 0.0015, perAhead: 0.0015, perOutput: 0.009}
	rng := rand.New(rand.NewPCG(3, 4))
	var mf, ms Model
	for range 200 {
		mf.Observe(fast.sample(rng, true))
		ms.Observe(slow.sample(rng, true))
	}
	pf, ps := mf.Params(), ms.Params()
	r := ps.TTFT(State{}, 1000) / pf.TTFT(State{}, 1000)
	if r < 2.7 || r > 3.3 {
		t.Errorf("slow ÷ fast predicted TTFT %.2f, engines 3", r)
	}
}

func TestPriorWorksOnTheFirstRequest(t *testing.T) {
	var m Model
	p := m.Params()
	if p.Samples != 0 || p.PerToken <= 0 || p.Overhead <= 0 || p.Run <= 0 || p.KVWait <= 0 {
		t.Fatalf("prior %+v", p)
	}
	// More uncached tokens, more work ahead, more queued: each costs time.
	base := p.TTFT(State{}, 100)
	if !(p.TTFT(State{}, 1000) > base && p.TTFT(State{Ahead: 1000}, 100) > base &&
		p.TTFT(State{Queued: 1}, 100) > base && p.TTFT(State{KVShort: true}, 100) > base) {
		t.Fatalf("prior's TTFT does not grow with work: %+v", p)
	}
	if Median(nil) != Prior() {
		t.Fatal("the median of no replica is not the prior")
	}
}

func TestLearnsTheWaitForASlotAndForKV(t *testing.T) {
	e := engine{overhead: 0.020, perToken: 0.001, perOutput: 0.010}
	rng := rand.New(rand.NewPCG(5, 6))
	var m Model
	for range 100 {
		m.Observe(e.sample(rng, true))
	}
	for range 100 {
		s := e.sample(rng, true)
		s.Queued = 2
		s.TTFT += 2 * 0.5 // half a second a request ahead
		s.Total += 2 * 0.5
		m.Observe(s)
		s = e.sample(rng, true)
		s.KVShort = true
		s.TTFT += 0.3
		s.Total += 0.3
		m.Observe(s)
	}
	p := m.Params()
	near(t, "WaitPer", p.WaitPer, 0.5, 0.05)
	near(t, "KVWait", p.KVWait, 0.3, 0.05)
	// The waits did not move the linear fit.
	near(t, "PerToken", p.PerToken, e.perToken, 0.0001)
}

func TestErrorTracksPredictions(t *testing.T) {
	var m Model
	m.Observe(Sample{Uncached: 10, TTFT: 0.2, Total: 0.3, Predicted: 0.1})
	p := m.Params()
	near(t, "Error", p.Error, math.Log(2), 1e-9)
	if p.Errors != 1 {
		t.Fatalf("errors %d", p.Errors)
	}
}

func TestIgnoresImpossibleSamples(t *testing.T) {
	var m Model
	for _, s := range []Sample{{Total: 0}, {Total: 1, TTFT: 2}, {Total: 1, Uncached: -1}, {Total: math.NaN()}, {Total: 1, TTFT: -1}} {
		m.Observe(s)
	}
	if p := m.Params(); p != Prior() {
		t.Fatalf("learned from impossible samples: %+v", p)
	}
}

func TestMedianOfReplicas(t *testing.T) {
	a, b, c := Prior(), Prior(), Prior()
	a.PerToken, b.PerToken, c.PerToken = 1, 2, 30
	if got := Median([]Params{a, b, c}).PerToken; got != 2 {
		t.Fatalf("median %v", got)
	}
}

// TestRateIsBoundByPrefillInTurn: an engine whose prompts wait for the
// ones ahead finishes no more requests a second than one prefill's time
// allows, however many sequences it runs.
func TestRateIsBoundByPrefillInTurn(t *testing.T) {
	p := Params{Overhead: 0.01, PerToken: 1e-4, PerAhead: 1e-4, PerOutput: 0.01, Run: 1, Uncached: 1000, Output: 50}
	if got := p.Rate(256); math.Abs(got-1/0.11) > 1e-9 {
		t.Fatalf("rate %v, want the prefill's 1/0.11 s", got)
	}
	p.PerAhead, p.Overhead = 0, 0 // prompts computed apart: the slots bound it
	if got := p.Rate(4); math.Abs(got-4/p.RunAt(4)) > 1e-9 {
		t.Fatalf("rate %v, want 4 slots over a run", got)
	}
}
