package replay

import (
	"fmt"
	"testing"
	"time"

	"github.com/semroute/semroute/routing"
)

// TestMatrixRuns: the replay command's flags expand into the runs a
// report lists, labelled as it lists them.
func TestMatrixRuns(t *testing.T) {
	c := &Config{Params: map[string]routing.Params{"semantic": {"load_weight": 0.2}}}
	label := func(runs []Run) string {
		var out []string
		for _, r := range runs {
			out = append(out, fmt.Sprintf("%s(%s,%s,%d,%s,%v)", r.Label, r.Policy, r.Picture, r.Routers, r.Sync, r.SyncDelay))
		}
		return fmt.Sprint(out)
	}
	for _, tc := range []struct {
		x    Matrix
		want string
	}{
		{Matrix{Policies: []string{"semantic", "llmd"}},
			"[(semantic,,0,,0s) (llmd,,0,,0s)]"},
		{Matrix{Policies: []string{"llmd"}, Extra: []Run{{Label: "d", Policy: "dynamo"}}, PrefixCredit: true, Matcher: true, Pictures: []string{"events"}},
			"[(llmd,events,0,,0s) d(dynamo,events,0,,0s) semantic-prefix-credit(semantic,events,0,,0s) semantic+matcher(semantic,events,0,,0s)]"},
		{Matrix{Policies: []string{"semantic"}, Pictures: []string{"approximate", "events"}},
			"[semantic/approximate(semantic,approximate,0,,0s) semantic/events(semantic,events,0,,0s)]"},
		{Matrix{Policies: []string{"semantic"}, Routers: 4, Syncs: []string{"none", " shared"}, SyncDelay: 5 * time.Millisecond},
			"[semantic/1-router(semantic,,0,,0s) semantic/4-routers-none(semantic,,4,none,0s) semantic/4-routers-shared(semantic,,4,shared,5ms)]"},
	} {
		if got := label(tc.x.Runs(c)); got != tc.want {
			t.Errorf("%+v:\n got %s\nwant %s", tc.x, got, tc.want)
		}
	}
	runs := Matrix{Ablations: true, PrefixCredit: true}.Runs(c)
	if len(runs) != 3 || runs[1].Params["load_weight"] != 0 || runs[2].Params["load_weight"] != 0.2 || runs[2].Params["prefix_only"] != true || c.Params["semantic"]["prefix_only"] != nil {
		t.Errorf("ablations and prefix credit: %+v; the config's params %+v", runs, c.Params)
	}
}
