package agreement

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"
)

type change struct {
	replica string
	cause   Cause
	on      bool
}

func tracker(now *time.Time) (*Tracker, *[]change) {
	var got []change
	t := New(Options{Now: func() time.Time { return *now }, OnChange: func(r string, c Cause, on bool, _ string) {
		got = append(got, change{r, c, on})
	}})
	return t, &got
}

// A replica whose /tokenize fails on every call is not asked, but once
// per Retry, and is asked again once it answers.
func TestTokenizeFailing(t *testing.T) {
	now := time.Unix(1000, 0)
	tr, got := tracker(&now)
	for range 7 {
		tr.Tokenized("a", errors.New("json: cannot unmarshal"))
	}
	if !tr.TokenizerOK("a") || len(*got) != 0 {
		t.Fatal("judged before MinCalls")
	}
	tr.Tokenized("a", errors.New("json: cannot unmarshal"))
	if tr.TokenizerOK("a") || len(*got) != 1 || (*got)[0] != (change{"a", TokenizeFailing, true}) {
		t.Fatalf("after 8 failures: ok %v, changes %v", tr.TokenizerOK("a"), *got)
	}
	if !tr.TokenizerOK("b") {
		t.Fatal("another replica is judged by a's calls")
	}
	now = now.Add(31 * time.Second)
	if !tr.TokenizerOK("a") || tr.TokenizerOK("a") {
		t.Fatal("a failing tokenizer is not tried exactly once per Retry")
	}
	tr.Tokenized("a", nil)
	if !tr.TokenizerOK("a") || (*got)[1] != (change{"a", TokenizeFailing, false}) {
		t.Fatalf("an answer did not clear it: %v", *got)
	}
	if s := tr.Status(); len(s) != 1 || s[0].Tokenizer != "ok" || len(s[0].Causes) != 0 {
		t.Fatalf("%+v", s)
	}
}

// Token counts that disagree with what the engine bills, and predictions
// off by more than the tolerance, are each a cause; agreeing ones are not.
func TestFinished(t *testing.T) {
	now := time.Unix(1000, 0)
	tr, got := tracker(&now)
	for range 64 {
		tr.Finished("good", true, 500, 500, 320, 320, true)
		tr.Finished("uint32", true, 500, 760, 0, 320, true) // its tokens are not the engine's
		tr.Finished("over", false, 500, 500, 400, 320, true)
	}
	st := map[string]Status{}
	for _, s := range tr.Status() {
		st[s.Replica] = s
	}
	if len(st["good"].Causes) != 0 || st["good"].PredictedRatio != 1 || st["good"].TokenAgreement != 1 {
		t.Fatalf("good: %+v", st["good"])
	}
	if c := st["uint32"].Causes; len(c) != 2 || c[0] != TokensDisagree || c[1] != PredictionsOff || tr.TokenizerOK("uint32") {
		t.Fatalf("uint32: %+v", st["uint32"])
	}
	if c := st["over"].Causes; len(c) != 1 || c[0] != PredictionsOff || st["over"].PredictedRatio != 1.25 {
		t.Fatalf("over: %+v", st["over"])
	}
	if len(*got) != 3 {
		t.Fatalf("changes %v: each cause is told once when it starts", *got)
	}
}

func TestEvents(t *testing.T) {
	now := time.Unix(1000, 0)
	tr, _ := tracker(&now)
	tr.Events("a", 10, 600, 0, true, true)
	tr.Events("b", 600, 10, 0, false, true)
	tr.Events("c", 0, 0, 0, false, false)
	tr.Events("d", 0, 0, 40, true, true) // block_tokens 32 against an engine's 16
	st := tr.Status()
	if len(st[0].Causes) != 1 || st[0].Causes[0] != EventOrphans || len(st[1].Causes) != 1 || st[1].Causes[0] != EventsSilent ||
		len(st[2].Causes) != 0 || len(st[3].Causes) != 1 || st[3].Causes[0] != EventsUnusable {
		t.Fatalf("%+v", st)
	}
	tr.Events("d", 640, 0, 0, true, true) // fixed
	if st := tr.Status(); len(st[3].Causes) != 0 {
		t.Fatalf("%+v", st[3])
	}
}

// TestTimeOff: a replica whose times to first token are twice and more
// what the router predicted is told as time_off, with the figures, and
// is cleared once the predictions agree again.
func TestTimeOff(t *testing.T) {
	var told []string
	tr := New(Options{Window: 16, MinRequests: 8, OnChange: func(r string, c Cause, on bool, d string) {
		told = append(told, fmt.Sprint(r, " ", c, " ", on))
	}})
	for range 8 {
		tr.Timed("a", 0.1, 0.25) // 2.5× slower than predicted
		tr.Timed("b", 0.1, 0.11)
	}
	tr.Timed("a", 0, 1) // no prediction: nothing
	st := map[string]Status{}
	for _, s := range tr.Status() {
		st[s.Replica] = s
	}
	if !slices.Contains(st["a"].Causes, TimeOff) || slices.Contains(st["b"].Causes, TimeOff) {
		t.Fatalf("causes: a %v, b %v", st["a"].Causes, st["b"].Causes)
	}
	if r := st["a"].TTFTRatio; math.Abs(r-0.4) > 1e-9 {
		t.Fatalf("a's predicted ÷ observed: %v", r)
	}
	for range 16 {
		tr.Timed("a", 0.1, 0.1)
	}
	if want := []string{"a time_off true", "a time_off false"}; !slices.Equal(told, want) {
		t.Fatalf("told %v, want %v", told, want)
	}
}
