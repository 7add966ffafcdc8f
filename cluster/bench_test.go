package cluster

import (
	"fmt"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/routing"
)

// BenchmarkBytesPerRoutedRequest measures what one routed request costs
// the fleet on the wire: its route record (replica, work, the blocks it
// matched named by one key, its new blocks in full), the end of its
// prefill, its end and its learned reply (2 blocks), with the batch
// header shared by a batch of 64 requests.
//
//	go test -run '^$' -bench BytesPerRoutedRequest -benchtime 1000x ./cluster
func BenchmarkBytesPerRoutedRequest(b *testing.B) {
	for _, tc := range []struct{ matched, fresh int }{{0, 16}, {60, 4}, {0, 128}, {120, 8}} {
		b.Run(fmt.Sprintf("matched=%d/new=%d", tc.matched, tc.fresh), func(b *testing.B) {
			e := newEngine(b)
			f, err := New(testOptions("nats://127.0.0.1:1", "router-0"), e)
			if err != nil {
				b.Fatal(err)
			}
			f.connected.Store(true) // encode only: nothing is sent
			r, _ := e.Pool().Get("a")
			blocks := make([]blockhash.Block, tc.matched+tc.fresh+2)
			for i := range blocks {
				blocks[i] = blockhash.Block{Hash: uint64(i)*0x9e3779b97f4a7c15 + 1, Tokens: 16, Kind: blockhash.KindSystem}
			}
			blocks[len(blocks)-3].Tokens = 7
			d := &routing.Decision{Blocks: blocks[:tc.matched+tc.fresh], Tokens: 16 * (tc.matched + tc.fresh)}
			c := &routing.Candidate{Replica: r}
			c.Match.Blocks, c.Match.Tokens = tc.matched, 16*tc.matched
			e.Commit(d, c) // the lease whose work the records carry
			const batch = 64
			var total int
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				d.SyncID = 0
				f.Committed(d, c)
				f.PrefillDone(d, c)
				f.Done(d, c)
				f.Learned(d, r, blocks, tc.matched+tc.fresh)
				if f.n == 4*batch {
					total += len(appendHeader(nil, header{sender: f.o.ID, epoch: f.epoch, seq: uint64(i), count: f.n})) + len(f.buf)
					f.buf, f.n = f.buf[:0], 0
				}
			}
			if n := b.N / batch * batch; n > 0 {
				b.ReportMetric(float64(total)/float64(n), "bytes/request")
			}
		})
	}
}
