package routing

import (
	"strings"
	"testing"

	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/plugin"
	"github.com/semroute/semroute/replica"
)

// TestReuseModes: each registered mode credits, takes donors and predicts
// the engine's report as its engine reuses; an unknown mode is refused.
func TestReuseModes(t *testing.T) {
	c := &Candidate{Replica: &replica.Replica{ID: 1}, Match: cachemodel.Match{Tokens: 100}}
	sc := &scratch{beyond: []float64{0, 400}}
	for _, tc := range []struct {
		spec              replica.Reuse
		credit            float64
		donorOK           bool
		predicted         int64
		onlyFewer         bool
		needSegs, needIdx bool
	}{
		{replica.Reuse{}, 0, false, 100, false, false, false},
		{replica.Reuse{Mode: replica.ReuseBlend, Recompute: 0.25}, 300, false, 400, false, true, false},
		{replica.Reuse{Mode: replica.ReuseDonor, MinSimilarity: 0.6}, 0, true, 100, true, false, true},
	} {
		u, err := newReuse(tc.spec)
		if err != nil {
			t.Fatal(err)
		}
		c.Reuse = u.credit(c, sc)
		_, ok := u.donor(c, 1000, 800, 0.7)
		p, fewer := u.predicted(c)
		segs, idx := reuseNeeds([]replica.Spec{{Reuse: tc.spec}})
		if c.Reuse != tc.credit || ok != tc.donorOK || p != tc.predicted || fewer != tc.onlyFewer || segs != tc.needSegs || idx != tc.needIdx {
			t.Errorf("%s: credit %v, donor %v, predicted %d (only fewer %v), needs %v %v", u.Mode(), c.Reuse, ok, p, fewer, segs, idx)
		}
	}
	d, _ := newReuse(replica.Reuse{Mode: replica.ReuseDonor, MinSimilarity: 0.6})
	if got, ok := d.donor(c, 1000, 800, 0.5); ok || got != 0 {
		t.Errorf("a donor below the least similarity credited %v", got)
	}
	if got, _ := d.donor(c, 500, 800, 0.8); got != 0.8*400 {
		t.Errorf("a donor longer than the prompt credited %v, want 0.8 × (500 − 100)", got)
	}
	if _, err := newReuse(replica.Reuse{Mode: "magic"}); err == nil || !strings.Contains(err.Error(), `unknown reuse mode "magic" (have prefix, blend, donor)`) {
		t.Errorf("an unknown mode: %v", err)
	}
	for _, bad := range []plugin.Spec{
		{Type: replica.ReusePrefix, Params: plugin.Params{"recompute": 0.2}},
		{Type: replica.ReuseBlend, Params: plugin.Params{"recompute": 1}},
		{Type: replica.ReuseDonor, Params: plugin.Params{"recompute": 0.2}},
	} {
		if _, err := reuseModes.New(bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}
