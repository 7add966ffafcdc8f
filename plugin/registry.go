package plugin

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
)

// Plugin is one plugin's registration in a Registry: a constructor of T
// from its parameters, under a name and its aliases.
type Plugin[T any] struct {
	// Name is the plugin's name: in config, logs, metrics and reports.
	Name string
	// Aliases are other spellings config accepts for it (older names).
	Aliases []string
	// Params is the zero value of its parameters' struct (json tags name
	// them; Names lists them); nil: it takes none.
	Params any
	// New builds the plugin from its parameters (nil: every default). The
	// registry has checked their names already; New decodes them
	// (Params.Decode, DecodeOver) and checks their values.
	New func(Params) (T, error)
}

// Registry holds the plugins of one kind (routing policies, eviction
// policies, reuse modes) by name: the one shape by which config reaches
// each of them (Spec). A package fills its registry in one place, from a
// function building it (NewRegistry), not from init. Safe for concurrent
// use.
type Registry[T any] struct {
	kind string // what its plugins are, in errors: "routing policy"
	noun string // what one is called before its name in its errors: "policy"

	mu     sync.RWMutex
	order  []string              // names, in registration order
	byName map[string]*Plugin[T] // names and aliases
}

// NewRegistry returns a registry of plugins of kind holding plugins, in
// that order. Its errors name the kind ("unknown routing policy \"x\"")
// and a plugin by noun and name ("policy dynamo: …"; noun "" is kind).
// It panics as Register does.
func NewRegistry[T any](kind, noun string, plugins ...Plugin[T]) *Registry[T] {
	if noun == "" {
		noun = kind
	}
	r := &Registry[T]{kind: kind, noun: noun, byName: map[string]*Plugin[T]{}}
	for _, p := range plugins {
		r.Register(p)
	}
	return r
}

// Register adds p. It panics on an empty name, a name or alias already
// registered, or no constructor: registries are filled once, in one place,
// and two plugins under one name is a programming error.
func (r *Registry[T]) Register(p Plugin[T]) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p.New == nil {
		panic(fmt.Sprintf("plugin: %s %q has no constructor", r.kind, p.Name))
	}
	for _, n := range append([]string{p.Name}, p.Aliases...) {
		if _, dup := r.byName[n]; dup || n == "" {
			panic(fmt.Sprintf("plugin: %s %q registered twice", r.kind, n))
		}
	}
	for _, n := range append([]string{p.Name}, p.Aliases...) {
		r.byName[n] = &p
	}
	r.order = append(r.order, p.Name)
}

// Kind returns what the registry's plugins are ("routing policy").
func (r *Registry[T]) Kind() string { return r.kind }

// Names returns the registered names, without aliases, in registration
// order.
func (r *Registry[T]) Names() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return slices.Clone(r.order)
}

// Lookup returns the registration of a name or alias.
func (r *Registry[T]) Lookup(name string) (Plugin[T], bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	p, ok := r.byName[name]
	if !ok {
		return Plugin[T]{}, false
	}
	return *p, true
}

// New builds the plugin s names (by name or alias) with s.Params. An
// unknown type is an error listing the registered names; a parameter the
// plugin does not have is one listing those it has (none: "takes no
// parameters"); the plugin's own errors come prefixed with its noun and
// name ("policy dynamo: temperature must be ≥ 0").
func (r *Registry[T]) New(s Spec) (T, error) {
	var zero T
	p, ok := r.Lookup(s.Type)
	if !ok {
		return zero, fmt.Errorf("unknown %s %q (have %s)", r.kind, s.Type, strings.Join(r.Names(), ", "))
	}
	if p.Params == nil && len(s.Params) > 0 {
		return zero, fmt.Errorf("%s %s takes no parameters", r.noun, p.Name)
	}
	if err := unknown(s.Params, p.Params); err != nil {
		return zero, fmt.Errorf("%s %s: %w", r.noun, p.Name, err)
	}
	v, err := p.New(s.Params)
	if err != nil {
		return zero, fmt.Errorf("%s %s: %w", r.noun, p.Name, err)
	}
	return v, nil
}

// unknown returns an error naming the first parameter, in sorted order,
// that the params struct of zero value have does not have, and those it has.
func unknown(params Params, have any) error {
	if len(params) == 0 {
		return nil
	}
	names := Names(have)
	keys := make([]string, 0, len(params))
	for k := range params {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !slices.Contains(names, k) {
			return fmt.Errorf("unknown parameter %q (have %s)", k, strings.Join(names, ", "))
		}
	}
	return nil
}
