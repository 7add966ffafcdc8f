package matcher

import (
	"testing"
)

// BenchmarkSketch sketches a retrieval prompt: an instruction, a
// 2,000-word document and a question, salted by a model as the router's
// requests are.
func BenchmarkSketch(b *testing.B) {
	m, err := New(Options{})
	if err != nil {
		b.Fatal(err)
	}
	text := parts("Answer from the document below only.", doc(1, 2000), "Question: "+doc(2, 20))
	n := 0
	for _, t := range text {
		n += len(t)
	}
	b.SetBytes(int64(n))
	b.ReportAllocs()
	for b.Loop() {
		m.Sketch("sim-model", text)
	}
}

// BenchmarkDonors looks up the donors of a prompt among the default
// 10,000, spread over 8 replicas, 100 of which share its document.
func BenchmarkDonors(b *testing.B) {
	m, err := New(Options{})
	if err != nil {
		b.Fatal(err)
	}
	shared := doc(1, 1000)
	for i := range DefaultMaxDonors {
		d := doc(1000+i, 300)
		if i%100 == 0 {
			d = doc(i, 20) + shared
		}
		m.Register(uint64(i), i%8, 1000, m.Sketch("", parts(d)))
	}
	sk := m.Sketch("", parts("Summarise the document below.", shared))
	found := 0
	b.ReportAllocs()
	for b.Loop() {
		m.Donors(sk, func(int, uint64, int, float64) { found++ })
	}
	if found == 0 {
		b.Fatal("no donor found")
	}
}
