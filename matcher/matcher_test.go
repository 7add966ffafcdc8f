package matcher

import (
	"fmt"
	"math"
	"math/rand"
	"strings"
	"testing"
)

func doc(seed int, words int) string {
	rng := rand.New(rand.NewSource(int64(seed)))
	var sb strings.Builder
	for i := 0; i < words; i++ {
		fmt.Fprintf(&sb, "w%d ", rng.Intn(5000))
	}
	return sb.String()
}

// find returns the replica of the most similar donor to text (ties: the
// lowest replica id).
func find(m *MinHash, text [][]byte) (replica int, ok bool) {
	bestSim := -1.0
	m.Donors(m.Sketch("", text), func(r int, _ uint64, _ int, sim float64) {
		if sim > bestSim {
			replica, ok, bestSim = r, true, sim
		}
	})
	return replica, ok
}

func parts(s ...string) [][]byte {
	out := make([][]byte, len(s))
	for i, x := range s {
		out[i] = []byte(x)
	}
	return out
}

func TestFindsSameDocumentUnderOtherInstruction(t *testing.T) {
	m, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		m.Register(uint64(i), i%4, 800, m.Sketch("", parts("Summarise this.", doc(i, 800))))
	}
	// The same document under another instruction: found on its replica.
	if r, ok := find(m, parts("Translate the following into French, keeping names.", doc(17, 800))); !ok || r != 17%4 {
		t.Fatalf("Find = %d, %v; want replica %d", r, ok, 17%4)
	}
	// Sections reordered: still found.
	d := doc(23, 800)
	half := strings.Index(d[len(d)/2:], " ") + len(d)/2
	if r, ok := find(m, parts("Question about it.", d[half:]+" "+d[:half])); !ok || r != 23%4 {
		t.Fatalf("reordered: Find = %d, %v; want replica %d", r, ok, 23%4)
	}
	// An unrelated document: nothing.
	if r, ok := find(m, parts("Summarise this.", doc(999, 800))); ok {
		t.Fatalf("unrelated text matched replica %d", r)
	}
}

func TestDonorsBestPerReplica(t *testing.T) {
	m, _ := New(Options{MinSimilarity: 0.3}) // the half document is about 0.5 similar
	d := doc(5, 600)
	m.Register(1, 0, 700, m.Sketch("", parts("Summarise this.", d)))            // the same document: similar
	m.Register(2, 0, 650, m.Sketch("", parts("Summarise this.", d[:len(d)/2]))) // half of it: less similar
	m.Register(3, 2, 610, m.Sketch("", parts("Explain it.", d)))                // another replica
	m.Register(4, 1, 600, m.Sketch("", parts(doc(6, 600))))                     // unrelated
	type got struct {
		replica, tokens int
		sim             float64
	}
	var found []got
	m.Donors(m.Sketch("", parts("Translate this.", d)), func(r int, _ uint64, tokens int, sim float64) { found = append(found, got{r, tokens, sim}) })
	if len(found) != 2 || found[0].replica != 0 || found[1].replica != 2 {
		t.Fatalf("Donors found %+v; want replicas 0 and 2, in order", found)
	}
	if found[0].tokens != 700 || found[1].tokens != 610 {
		t.Fatalf("Donors found %+v; want the whole document's donor on replica 0 (700 tokens), 610 on replica 2", found)
	}
	if found[0].sim < 0.8 || found[0].sim > 1 {
		t.Fatalf("similarity %v of the same document under another instruction, want ≥ 0.8", found[0].sim)
	}
	m.Forget(0, 1)
	found = found[:0]
	m.Donors(m.Sketch("", parts("Translate this.", d)), func(r int, _ uint64, tokens int, sim float64) { found = append(found, got{r, tokens, sim}) })
	if len(found) != 2 || found[0].tokens != 650 || found[0].sim >= 0.8 {
		t.Fatalf("after forgetting the best donor, found %+v; want the half document's (650 tokens) on replica 0", found)
	}
}

func TestForgetAndBound(t *testing.T) {
	m, _ := New(Options{MaxDonors: 10})
	m.Register(1, 2, 300, m.Sketch("", parts(doc(1, 300))))
	if _, ok := find(m, parts(doc(1, 300))); !ok {
		t.Fatal("registered donor not found")
	}
	m.Forget(2, 1)
	if _, ok := find(m, parts(doc(1, 300))); ok {
		t.Fatal("forgotten donor found")
	}
	for i := 0; i < 100; i++ {
		m.Register(uint64(i), 0, 300, m.Sketch("", parts(doc(i, 300))))
	}
	if m.Len() != 10 {
		t.Fatalf("holds %d donors, want the bound 10", m.Len())
	}
	m.mu.Lock()
	entries := 0
	for _, list := range m.index {
		entries += len(list)
	}
	m.mu.Unlock()
	if entries > 10*64 {
		t.Fatalf("index holds %d entries for 10 donors of 64 values", entries)
	}
}

func TestSimilarityEstimate(t *testing.T) {
	m, _ := New(Options{K: 256, Shingle: 1})
	// Two sets of 2,000 words sharing 1,000: Jaccard 1000/3000 = 1/3.
	var a, b strings.Builder
	for i := 0; i < 2000; i++ {
		fmt.Fprintf(&a, "x%d ", i)
		fmt.Fprintf(&b, "x%d ", i+1000)
	}
	s := m.Similarity(m.Sketch("", parts(a.String())), m.Sketch("", parts(b.String())))
	if s < 0.25 || s > 0.42 {
		t.Fatalf("estimated %.3f, want about 0.333", s)
	}
	if _, err := New(Options{MinSimilarity: 2}); err == nil {
		t.Fatal("min similarity 2 accepted")
	}
	if len(m.Sketch("", nil)) != 0 || m.Similarity(nil, nil) != 0 {
		t.Fatal("empty text must give an empty sketch")
	}
}

func FuzzSketch(f *testing.F) {
	f.Add([]byte("the quick brown fox jumps over the lazy dog"), []byte("  \n\t x"))
	f.Fuzz(func(t *testing.T, a, b []byte) {
		m, _ := New(Options{K: 16, Shingle: 2, MaxWords: 200})
		s1 := m.Sketch("", [][]byte{a, b})
		s2 := m.Sketch("", [][]byte{a, b})
		if len(s1) > 16 || fmt.Sprint(s1) != fmt.Sprint(s2) {
			t.Fatalf("sketch not deterministic or too long: %v %v", s1, s2)
		}
		if len(s1) > 0 && m.Similarity(s1, s1) != 1 {
			t.Fatal("a sketch is not similar to itself")
		}
	})
}

// Thousands of donors of one document cost a lookup at most PerValue votes
// per sketch value, and the latest are the ones found.
func TestPopularDocumentBoundsLookups(t *testing.T) {
	m, _ := New(Options{})
	d := doc(3, 500)
	for i := range 3000 {
		m.Register(uint64(i), i%8, 500, m.Sketch("", parts(fmt.Sprint("question ", i), d)))
	}
	m.mu.Lock()
	for v, list := range m.index {
		if len(list) > PerValue {
			t.Fatalf("value %x lists %d donors", v, len(list))
		}
	}
	m.mu.Unlock()
	n := 0
	m.Donors(m.Sketch("", parts("another question", d)), func(r int, key uint64, _ int, _ float64) {
		n++
		if key < 3000-PerValue {
			t.Errorf("replica %d: donor %d found, not one of the latest", r, key)
		}
	})
	if n != 8 {
		t.Fatalf("found donors on %d replicas, want 8", n)
	}
}

// A donor's recency follows the replicas' order, not a map's: which donor
// the LRU drops next is the same from run to run.
func TestDonorsRecencyIsDeterministic(t *testing.T) {
	for range 50 {
		m, _ := New(Options{MaxDonors: 4})
		d := doc(7, 400)
		for r := range 4 {
			m.Register(uint64(r), r, 400, m.Sketch("", parts(d)))
		}
		m.Donors(m.Sketch("", parts(d)), func(int, uint64, int, float64) {})
		m.Register(99, 9, 400, m.Sketch("", parts(doc(8, 400))))
		if _, ok := m.donors.Peek(donorKey{0, 0}); ok {
			t.Fatal("the donor of replica 0, refreshed first, outlived the others")
		}
	}
}

func TestNaNSimilarityRefused(t *testing.T) {
	if _, err := New(Options{MinSimilarity: math.NaN()}); err == nil {
		t.Fatal("NaN min similarity accepted")
	}
}

// TestModelsNeverShareDonors: one model's KV cache is no donor for
// another's, so the same document under another model's name is not
// found, while under the same model (salted or not) it is, at the
// similarity the unsalted sketches give.
func TestModelsNeverShareDonors(t *testing.T) {
	m, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	d := doc(3, 700)
	m.Register(1, 0, 700, m.Sketch("llama-8b", parts("Summarise this.", d)))
	m.Register(2, 1, 700, m.Sketch("", parts("Summarise this.", d)))
	found := map[int]float64{}
	collect := func(model string) {
		clear(found)
		m.Donors(m.Sketch(model, parts("Translate this.", d)), func(r int, _ uint64, _ int, sim float64) { found[r] = sim })
	}
	collect("qwen-7b")
	if len(found) != 0 {
		t.Fatalf("another model's request found donors %v", found)
	}
	collect("llama-8b")
	if _, ok := found[0]; !ok || len(found) != 1 {
		t.Fatalf("the same model's request found %v, want replica 0 alone", found)
	}
	salted := found[0]
	collect("")
	if _, ok := found[1]; !ok || len(found) != 1 {
		t.Fatalf("a request naming no model found %v, want replica 1 alone", found)
	}
	if math.Abs(salted-found[1]) > 0.15 || salted < 0.7 {
		t.Fatalf("similarity salted %.2f, unsalted %.2f: want both high and close", salted, found[1])
	}
	a, b := m.Sketch("x", parts(d)), m.Sketch("y", parts(d))
	if s := m.Similarity(a, b); s != 0 {
		t.Fatalf("one text under two models: similarity %.2f, want 0", s)
	}
}
