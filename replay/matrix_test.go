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
	if len(runs) != 4 || runs[1].Params["copy_weight"] != 0 || runs[2].Params["load_weight"] != 0.1 || runs[3].Params["load_weight"] != 0.2 || runs[3].Params["prefix_only"] != true || c.Params["semantic"]["prefix_only"] != nil {
		t.Errorf("ablations and prefix credit: %+v; the config's params %+v", runs, c.Params)
	}
}

// TestFlowControlRun: with the router's queue on, replicas that run one
// request at a time hold the others in the router; every request is
// answered, none later than without the queue.
func TestFlowControlRun(t *testing.T) {
	reqs := mooncake(t, 2,
		`{"timestamp": 0, "input_length": 4, "output_length": 50, "hash_ids": [1, 2]}`,
		`{"timestamp": 0, "input_length": 4, "output_length": 5, "hash_ids": [3, 4]}`,
		`{"timestamp": 1, "input_length": 4, "output_length": 5, "hash_ids": [1, 2]}`,
		`{"timestamp": 1, "input_length": 4, "output_length": 5, "hash_ids": [5, 6]}`)
	c := Config{Replicas: 2, BudgetTokens: 1000, BlockTokens: 2, MaxRunning: 1}
	sum, err := Replay(reqs, c, Matrix{Policies: []string{"semantic"}, FlowControl: true}.Runs(&c))
	if err != nil {
		t.Fatal(err)
	}
	off, on := sum.Policies[0], sum.Policies[1]
	if on.Name != "semantic/flow-control" || on.Requests != 4 || off.Requests != 4 {
		t.Fatalf("runs %s (%d requests) and %s (%d)", off.Name, off.Requests, on.Name, on.Requests)
	}
	// The queue costs no request time here. (Which request the replica
	// that frees first takes is router/flow_test.go's; on four requests
	// the service-time model knows only means, not that the first is long.)
	if on.TTFTP99MS > off.TTFTP99MS {
		t.Errorf("TTFT p99 %.0f ms with the queue, %.0f ms without", on.TTFTP99MS, off.TTFTP99MS)
	}
	if _, err := Replay(reqs, c, []Run{{Policy: "semantic", FlowControl: true, Routers: 2, Sync: SyncShared}}); err == nil {
		t.Error("flow control with two routers was accepted")
	}
}
