// Package servicetime models, in seconds, how long one replica's engine
// takes to serve a request, learned online from what every engine already
// reports: each answer's time to first token and its end, its usage
// (uncached prompt tokens, output tokens), and the load the request met
// when it was sent (prefill work ahead of it, sequences running beside it,
// requests it had to wait behind, whether its blocks fitted the free KV
// cache).
//
// The model of a request that starts at once is linear in what it does:
//
//	ttft   = Overhead + PerToken × uncached + PerAhead × ahead
//	decode = (output − 1) × (PerOutput + PerOutputBatch × batch)
//
// PerAhead is what prefill work already sent costs the next request: about
// PerToken on an engine that computes prefills first come first served in
// one batch (vLLM's chunked prefill), about 0 on one that computes them
// apart (llm-d's simulator). A request that cannot start at once waits
// first: WaitPer seconds for each request that must finish before a
// sequence slot frees (the engine's max-num-seqs; a slot's turn: a mean
// request's run time over the slots until waits are seen), and
// KVWait when its blocks did not fit the engine's free KV cache (vLLM
// admits a request only when they do). So
//
//	TTFT(state, uncached) = queued × WaitPer + [short of KV] × KVWait
//	                        + Overhead + PerToken × uncached + PerAhead × ahead
//
// The five linear parameters are a least-squares fit over the recent
// requests that started at once (weights decaying by 1/64 a request),
// pulled toward the prior by one request's weight so that it is defined
// from the first request and never swings on a few; a streamed answer
// gives two equations (its first token and its decode), an answer that is
// not streamed one (its end). WaitPer and KVWait are averages of the waits
// that requests which could not start at once met beyond the linear model's
// time, each starting from its prior: a slot's turn is a mean request's
// run time over the slots, the KV wait half of it.
//
// The priors are no engine's: 10 ms of overhead, 10,000 prefill tokens a
// second for the prompt and for the work ahead, 20 ms an output token.
// A replica's own requests replace them within tens of requests; until
// then a caller may use its fleet's (Median).
package servicetime

import (
	"math"
	"slices"
	"sync"
)

// Sample is one answered request as the model learns from it. Times are
// seconds from its sending; tokens are the engine's.
type Sample struct {
	// Uncached is the prompt tokens the engine computed (prompt_tokens −
	// cached_tokens).
	Uncached float64
	// Ahead is the prefill tokens sent to the replica before it and not
	// yet prefilled when it was sent.
	Ahead float64
	// Batch is the sequences the engine ran when it was sent, itself
	// included.
	Batch float64
	// Output is the tokens the engine generated.
	Output int
	// Queued is how many requests had to finish before it could start (0:
	// a slot was free), and KVShort whether its tokens did not fit the
	// engine's free KV cache, both as the router saw them when it was sent.
	Queued  float64
	KVShort bool
	// Slots is the sequences its engine runs at once (0: not known).
	Slots float64
	// TTFT is the seconds to its first token; 0 when not known (an answer
	// not streamed). Total is the seconds to the engine's end.
	TTFT, Total float64
	// Predicted is the time to first token predicted when it was sent
	// (Params.TTFT), 0 if none was: compared with TTFT for Error.
	Predicted float64
}

// State is what a replica has on hand when a request would be sent to it.
type State struct {
	// Ahead is the prefill tokens sent to it and not yet prefilled.
	Ahead float64
	// Slots is how many sequences its engine runs at once (0: not known,
	// read as 1).
	Slots float64
	// Queued is how many requests must finish before the request could
	// start there (0: a slot is free now).
	Queued float64
	// KVShort: the request's tokens do not fit its engine's free KV cache.
	KVShort bool
}

// Params are one replica's learned parameters, in seconds.
type Params struct {
	Overhead       float64 `json:"overhead_seconds"`
	PerToken       float64 `json:"prefill_seconds_per_token"`
	PerAhead       float64 `json:"ahead_seconds_per_token"`
	PerOutput      float64 `json:"decode_seconds_per_token"`
	PerOutputBatch float64 `json:"decode_seconds_per_token_per_sequence"`
	// Run is a mean request's seconds on a slot, from its start to its
	// end: its prefill and decode at the mean uncached and output tokens
	// of the recent answers (Uncached, Output), alone.
	Run              float64 `json:"run_seconds"`
	Uncached, Output float64 `json:"-"`
	// WaitPer is the learned seconds a request waits for each request
	// queued ahead of it, 0 until one waited: 1 ÷ Rate until then.
	WaitPer float64 `json:"wait_seconds_per_queued_request"`
	KVWait  float64 `json:"kv_wait_seconds"`
	// Samples is the answers learned from (0: the parameters are the
	// prior).
	Samples int `json:"samples"`
	// Error is the recent mean of |log(observed ÷ predicted)| time to
	// first token over the streamed answers that carried a prediction (0
	// before any): 0.1 is about 10% off, ln 2 ≈ 0.69 a factor of 2. Errors
	// counts those answers.
	Error  float64 `json:"ttft_log_error"`
	Errors int     `json:"ttft_errors"`
}

// Prior returns the parameters of a replica nothing is known of.
func Prior() Params {
	p := Params{Overhead: priorTheta[0], PerToken: priorTheta[1], PerAhead: priorTheta[2],
		PerOutput: priorTheta[3], PerOutputBatch: priorTheta[4]}
	p.Uncached, p.Output = priorUncached, priorOutput
	p.Run = p.run(p.Uncached, p.Output, 1)
	p.KVWait = p.Run / 2
	return p
}

// Prefill returns the seconds to first token of a request that starts at
// once with ahead prefill tokens ahead of it: no wait.
func (p *Params) Prefill(uncached, ahead float64) float64 {
	return p.Overhead + p.PerToken*uncached + p.PerAhead*ahead
}

// Wait returns the seconds a request would wait in s before it starts.
func (p *Params) Wait(s State) float64 {
	w := max(s.Queued, 0) * p.waitPer(s.Slots)
	if s.KVShort {
		w += p.KVWait
	}
	return w
}

// TTFT returns the predicted seconds to the first token of a request with
// uncached prompt tokens to compute, sent in s.
func (p *Params) TTFT(s State, uncached float64) float64 {
	return p.Wait(s) + p.Prefill(uncached, s.Ahead)
}

// Decode returns the seconds of output tokens after the first, batch
// sequences running.
func (p *Params) Decode(output, batch float64) float64 {
	return max(output-1, 0) * (p.PerOutput + p.PerOutputBatch*batch)
}

// RunAt is a mean request's seconds on a slot with slots sequences
// running: Run, its decode slowed by the batch.
func (p *Params) RunAt(slots float64) float64 {
	return p.Run + p.Decode(p.Output, max(slots, 1)) - p.Decode(p.Output, 1)
}

// Rate is the requests a second an engine of slots sequences finishes
// when every slot is busy: slots ÷ RunAt(slots), and at most what its
// prefill lets through where prompts wait for the ones ahead (PerAhead: a
// mean request's prefill at PerAhead a token, its overhead included, one
// after the other); 0 when Run is not above 0.
func (p *Params) Rate(slots float64) float64 {
	run := p.RunAt(slots)
	if !(run > 0) {
		return 0
	}
	rate := max(slots, 1) / run
	if one := p.Overhead + p.PerAhead*p.Uncached; one > 0 {
		rate = min(rate, 1/one)
	}
	return rate
}

// waitPer is WaitPer, or before any wait was learned the seconds between
// two requests' ends when every slot is busy (1 ÷ Rate: Run over the
// slots, or one prefill where prompts wait for the ones ahead).
func (p *Params) waitPer(slots float64) float64 {
	if p.WaitPer > 0 {
		return p.WaitPer
	}
	if r := p.Rate(slots); r > 0 {
		return 1 / r
	}
	return p.Run / max(slots, 1)
}

// run is a request's time from start to end, alone ahead of it, over slots
// sequences.
func (p *Params) run(uncached, output, slots float64) float64 {
	return p.Prefill(uncached, 0) + p.Decode(output, slots)
}

// Median returns, parameter by parameter, the median of ps (the mean of
// the middle two for an even count), and the prior when ps is empty: a
// fleet's model for a replica that has not learned its own.
func Median(ps []Params) Params {
	if len(ps) == 0 {
		return Prior()
	}
	vals := make([]float64, len(ps))
	med := func(f func(*Params) float64) float64 {
		for i := range ps {
			vals[i] = f(&ps[i])
		}
		slices.Sort(vals)
		n := len(vals)
		return (vals[(n-1)/2] + vals[n/2]) / 2
	}
	return Params{
		Overhead:       med(func(p *Params) float64 { return p.Overhead }),
		PerToken:       med(func(p *Params) float64 { return p.PerToken }),
		PerAhead:       med(func(p *Params) float64 { return p.PerAhead }),
		PerOutput:      med(func(p *Params) float64 { return p.PerOutput }),
		PerOutputBatch: med(func(p *Params) float64 { return p.PerOutputBatch }),
		Run:            med(func(p *Params) float64 { return p.Run }),
		Uncached:       med(func(p *Params) float64 { return p.Uncached }),
		Output:         med(func(p *Params) float64 { return p.Output }),
		WaitPer:        med(func(p *Params) float64 { return p.WaitPer }),
		KVWait:         med(func(p *Params) float64 { return p.KVWait }),
	}
}

// The fit's dimension, decay and prior.
const (
	dim = 5
	// decay is the weight the fit keeps at each equation: about the last
	// 64 count.
	decay = 63.0 / 64
	// priorWeight is the prior's weight, in equations of typical size.
	priorWeight = 1.0
	// waitShare is the weight of one wait in WaitPer and KVWait, and of
	// one answer in the averages and Error.
	waitShare = 1.0 / 16
	// priorUncached and priorOutput are the request the priors of WaitPer
	// and KVWait assume, until answers show the mean.
	priorUncached = 1000
	priorOutput   = 100
)

// priorTheta is the linear parameters' prior (see the package comment);
// priorScale the typical size of each regressor, which scales the prior's
// pull until the answers show their own.
var (
	priorTheta = [dim]float64{0.010, 1e-4, 1e-4, 0.020, 0}
	priorScale = [dim]float64{1, 1000, 1000, 100, 800}
)

// Model is one replica's service time, learned online. The zero value is
// a model with the prior, ready to use. Safe for concurrent use.
type Model struct {
	mu      sync.Mutex
	a       [dim][dim]float64 // decayed Σ w x xᵀ
	b       [dim]float64      // decayed Σ w x y
	n       float64           // decayed equation count
	samples int
	p       Params
	init    bool
	waits   int // waits learned into WaitPer
	kvWaits int
	// avgUncached and avgOutput are the recent means of the answers'.
	avgUncached, avgOutput float64
}

// Params returns the learned parameters.
func (m *Model) Params() Params {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.start()
	return m.p
}

// start sets the prior on a zero model. m.mu is held.
func (m *Model) start() {
	if !m.init {
		m.p, m.init = Prior(), true
		m.avgUncached, m.avgOutput = priorUncached, priorOutput
	}
}

// Observe learns from one answer. Samples with no time (Total ≤ 0) or a
// first token after the end teach nothing.
func (m *Model) Observe(s Sample) {
	if !(s.Total > 0) || s.TTFT > s.Total || s.TTFT < 0 || s.Uncached < 0 || s.Ahead < 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.start()
	m.samples++
	m.p.Samples = m.samples
	if m.samples == 1 { // the prior's request is no engine's: the first answer replaces it
		m.avgUncached, m.avgOutput = s.Uncached, float64(s.Output)
	}
	m.avgUncached += waitShare * (s.Uncached - m.avgUncached)
	m.avgOutput += waitShare * (float64(s.Output) - m.avgOutput)
	if s.TTFT > 0 && s.Predicted > 0 {
		e := math.Abs(math.Log(s.TTFT / s.Predicted))
		if m.p.Errors == 0 {
			m.p.Error = e
		} else {
			m.p.Error += waitShare * (e - m.p.Error)
		}
		m.p.Errors++
	}
	out := float64(max(s.Output-1, 0))
	decode := [dim]float64{0, 0, 0, out, out * s.Batch}
	if s.Queued > 0 || s.KVShort {
		m.learnWait(s, decode)
		return
	}
	if s.TTFT > 0 {
		m.add([dim]float64{1, s.Uncached, s.Ahead, 0, 0}, s.TTFT)
		if out > 0 {
			m.add(decode, s.Total-s.TTFT)
		}
	} else {
		m.add([dim]float64{1, s.Uncached, s.Ahead, out, out * s.Batch}, s.Total)
	}
	m.solve()
}

// learnWait moves WaitPer (a request that waited for a slot) or KVWait
// (one that waited for KV room only) toward the wait s met beyond the
// linear model's time. m.mu is held.
func (m *Model) learnWait(s Sample, decode [dim]float64) {
	p := &m.p
	busy := p.Prefill(s.Uncached, s.Ahead)
	if s.TTFT > 0 {
		busy = s.TTFT - busy
	} else {
		busy = s.Total - busy - dot(decode, p.theta())
	}
	wait := max(busy, 0)
	switch {
	case s.Queued > 0:
		if s.KVShort {
			wait = max(wait-p.KVWait, 0)
		}
		per := wait / s.Queued
		if m.waits == 0 {
			p.WaitPer = (p.waitPer(s.Slots) + per) / 2
		} else {
			p.WaitPer += waitShare * (per - p.WaitPer)
		}
		m.waits++
	default:
		if m.kvWaits == 0 {
			p.KVWait = (p.KVWait + wait) / 2
		} else {
			p.KVWait += waitShare * (wait - p.KVWait)
		}
		m.kvWaits++
	}
}

// add adds the equation x·θ = y to the fit. m.mu is held.
func (m *Model) add(x [dim]float64, y float64) {
	for i := range dim {
		m.b[i] = decay*m.b[i] + x[i]*y
		for j := range dim {
			m.a[i][j] = decay*m.a[i][j] + x[i]*x[j]
		}
	}
	m.n = decay*m.n + 1
}

// solve sets the linear parameters to the fit's, pulled toward the prior:
// (A + R) θ = b + R θ₀, R the prior's weight times each regressor's mean
// square (or its typical size before any), each parameter at least 0.
// The waits' priors follow the fit until waits were seen. m.mu is held.
func (m *Model) solve() {
	var a [dim][dim + 1]float64
	for i := range dim {
		scale := priorScale[i] * priorScale[i]
		if m.n > 0 && m.a[i][i] > 0 {
			scale = max(m.a[i][i]/m.n, 1e-12)
		}
		r := priorWeight * scale
		for j := range dim {
			a[i][j] = m.a[i][j]
		}
		a[i][i] += r
		a[i][dim] = m.b[i] + r*priorTheta[i]
	}
	theta, ok := gauss(&a)
	if !ok {
		return
	}
	p := &m.p
	p.Overhead, p.PerToken, p.PerAhead = max(theta[0], 0), max(theta[1], 0), max(theta[2], 0)
	p.PerOutput, p.PerOutputBatch = max(theta[3], 0), max(theta[4], 0)
	p.Uncached, p.Output = m.avgUncached, m.avgOutput
	p.Run = p.run(p.Uncached, p.Output, 1)
	if m.kvWaits == 0 {
		p.KVWait = p.Run / 2
	}
}

func (p *Params) theta() [dim]float64 {
	return [dim]float64{p.Overhead, p.PerToken, p.PerAhead, p.PerOutput, p.PerOutputBatch}
}

func dot(x, y [dim]float64) float64 {
	s := 0.0
	for i := range dim {
		s += x[i] * y[i]
	}
	return s
}

// gauss solves the augmented system a by Gaussian elimination with partial
// pivoting; false when it is singular.
func gauss(a *[dim][dim + 1]float64) ([dim]float64, bool) {
	var x [dim]float64
	for c := range dim {
		p := c
		for r := c + 1; r < dim; r++ {
			if math.Abs(a[r][c]) > math.Abs(a[p][c]) {
				p = r
			}
		}
		if !(math.Abs(a[p][c]) > 1e-300) {
			return x, false
		}
		a[c], a[p] = a[p], a[c]
		for r := c + 1; r < dim; r++ {
			f := a[r][c] / a[c][c]
			for k := c; k <= dim; k++ {
				a[r][k] -= f * a[c][k]
			}
		}
	}
	for r := dim - 1; r >= 0; r-- {
		s := a[r][dim]
		for k := r + 1; k < dim; k++ {
			s -= a[r][k] * x[k]
		}
		x[r] = s / a[r][r]
	}
	return x, true
}
