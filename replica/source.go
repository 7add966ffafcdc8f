package replica

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"
)

// Source names the replicas that should be in a pool: the config file, DNS
// discovery, the admin API (in the spirit of Caddy's UpstreamSource). A
// Membership asks it when it may have changed.
type Source interface {
	// Name identifies the source in logs and listings: "config", "dns",
	// "admin".
	Name() string
	// Specs returns the replicas the source names now. An error leaves
	// the pool as it is.
	Specs(ctx context.Context) ([]Spec, error)
}

// Static is a source whose list is set by its owner: the config file's
// replicas (replaced on reload), or those added through the admin API.
// Safe for concurrent use.
type Static struct {
	name  string
	mu    sync.Mutex
	specs []Spec
}

var _ Source = (*Static)(nil)

// NewStatic returns a source named name listing specs.
func NewStatic(name string, specs []Spec) *Static {
	return &Static{name: name, specs: slices.Clone(specs)}
}

// Name implements Source.
func (s *Static) Name() string { return s.name }

// Specs implements Source.
func (s *Static) Specs(context.Context) ([]Spec, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.specs), nil
}

// Set replaces the list.
func (s *Static) Set(specs []Spec) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.specs = slices.Clone(specs)
}

// Put adds spec to the list, replacing one of the same name.
func (s *Static) Put(spec Spec) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.specs = slices.DeleteFunc(s.specs, func(x Spec) bool { return x.Name == spec.Name })
	s.specs = append(s.specs, spec)
}

// Delete removes the named replica from the list and reports whether it
// was there.
func (s *Static) Delete(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := len(s.specs)
	s.specs = slices.DeleteFunc(s.specs, func(x Spec) bool { return x.Name == name })
	return len(s.specs) < n
}

// MembershipOptions configure a Membership. Add is required.
type MembershipOptions struct {
	// Add adds a replica to the pool with an empty cache picture (the
	// engine's AddReplica).
	Add func(Spec) (*Replica, error)
	// Retire, if set, is called with a removed replica once nothing is in
	// flight on it (or Context ends first: then not at all), to drop its
	// cache picture and stop checking it.
	Retire func(*Replica)
	// Precedence lists source names, strongest first: a source takes a
	// replica name from a weaker one that holds it (replacing the
	// replica). A source not listed is weaker than every listed one. Among
	// equals, the first to name a replica keeps it.
	Precedence []string
	// Context bounds the goroutines that wait to retire removed replicas.
	// Nil means context.Background().
	Context context.Context
	Logger  *slog.Logger
}

// Membership keeps a pool's members in step with its sources: it adds the
// replicas a source names, replaces those whose spec changed, and drains
// and retires those it no longer names. It is the one path by which
// replicas join and leave. Safe for concurrent use.
type Membership struct {
	o    MembershipOptions
	pool *Pool

	mu    sync.Mutex
	owner map[string]string // replica name → the source that owns it
	specs map[string]Spec   // replica name → the spec it joined with
	last  map[string][]Spec // source name → what it named at its last Reconcile
	// drained names the replicas an operator drained: the state follows
	// the name when a replica is replaced or changes hands.
	drained map[string]bool
}

// NewMembership returns the membership of pool.
func NewMembership(pool *Pool, o MembershipOptions) *Membership {
	if o.Context == nil {
		o.Context = context.Background()
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return &Membership{o: o, pool: pool, owner: map[string]string{}, specs: map[string]Spec{}, last: map[string][]Spec{},
		drained: map[string]bool{}}
}

// rank is a source's strength: lower is stronger.
func (m *Membership) rank(source string) int {
	if i := slices.Index(m.o.Precedence, source); i >= 0 {
		return i
	}
	return len(m.o.Precedence)
}

// Reconcile brings the pool in step with src: it adds the replicas src
// names, replaces those whose spec changed, and drains and retires those
// src owned and no longer names. A replica of data-parallel ranks joins
// as one replica a rank (see Ranks). A replica another source owns is left
// alone unless src is stronger (see Precedence). It returns the first
// error; the other changes are still made.
func (m *Membership) Reconcile(ctx context.Context, src Source) error {
	specs, err := src.Specs(ctx)
	if err != nil {
		return fmt.Errorf("%s: %w", src.Name(), err)
	}
	specs = Ranks(specs)
	name := src.Name()
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	want := map[string]bool{}
	for _, s := range specs {
		want[s.Name] = true
		owner, ok := m.owner[s.Name]
		switch {
		case !ok:
		case owner == name && m.specs[s.Name] == s:
			continue // unchanged
		case owner != name && m.rank(name) >= m.rank(owner):
			continue // a source as strong or stronger holds it
		default:
			m.removeLocked(s.Name, "replaced")
		}
		if err := m.addLocked(s); err != nil {
			errs = append(errs, fmt.Errorf("%s: replica %s: %w", name, s.Name, err))
			continue
		}
		m.owner[s.Name], m.specs[s.Name] = name, s
		m.o.Logger.Info("replica joined", "replica", s.Name, "source", name)
	}
	m.last[name] = specs
	for r, owner := range m.owner {
		if owner == name && !want[r] {
			m.removeLocked(r, "no longer named by "+name)
			if err := m.handOverLocked(r); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

// handOverLocked gives the named replica, which its owner just let go, to
// the strongest other source that named it at its last Reconcile, if any
// (an admin-added replica the file took over and then dropped comes back
// as the admin API's). m.mu is held.
func (m *Membership) handOverLocked(name string) error {
	best, bestRank := "", -1
	var spec Spec
	for src, specs := range m.last {
		for _, s := range specs {
			if s.Name == name && (bestRank < 0 || m.rank(src) < bestRank) {
				best, bestRank, spec = src, m.rank(src), s
			}
		}
	}
	if best == "" {
		return nil
	}
	if err := m.addLocked(spec); err != nil {
		return fmt.Errorf("%s: replica %s: %w", best, name, err)
	}
	m.owner[name], m.specs[name] = best, spec
	m.o.Logger.Info("replica joined", "replica", name, "source", best)
	return nil
}

// addLocked adds a replica, drained if an operator drained its name. m.mu
// is held.
func (m *Membership) addLocked(s Spec) error {
	r, err := m.o.Add(s)
	if err == nil && m.drained[s.Name] {
		r.Drain()
	}
	return err
}

// SetDraining drains (or lets back) the named replica; the state follows
// the name across replacements and hand-overs until changed here.
func (m *Membership) SetDraining(name string, drain bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.pool.Get(name)
	if !ok {
		return fmt.Errorf("no replica %q", name)
	}
	if drain {
		r.Drain()
		m.drained[name] = true
	} else {
		r.Undrain()
		delete(m.drained, name)
	}
	return nil
}

// Remove takes the named replica out of the pool now, whatever its source;
// its source names it again on its next change (a reload, a DNS change).
func (m *Membership) Remove(name string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.owner[name]; !ok {
		return fmt.Errorf("no replica %q", name)
	}
	m.removeLocked(name, "removed")
	return nil
}

// Owner returns the name of the source that owns the named replica, or "".
func (m *Membership) Owner(name string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.owner[name]
}

// removeLocked drains and removes a replica, and retires it once nothing
// is in flight on it; m.mu is held.
func (m *Membership) removeLocked(name, why string) {
	delete(m.owner, name)
	delete(m.specs, name)
	r, ok := m.pool.Remove(name)
	if !ok {
		return
	}
	r.Drain()
	m.o.Logger.Info("replica left; draining", "replica", name, "why", why)
	go m.retire(r)
}

// retire calls Retire once nothing is in flight on r, or gives up when the
// context ends.
func (m *Membership) retire(r *Replica) {
	if m.o.Retire == nil {
		return
	}
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for r.Load(time.Now()).InFlight > 0 {
		select {
		case <-m.o.Context.Done():
			return
		case <-t.C:
		}
	}
	m.o.Retire(r)
}

// Watch reconciles src now and every interval until ctx ends; a failure
// is logged and changes nothing (the replicas found before stay).
func (m *Membership) Watch(ctx context.Context, src Source, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := m.Reconcile(ctx, src); err != nil && ctx.Err() == nil {
			m.o.Logger.Warn("replica source failed; keeping the replicas it named before", "source", src.Name(), "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
