package cachemodel

import (
	"encoding/binary"
	"runtime"
	"testing"
	"unsafe"

	"github.com/semroute/semroute/blockhash"
)

// BenchmarkMemoryPerTrackedBlock fills a model with 10 million tracked
// (block, replica) pairs — chains of 32 blocks recorded on one of 8
// replicas each, all starting with the same 4-block system prompt held by
// every replica — and reports the heap it takes per pair.
//
//	go test -run '^$' -bench MemoryPerTrackedBlock -benchtime 1x ./cachemodel
func BenchmarkMemoryPerTrackedBlock(b *testing.B) {
	const pairs, replicas, chainLen, shared = 10_000_000, 8, 32, 4
	for i := 0; i < b.N; i++ {
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		m := New(Options{})
		for r := 0; r < replicas; r++ {
			m.AddReplica("r", 0)
		}
		blocks := make([]blockhash.Block, chainLen)
		var buf [8]byte
		tracked := 0
		for c := 0; tracked < pairs; c++ {
			h := blockhash.Seed("m")
			for j := range blocks {
				if j < shared {
					binary.LittleEndian.PutUint64(buf[:], uint64(j))
				} else {
					binary.LittleEndian.PutUint64(buf[:], uint64(c)<<8|uint64(j))
				}
				h = blockhash.ChainHash(h, 'u', buf[:])
				blocks[j] = blockhash.Block{Hash: h, Tokens: 64}
			}
			m.Record(c%replicas, blocks, int64(c))
			tracked += chainLen - shared
		}
		st := 0
		for r := 0; r < replicas; r++ {
			s, _ := m.Stats(r)
			st += int(s.Blocks)
		}
		runtime.GC()
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(st), "bytes/pair")
		b.ReportMetric(float64(st), "pairs")
		runtime.KeepAlive(m)
	}
}

// TestNodeLayout keeps the per-block cost the memory target was met with.
func TestNodeLayout(t *testing.T) {
	if n, s := unsafe.Sizeof(node{}), unsafe.Sizeof(slot{}); n != 64 || s != 32 {
		t.Fatalf("node is %d bytes and slot %d; the cache picture's size assumes 64 and 32", n, s)
	}
	if s := unsafe.Sizeof(ixSlot{}); s != 6 {
		t.Fatalf("the node index's slot is %d bytes; the cache picture's size assumes 6", s)
	}
}
