package replica

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Resolver looks names up in DNS; *net.Resolver is one.
type Resolver interface {
	LookupHost(ctx context.Context, host string) ([]string, error)
	LookupSRV(ctx context.Context, service, proto, name string) (string, []*net.SRV, error)
}

// DiscoveryOptions configure a Discovery. Name is required.
type DiscoveryOptions struct {
	// Name is resolved: as a host (A/AAAA records, each replica on Port),
	// or with SRV as an SRV name (each record's target and port).
	Name   string
	SRV    bool
	Port   int
	Scheme string // default http
	// Interval between resolutions. Default 10s.
	Interval time.Duration
	// BudgetTokens for every discovered replica; 0 means learn it.
	BudgetTokens int64
	// Resolver; nil means net.DefaultResolver.
	Resolver Resolver
	Logger   *slog.Logger
}

// Discovery keeps a set of replicas in step with DNS: it adds replicas
// that appear and removes those that leave, through the callbacks, and
// leaves every replica it did not add alone. A failed lookup changes
// nothing. Run it in one goroutine.
type Discovery struct {
	o      DiscoveryOptions
	add    func(Spec) error
	remove func(name string) error
	have   map[string]bool
}

// NewDiscovery returns a discovery that calls add and remove.
func NewDiscovery(o DiscoveryOptions, add func(Spec) error, remove func(name string) error) *Discovery {
	if o.Scheme == "" {
		o.Scheme = "http"
	}
	if o.Interval <= 0 {
		o.Interval = 10 * time.Second
	}
	if o.Resolver == nil {
		o.Resolver = net.DefaultResolver
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return &Discovery{o: o, add: add, remove: remove, have: map[string]bool{}}
}

// Resolve returns the endpoints (host:port) the name resolves to, sorted.
func (d *Discovery) Resolve(ctx context.Context) ([]string, error) {
	var out []string
	if d.o.SRV {
		_, recs, err := d.o.Resolver.LookupSRV(ctx, "", "", d.o.Name)
		if err != nil {
			return nil, err
		}
		for _, r := range recs {
			out = append(out, net.JoinHostPort(strings.TrimSuffix(r.Target, "."), strconv.Itoa(int(r.Port))))
		}
	} else {
		hosts, err := d.o.Resolver.LookupHost(ctx, d.o.Name)
		if err != nil {
			return nil, err
		}
		for _, h := range hosts {
			out = append(out, net.JoinHostPort(h, strconv.Itoa(d.o.Port)))
		}
	}
	sort.Strings(out)
	return out, nil
}

// Sync resolves once and applies the difference.
func (d *Discovery) Sync(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	eps, err := d.Resolve(ctx)
	if err != nil {
		return fmt.Errorf("discovery %s: %w", d.o.Name, err)
	}
	want := map[string]bool{}
	for _, ep := range eps {
		want[ep] = true
		if d.have[ep] {
			continue
		}
		if err := d.add(Spec{Name: ep, URL: d.o.Scheme + "://" + ep, BudgetTokens: d.o.BudgetTokens}); err != nil {
			d.o.Logger.Warn("discovered replica not added", "replica", ep, "err", err)
			continue
		}
		d.o.Logger.Info("replica discovered", "replica", ep)
		d.have[ep] = true
	}
	for ep := range d.have {
		if !want[ep] {
			if err := d.remove(ep); err != nil {
				d.o.Logger.Warn("replica that left DNS not removed", "replica", ep, "err", err)
			} else {
				d.o.Logger.Info("replica left DNS; drained and removed", "replica", ep)
			}
			delete(d.have, ep)
		}
	}
	return nil
}

// Run syncs now and every Interval until ctx ends.
func (d *Discovery) Run(ctx context.Context) {
	t := time.NewTicker(d.o.Interval)
	defer t.Stop()
	for {
		if err := d.Sync(ctx); err != nil && ctx.Err() == nil {
			d.o.Logger.Warn("DNS discovery failed; keeping the replicas found before", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
