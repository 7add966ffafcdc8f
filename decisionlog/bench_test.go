package decisionlog

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"
)

// benchRecord is a decision about the size the router logs: a prompt of
// eight blocks scored on four replicas, with an outcome.
func benchRecord() *Record {
	r := &Record{TimeNs: time.Now().UnixNano(), ID: "req-0123456789", Arm: "main", Policy: "semantic", Model: "m",
		Session: "h:0123456789abcdef", Tenant: "h:fedcba9876543210", Key: "00000000deadbeef", Tokens: 512,
		Chosen: "r1", Outcome: &Outcome{Status: 200, TTFTNs: 1234567, DurationNs: 7654321, PromptTokens: 512, OutputTokens: 32, CachedTokens: 448, Replica: "r1"}}
	for i := 0; i < 8; i++ {
		r.Blocks = append(r.Blocks, Block{Hash: fmt.Sprintf("%016x", i*7919), Kind: "system", Tokens: 64})
	}
	for i := 0; i < 4; i++ {
		name := fmt.Sprint("r", i)
		r.Replicas = append(r.Replicas, name)
		r.Budgets = append(r.Budgets, 1_000_000)
		r.Candidates = append(r.Candidates, Candidate{Replica: name, Score: 0.25 * float64(i), Matched: 64 * i, InFlight: int64(i), Pending: 100, Recent: 50, Reason: "scored"})
	}
	return r
}

// BenchmarkWriter is the writer's cost per record: Log b.N records (none
// dropped) and Close, which writes them all.
func BenchmarkWriter(b *testing.B) {
	rec := benchRecord()
	w, err := Open(Options{Path: filepath.Join(b.TempDir(), "d.jsonl"), Buffer: b.N + 1, MaxBytes: 1 << 40})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		w.Log(rec)
	}
	if err := w.Close(); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	if w.Written() != int64(b.N) {
		b.Fatalf("wrote %d of %d", w.Written(), b.N)
	}
}
