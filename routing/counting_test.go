package routing

import (
	"testing"

	"github.com/semroute/semroute/cachemodel"
)

// A replica whose engine reports the blocks it holds past a hole is
// learned to count them; one that reports the prefix only is not; a
// replica whose engine has cached blocks whose events are still on their
// way is learned to count those; and a replica that changes engine is
// relearned.
func TestCountingLearnsHowTheEngineCounts(t *testing.T) {
	var c counting
	const block = 16
	held := cachemodel.Match{Confirmed: 160, Tokens: 160, Past: 64}
	routed := cachemodel.Match{Confirmed: 96, Tokens: 160}
	for range 20 {
		c.observe(0, held, 224, block)                                                   // prefix + past
		c.observe(1, held, 160, block)                                                   // prefix only
		c.observe(2, cachemodel.Match{Confirmed: 160, Tokens: 160, Past: 8}, 168, block) // under a block: no vote
		c.observe(3, routed, 160, block)                                                 // pending counted
		c.observe(4, routed, 96, block)                                                  // confirmed only
	}
	want := []reading{{past: true}, {}, {}, {pending: true}, {}}
	for id, w := range want {
		if got := c.read(id); got != w {
			t.Errorf("replica %d read as %+v, want %+v", id, got, w)
		}
	}
	if got := c.predict(0, held); got != 224 {
		t.Errorf("predicted %d for replica 0, want 224", got)
	}
	if got := c.predict(3, routed); got != 160 {
		t.Errorf("predicted %d for replica 3, want 160", got)
	}
	for range 5 {
		c.observe(0, held, 160, block)
	}
	if !c.anywhere(0) {
		t.Fatal("5 prefix votes undid 20 anywhere votes")
	}
	for range 40 {
		c.observe(0, held, 160, block)
	}
	if c.anywhere(0) {
		t.Fatal("40 prefix votes did not relearn the replica")
	}
	c.observe(5, held, 224, block)
	if c.anywhere(5) {
		t.Fatal("one vote decided")
	}
	c.forget(3)
	if c.read(3).pending {
		t.Fatal("forget kept the votes")
	}
}
