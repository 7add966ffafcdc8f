package routing

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/semroute/semroute/plugin"
)

// TestPolicyParams: every registered policy's every parameter is settable
// by name, and a wrong name, type or value is refused with an error that
// says which.
func TestPolicyParams(t *testing.T) {
	for _, name := range PolicyNames() {
		p, _ := LookupPolicy(name)
		for _, param := range plugin.Names(p.Params) {
			v := any(1.5)
			switch param {
			case "virtual_nodes", "sessions":
				v = 7
			case "prefix_only":
				v = true
			case "cache_threshold":
				v = 0.5
			}
			if _, err := NewPolicy(PolicySpec{Type: name, Params: Params{param: v}}); err != nil {
				t.Errorf("%s.%s = %v: %v", name, param, v, err)
			}
		}
		_, err := NewPolicy(PolicySpec{Type: name, Params: Params{"no_such_param": 1}})
		if err == nil || !strings.Contains(err.Error(), name) || p.Params != nil && !strings.Contains(err.Error(), "no_such_param") {
			t.Errorf("%s: an unknown parameter gave %v", name, err)
		}
	}
	for _, bad := range []PolicySpec{
		{Type: "dynamo", Params: Params{"temperature": "hot"}},
		{Type: "dynamo", Params: Params{"temperature": -1}},
		{Type: "sglang", Params: Params{"cache_threshold": 2}},
		{Type: "llmd", Params: Params{"kv_weight": -0.5}},
		{Type: "consistent_hash", Params: Params{"virtual_nodes": 0}},
		{Type: "semantickv", Params: Params{"sessions": 0}},
		{Type: "semantic", Params: Params{"load_weight": -1}},
	} {
		if _, err := NewPolicy(bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
	if p, err := NewPolicy(PolicySpec{Type: "llm-d"}); err != nil || p.Name() != "llmd" {
		t.Errorf("the alias llm-d: %v, %v", p, err)
	}
}

// TestPolicyParamsReachThePolicy: a parameter set by name is the one the
// policy scores with.
func TestPolicyParamsReachThePolicy(t *testing.T) {
	p, err := NewPolicy(PolicySpec{Type: "llmd", Params: Params{"prefix_weight": 0, "queue_weight": 0, "kv_weight": 5}})
	if err != nil {
		t.Fatal(err)
	}
	if got := p.(*LLMD).p; got != (LLMDParams{PrefixWeight: 0, QueueWeight: 0, KVWeight: 5}) {
		t.Errorf("llmd params %+v", got)
	}
	s, _ := NewPolicy(PolicySpec{Type: "semantic", Params: Params{"load_weight": 0.7}})
	if got := s.(*PrefixCost).cfg; got.LoadWeight != 0.7 || got.SpillFactor != DefaultSpillFactor {
		t.Errorf("semantic params %+v: load_weight set, the rest defaults", got)
	}
}

// TestSeededPoliciesRepeat: a randomised policy built twice with one seed
// (config's routing.seed, the replay's --seed) scores the same candidates
// the same way, and one without randomness takes a seed as well.
func TestSeededPoliciesRepeat(t *testing.T) {
	scores := func(p Policy) []string {
		var out []string
		for range 20 {
			cs := cands(5)
			for i := range cs {
				cs[i].Match.Tokens, cs[i].Match.Weighted = i*100, float64(i*100)
			}
			p.Score(&View{Tokens: 1000, Weighted: 1000, BlockTokens: 16}, cs)
			for _, c := range cs {
				out = append(out, fmt.Sprint(c.Tier, c.Score, c.Reason))
			}
		}
		return out
	}
	for _, spec := range []PolicySpec{{Type: "random"}, {Type: "power_of_two"}, {Type: "dynamo", Params: Params{"temperature": 1}}, {Type: "least_load"}} {
		a, err := NewSeededPolicy(spec, 42)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := NewSeededPolicy(spec, 42)
		if !slices.Equal(scores(a), scores(b)) {
			t.Errorf("%s: one seed, two sequences", spec.Type)
		}
	}
}
