// Package testwait is the tests' one way to wait for what another
// goroutine, a server or a child process brings about: poll a condition,
// with a short backoff, until it holds or a generous deadline passes.
//
// A test waits for a state, never for a duration: a sleep that "should be
// enough" is a race that a loaded machine (two cores, -race, several
// packages at once) loses. The deadline is only the bound past which the
// state is not coming; reaching it is the failure, not slowness.
package testwait

import (
	"testing"
	"time"
)

// Deadline is how long Until and Value poll before they fail the test.
const Deadline = 30 * time.Second

// The backoff between two polls: from minPause, doubling, to maxPause.
// Short, because the conditions are cheap and the waits are on the tests'
// critical path; capped, so that one that reads /metrics does not spin.
const (
	minPause = time.Millisecond
	maxPause = 20 * time.Millisecond
)

// Until polls cond until it returns true. If it has not by Deadline, it
// fails t with "timed out after 30s waiting for " and what. cond runs on the
// caller's goroutine, so it may itself call t.Fatal when what it sees can
// no longer become true. Call Until from the test's goroutine.
func Until(t testing.TB, what string, cond func() bool) {
	t.Helper()
	until(t, Deadline, what, cond)
}

func until(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Within(d, cond) {
		t.Fatalf("timed out after %v waiting for %s", d, what)
	}
}

// Value polls get until it reports ok and returns the value it got then.
// If it has not by Deadline, it fails t with what and the last value, so
// that the failure says where the state was stuck.
func Value[T any](t testing.TB, what string, get func() (T, bool)) T {
	t.Helper()
	return value(t, Deadline, what, get)
}

func value[T any](t testing.TB, d time.Duration, what string, get func() (T, bool)) T {
	t.Helper()
	var last T
	if !Within(d, func() bool {
		var ok bool
		last, ok = get()
		return ok
	}) {
		t.Fatalf("timed out after %v waiting for %s; last saw %+v", d, what, last)
	}
	return last
}

// Within polls cond until it returns true or d has passed, and reports
// whether it held. It is the one polling loop: Until and Value are it with
// Deadline and a failure. Use it directly only where the caller does
// something else than fail with what it waited for: it reports more (a
// log, a goroutine dump), goes on another way (starts a process again),
// or may not fail from its goroutine (a fake server's handler).
func Within(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for pause := minPause; ; pause = min(2*pause, maxPause) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(pause)
	}
}
