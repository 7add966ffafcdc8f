package kvsync_test

import (
	"runtime"
	"testing"

	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/kvsync"
)

// BenchmarkMemoryPerTrackedBlockWithEvents is cachemodel's
// BenchmarkMemoryPerTrackedBlock with the picture built only from engine
// events: 10 million tracked (block, replica) pairs — chains of 32 blocks
// of 16 tokens stored by one of 8 replicas' engines each, all starting
// with the same 4-block system prompt every engine stores once — applied
// by one Applier per replica, and the heap they take per pair, the
// Appliers' engine-hash maps included.
//
//	go test -run '^$' -bench MemoryPerTrackedBlockWithEvents -benchtime 1x ./kvsync
func BenchmarkMemoryPerTrackedBlockWithEvents(b *testing.B) {
	const pairs, replicas, chainLen, shared, blockSize = 10_000_000, 8, 32, 4, 16
	// The event is built in buffers made before the measurement starts and
	// reused for every chain.
	hashes := make([]uint64, chainLen)
	tokens := make([]uint32, chainLen*blockSize)
	batch := kvevents.Batch{Events: make([]kvevents.Event, 1)}
	for i := 0; i < b.N; i++ {
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		m := cachemodel.New(cachemodel.Options{})
		apps := make([]*kvsync.Applier, replicas)
		for r := range apps {
			id, _ := m.AddReplica("r", 0)
			apps[r] = kvsync.NewApplier(m, id, blockSize, 1<<30, nil)
		}
		started := make([]bool, replicas)
		tracked := 0
		for c := 0; tracked < pairs; c++ {
			r := c % replicas
			for j := range chainLen {
				// Engine hashes: the shared blocks' are the same on every
				// engine (each Applier keeps its own), the rest unique.
				hashes[j] = uint64(j) + 1
				base := uint32(j * blockSize)
				if j >= shared {
					hashes[j] = 1<<40 | uint64(c)<<8 | uint64(j)
					base = uint32(c)*chainLen*blockSize + base + 1<<20
				}
				for t := range blockSize {
					tokens[j*blockSize+t] = base + uint32(t)
				}
			}
			// An engine reports the blocks it newly stores: the shared
			// prefix with its first chain only.
			from := shared
			if !started[r] {
				from, started[r] = 0, true
			}
			batch.Events[0] = kvevents.Event{Kind: kvevents.BlockStored, BlockHashes: hashes[from:],
				TokenIDs: tokens[from*blockSize:], BlockSize: blockSize, Medium: "GPU"}
			if from > 0 {
				batch.Events[0].ParentHash, batch.Events[0].HasParent = hashes[from-1], true
			}
			apps[r].Apply(&batch, int64(c))
			tracked += chainLen - shared
		}
		batch.Events[0] = kvevents.Event{}
		st, keys := 0, 0
		for r, a := range apps {
			s, _ := m.Stats(r)
			st += int(s.Blocks)
			keys += a.Tracked()
			if c := a.Counts(); c.Orphans+c.Skipped+c.Cleared != 0 {
				b.Fatalf("replica %d: %+v", r, c)
			}
		}
		if keys != st {
			b.Fatalf("%d engine hashes tracked for %d pairs", keys, st)
		}
		runtime.GC()
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(st), "bytes/pair")
		b.ReportMetric(float64(st), "pairs")
		runtime.KeepAlive(m)
		runtime.KeepAlive(apps)
	}
}
