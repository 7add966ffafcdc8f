package kvsync_test

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/semroute/semroute/kvevents"
)

// frames reads a capture of testdata/thirdparty: each ZeroMQ frame as a
// 4-byte big-endian length and its bytes (see testdata/thirdparty/README.md).
func frames(t *testing.T, name string) [][]byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "testdata", "thirdparty", name))
	if err != nil {
		t.Fatal(err)
	}
	var fs [][]byte
	for len(b) >= 4 {
		n := binary.BigEndian.Uint32(b)
		fs = append(fs, b[4:4+n])
		b = b[4+n:]
	}
	return fs
}

// The batches llm-d's simulator really published, in both its formats,
// apply to a picture with no orphan: the positional format's parent 0 is
// read as no parent, as the map format's nil is. Its replay replies carry
// a topic frame, and its end marker is ["", "", -1, ""].
func TestThirdPartyCapturedBatches(t *testing.T) {
	for _, format := range []string{"array", "map"} {
		_, _, a := applier(t)
		var stored int
		for _, name := range []string{format + "-live-1.bin", format + "-live-2.bin"} {
			f := frames(t, name)
			if len(f) != 3 || len(f[1]) != 8 {
				t.Fatalf("%s: %d frames", name, len(f))
			}
			b, err := kvevents.Decode(f[2])
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if b.DPRank == nil || *b.DPRank != 0 {
				t.Fatalf("%s: data_parallel_rank %v", name, b.DPRank)
			}
			for _, e := range b.Events {
				if e.Kind == kvevents.BlockStored {
					stored += len(e.BlockHashes)
					if e.Medium != "GPU" || e.BlockSize != 16 {
						t.Fatalf("%s: %+v", name, e)
					}
				}
			}
			a.Apply(&b, 1)
		}
		c := a.Counts()
		if stored == 0 || c.Orphans != 0 || c.Skipped != 0 || c.Stored != uint64(stored) || c.Removed == 0 {
			t.Fatalf("%s: %d blocks stored in the capture, applied %+v", format, stored, c)
		}
		reply := frames(t, format+"-replay-1.bin")
		if len(reply) != 4 || len(reply[0]) != 0 || string(reply[1]) != "kv@127.0.0.1:8111@fake-model" {
			t.Fatalf("%s replay reply: %q", format, reply[:2])
		}
		if _, err := kvevents.Decode(reply[3]); err != nil {
			t.Fatal(err)
		}
		end := frames(t, format+"-replay-end.bin")
		if len(end) != 4 || binary.BigEndian.Uint64(end[2]) != ^uint64(0) {
			t.Fatalf("end marker %q", end)
		}
	}
}
