package testwait

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	var n atomic.Int32
	go func() {
		for range 3 {
			n.Add(1)
		}
	}()
	Until(t, "three increments", func() bool { return n.Load() == 3 })
}

func TestValueReturnsTheValueThatSatisfied(t *testing.T) {
	polls := 0
	got := Value(t, "the fifth poll", func() (int, bool) {
		polls++
		return polls, polls == 5
	})
	if got != 5 {
		t.Fatalf("Value returned %d, want 5", got)
	}
}

func TestWithinGivesUpAfterItsBound(t *testing.T) {
	polls := 0
	if Within(10*time.Millisecond, func() bool { polls++; return false }) {
		t.Fatal("Within reported a condition that never held")
	}
	if polls < 2 {
		t.Fatalf("Within polled %d times in its bound, want at least 2 (one at the start, one at the end)", polls)
	}
}

// fatalRecorder is a testing.TB whose Fatalf records the message instead
// of ending the test, to read what Until and Value say when they give up.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}
func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
}

func TestAFailureSaysWhatItWaitedForAndWhereItStuck(t *testing.T) {
	r := &fatalRecorder{TB: t}
	until(r, time.Millisecond, "the moon", func() bool { return false })
	if !strings.Contains(r.msg, "waiting for the moon") {
		t.Errorf("Until's failure %q does not name what it waited for", r.msg)
	}
	r.msg = ""
	value(r, time.Millisecond, "seven", func() (int, bool) { return 6, false })
	if !strings.Contains(r.msg, "waiting for seven") || !strings.Contains(r.msg, "last saw 6") {
		t.Errorf("Value's failure %q does not name what it waited for and the last value", r.msg)
	}
}
