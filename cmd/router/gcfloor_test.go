package main

import (
	"runtime"
	"runtime/metrics"
	"strings"
	"testing"

	"github.com/bytedance/gopkg/util/gctuner"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/internal/testwait"
)

var gcSink []byte

// TestGCFloorPacesCollections: 192 MiB of short-lived garbage costs Go's
// default pacing a collection every few MB of it; under a 256 MiB floor it
// passes with a handful (one to four, depending on what the earlier tests
// left live and still allocate), at most half as many. Stopping the
// floor restores the GOGC it found.
func TestGCFloorPacesCollections(t *testing.T) {
	cycles := func() uint64 {
		s := []metrics.Sample{{Name: "/gc/cycles/total:gc-cycles"}}
		metrics.Read(s)
		return s[0].Value.Uint64()
	}
	churn := func() uint64 {
		before := cycles()
		for range 48 << 10 {
			gcSink = make([]byte, 4<<10)
		}
		return cycles() - before
	}
	runtime.GC()
	unfloored := churn()

	desc, stop := startGCFloor(configs.RuntimeConfig{GCFloorMB: 256})
	if desc != "256 MiB" {
		t.Fatalf("description %q", desc)
	}
	// The floor is set after each collection, from the first one on.
	t.Cleanup(stop) // also when the wait fails; stop twice is harmless
	testwait.Until(t, "GOGC raised", func() bool {
		if gctuner.GetGCPercent() > 100 {
			return true
		}
		runtime.GC()
		return false
	})
	// Other tests' goroutines in this process may still be winding down
	// and allocating: the fewest collections of three rounds is the
	// floor's.
	floored := min(churn(), churn(), churn())
	stop()
	t.Logf("192 MiB of garbage: %d collections without the floor, %d with it", unfloored, floored)
	// At most half: the floor alone makes none or one; others' goroutines
	// winding down in this process have made up to 3 under CI's load
	// (10 without the floor).
	if unfloored < 4 || floored*2 > unfloored {
		t.Fatalf("192 MiB of garbage: %d collections without the floor, %d with it; want ≥ 4 without, and at most half of that with", unfloored, floored)
	}
	if again := churn(); again < 4 {
		t.Fatalf("after stop: %d collections for 192 MiB of garbage; the floor is still on", again)
	}
}

func TestGCFloorOff(t *testing.T) {
	if desc, stop := startGCFloor(configs.RuntimeConfig{}); desc != "off" {
		stop()
		t.Fatalf("gc_floor_mb 0: %q", desc)
	}
	t.Setenv("GOGC", "150")
	if desc, stop := startGCFloor(configs.RuntimeConfig{GCFloorMB: 64}); !strings.Contains(desc, "GOGC=150") {
		stop()
		t.Fatalf("with GOGC set: %q", desc)
	}
}
