package routing

import (
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/semroute/semroute/plugin"
)

// Params are a policy's parameters as config gives them (plugin.Params).
type Params = plugin.Params

// PolicySpec names a routing policy and its parameters: config's
// routing.policy (`{type: dynamo, params: {temperature: 0.5}}`, or just
// the type), an A/B arm's, a replay run's.
type PolicySpec struct {
	// Type is the policy's registered name or one of its aliases.
	Type string `json:"type" mapstructure:"type"`
	// Params are the policy's own parameters; the policy validates them.
	Params Params `json:"params,omitempty" mapstructure:"params"`
	// Seed seeds a randomised policy; 0 draws one at random. Config sets
	// it from routing.seed, the replay from its --seed.
	Seed uint64 `json:"-" mapstructure:"-"`
}

// PolicyPlugin is a routing policy's registration.
type PolicyPlugin struct {
	// Name is the policy's name: in config, decision logs, metrics and
	// replay reports.
	Name string
	// Aliases are other spellings config accepts for it.
	Aliases []string
	// Params is the zero value of its parameters' struct, for their names
	// (nil: it takes none).
	Params any
	// New builds the policy from its parameters and a seed (0: random).
	New func(p Params, seed uint64) (Policy, error)
}

var registry struct {
	sync.RWMutex
	order  []string                 // names, in registration order
	byName map[string]*PolicyPlugin // names and aliases
}

// RegisterPolicy adds a routing policy to those NewPolicy builds. It
// panics on a name or alias already registered: registration happens in
// init, and two plugins under one name is a programming error.
func RegisterPolicy(p PolicyPlugin) {
	registry.Lock()
	defer registry.Unlock()
	if registry.byName == nil {
		registry.byName = map[string]*PolicyPlugin{}
	}
	for _, n := range append([]string{p.Name}, p.Aliases...) {
		if _, dup := registry.byName[n]; dup || n == "" {
			panic(fmt.Sprintf("routing: policy %q registered twice", n))
		}
		registry.byName[n] = &p
	}
	registry.order = append(registry.order, p.Name)
}

// PolicyNames lists the registered routing policies' names, in the order
// they were registered (semroute's own first, then the baselines, then
// the ports of other routers).
func PolicyNames() []string {
	registry.RLock()
	defer registry.RUnlock()
	return slices.Clone(registry.order)
}

// LookupPolicy returns the registration of a policy name or alias.
func LookupPolicy(name string) (PolicyPlugin, bool) {
	registry.RLock()
	defer registry.RUnlock()
	p, ok := registry.byName[name]
	if !ok {
		return PolicyPlugin{}, false
	}
	return *p, true
}

// NewPolicy builds the routing policy s names, with its parameters.
func NewPolicy(s PolicySpec) (Policy, error) {
	p, ok := LookupPolicy(s.Type)
	if !ok {
		return nil, fmt.Errorf("unknown routing policy %q (have %s)", s.Type, strings.Join(PolicyNames(), ", "))
	}
	if p.Params == nil && len(s.Params) > 0 {
		return nil, fmt.Errorf("policy %s takes no parameters", p.Name)
	}
	pol, err := p.New(s.Params, s.Seed)
	if err != nil {
		return nil, fmt.Errorf("policy %s: %w", p.Name, err)
	}
	return pol, nil
}
