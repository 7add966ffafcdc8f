package main

import (
	"context"
	"testing"
)

// TestThirdPartyRestartSeenInEventsFirst: a replica's engine restarted and
// requests reached the new one before any scrape of its metrics: its
// events show the restart first (their sequence starts over), and its
// picture is cleared and rebuilt from them. The next scrape shows it too
// (its counters went back), and the picture rebuilt is kept: one clear, no
// orphans. (Checks and scrapes are an hour apart: the test scrapes.)
func TestThirdPartyRestartSeenInEventsFirst(t *testing.T) {
	reps := startThirdParty(t, tpOptions{n: 2, events: true})
	r := startRouterYAML(t, "health:\n  check_interval: 1h\n  scrape_interval: 1h\n"+tpConfig(reps, true, ""))
	waitBudgets(t, r, 2, 768*16)
	work := tpWork(140)
	if run := sendTruth(r.url, work[:100], 8, nil); run.errors > 0 {
		t.Fatalf("%d requests failed: %s", run.errors, run.firstErr)
	}
	rep, _ := r.app.core.Engine().Pool().Get("tp-1")
	f := r.app.events.follower(rep.ID)
	r.app.monitor.Scrape(context.Background(), rep) // the old engine's counters
	reps[1].restart(t)
	if run := sendTruth(r.url, work[100:], 4, nil); run.errors > 0 {
		t.Fatalf("%d requests failed: %s", run.errors, run.firstErr)
	}
	seen := f.Stats()
	r.app.monitor.Scrape(context.Background(), rep)
	st := f.Stats()
	stored := metric(t, r.url, "semroute_kv_events_blocks_total", `event="stored",replica="tp-1"`)
	orphans := metric(t, r.url, "semroute_kv_events_blocks_total", `event="orphan",replica="tp-1"`)
	t.Logf("tp-1: %d clears, restarts seen in its events %d, in its metrics %d (kept %d); %.0f blocks stored, %.0f orphans",
		st.Cleared, st.Subscriber.Restarts, st.Restarts, st.Kept, stored, orphans)
	if seen.Subscriber.Restarts != 1 || seen.Cleared != 1 || st.Restarts != 1 {
		t.Fatalf("the restart was not seen in the events first, then in the metrics: before the scrape %+v, after %+v", seen, st)
	}
	if st.Cleared != 1 || st.Kept != 1 || orphans > stored/100 || st.Tracked != seen.Tracked {
		t.Fatalf("one restart: %d clears, %.0f orphans of %.0f blocks stored, %d blocks tracked after the scrape, %d before",
			st.Cleared, orphans, stored, st.Tracked, seen.Tracked)
	}
}
