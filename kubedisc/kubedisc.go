// Package kubedisc finds replicas through the Kubernetes API, with
// client-go's informers: the ready endpoints of a Service's
// EndpointSlices, the ready pods of a label selector, or the ready pods of
// a Gateway API Inference Extension InferencePool (its selector and target
// port, followed as the pool changes). A Source is a replica.Source: a
// replica.Membership adds and retires the replicas it names.
//
// Only what Kubernetes itself wrote is a replica; anyone allowed to write
// an EndpointSlice in the namespace could otherwise point the router
// anywhere:
//
//   - An EndpointSlice is read only when its
//     endpointslice.kubernetes.io/managed-by label names Kubernetes' own
//     EndpointSlice controller (ControllerManager) or its mirroring
//     controller (MirroringManager, which copies a selectorless Service's
//     Endpoints object, so whoever may write that object is trusted as
//     Kubernetes trusts it). A hand-made slice that only carries the
//     kubernetes.io/service-name label is ignored. There is no switch to
//     turn this check off: the unlabelled hand-made slice is exactly the
//     hole. A cluster whose slices come from another controller names its
//     managed-by value in Options.TrustedManagers; such a slice is trusted
//     less: only its endpoints naming a Pod (targetRef) are read, and a pod
//     that a Kubernetes-written slice also names keeps that slice's
//     address. The label is a claim, not a signature: one who may write
//     EndpointSlices may forge it too, and RBAC on EndpointSlices remains
//     the boundary; the rules below still bound what a forgery can do.
//   - An address is a replica only if it can be a pod's IP: an IPv4 or
//     IPv6 literal of the slice's address type (an FQDN slice is ignored),
//     not unspecified (0.0.0.0, ::, 0.0.0.0/8), loopback, link-local
//     (169.254.0.0/16 — the cloud metadata address —, fe80::/10),
//     multicast, broadcast, IPv4-mapped or zoned. The same holds for a
//     pod's status.podIP with a selector or an InferencePool.
//   - A pod is one replica, named by the pod: endpoints claiming the same
//     pod (two slices, or the IPv4 and IPv6 slices of a dual-stack
//     Service) do not replace each other by arrival order; the one kept is
//     chosen from what they say alone: a Kubernetes-written slice's
//     endpoint first, then an IPv4 address before an IPv6 one, then the
//     lowest URL. An endpoint naming a pod of another namespace, or a
//     name no pod can have, is not read.
//   - At most Options.MaxReplicas (DefaultMaxReplicas, 1024, when zero)
//     replicas are named at once. Past it the replicas already named stay
//     and new ones wait; a Warn is logged when the bound is first exceeded
//     and an Info when the count is back within it, not on every read.
package kubedisc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/semroute/semroute/replica"
)

// InferencePool is the Gateway API Inference Extension's resource, v1
// (spec.selector.matchLabels, spec.targetPorts[].number);
// InferencePoolAlpha its v1alpha2 (spec.selector a map,
// spec.targetPortNumber), read alike.
var (
	InferencePool      = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}
	InferencePoolAlpha = schema.GroupVersionResource{Group: "inference.networking.x-k8s.io", Version: "v1alpha2", Resource: "inferencepools"}
)

// The endpointslice.kubernetes.io/managed-by values of Kubernetes' own
// controllers, whose EndpointSlices are always read.
const (
	ControllerManager = "endpointslice-controller.k8s.io"
	MirroringManager  = "endpointslicemirroring-controller.k8s.io"
)

// DefaultMaxReplicas is Options.MaxReplicas when it is zero.
const DefaultMaxReplicas = 1024

// Options say where the replicas are. Exactly one of Service, Selector
// and InferencePool is set.
type Options struct {
	Client    kubernetes.Interface
	Dynamic   dynamic.Interface // needed with InferencePool
	Namespace string            // required

	// Service: the ready endpoints of the EndpointSlices of this Service
	// (labelled kubernetes.io/service-name) that Kubernetes wrote (see the
	// package doc), on the slice's port named PortName (the first port
	// when empty).
	Service string
	// Selector: the ready pods matching this label selector, on Port.
	Selector string
	// InferencePool: the ready pods its selector matches, on its target
	// port; PoolVersion is its API (InferencePool, the zero value, or
	// InferencePoolAlpha).
	InferencePool string
	PoolVersion   schema.GroupVersionResource

	Port     int    // pods' port (Selector; InferencePool without one); required with Selector
	PortName string // the EndpointSlice port to use (Service)
	Scheme   string // default "http"
	// BudgetTokens, when positive, is every replica's KV cache in tokens;
	// otherwise each learns its own from its metrics.
	BudgetTokens int64
	// Resync is the informers' resync period; 0: none (events alone).
	Resync time.Duration
	// SyncTimeout bounds the wait for the informers' first list; default
	// 30s.
	SyncTimeout time.Duration

	// MaxReplicas bounds the replicas named at once (a count); 0:
	// DefaultMaxReplicas; negative is refused.
	MaxReplicas int
	// TrustedManagers are endpointslice.kubernetes.io/managed-by values
	// read besides ControllerManager and MirroringManager (Service only),
	// for a cluster whose EndpointSlices another controller writes; only
	// the endpoints of their slices that name a Pod are read. Nil: none.
	// Each must be a valid label value.
	TrustedManagers []string
	// Logger receives the replica bound's crossings (nil: slog.Default()).
	Logger *slog.Logger
}

// Source names the replicas the Kubernetes API shows, from its informers'
// caches. Safe for concurrent use.
type Source struct {
	o        Options
	log      *slog.Logger
	slices   cache.GenericLister // nil unless Service
	sliceSel labels.Selector     // Service's: its name, a trusted manager
	pods     cache.GenericLister // nil unless Selector or InferencePool
	pool     cache.GenericLister // nil unless InferencePool
	sel      labels.Selector     // Selector's

	mu   sync.Mutex
	kept map[string]bool // the names the last Specs returned
	over bool            // the last Specs found more than MaxReplicas
}

var _ replica.Source = (*Source)(nil)

// Start starts the informers and waits for their first list (at most
// SyncTimeout); they stop when ctx ends.
func Start(ctx context.Context, o Options) (*Source, error) {
	if err := check(&o); err != nil {
		return nil, err
	}
	s := &Source{o: o, log: cmp.Or(o.Logger, slog.Default())}
	var synced []cache.InformerSynced
	switch {
	case o.Service != "":
		sel, err := sliceSelector(o.Service, o.TrustedManagers)
		if err != nil {
			return nil, err
		}
		s.sliceSel = sel
		f := informers.NewSharedInformerFactoryWithOptions(o.Client, o.Resync, informers.WithNamespace(o.Namespace),
			informers.WithTweakListOptions(func(lo *metav1.ListOptions) { lo.LabelSelector = sel.String() }))
		inf := f.Discovery().V1().EndpointSlices().Informer()
		s.slices = cache.NewGenericLister(inf.GetIndexer(), discoveryv1.Resource("endpointslices"))
		synced = append(synced, inf.HasSynced)
		f.Start(ctx.Done())
	default:
		var tweak func(*metav1.ListOptions)
		if o.Selector != "" {
			sel, err := labels.Parse(o.Selector)
			if err != nil {
				return nil, fmt.Errorf("kubedisc: selector: %w", err)
			}
			s.sel = sel
			tweak = func(lo *metav1.ListOptions) { lo.LabelSelector = o.Selector }
		}
		f := informers.NewSharedInformerFactoryWithOptions(o.Client, o.Resync, informers.WithNamespace(o.Namespace), informers.WithTweakListOptions(tweak))
		inf := f.Core().V1().Pods().Informer()
		s.pods = cache.NewGenericLister(inf.GetIndexer(), corev1.Resource("pods"))
		synced = append(synced, inf.HasSynced)
		f.Start(ctx.Done())
		if o.InferencePool != "" {
			df := dynamicinformer.NewFilteredDynamicSharedInformerFactory(o.Dynamic, o.Resync, o.Namespace,
				func(lo *metav1.ListOptions) { lo.FieldSelector = "metadata.name=" + o.InferencePool })
			gi := df.ForResource(o.PoolVersion)
			s.pool = gi.Lister()
			synced = append(synced, gi.Informer().HasSynced)
			df.Start(ctx.Done())
		}
	}
	wait, cancel := context.WithTimeout(ctx, cmp.Or(o.SyncTimeout, 30*time.Second))
	defer cancel()
	if !cache.WaitForCacheSync(wait.Done(), synced...) {
		return nil, fmt.Errorf("kubedisc: the first list did not come: %w", context.Cause(wait))
	}
	return s, nil
}

// check refuses options that name no single place, and fills defaults.
func check(o *Options) error {
	n := 0
	for _, s := range []string{o.Service, o.Selector, o.InferencePool} {
		if s != "" {
			n++
		}
	}
	switch {
	case n != 1:
		return errors.New("kubedisc: exactly one of service, selector and inference_pool")
	case o.Client == nil || o.Namespace == "":
		return errors.New("kubedisc: a client and a namespace are required")
	case o.InferencePool != "" && o.Dynamic == nil:
		return errors.New("kubedisc: an InferencePool needs a dynamic client")
	case o.Selector != "" && (o.Port < 1 || o.Port > 65535):
		return errors.New("kubedisc: a selector needs the pods' port")
	case o.MaxReplicas < 0:
		return fmt.Errorf("kubedisc: max replicas %d is negative", o.MaxReplicas)
	}
	if o.Scheme == "" {
		o.Scheme = "http"
	}
	if o.PoolVersion.Resource == "" {
		o.PoolVersion = InferencePool
	}
	if o.MaxReplicas == 0 {
		o.MaxReplicas = DefaultMaxReplicas
	}
	return nil
}

// sliceSelector selects a Service's EndpointSlices that Kubernetes' own
// controllers or a trusted manager wrote; the API server filters the
// informer's list and watch with it, and Specs its cache again.
func sliceSelector(service string, trusted []string) (labels.Selector, error) {
	svc, err := labels.NewRequirement(discoveryv1.LabelServiceName, selection.Equals, []string{service})
	if err != nil {
		return nil, fmt.Errorf("kubedisc: service: %w", err)
	}
	mgr, err := labels.NewRequirement(discoveryv1.LabelManagedBy, selection.In, append([]string{ControllerManager, MirroringManager}, trusted...))
	if err != nil {
		return nil, fmt.Errorf("kubedisc: trusted managers: %w", err)
	}
	return labels.NewSelector().Add(*svc, *mgr), nil
}

// Name implements replica.Source.
func (s *Source) Name() string { return "kubernetes" }

// Specs implements replica.Source: the ready replicas now, by name (a
// pod's name; an endpoint's address when a Kubernetes-written slice names
// no pod), sorted by name, at most MaxReplicas of them.
func (s *Source) Specs(context.Context) ([]replica.Spec, error) {
	var cs []candidate
	var err error
	if s.slices != nil {
		cs, err = s.fromSlices()
	} else {
		cs, err = s.fromPods()
	}
	if err != nil {
		return nil, err
	}
	// One spec a name, the same on every call and whatever order the
	// informers list in: a changed URL would retire the replica and its
	// cache picture.
	slices.SortFunc(cs, func(a, b candidate) int {
		return cmp.Or(strings.Compare(a.Name, b.Name), cmp.Compare(a.rank, b.rank), cmp.Compare(isV6(a.URL), isV6(b.URL)), strings.Compare(a.URL, b.URL))
	})
	cs = slices.CompactFunc(cs, func(a, b candidate) bool { return a.Name == b.Name })
	out := make([]replica.Spec, len(cs))
	for i, c := range cs {
		out[i] = c.Spec
	}
	return s.bound(out), nil
}

// candidate is a replica some object names, and how far that object is
// trusted: among those of one name, the lowest rank is kept.
type candidate struct {
	replica.Spec
	rank int
}

// The ranks of candidates.
const (
	rankPod      = iota // a pod: a Kubernetes-written slice's endpoint naming it, or the pod itself
	rankAddress         // a Kubernetes-written slice's endpoint naming no pod
	rankOtherPod        // a TrustedManagers slice's endpoint naming a pod
)

// isV6 reports 1 for a URL whose host is an IPv6 address, else 0.
func isV6(u string) int {
	if strings.Contains(u, "://[") {
		return 1
	}
	return 0
}

// fromPods lists the ready pods of the selector or the InferencePool.
func (s *Source) fromPods() ([]candidate, error) {
	sel, port := s.sel, s.o.Port
	if s.pool != nil {
		var err error
		if sel, port, err = s.poolTarget(); err != nil {
			return nil, err
		}
	}
	objs, err := s.pods.List(sel)
	if err != nil {
		return nil, err
	}
	var out []candidate
	for _, o := range objs {
		p := o.(*corev1.Pod)
		if !podReady(p) {
			continue
		}
		if addr, ok := podAddr(p.Status.PodIP, ""); ok {
			out = append(out, candidate{s.spec(p.Name, addr, port), rankPod})
		}
	}
	return out, nil
}

// podReady reports whether a pod serves: running, Ready, not going away,
// with an address.
func podReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil || p.Status.PodIP == "" || p.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// bound keeps at most MaxReplicas of specs (sorted by name): those the
// last call kept first, then the others by name; it logs the bound's
// crossings.
func (s *Source) bound(specs []replica.Spec) []replica.Spec {
	s.mu.Lock()
	defer s.mu.Unlock()
	limit := s.o.MaxReplicas
	if len(specs) > limit {
		if !s.over {
			s.log.Warn("kubernetes discovery: more ready replicas than the bound; the others are left out until some leave",
				"ready", len(specs), "max_replicas", limit, "namespace", s.o.Namespace, "service", s.o.Service,
				"selector", s.o.Selector, "inference_pool", s.o.InferencePool)
		}
		s.over = true
		out := make([]replica.Spec, 0, limit)
		for _, sp := range specs {
			if s.kept[sp.Name] && len(out) < limit {
				out = append(out, sp)
			}
		}
		for _, sp := range specs {
			if !s.kept[sp.Name] && len(out) < limit {
				out = append(out, sp)
			}
		}
		slices.SortFunc(out, func(a, b replica.Spec) int { return strings.Compare(a.Name, b.Name) })
		specs = out
	} else if s.over {
		s.log.Info("kubernetes discovery: ready replicas back within the bound", "ready", len(specs), "max_replicas", limit,
			"namespace", s.o.Namespace)
		s.over = false
	}
	s.kept = make(map[string]bool, len(specs))
	for _, sp := range specs {
		s.kept[sp.Name] = true
	}
	return specs
}

// poolTarget reads the InferencePool's pod selector and target port.
func (s *Source) poolTarget() (labels.Selector, int, error) {
	obj, err := s.pool.Get(s.o.Namespace + "/" + s.o.InferencePool)
	if err != nil {
		return nil, 0, fmt.Errorf("kubedisc: InferencePool %s/%s: %w", s.o.Namespace, s.o.InferencePool, err)
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil, 0, fmt.Errorf("kubedisc: InferencePool %s is a %T", s.o.InferencePool, obj)
	}
	match, found, _ := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if !found { // v1alpha2: the selector is the map itself
		match, found, _ = unstructured.NestedStringMap(u.Object, "spec", "selector")
	}
	if !found || len(match) == 0 {
		return nil, 0, fmt.Errorf("kubedisc: InferencePool %s has no selector", s.o.InferencePool)
	}
	port := s.o.Port
	if ports, ok, _ := unstructured.NestedSlice(u.Object, "spec", "targetPorts"); ok && len(ports) > 0 {
		if m, ok := ports[0].(map[string]any); ok {
			if n, ok, _ := unstructured.NestedInt64(m, "number"); ok {
				port = int(n)
			}
		}
	} else if n, ok, _ := unstructured.NestedInt64(u.Object, "spec", "targetPortNumber"); ok {
		port = int(n)
	}
	if port < 1 || port > 65535 {
		return nil, 0, fmt.Errorf("kubedisc: InferencePool %s has no target port", s.o.InferencePool)
	}
	return labels.SelectorFromSet(match), port, nil
}
