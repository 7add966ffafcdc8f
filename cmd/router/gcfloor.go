package main

import (
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/bytedance/gopkg/util/gctuner"

	"github.com/semroute/semroute/configs"
)

// startGCFloor paces the garbage collector as c.GCFloorMB describes: after
// each collection GOGC is set so that the next comes when the heap reaches
// about the floor, and never below 100, so a live heap above half the floor
// is collected as Go's default would. With a few MB live (the router before
// its cache picture fills), Go's default collects every few MB of request
// garbage: a collection every ~45 proxied 128 KB requests in the proxy
// benchmark, each a chance for a latency outlier.
//
// It is off when c.GCFloorMB is 0 or GOGC is set in the environment. It
// returns a description for the start-up log and a stop function that
// restores the GOGC it found. One floor per process: gctuner's state is
// global.
func startGCFloor(c configs.RuntimeConfig) (desc string, stop func()) {
	if c.GCFloorMB == 0 {
		return "off", func() {}
	}
	if v, ok := os.LookupEnv("GOGC"); ok {
		return "off (GOGC=" + v + " is set)", func() {}
	}
	prev := debug.SetGCPercent(100)
	gctuner.SetMinGCPercent(100) // never more eager than Go's default
	gctuner.SetMaxGCPercent(1 << 20)
	gctuner.Tuning(uint64(c.GCFloorMB) << 20)
	return fmt.Sprintf("%d MiB", c.GCFloorMB), func() {
		gctuner.Tuning(0)
		finalizersRan()
		debug.SetGCPercent(prev)
	}
}

// finalizersRan returns once every finalizer queued before it has run.
// gctuner sets GOGC from a finalizer: one that was already running when
// Tuning(0) stopped it would otherwise undo the restore that follows.
// Finalizers run one at a time, in one goroutine, so a new object's
// finalizer runs after them.
func finalizersRan() {
	done := make(chan struct{})
	marker := new([16]byte)
	runtime.SetFinalizer(marker, func(*[16]byte) { close(done) })
	marker = nil
	for {
		runtime.GC()
		select {
		case <-done:
			return
		case <-time.After(10 * time.Millisecond):
		}
	}
}
