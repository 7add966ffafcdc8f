package replay

import (
	"cmp"
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/semroute/semroute/routing"
)

// Matrix is the set of runs a replay compares, as the replay command's
// flags describe it. Runs expands it.
type Matrix struct {
	// Policies are run with the config's parameters for them
	// (Config.Params); Extra are further runs with their own (a policy
	// file), after them.
	Policies []string
	Extra    []Run
	// Ablations adds the semantic policy with unit kind weights, without
	// a copy's cost and on the token formula (Ablations); PrefixCredit the
	// semantic policy crediting
	// the exact prefix alone (the baseline of engines that reuse past it);
	// Matcher the semantic policy with the semantic matcher.
	Ablations, PrefixCredit, Matcher bool
	// Pictures are the picture modes: each run once per mode, labelled
	// policy/mode, when there are several; the one mode otherwise.
	Pictures []string
	// Routers > 1 runs each with one router, then with that many per sync
	// mode of Syncs (SyncShared with SyncDelay).
	Routers   int
	Syncs     []string
	SyncDelay time.Duration
	// FlowControl runs each run again with the router's queue on, labelled
	// policy/flow-control (one router only).
	FlowControl bool
}

// Runs returns the matrix's runs, in the order a report lists them: the
// policies, the extra runs, the ablations, the prefix credit and the
// matcher, each expanded by picture mode, then by router count and sync.
func (x Matrix) Runs(c *Config) []Run {
	var runs []Run
	for _, p := range x.Policies {
		runs = append(runs, Run{Policy: p})
	}
	runs = append(runs, x.Extra...)
	semantic := c.Params["semantic"]
	if x.Ablations {
		runs = append(runs, Ablations(semantic)...)
	}
	if x.PrefixCredit {
		prefixOnly := maps.Clone(semantic)
		if prefixOnly == nil {
			prefixOnly = routing.Params{}
		}
		prefixOnly["prefix_only"] = true
		runs = append(runs, Run{Label: "semantic-prefix-credit", Policy: "semantic", Params: prefixOnly})
	}
	if x.Matcher {
		runs = append(runs, Run{Label: "semantic+matcher", Policy: "semantic", Matcher: true})
	}
	runs = x.byPicture(runs)
	if x.FlowControl {
		var each []Run
		for _, r := range runs {
			y := r
			y.Label, y.FlowControl = cmp.Or(r.Label, r.Policy)+"/flow-control", true
			each = append(each, r, y)
		}
		runs = each
	}
	if x.Routers > 1 {
		runs = x.byRouters(runs)
	}
	return runs
}

// byPicture gives every run the one picture mode, or each run once per
// mode side by side: semantic/approximate, semantic/events, ...
func (x Matrix) byPicture(runs []Run) []Run {
	switch len(x.Pictures) {
	case 0:
		return runs
	case 1:
		for i := range runs {
			runs[i].Picture = x.Pictures[0]
		}
		return runs
	}
	var each []Run
	for _, r := range runs {
		for _, mode := range x.Pictures {
			y := r
			y.Label, y.Picture = cmp.Or(r.Label, r.Policy)+"/"+mode, mode
			each = append(each, y)
		}
	}
	return each
}

// byRouters runs each with one router, then with x.Routers per sync mode.
func (x Matrix) byRouters(runs []Run) []Run {
	var each []Run
	for _, r := range runs {
		y := r
		y.Label = cmp.Or(r.Label, r.Policy) + "/1-router"
		each = append(each, y)
		for _, sm := range x.Syncs {
			y := r
			y.Routers, y.Sync = x.Routers, strings.TrimSpace(sm)
			if y.Sync == SyncShared {
				y.SyncDelay = x.SyncDelay
			}
			y.Label = fmt.Sprintf("%s/%d-routers-%s", cmp.Or(r.Label, r.Policy), x.Routers, y.Sync)
			each = append(each, y)
		}
	}
	return each
}
