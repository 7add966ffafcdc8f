// Package agreement watches, replica by replica, whether what the router
// believes about an engine agrees with what the engine itself reports: its
// /tokenize answers against the prompt_tokens it bills, the cached tokens
// the router predicted against those it reports, the blocks its KV events
// store against the parents they name. When they disagree it says so
// (Status, OnChange: a warning naming the replica and the cause) and
// answers whether a source is still to be used (TokenizerOK), so the router
// falls back to the best mode that works for that replica instead of
// routing silently on a wrong picture, the most reported failure of precise
// routers (llm-d #2513 and #1861, production-stack #1045).
//
// A Tracker is safe for concurrent use.
package agreement

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"
)

// Cause is one way a replica's sources disagree with the engine.
type Cause string

// The causes, as they appear in logs, metrics and the admin API.
const (
	// TokenizeFailing: every recent /tokenize call to the replica failed
	// or was slow. Its tokenizer is not asked until it answers again.
	TokenizeFailing Cause = "tokenize_failing"
	// TokensDisagree: the prompt_tokens the replica reports differ from the
	// /tokenize count for many of its requests: the router's tokens are not
	// the engine's, and precise keys would never match its cache.
	TokensDisagree Cause = "tokens_disagree"
	// PredictionsOff: the cached tokens the router predicted for its recent
	// requests are off by more than the tolerance from what it reported.
	PredictionsOff Cause = "predictions_off"
	// EventOrphans: most blocks its KV events stored named a parent the
	// router never saw, so they could not be keyed.
	EventOrphans Cause = "events_orphans"
	// EventsSilent: its KV events went silent while requests were routed
	// there; its picture is the approximate one.
	EventsSilent Cause = "events_silent"
	// EventsUnusable: most of its stored-block events could not be applied:
	// a block size other than tokenizer.block_tokens (vLLM's --block-size),
	// or token ids that do not fill their blocks.
	EventsUnusable Cause = "events_unusable"
	// TimeOff: the times to first token the router predicted for its
	// recent streamed requests (its service-time model) are off from those
	// it took by more than a factor of TimeTolerance, on the mean of their
	// logs: routing in seconds misjudges it.
	TimeOff Cause = "time_off"
)

// Causes lists every cause, in a fixed order.
var Causes = []Cause{TokenizeFailing, TokensDisagree, PredictionsOff, EventOrphans, EventsSilent, EventsUnusable, TimeOff}

// Options configure a Tracker. The zero value uses the defaults.
type Options struct {
	// Window is how many recent requests per replica are judged. Default 64.
	Window int
	// MinRequests is how many of them must have reported cached tokens (or
	// been tokenized) before a judgement. Default 16.
	MinRequests int
	// Tolerance is the predicted ÷ reported cached tokens band, ±. Default 0.10.
	Tolerance float64
	// TimeTolerance is the factor by which predicted and observed times to
	// first token may differ, on the mean of |log(observed ÷ predicted)|
	// over the window, before TimeOff. Default 2.
	TimeTolerance float64
	// MinCalls is how many /tokenize calls in a row must fail. Default 8.
	MinCalls int
	// Retry is how long a failing tokenizer rests before one call tries it
	// again. Default 30s.
	Retry time.Duration
	// OnChange hears every cause that starts or ends on a replica, with
	// the figures behind it (for the log). May be nil.
	OnChange func(replica string, c Cause, on bool, detail string)
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Status is one replica's judgement.
type Status struct {
	Replica string `json:"replica"`
	// Causes are the disagreements now, empty when all agree.
	Causes []Cause `json:"causes"`
	// PredictedRatio is predicted ÷ reported cached tokens over the window
	// (0 before any reported hit).
	PredictedRatio float64 `json:"predicted_ratio"`
	// Requests is how many requests the window holds.
	Requests int `json:"requests"`
	// Finished counts every request it served since the Tracker knew it.
	Finished uint64 `json:"finished"`
	// TTFTRatio is predicted ÷ observed time to first token over the
	// window's streamed requests (0 before any), and TTFTError the mean of
	// |log(observed ÷ predicted)| over them: 0.1 is about 10% off.
	TTFTRatio float64 `json:"ttft_predicted_ratio"`
	TTFTError float64 `json:"ttft_log_error"`
	// TokenAgreement is the share of its tokenized requests whose
	// prompt_tokens matched the /tokenize count (1 before any).
	TokenAgreement float64 `json:"token_agreement"`
	// Tokenizer is "ok", "failing" or "disagrees".
	Tokenizer string `json:"tokenizer"`
}

type request struct {
	precise              bool
	tokens, prompt       int
	predicted, reported  int
	reportedCachedTokens bool
}

type replica struct {
	finished uint64
	reqs     []request // ring of the last Window
	next     int
	sums     sums    // over reqs
	times    []timed // ring of the last Window streamed requests' times
	timeNext int
	timeSums timed  // over times
	calls    []bool // ring of the last MinCalls /tokenize results, true ok
	callNext int
	callN    int
	on       map[Cause]bool
	retryAt  time.Time
}

// timed is one request's predicted and observed time to first token,
// seconds, and the |log| of their ratio; as a sum, the window's.
type timed struct{ pred, obs, logErr float64 }

// sums are the window's totals, kept as requests enter and leave it.
type sums struct {
	pred, rep, hits, tok, agree int
}

// add adds q to the totals (sign 1) or takes it out (sign -1).
func (s *sums) add(q request, sign int) {
	if q.reportedCachedTokens {
		s.pred += sign * q.predicted
		s.rep += sign * q.reported
		if q.reported > 0 {
			s.hits += sign
		}
	}
	if q.precise {
		s.tok += sign
		if d := q.tokens - q.prompt; max(d, -d) <= max(1, q.prompt/100) {
			s.agree += sign
		}
	}
}

// note is a cause that flipped, told to OnChange after the lock.
type note struct {
	cause  Cause
	on     bool
	detail string
}

// Tracker judges every replica's sources. Safe for concurrent use.
type Tracker struct {
	o  Options
	mu sync.Mutex
	by map[string]*replica
}

// New returns a Tracker.
func New(o Options) *Tracker {
	if o.Window <= 0 {
		o.Window = 64
	}
	if o.MinRequests <= 0 {
		o.MinRequests = 16
	}
	if o.Tolerance <= 0 {
		o.Tolerance = 0.10
	}
	if o.TimeTolerance <= 1 {
		o.TimeTolerance = 2
	}
	if o.MinCalls <= 0 {
		o.MinCalls = 8
	}
	if o.Retry <= 0 {
		o.Retry = 30 * time.Second
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Tracker{o: o, by: map[string]*replica{}}
}

func (t *Tracker) get(name string) *replica {
	r := t.by[name]
	if r == nil {
		r = &replica{on: map[Cause]bool{}, calls: make([]bool, t.o.MinCalls)}
		t.by[name] = r
	}
	return r
}

// set records cause c on r with t.mu held, appending to notes when it
// flips; tell gives them to OnChange once the lock is released.
func set(notes []note, r *replica, c Cause, on bool, detail func() string) []note {
	if r.on[c] == on {
		return notes
	}
	r.on[c] = on
	return append(notes, note{c, on, detail()})
}

func (t *Tracker) tell(name string, notes []note) {
	if t.o.OnChange == nil {
		return
	}
	for _, n := range notes {
		t.o.OnChange(name, n.cause, n.on, n.detail)
	}
}

// Tokenized records one /tokenize call to the replica: err nil if it
// answered in time.
func (t *Tracker) Tokenized(name string, err error) {
	t.mu.Lock()
	r := t.get(name)
	r.calls[r.callNext] = err == nil
	r.callNext = (r.callNext + 1) % len(r.calls)
	r.callN = min(r.callN+1, len(r.calls))
	failing := r.callN == len(r.calls) && !slices.Contains(r.calls, true)
	if failing && !r.on[TokenizeFailing] {
		r.retryAt = t.o.Now().Add(t.o.Retry)
	}
	var buf [1]note
	notes := set(buf[:0], r, TokenizeFailing, failing, func() string {
		if err != nil {
			return "its last calls failed or were slow: " + err.Error()
		}
		return "its last calls failed or were slow"
	})
	t.mu.Unlock()
	t.tell(name, notes)
}

// TokenizerOK reports whether the replica's /tokenize is to be asked: not
// while it fails (but once per Retry, to see if it answers again), nor
// while its counts disagree with what its engine bills.
func (t *Tracker) TokenizerOK(name string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.by[name]
	if r == nil {
		return true
	}
	if r.on[TokenizeFailing] || r.on[TokensDisagree] {
		if now := t.o.Now(); now.After(r.retryAt) {
			r.retryAt = now.Add(t.o.Retry)
			return true
		}
		return false
	}
	return true
}

// Finished records a request the replica served and reported usage for:
// whether it was routed on tokens from /tokenize and how many, the
// prompt_tokens the engine billed, the cached tokens the router predicted,
// and those the engine reported (when it reports them).
func (t *Tracker) Finished(name string, precise bool, tokens, prompt, predicted, reported int, reportedCached bool) {
	t.mu.Lock()
	r := t.get(name)
	r.finished++
	q := request{precise, tokens, prompt, predicted, reported, reportedCached}
	if len(r.reqs) < t.o.Window {
		r.reqs = append(r.reqs, q)
	} else {
		r.sums.add(r.reqs[r.next], -1)
		r.reqs[r.next] = q
		r.next = (r.next + 1) % t.o.Window
	}
	r.sums.add(q, 1)
	st := r.status(name)
	disagree := r.sums.tok >= t.o.MinRequests && st.TokenAgreement < 0.75
	if disagree && !r.on[TokensDisagree] {
		r.retryAt = t.o.Now().Add(t.o.Retry)
	}
	var buf [2]note
	notes := set(buf[:0], r, TokensDisagree, disagree, func() string {
		return "the prompt_tokens it reports differ from the /tokenize count for most requests: the router's tokens are not its engine's"
	})
	off := r.sums.hits >= t.o.MinRequests && (st.PredictedRatio < 1-t.o.Tolerance || st.PredictedRatio > 1+t.o.Tolerance)
	notes = set(notes, r, PredictionsOff, off, func() string { return "predicted ÷ reported cached tokens is outside the tolerance" })
	t.mu.Unlock()
	t.tell(name, notes)
}

// Timed records the time to first token the router predicted for a
// streamed request the replica served, and the one it took, in seconds.
// Either not above 0 records nothing.
func (t *Tracker) Timed(name string, predicted, observed float64) {
	if !(predicted > 0) || !(observed > 0) {
		return
	}
	q := timed{predicted, observed, math.Abs(math.Log(observed / predicted))}
	t.mu.Lock()
	r := t.get(name)
	if len(r.times) < t.o.Window {
		r.times = append(r.times, q)
	} else {
		old := r.times[r.timeNext]
		r.timeSums = timed{r.timeSums.pred - old.pred, r.timeSums.obs - old.obs, r.timeSums.logErr - old.logErr}
		r.times[r.timeNext] = q
		r.timeNext = (r.timeNext + 1) % t.o.Window
	}
	r.timeSums = timed{r.timeSums.pred + q.pred, r.timeSums.obs + q.obs, r.timeSums.logErr + q.logErr}
	st := r.status(name)
	var buf [1]note
	off := len(r.times) >= t.o.MinRequests && st.TTFTError > math.Log(t.o.TimeTolerance)
	notes := set(buf[:0], r, TimeOff, off, func() string {
		return fmt.Sprintf("predicted time to first token is off by a factor of %.2f on average (predicted ÷ observed %.2f over %d requests): its service-time model misjudges it", math.Exp(st.TTFTError), st.TTFTRatio, len(r.times))
	})
	t.mu.Unlock()
	t.tell(name, notes)
}

// Events records the state of the replica's KV events since the last
// call: blocks stored and orphaned, stored-block events skipped as
// unusable, whether batches came (live) and whether requests were routed
// there.
func (t *Tracker) Events(name string, stored, orphans, skipped uint64, live, routed bool) {
	t.mu.Lock()
	r := t.get(name)
	var buf [3]note
	notes := buf[:0]
	if skipped >= 8 {
		// An event holds a chain of blocks: compare events with events.
		notes = set(notes, r, EventsUnusable, skipped > stored/16, func() string {
			return "its stored-block events could not be applied: is tokenizer.block_tokens its engine's --block-size?"
		})
	} else if stored >= 64 {
		notes = set(notes, r, EventsUnusable, false, func() string { return "" })
	}
	if stored+orphans >= 64 {
		notes = set(notes, r, EventOrphans, orphans*2 > stored+orphans, func() string {
			return "most stored blocks named a parent the router never saw: the events do not describe the engine's cache as the router keys it"
		})
	}
	notes = set(notes, r, EventsSilent, !live && routed, func() string {
		return "no KV event batches while requests were routed there: its picture is the approximate one"
	})
	t.mu.Unlock()
	t.tell(name, notes)
}

// status is the replica's figures, from the window's totals.
func (r *replica) status(name string) Status {
	s := Status{Replica: name, Requests: len(r.reqs), Finished: r.finished, TokenAgreement: 1, Tokenizer: "ok"}
	if r.sums.rep > 0 {
		s.PredictedRatio = float64(r.sums.pred) / float64(r.sums.rep)
	}
	if r.sums.tok > 0 {
		s.TokenAgreement = float64(r.sums.agree) / float64(r.sums.tok)
	}
	if n := len(r.times); n > 0 && r.timeSums.obs > 0 {
		s.TTFTRatio = r.timeSums.pred / r.timeSums.obs
		s.TTFTError = max(r.timeSums.logErr, 0) / float64(n)
	}
	return s
}

// Status returns every replica's judgement, by name.
func (t *Tracker) Status() []Status {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Status, 0, len(t.by))
	for name, r := range t.by {
		s := r.status(name)
		s.Causes = []Cause{}
		for _, c := range Causes {
			if r.on[c] {
				s.Causes = append(s.Causes, c)
			}
		}
		switch {
		case r.on[TokenizeFailing]:
			s.Tokenizer = "failing"
		case r.on[TokensDisagree]:
			s.Tokenizer = "disagrees"
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Replica, b.Replica) })
	return out
}

// Forget drops a replica (removed from the pool).
func (t *Tracker) Forget(name string) {
	t.mu.Lock()
	delete(t.by, name)
	t.mu.Unlock()
}
