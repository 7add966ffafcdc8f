package routing

import "testing"

// A replica whose engine reports the blocks it holds past a hole is
// learned to count anywhere; one that reports the prefix only is not,
// and a replica that changes engine is relearned.
func TestCountingLearnsHowTheEngineCounts(t *testing.T) {
	var c counting
	const block = 16
	for range 20 { // reports prefix + past
		c.observe(0, 160, 64, 224, block)
		c.observe(1, 160, 64, 160, block) // prefix only
		c.observe(2, 160, 8, 168, block)  // past less than a block: no vote
	}
	if !c.anywhere(0) || c.anywhere(1) || c.anywhere(2) {
		t.Fatalf("anywhere: %v %v %v, want true false false", c.anywhere(0), c.anywhere(1), c.anywhere(2))
	}
	for range 5 {
		c.observe(0, 160, 64, 160, block)
	}
	if !c.anywhere(0) {
		t.Fatal("5 prefix votes undid 20 anywhere votes")
	}
	for range 40 {
		c.observe(0, 160, 64, 160, block)
	}
	if c.anywhere(0) {
		t.Fatal("40 prefix votes did not relearn the replica")
	}
	c.observe(3, 0, 64, 64, block)
	if c.anywhere(3) {
		t.Fatal("one vote decided")
	}
	c.forget(0)
	if c.anywhere(0) {
		t.Fatal("forget kept the votes")
	}
}
