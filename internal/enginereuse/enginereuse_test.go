package enginereuse

import (
	"fmt"
	"math"
	"strings"
	"testing"
)

func words(prefix string, n int) []byte {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "%s%d ", prefix, i)
	}
	return []byte(b.String())
}

// TestSampleJaccard: the sampled resemblance of two texts tracks their
// shingles' true Jaccard similarity (an unbiased sample of one shingle in
// four).
func TestSampleJaccard(t *testing.T) {
	doc := words("w", 4000)
	same := NewSample([][]byte{doc})
	if j := Jaccard(same, NewSample([][]byte{doc})); j != 1 {
		t.Fatalf("a text against itself: %v", j)
	}
	// The second text shares its first half: of 3,996 + 3,996 shingles,
	// 1,996 are shared, a Jaccard of 1996/5996 ≈ 0.333.
	other := append(append([]byte{}, doc[:len(words("w", 2000))]...), words("x", 2000)...)
	j := Jaccard(same, NewSample([][]byte{other}))
	if math.Abs(j-1996.0/5996) > 0.05 {
		t.Errorf("half shared: sampled Jaccard %.3f, true 0.333", j)
	}
	if j := Jaccard(same, NewSample([][]byte{words("y", 4000)})); j != 0 {
		t.Errorf("nothing shared: %v", j)
	}
}

// TestDonorsFind: the most similar donor of the namespace is found when it
// is similar enough, and not otherwise; a forgotten or evicted donor is
// not found.
func TestDonorsFind(t *testing.T) {
	d, err := NewDonors(0.5, 2)
	if err != nil {
		t.Fatal(err)
	}
	a := NewSample([][]byte{words("a", 1000)})
	near := NewSample([][]byte{words("a", 900), words("z", 50)})
	d.Put(0, 1, a)
	if k, ok := d.Find(0, near); !ok || k != 1 {
		t.Fatalf("a near prompt found %d, %v", k, ok)
	}
	if _, ok := d.Find(1, near); ok {
		t.Fatal("found in another namespace")
	}
	if _, ok := d.Find(0, NewSample([][]byte{words("a", 300), words("q", 700)})); ok {
		t.Fatal("found a donor sharing under half its shingles")
	}
	d.Put(0, 2, NewSample([][]byte{words("b", 1000)}))
	d.Put(0, 3, NewSample([][]byte{words("c", 1000)})) // evicts 1, the least recently used
	if _, ok := d.Find(0, near); ok {
		t.Fatal("an evicted donor was found")
	}
	d.Forget(0, 3)
	if _, ok := d.Find(0, NewSample([][]byte{words("c", 1000)})); ok {
		t.Fatal("a forgotten donor was found")
	}
	if len(d.index) == 0 {
		t.Fatal("the remaining donor is not indexed")
	}
	d.Clear()
	if len(d.index) != 0 {
		t.Fatalf("%d index entries after Clear", len(d.index))
	}
}

// TestStoreBudget: a store keeps at most its budget, least recently used
// first out, and refuses a segment larger than it.
func TestStoreBudget(t *testing.T) {
	s, err := NewStore(100, 10)
	if err != nil {
		t.Fatal(err)
	}
	s.Put(1, 40)
	s.Put(2, 40)
	s.Has(1) // 2 is now the least recently used
	s.Put(3, 40)
	if !s.Has(1) || s.Has(2) || !s.Has(3) {
		t.Fatal("evicted the wrong segment")
	}
	s.Put(4, 101)
	if s.Has(4) || s.tokens != 80 {
		t.Fatalf("a segment over the budget: held %d tokens", s.tokens)
	}
}
