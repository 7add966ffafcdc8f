package routing

import (
	"testing"

	"github.com/semroute/semroute/cachemodel"
)

// A replica whose engine reports the blocks it holds past a hole is
// learned to count them; one that reports the prefix only is not; a
// replica whose engine has cached blocks whose events are still on their
// way is learned to count those, in the share it does; and a replica that
// changes engine is relearned.
func TestCountingLearnsHowTheEngineCounts(t *testing.T) {
	var c counting
	const block = 16
	held := cachemodel.Match{Confirmed: 160, Tokens: 160, Past: 64}
	routed := cachemodel.Match{Confirmed: 96, Tokens: 160}
	both := cachemodel.Match{Confirmed: 96, Tokens: 160, Past: 64}
	for i := range 40 {
		c.observe(0, held, 224, block)                                                   // prefix + past
		c.observe(1, held, 160, block)                                                   // prefix only
		c.observe(2, cachemodel.Match{Confirmed: 160, Tokens: 160, Past: 8}, 168, block) // under a block: nothing learned
		c.observe(3, routed, 160, block)                                                 // pending counted
		c.observe(4, routed, 96, block)                                                  // confirmed only
		if i%4 == 0 {                                                                    // a quarter of the routed blocks cached
			c.observe(5, routed, 160, block)
		} else {
			c.observe(5, routed, 96, block)
		}
		c.observe(6, routed, 160, block) // pending counted, and past not, learned from both at once
		c.observe(6, held, 160, block)
		c.observe(6, both, 160, block)
	}
	for _, tc := range []struct {
		id   int
		m    cachemodel.Match
		want int
	}{
		{0, held, 224}, {1, held, 160}, {2, held, 160}, {3, routed, 160}, {4, routed, 96},
		{5, routed, 112}, {6, both, 160},
	} {
		if got := c.read(tc.id).predict(tc.m); abs(got-tc.want) > block/4 { // the priors fade, never quite vanish
			t.Errorf("replica %d: predicted %d for %+v, want %d (read %+v)", tc.id, got, tc.m, tc.want, c.read(tc.id))
		}
	}
	for range 5 {
		c.observe(0, held, 160, block)
	}
	if r := c.read(0); r.past < 0.8 {
		t.Fatalf("5 prefix-only replies undid 40 that counted past the prefix: %+v", r)
	}
	for range 100 {
		c.observe(0, held, 160, block)
	}
	if r := c.read(0); r.past > 0.25 {
		t.Fatalf("100 prefix-only replies did not relearn the replica: %+v", r)
	}
	if r := c.read(7); r.past != 0 || r.pending != 0.5 {
		t.Fatalf("an unknown replica read as %+v, want the priors", r)
	}
	c.observe(7, held, 224, block)
	if r := c.read(7); r.past > 0.25 {
		t.Fatalf("one reply decided: %+v", r)
	}
	c.forget(3)
	if r := c.read(3); r.pending != 0.5 {
		t.Fatal("forget kept the shares")
	}
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}
