package main

// The decision log under a router serving real sockets: its directory
// removed and recreated mid-run, and replay of a log with a torn line.

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/internal/testwait"
)

// metricValue returns the value of the unlabelled sample name in scraped; a
// counter not exported counts as 0, so that a router that does not count
// failures fails on the counts, not on the metric's name.
func metricValue(t *testing.T, scraped, name string) int64 {
	t.Helper()
	for _, line := range strings.Split(scraped, "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == name {
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return int64(v)
		}
	}
	t.Logf("no %s in /metrics: taken as 0", name)
	return 0
}

type dlCounts struct{ written, dropped, failed int64 }

func scrapeDecisionLog(t *testing.T, base string) dlCounts {
	t.Helper()
	s := scrapeURL(t, base)
	return dlCounts{
		metricValue(t, s, "semroute_decision_log_lines_written_total"),
		metricValue(t, s, "semroute_decision_log_lines_dropped_total"),
		metricValue(t, s, "semroute_decision_log_lines_failed_total"),
	}
}

// waitDecisionsCounted polls /metrics until every one of routed decisions
// is counted written, dropped or failed.
func waitDecisionsCounted(t *testing.T, base string, routed int64) dlCounts {
	t.Helper()
	return testwait.Value(t, fmt.Sprint(routed, " routed decisions counted"), func() (dlCounts, bool) {
		c := scrapeDecisionLog(t, base)
		if c.written+c.dropped+c.failed > routed {
			t.Fatalf("decision log counts %+v, sum %d, more than %d routed requests", c, c.written+c.dropped+c.failed, routed)
		}
		return c, c.written+c.dropped+c.failed == routed
	})
}

func readDecisions(t *testing.T, path string) []*decisionlog.Record {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var recs []*decisionlog.Record
	if err := decisionlog.Read(bytes.NewReader(b), func(r *decisionlog.Record) error { recs = append(recs, r); return nil }); err != nil {
		t.Fatal(err)
	}
	return recs
}

func TestDecisionLogE2EDirectoryRemovedAndRecreated(t *testing.T) {
	sims := startSims(t, 2, fastSim)
	dir := t.TempDir()
	logDir := filepath.Join(dir, "logs")
	if err := os.Mkdir(logDir, 0o755); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(logDir, "decisions.jsonl")
	cfg := filepath.Join(dir, "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("decision_log: {path: %q, fsync_interval: 20ms}\nreplicas:\n  - {name: a, url: %q}\n  - {name: b, url: %q}\n",
		logPath, sims[0].URL, sims[1].URL))
	r := serveConfig(t, cfg)
	base := r.http.URL()
	var routed int64
	send := func(phase string, n int) {
		t.Helper()
		for i := 0; i < n; i++ {
			code, _, err := postURL(base, chat([2]string{"system", text("decision log "+phase, 200)}, [2]string{"user", fmt.Sprint(phase, i)}), nil)
			if err != nil || code != 200 {
				t.Fatalf("%s request %d: %d %v", phase, i, code, err)
			}
			routed++
		}
	}

	send("before", 20)
	c := waitDecisionsCounted(t, base, routed)
	if c.written != 20 || len(readDecisions(t, logPath)) != 20 {
		t.Fatalf("before: counts %+v", c)
	}

	if err := os.RemoveAll(logDir); err != nil {
		t.Fatal(err)
	}
	send("gone", 20)
	c = waitDecisionsCounted(t, base, routed)
	if c.written != 20 || c.failed != 20 || c.dropped != 0 {
		t.Fatalf("with the directory gone: counts %+v, want 20 written and 20 failed", c)
	}

	if err := os.Mkdir(logDir, 0o755); err != nil {
		t.Fatal(err)
	}
	// The writer retries about once a second: keep sending until lines
	// appear in the new file.
	c = testwait.Value(t, "a line written after the directory came back", func() (dlCounts, bool) {
		send("after", 5)
		c := scrapeDecisionLog(t, base)
		return c, c.written > 20
	})
	send("after", 10)
	c = waitDecisionsCounted(t, base, routed)
	recs := readDecisions(t, logPath)
	if int64(len(recs)) != c.written-20 || len(recs) < 10 {
		t.Fatalf("new file has %d records, metrics %+v (20 written before)", len(recs), c)
	}
	for _, rec := range recs {
		if rec.Outcome == nil || rec.Outcome.Status != 200 || len(rec.Blocks) == 0 {
			t.Fatalf("record %+v", rec)
		}
	}

	// After shutdown the invariant holds exactly, and the log, with a torn
	// last line appended, still replays.
	if err := r.stop(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	if c = scrapeDecisionLogOf(t, r); c.written+c.dropped+c.failed != routed {
		t.Fatalf("after stop: counts %+v, routed %d", c, routed)
	}
	b, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	first := b[:bytes.IndexByte(b, '\n')]
	torn := filepath.Join(dir, "torn.jsonl")
	if err := os.WriteFile(torn, append(b, first[:len(first)/2]...), 0o600); err != nil {
		t.Fatal(err)
	}
	out := runCLI(t, "replay", "--format", "decisions", "--trace", torn, "--policies", "semantic,round_robin", "--out", filepath.Join(dir, "rep"))
	if want := fmt.Sprintf("%d requests (decisions format)", len(recs)); !strings.Contains(out, want) {
		t.Fatalf("replay output lacks %q:\n%s", want, out)
	}
}

// scrapeDecisionLogOf reads the counters from the stopped router's writer.
func scrapeDecisionLogOf(t *testing.T, r *running) dlCounts {
	t.Helper()
	dl := r.app.decisions
	if dl == nil {
		t.Fatal("no decision log")
	}
	return dlCounts{dl.Written(), dl.Dropped(), dl.Failed()}
}

func TestDecisionLogReplayTornLastLine(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "d.jsonl")
	w, err := decisionlog.Open(decisionlog.Options{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 6; i++ {
		w.Log(&decisionlog.Record{TimeNs: int64(i) * 1e6, ID: fmt.Sprint("r", i), Arm: "default", Policy: "semantic",
			Key: fmt.Sprintf("%016x", i%2), Tokens: 128, Chosen: "a", Replicas: []string{"a", "b"}, Budgets: []int64{1 << 20, 1 << 20},
			Blocks:  []decisionlog.Block{{Hash: "00000000000000aa", Kind: "system", Tokens: 64}, {Hash: fmt.Sprintf("%016x", 100+i), Kind: "user_query", Tokens: 64}},
			Outcome: &decisionlog.Outcome{Status: 200, TTFTNs: 1e6, DurationNs: 2e6, PromptTokens: 128, OutputTokens: 4, Replica: "a"}})
	}
	if err := w.Close(); err != nil || w.Written() != 6 {
		t.Fatalf("written %d: %v", w.Written(), err)
	}
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"time_ns":7000000,"id":"r7","arm":"default","policy":"sem`) // the disk filled here
	f.Close()
	out := runCLI(t, "replay", "--format", "decisions", "--trace", path, "--policies", "semantic", "--out", filepath.Join(dir, "rep"))
	if !strings.Contains(out, "6 requests (decisions format)") {
		t.Fatalf("output:\n%s", out)
	}
}
