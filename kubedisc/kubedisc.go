// Package kubedisc finds replicas through the Kubernetes API, with
// client-go's informers: the ready endpoints of a Service's
// EndpointSlices, the ready pods of a label selector, or the ready pods of
// a Gateway API Inference Extension InferencePool (its selector and target
// port, followed as the pool changes). A Source is a replica.Source: a
// replica.Membership adds and retires the replicas it names.
package kubedisc

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
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

// Options say where the replicas are. Exactly one of Service, Selector
// and InferencePool is set.
type Options struct {
	Client    kubernetes.Interface
	Dynamic   dynamic.Interface // needed with InferencePool
	Namespace string            // required

	// Service: the ready endpoints of the EndpointSlices of this Service
	// (labelled kubernetes.io/service-name), on the slice's port named
	// PortName (the first port when empty).
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
}

// Source names the replicas the Kubernetes API shows, from its informers'
// caches. Safe for concurrent use.
type Source struct {
	o      Options
	slices cache.GenericLister // nil unless Service
	pods   cache.GenericLister // nil unless Selector or InferencePool
	pool   cache.GenericLister // nil unless InferencePool
	sel    labels.Selector     // Selector's
}

var _ replica.Source = (*Source)(nil)

// Start starts the informers and waits for their first list (at most
// SyncTimeout); they stop when ctx ends.
func Start(ctx context.Context, o Options) (*Source, error) {
	n := 0
	for _, s := range []string{o.Service, o.Selector, o.InferencePool} {
		if s != "" {
			n++
		}
	}
	switch {
	case n != 1:
		return nil, errors.New("kubedisc: exactly one of service, selector and inference_pool")
	case o.Client == nil || o.Namespace == "":
		return nil, errors.New("kubedisc: a client and a namespace are required")
	case o.InferencePool != "" && o.Dynamic == nil:
		return nil, errors.New("kubedisc: an InferencePool needs a dynamic client")
	case o.Selector != "" && (o.Port < 1 || o.Port > 65535):
		return nil, errors.New("kubedisc: a selector needs the pods' port")
	}
	if o.Scheme == "" {
		o.Scheme = "http"
	}
	if o.PoolVersion.Resource == "" {
		o.PoolVersion = InferencePool
	}
	s := &Source{o: o}
	var synced []cache.InformerSynced
	switch {
	case o.Service != "":
		f := informers.NewSharedInformerFactoryWithOptions(o.Client, o.Resync, informers.WithNamespace(o.Namespace),
			informers.WithTweakListOptions(func(lo *metav1.ListOptions) { lo.LabelSelector = discoveryv1.LabelServiceName + "=" + o.Service }))
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

// Name implements replica.Source.
func (s *Source) Name() string { return "kubernetes" }

// Specs implements replica.Source: the ready replicas now, by name (a
// pod's name; an endpoint's address when it names no pod).
func (s *Source) Specs(context.Context) ([]replica.Spec, error) {
	var out []replica.Spec
	switch {
	case s.slices != nil:
		objs, err := s.slices.List(labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: s.o.Service}))
		if err != nil {
			return nil, err
		}
		for _, o := range objs {
			out = s.fromSlice(out, o.(*discoveryv1.EndpointSlice))
		}
	default:
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
		for _, o := range objs {
			if p := o.(*corev1.Pod); podReady(p) {
				out = append(out, s.spec(p.Name, p.Status.PodIP, port))
			}
		}
	}
	// One spec a name, the same on every call: a dual-stack pod's IPv4
	// endpoint before its IPv6 one (a changed URL would retire the replica
	// and its cache picture).
	slices.SortFunc(out, func(a, b replica.Spec) int {
		return cmp.Or(strings.Compare(a.Name, b.Name), cmp.Compare(isV6(a.URL), isV6(b.URL)), strings.Compare(a.URL, b.URL))
	})
	return slices.CompactFunc(out, func(a, b replica.Spec) bool { return a.Name == b.Name }), nil
}

// isV6 reports 1 for a URL whose host is an IPv6 address, else 0.
func isV6(u string) int {
	if strings.Contains(u, "://[") {
		return 1
	}
	return 0
}

// fromSlice appends the ready endpoints of an EndpointSlice.
func (s *Source) fromSlice(out []replica.Spec, es *discoveryv1.EndpointSlice) []replica.Spec {
	port := 0
	for _, p := range es.Ports {
		if p.Port != nil && (s.o.PortName == "" || p.Name != nil && *p.Name == s.o.PortName) {
			port = int(*p.Port)
			break
		}
	}
	if port == 0 {
		return out
	}
	for _, ep := range es.Endpoints {
		c := ep.Conditions
		if len(ep.Addresses) == 0 || c.Ready != nil && !*c.Ready || c.Terminating != nil && *c.Terminating {
			continue
		}
		name := ep.Addresses[0]
		if ep.TargetRef != nil && ep.TargetRef.Kind == "Pod" {
			name = ep.TargetRef.Name
		}
		out = append(out, s.spec(name, ep.Addresses[0], port))
	}
	return out
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

func (s *Source) spec(name, addr string, port int) replica.Spec {
	return replica.Spec{Name: name, URL: s.o.Scheme + "://" + net.JoinHostPort(addr, strconv.Itoa(port)), BudgetTokens: s.o.BudgetTokens}
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
