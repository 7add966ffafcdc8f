package decisionlog

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
)

// mountTmpfs mounts a tmpfs of size bytes on a new directory, or skips the
// test when mounting is not permitted (not root, a container, CI).
func mountTmpfs(t *testing.T, size string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tmpfs")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size); err != nil {
		t.Skipf("cannot mount a tmpfs here: %v", err)
	}
	t.Cleanup(func() { // before TempDir's removal, registered earlier
		if err := syscall.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
			_ = syscall.Unmount(dir, syscall.MNT_DETACH)
		}
	})
	return dir
}

// fill writes to path until the file system is full.
func fill(t *testing.T, path string) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	chunk := make([]byte, 4096)
	for i := 0; ; i++ {
		if _, err := f.Write(chunk); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			break
		}
		if i > 1<<20 {
			t.Fatal("the tmpfs never filled")
		}
	}
	// The last page may have room for a few bytes: fill them too.
	for {
		if _, err := f.Write(chunk[:1]); err != nil {
			break
		}
	}
}

func TestDecisionLogFullTmpfs(t *testing.T) {
	dir := mountTmpfs(t, "64k")
	path := filepath.Join(dir, "d.jsonl")
	logs := &logBuffer{}
	w, err := Open(Options{Path: path, FsyncInterval: 5 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(logs, nil)),
		retry: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	rec := benchRecord()
	var n int64
	logSome := func(k int) {
		for i := 0; i < k; i++ {
			w.Log(rec)
			n++
		}
	}
	logSome(10)
	settle(t, w, n)
	if w.Written() != 10 {
		t.Fatalf("written %d of 10 before the disk filled", w.Written())
	}

	filler := filepath.Join(dir, "filler")
	fill(t, filler)
	testwait.Until(t, "a write failing on the full disk", func() bool { // the log's own last page may take a few records
		if w.Failed() > 0 {
			return true
		}
		logSome(5)
		return false
	})
	logSome(50) // while full: failed, not dropped, not written
	settle(t, w, n)
	full := w.Written()

	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "writing to resume after space was freed", func() bool {
		if w.Written() >= full+20 {
			return true
		}
		logSome(5)
		return false
	})
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if w.Written()+w.Dropped()+w.Failed() != n || w.Dropped() != 0 {
		t.Fatalf("written %d + dropped %d + failed %d != %d logged", w.Written(), w.Dropped(), w.Failed(), n)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	decoded := 0
	skipped, err := ReadWith(bytes.NewReader(b), ReadOptions{Warn: func(int, error) {}}, func(*Record) error { decoded++; return nil })
	if err != nil {
		t.Fatal(err)
	}
	// Every record counted written is whole in the file, and no more.
	if int64(decoded) != w.Written() {
		t.Fatalf("file has %d records (%d torn lines skipped), written %d", decoded, skipped, w.Written())
	}
	if !strings.Contains(logs.String(), "no space left on device") {
		t.Errorf("no ENOSPC in the log:\n%s", logs.String())
	}
	t.Logf("written %d, failed %d, torn lines %d, log lines %d", w.Written(), w.Failed(), skipped, len(logs.lines()))
}
