package replica

import (
	"context"
	"fmt"
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

// DNSOptions configure a DNS source. Name is required.
type DNSOptions struct {
	// Name is resolved: as a host (A/AAAA records, each replica on Port),
	// or with SRV as an SRV name (each record's target and port).
	Name   string
	SRV    bool
	Port   int
	Scheme string // default http
	// BudgetTokens for every discovered replica; 0 means learn it.
	BudgetTokens int64
	// Resolver; nil means net.DefaultResolver.
	Resolver Resolver
}

// DNS is the source of the replicas a DNS name resolves to (a Kubernetes
// headless Service): each endpoint host:port is a replica of that name.
// Safe for concurrent use.
type DNS struct{ o DNSOptions }

var _ Source = (*DNS)(nil)

// NewDNS returns the DNS source o describes.
func NewDNS(o DNSOptions) *DNS {
	if o.Scheme == "" {
		o.Scheme = "http"
	}
	if o.Resolver == nil {
		o.Resolver = net.DefaultResolver
	}
	return &DNS{o: o}
}

// Name implements Source.
func (d *DNS) Name() string { return "dns" }

// Resolve returns the endpoints (host:port) the name resolves to, sorted.
func (d *DNS) Resolve(ctx context.Context) ([]string, error) {
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

// Specs implements Source: one replica per endpoint, named host:port. A
// lookup is bounded by 5 s.
func (d *DNS) Specs(ctx context.Context) ([]Spec, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	eps, err := d.Resolve(ctx)
	if err != nil {
		return nil, fmt.Errorf("resolve %s: %w", d.o.Name, err)
	}
	specs := make([]Spec, len(eps))
	for i, ep := range eps {
		specs[i] = Spec{Name: ep, URL: d.o.Scheme + "://" + ep, BudgetTokens: d.o.BudgetTokens}
	}
	return specs, nil
}
