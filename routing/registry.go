package routing

import (
	"fmt"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/semroute/semroute/plugin"
)

// Params are a policy's parameters as config gives them (plugin.Params).
type Params = plugin.Params

// PolicySpec names a routing policy and its parameters: config's
// routing.policy (`{type: dynamo, params: {temperature: 0.5}}`, or just
// the type), an A/B arm's, a replay run's. Type is the policy's
// registered name or one of its aliases; the policy validates its Params.
type PolicySpec = plugin.Spec

// PolicyPlugin is a routing policy's registration: its name, aliases,
// parameters' struct and constructor.
type PolicyPlugin = plugin.Plugin[Policy]

// policies are the registered routing policies (policyRegistry).
var policies = policyRegistry()

// PolicyNames lists the registered routing policies' names, in the order
// they were registered (semroute's own first, then the baselines, then
// the ports of other routers).
func PolicyNames() []string { return policies.Names() }

// LookupPolicy returns the registration of a policy name or alias.
func LookupPolicy(name string) (PolicyPlugin, bool) { return policies.Lookup(name) }

// NewPolicy builds the routing policy s names, with its parameters; a
// randomised one draws its seed at random.
func NewPolicy(s PolicySpec) (Policy, error) { return NewSeededPolicy(s, 0) }

// NewSeededPolicy builds the routing policy s names, with its parameters,
// and seeds its randomness with seed (0: drawn at random) if it has any
// (random, power_of_two, dynamo): config's routing.seed, shared by its A/B
// arms, and the replay's --seed.
func NewSeededPolicy(s PolicySpec, seed uint64) (Policy, error) {
	p, err := policies.New(s)
	if err != nil {
		return nil, err
	}
	if r, ok := p.(seeded); ok && seed != 0 {
		r.seed(seed)
	}
	return p, nil
}

// seeded is a policy whose choices are random: seed replaces its
// generator's seed (NewSeededPolicy), before it scores anything.
type seeded interface{ seed(uint64) }

func (p *Random) seed(s uint64)     { p.rng = newSeededRand(s) }
func (p *PowerOfTwo) seed(s uint64) { p.rng = newSeededRand(s) }
func (p *Dynamo) seed(s uint64)     { p.rng = newSeededRand(s) }

// policyRegistry returns the routing policies, in the order PolicyNames
// lists them: semroute's own first, then the baselines, then the ports of
// other routers. The one place they are registered.
func policyRegistry() *plugin.Registry[Policy] {
	return plugin.NewRegistry("routing policy", "policy",
		PolicyPlugin{Name: "semantic", Params: PrefixCostParams{},
			New: func(p Params) (Policy, error) {
				c, err := plugin.DecodeOver(p, DefaultPrefixCostParams(), (*PrefixCostParams).valid)
				return &PrefixCost{cfg: c}, err
			}},
		PolicyPlugin{Name: "round_robin",
			New: func(Params) (Policy, error) { return &RoundRobin{}, nil }},
		PolicyPlugin{Name: "random",
			New: func(Params) (Policy, error) { return &Random{rng: newSeededRand(0)}, nil }},
		PolicyPlugin{Name: "least_load",
			New: func(Params) (Policy, error) { return LeastLoad{}, nil }},
		PolicyPlugin{Name: "power_of_two",
			New: func(Params) (Policy, error) { return &PowerOfTwo{rng: newSeededRand(0)}, nil }},
		PolicyPlugin{Name: "consistent_hash", Params: ConsistentHashParams{},
			New: func(p Params) (Policy, error) {
				c, err := plugin.DecodeOver(p, ConsistentHashParams{VirtualNodes: 160}, func(c *ConsistentHashParams) error {
					if c.VirtualNodes < 1 || c.VirtualNodes > 1<<16 {
						return fmt.Errorf("virtual_nodes must be in [1, 65536], not %d", c.VirtualNodes)
					}
					return nil
				})
				return &ConsistentHash{VirtualNodes: c.VirtualNodes}, err
			}},
		PolicyPlugin{Name: "sglang", Params: SGLangParams{},
			New: func(p Params) (Policy, error) {
				c, err := plugin.DecodeOver(p, SGLangParams{CacheThreshold: 0.3, BalanceAbsThreshold: 64, BalanceRelThreshold: 1.5}, func(c *SGLangParams) error {
					if !(c.CacheThreshold >= 0 && c.CacheThreshold <= 1) || !(c.BalanceRelThreshold >= 1) {
						return fmt.Errorf("cache_threshold must be in [0, 1] and balance_rel_threshold ≥ 1")
					}
					return nonNegative([]string{"balance_abs_threshold"}, c.BalanceAbsThreshold)
				})
				return &SGLang{p: c}, err
			}},
		PolicyPlugin{Name: "dynamo", Params: DynamoParams{},
			New: func(p Params) (Policy, error) {
				c, err := plugin.DecodeOver(p, DynamoParams{OverlapWeight: 1}, func(c *DynamoParams) error {
					return nonNegative([]string{"overlap_weight", "temperature"}, c.OverlapWeight, c.Temperature)
				})
				return &Dynamo{p: c, rng: newSeededRand(0)}, err
			}},
		PolicyPlugin{Name: "llmd", Aliases: []string{"llm-d"}, Params: LLMDParams{},
			New: func(p Params) (Policy, error) {
				c, err := plugin.DecodeOver(p, LLMDParams{PrefixWeight: 3, QueueWeight: 2, KVWeight: 2}, func(c *LLMDParams) error {
					return nonNegative([]string{"prefix_weight", "queue_weight", "kv_weight"}, c.PrefixWeight, c.QueueWeight, c.KVWeight)
				})
				return &LLMD{p: c}, err
			}},
		PolicyPlugin{Name: "aibrix", Params: AIBrixParams{},
			New: func(p Params) (Policy, error) {
				c, err := plugin.DecodeOver(p, AIBrixParams{ImbalanceCount: 16, StdDevFactor: 2}, func(c *AIBrixParams) error {
					return nonNegative([]string{"imbalance_count", "std_dev_factor"}, c.ImbalanceCount, c.StdDevFactor)
				})
				return &AIBrix{p: c}, err
			}},
		PolicyPlugin{Name: "semantickv", Params: SemanticKVParams{},
			New: func(p Params) (Policy, error) {
				c, err := plugin.DecodeOver(p, SemanticKVParams{SessionBonusTokens: 512, LoadWeight: 1, Sessions: 65536}, func(c *SemanticKVParams) error {
					if c.Sessions < 1 || c.Sessions > 1<<24 {
						return fmt.Errorf("sessions must be in [1, 16777216], not %d", c.Sessions)
					}
					return nonNegative([]string{"session_bonus_tokens", "load_weight"}, c.SessionBonusTokens, c.LoadWeight)
				})
				if err != nil {
					return nil, err
				}
				sessions, err := lru.New[uint64, string](c.Sessions)
				return &SemanticKV{p: c, sessions: sessions}, err
			}},
	)
}
