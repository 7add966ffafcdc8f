package decisionlog

import (
	"bytes"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

func TestWriteReadRotate(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "decisions.jsonl")
	w, err := Open(Options{Path: path, MaxBytes: 2000, MaxFiles: 3, FsyncInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 25; i++ {
				w.Log(&Record{ID: "x", Arm: "a", Blocks: []Block{{Hash: "00000000000000ff", Kind: "system", Tokens: 64}},
					Outcome: &Outcome{Status: 200, TTFTNs: int64(i)}})
			}
		}(g)
	}
	wg.Wait()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	w.Log(&Record{}) // after Close: dropped, no panic
	if w.Written()+w.Dropped() != 101 || w.Errors() != 0 {
		t.Fatalf("written %d dropped %d errors %d", w.Written(), w.Dropped(), w.Errors())
	}
	total := 0
	for _, f := range []string{path, path + ".1", path + ".2", path + ".3"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if len(b) > 2000 {
			t.Errorf("%s has %d bytes, over the rotation size", f, len(b))
		}
		err = Read(bytes.NewReader(b), func(r *Record) error {
			if r.Outcome == nil || r.Outcome.Status != 200 || len(r.Blocks) != 1 {
				t.Errorf("record %+v", r)
			}
			total++
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(path + ".4"); err == nil {
		t.Error("more rotated files than MaxFiles")
	}
	// Rotation keeps MaxFiles files, so the oldest lines are gone; what is
	// kept was all written.
	if total == 0 || int64(total) > w.Written() {
		t.Fatalf("read %d records, wrote %d", total, w.Written())
	}
}

func TestFullBufferDropsWithoutBlocking(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d.jsonl")
	w, err := Open(Options{Path: path, Buffer: 1})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for i := 0; i < 100000; i++ {
		w.Log(&Record{ID: "y"})
	}
	elapsed := time.Since(start)
	w.Close()
	if w.Dropped() == 0 {
		t.Fatalf("no drop with a buffer of 1 (took %v)", elapsed)
	}
	if w.Written()+w.Dropped() != 100000 {
		t.Fatalf("written %d + dropped %d != 100000", w.Written(), w.Dropped())
	}
}

func TestCleanCloseLosesNothing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "d.jsonl")
	w, _ := Open(Options{Path: path, Buffer: 10000, FsyncInterval: time.Hour})
	for i := 0; i < 5000; i++ {
		w.Log(&Record{ID: "z"})
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(path)
	if n := bytes.Count(b, []byte("\n")); n != 5000 || w.Dropped() != 0 {
		t.Fatalf("%d lines, %d dropped", n, w.Dropped())
	}
}

func TestOpenErrors(t *testing.T) {
	if _, err := Open(Options{}); err == nil {
		t.Error("empty path accepted")
	}
	if _, err := Open(Options{Path: filepath.Join(t.TempDir(), "no", "such", "dir", "f")}); err == nil {
		t.Error("unwritable path accepted")
	}
	if err := Read(bytes.NewReader([]byte("{bad\n")), func(*Record) error { return nil }); err == nil {
		t.Error("bad line accepted")
	}
}
