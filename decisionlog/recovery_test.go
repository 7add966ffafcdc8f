package decisionlog

// Tests of the writer's behaviour under write errors: counting, logging,
// recovery, torn lines, files replaced under it, failed rotations.

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testlog"

	"github.com/semroute/semroute/internal/testwait"
)

// fakeClock is a clock the test moves.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// Fault modes of faultyFS.
const (
	writeOK   = iota
	writeFull // every write fails with ENOSPC
	writeTear // the next write writes half its bytes, then the disk is full
)

// faultyFS opens real files whose writes fail as the test says.
type faultyFS struct {
	mu    sync.Mutex
	mode  int
	opens int
}

func (fs *faultyFS) set(mode int) {
	fs.mu.Lock()
	fs.mode = mode
	fs.mu.Unlock()
}

func (fs *faultyFS) openCount() int {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.opens
}

func (fs *faultyFS) open(path string) (file, error) {
	fs.mu.Lock()
	fs.opens++
	fs.mu.Unlock()
	f, err := openOS(path)
	if err != nil {
		return nil, err
	}
	return &faultyFile{File: f.(*os.File), fs: fs}, nil
}

type faultyFile struct {
	*os.File
	fs *faultyFS
}

func (f *faultyFile) Write(p []byte) (int, error) {
	f.fs.mu.Lock()
	mode := f.fs.mode
	if mode == writeTear {
		f.fs.mode = writeFull
	}
	f.fs.mu.Unlock()
	switch mode {
	case writeFull:
		return 0, syscall.ENOSPC
	case writeTear:
		n, err := f.File.Write(p[:len(p)/2])
		if err != nil {
			return n, err
		}
		return n, syscall.ENOSPC
	}
	return f.File.Write(p)
}

// logBuffer is a slog destination safe for the writer's goroutine.
type logBuffer struct{ testlog.Buffer }

func (l *logBuffer) lines() []string {
	return strings.Split(strings.TrimSpace(l.String()), "\n")
}

// settle waits until the writer has counted n records.
func settle(t *testing.T, w *Writer, n int64) {
	t.Helper()
	testwait.Value(t, fmt.Sprint(n, " records counted"), func() (string, bool) {
		return fmt.Sprintf("written %d + dropped %d + failed %d", w.Written(), w.Dropped(), w.Failed()), w.Written()+w.Dropped()+w.Failed() == n
	})
}

// logged logs n records with IDs prefix0, prefix1, … and returns n.
func logN(w *Writer, prefix string, n int) int64 {
	for i := 0; i < n; i++ {
		w.Log(&Record{ID: fmt.Sprint(prefix, i), Arm: "a", Blocks: []Block{{Hash: "00000000000000ff", Kind: "system", Tokens: 64}}})
	}
	return int64(n)
}

func readAll(t *testing.T, path string) (ids []string, warned []int) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	skipped, err := ReadWith(bytes.NewReader(b), ReadOptions{Warn: func(line int, err error) { warned = append(warned, line) }}, func(r *Record) error {
		ids = append(ids, r.ID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if skipped != len(warned) {
		t.Fatalf("skipped %d, warned %d", skipped, len(warned))
	}
	return ids, warned
}

func TestDecisionLogRecoversFromWriteErrors(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d.jsonl")
	fs, clk, logs := &faultyFS{}, newClock(), &logBuffer{}
	w, err := Open(Options{Path: path, FsyncInterval: time.Hour, Logger: slog.New(slog.NewTextHandler(logs, nil)),
		openFile: fs.open, now: clk.now, batchBytes: 1}) // a write per record
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	n += logN(w, "ok", 5)
	settle(t, w, n)

	fs.set(writeTear) // the disk fills in the middle of a line
	n += logN(w, "torn", 1)
	settle(t, w, n)
	n += logN(w, "full", 4) // no file: failed, and no reopening within a second
	settle(t, w, n)
	if got := fs.openCount(); got != 1 {
		t.Fatalf("%d opens within the retry interval, want 1", got)
	}
	clk.advance(11 * time.Second) // a retry is due, and a log line
	n += logN(w, "still-full", 1)
	settle(t, w, n)
	if got := fs.openCount(); got != 2 {
		t.Fatalf("%d opens after the retry interval, want 2", got)
	}
	n += logN(w, "full-again", 3)
	fs.set(writeOK) // space again, but no retry is due yet
	n += logN(w, "early", 2)
	settle(t, w, n)
	if w.Written() != 5 || w.Failed() != 11 || w.Dropped() != 0 {
		t.Fatalf("while failing: written %d failed %d dropped %d", w.Written(), w.Failed(), w.Dropped())
	}
	clk.advance(1500 * time.Millisecond)
	n += logN(w, "back", 10)
	settle(t, w, n)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if w.Written()+w.Dropped()+w.Failed() != n || w.Written() != 15 || w.Failed() != 11 {
		t.Fatalf("written %d + dropped %d + failed %d, logged %d", w.Written(), w.Dropped(), w.Failed(), n)
	}
	if got := fs.openCount(); got != 3 {
		t.Fatalf("%d opens, want 3", got)
	}

	ids, warned := readAll(t, path)
	want := []string{"ok0", "ok1", "ok2", "ok3", "ok4"}
	for i := 0; i < 10; i++ {
		want = append(want, fmt.Sprint("back", i))
	}
	if fmt.Sprint(ids) != fmt.Sprint(want) || fmt.Sprint(warned) != "[6]" {
		t.Fatalf("read %v, skipped lines %v", ids, warned)
	}
	b, _ := os.ReadFile(path)
	lines := strings.Split(string(b), "\n")
	if !strings.HasPrefix(lines[5], `{"time_ns":0,"id":"torn0"`) || !strings.HasPrefix(lines[6], `{"time_ns":0,"id":"back0"`) {
		t.Fatalf("torn line and the next:\n%s\n%s", lines[5], lines[6])
	}
	if err := Read(bytes.NewReader(b), func(*Record) error { return nil }); err != nil {
		t.Fatalf("Read of a log with a torn line: %v", err)
	}

	// One line at the first failure, one 11s later, one at Close: the
	// failures since the last line add up to Failed.
	got := logs.lines()
	if len(got) != 3 {
		t.Fatalf("log lines:\n%s", strings.Join(got, "\n"))
	}
	for i, wantFailed := range []string{"failed=1 ", "failed=5 ", "failed=5 "} {
		if !strings.Contains(got[i], wantFailed) || !strings.Contains(got[i], "no space left on device") || !strings.Contains(got[i], "path="+path) {
			t.Errorf("log line %d: %s", i, got[i])
		}
	}
}

func TestDecisionLogReopensWhenPathReplaced(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "logs")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "d.jsonl")
	clk := newClock()
	w, err := Open(Options{Path: path, FsyncInterval: time.Hour, Logger: slog.New(slog.DiscardHandler), now: clk.now, batchBytes: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	var n int64
	n += logN(w, "first", 3)
	settle(t, w, n)

	os.Remove(path) // deleted
	n += logN(w, "recreated", 2)
	settle(t, w, n)
	if ids, _ := readAll(t, path); fmt.Sprint(ids) != "[recreated0 recreated1]" {
		t.Fatalf("after the file was removed: %v", ids)
	}

	os.Rename(path, path+".moved") // rotated by someone else
	n += logN(w, "after-move", 1)
	settle(t, w, n)
	if ids, _ := readAll(t, path); fmt.Sprint(ids) != "[after-move0]" {
		t.Fatalf("after the file was moved: %v", ids)
	}

	if err := os.RemoveAll(dir); err != nil { // directory gone
		t.Fatal(err)
	}
	n += logN(w, "nodir", 2)
	settle(t, w, n)
	if w.Failed() != 2 {
		t.Fatalf("failed %d with no directory", w.Failed())
	}
	os.Mkdir(dir, 0o755)
	n += logN(w, "early", 1) // retry not due
	settle(t, w, n)
	clk.advance(2 * time.Second)
	n += logN(w, "new-dir", 2)
	settle(t, w, n)
	if ids, _ := readAll(t, path); fmt.Sprint(ids) != "[new-dir0 new-dir1]" {
		t.Fatalf("after the directory came back: %v", ids)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if w.Written() != 8 || w.Failed() != 3 || w.Written()+w.Dropped()+w.Failed() != n {
		t.Fatalf("written %d dropped %d failed %d, logged %d", w.Written(), w.Dropped(), w.Failed(), n)
	}
}

func TestDecisionLogTickNoticesRemovedFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d.jsonl")
	w, err := Open(Options{Path: path, FsyncInterval: 5 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	os.Remove(path)
	testwait.Until(t, "the fsync tick to reopen the removed file", func() bool {
		_, err := os.Stat(path)
		return err == nil
	})
	n := logN(w, "x", 3)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if ids, _ := readAll(t, path); len(ids) != 3 || w.Written() != n {
		t.Fatalf("read %v, written %d", ids, w.Written())
	}
}

func TestDecisionLogRotationFailureKeepsWriting(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "d.jsonl")
	// path.1 a non-empty directory: moving the file there fails.
	if err := os.MkdirAll(filepath.Join(path+".1", "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	clk, logs := newClock(), &logBuffer{}
	w, err := Open(Options{Path: path, MaxBytes: 300, MaxFiles: 1, FsyncInterval: time.Hour,
		Logger: slog.New(slog.NewTextHandler(logs, nil)), now: clk.now, batchBytes: 1})
	if err != nil {
		t.Fatal(err)
	}
	n := logN(w, "a", 10)
	settle(t, w, n)
	if w.Written() != 10 || w.Failed() != 0 {
		t.Fatalf("written %d failed %d after a failed rotation", w.Written(), w.Failed())
	}
	if got := logs.lines(); len(got) != 1 || !strings.Contains(got[0], "rotate") {
		t.Fatalf("log lines: %q", got)
	}
	os.RemoveAll(path + ".1")
	clk.advance(2 * time.Second)
	n += logN(w, "b", 1)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if w.Written() != n || w.Failed() != 0 {
		t.Fatalf("written %d failed %d, logged %d", w.Written(), w.Failed(), n)
	}
	old, _ := readAll(t, path+".1")
	cur, _ := readAll(t, path)
	if len(old) != 10 || fmt.Sprint(cur) != "[b0]" {
		t.Fatalf("rotated %v, current %v", old, cur)
	}
}

func TestDecisionLogUnencodableRecordFails(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d.jsonl")
	w, err := Open(Options{Path: path, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	logN(w, "ok", 2)
	w.Log(&Record{ID: "nan", Candidates: []Candidate{{Score: math.NaN()}}})
	logN(w, "ok-after", 1)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if w.Written() != 3 || w.Failed() != 1 || w.Dropped() != 0 {
		t.Fatalf("written %d failed %d dropped %d", w.Written(), w.Failed(), w.Dropped())
	}
	if ids, warned := readAll(t, path); fmt.Sprint(ids) != "[ok0 ok1 ok-after0]" || len(warned) != 0 {
		t.Fatalf("read %v, skipped %v", ids, warned)
	}
}

func TestDecisionLogOpenAfterTornTail(t *testing.T) {
	// A log left by an earlier run that ended in a torn line: the next run
	// starts on a new line.
	path := filepath.Join(t.TempDir(), "d.jsonl")
	os.WriteFile(path, []byte("{\"id\":\"old\"}\n{\"id\":\"to"), 0o644)
	w, err := Open(Options{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	logN(w, "new", 1)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if ids, warned := readAll(t, path); fmt.Sprint(ids) != "[old new0]" || fmt.Sprint(warned) != "[2]" {
		t.Fatalf("read %v, skipped %v", ids, warned)
	}
}

func TestDecisionLogReadSkipsTornLines(t *testing.T) {
	good := `{"id":"a","key":"0000000000000001"}` + "\n" + `{"id":"b","key":"0000000000000002"}` + "\n"
	for name, in := range map[string]string{
		"torn last line":   good + `{"id":"c","ke`,
		"torn middle line": `{"id":"a","key":"0000000000000001"}` + "\n" + `{"id":"x",` + "\n" + `{"id":"b","key":"0000000000000002"}` + "\n",
		"garbage line":     good + "\x00\x00\x00\n",
	} {
		var ids []string
		var warned []error
		skipped, err := ReadWith(strings.NewReader(in), ReadOptions{Warn: func(_ int, err error) { warned = append(warned, err) }},
			func(r *Record) error { ids = append(ids, r.ID); return nil })
		if err != nil || skipped != 1 || len(warned) != 1 || fmt.Sprint(ids) != "[a b]" {
			t.Errorf("%s: ids %v skipped %d warned %v err %v", name, ids, skipped, warned, err)
		}
		ids = nil
		if err := Read(strings.NewReader(in), func(r *Record) error { ids = append(ids, r.ID); return nil }); err != nil || fmt.Sprint(ids) != "[a b]" {
			t.Errorf("%s: Read: %v %v", name, ids, err)
		}
	}
	// Not a decision log at all: an error.
	if _, err := ReadWith(strings.NewReader("hello\nworld\n"), ReadOptions{Warn: func(int, error) {}}, func(*Record) error { return nil }); err == nil {
		t.Error("a file of which no line decodes was accepted")
	}
	// each's error still stops the read.
	stop := errors.New("stop")
	if err := Read(strings.NewReader(good), func(*Record) error { return stop }); !errors.Is(err, stop) {
		t.Errorf("each's error: %v", err)
	}
	// Empty input is an empty log.
	if err := Read(strings.NewReader(""), func(*Record) error { return nil }); err != nil {
		t.Errorf("empty log: %v", err)
	}
}
