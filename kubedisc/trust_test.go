package kubedisc

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/semroute/semroute/internal/testlog"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// A hand-made EndpointSlice labelled with the Service's name, or one
// another controller wrote, is not read: it neither replaces the real
// pod of the same name nor adds replicas; one made after the start is
// ignored too. The mirroring controller's slice is Kubernetes' and is
// read, an endpoint of it naming no pod by its address.
func TestHandMadeSliceIgnored(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	forged := slice("vllm-forged", 8000, endpoint("vllm-0", "1.2.3.4", true), endpoint("evil", "10.6.6.6", true))
	delete(forged.Labels, discoveryv1.LabelManagedBy)
	other := slice("vllm-other", 8000, endpoint("vllm-1", "1.2.3.5", true))
	other.Labels[discoveryv1.LabelManagedBy] = "my-controller.example.com"
	c := fake.NewClientset(slice("vllm-a", 8000, endpoint("vllm-0", "10.0.0.1", true)), forged, other)
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Service: "vllm", PortName: "http"})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-0=http://10.0.0.1:8000")

	es := c.DiscoveryV1().EndpointSlices(ns)
	later := slice("vllm-forged-2", 8000, endpoint("vllm-0", "1.2.3.3", true))
	delete(later.Labels, discoveryv1.LabelManagedBy)
	if _, err := es.Create(ctx, later, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Made after the forged one: once it is seen, so was the forged one.
	mirrored := slice("vllm-mirrored", 8000, discoveryv1.Endpoint{Addresses: []string{"10.0.0.7"}})
	mirrored.Labels[discoveryv1.LabelManagedBy] = MirroringManager
	if _, err := es.Create(ctx, mirrored, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "10.0.0.7=http://10.0.0.7:8000", "vllm-0=http://10.0.0.1:8000")
}

// Only an address that can be a pod's IP is a replica: not an FQDN slice,
// a name in an IP slice, an address of the other family, unspecified,
// loopback, link-local (the cloud metadata address), multicast,
// broadcast, IPv4-mapped or zoned.
func TestOnlyPodAddressesAreReplicas(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	v4 := slice("vllm-v4", 8000, endpoint("vllm-0", "10.0.0.1", true))
	for i, a := range []string{"169.254.169.254", "0.0.0.0", "127.0.0.1", "0.1.2.3", "255.255.255.255", "224.0.0.1",
		"fd00::9", "vllm.example.com", "010.0.0.1", ""} {
		v4.Endpoints = append(v4.Endpoints, endpoint(fmt.Sprintf("bad4-%d", i), a, true))
	}
	v6 := slice("vllm-v6", 8000, endpoint("vllm-1", "fd00::2", true))
	v6.AddressType = discoveryv1.AddressTypeIPv6
	for i, a := range []string{"::1", "::", "fe80::1", "fd00::3%eth0", "::ffff:10.0.0.5", "ff02::1", "10.0.0.6"} {
		v6.Endpoints = append(v6.Endpoints, endpoint(fmt.Sprintf("bad6-%d", i), a, true))
	}
	fqdn := slice("vllm-fqdn", 8000, endpoint("vllm-2", "vllm.example.com", true), endpoint("vllm-3", "10.0.0.3", true))
	fqdn.AddressType = discoveryv1.AddressTypeFQDN
	c := fake.NewClientset(v4, v6, fqdn)
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Service: "vllm", PortName: "http"})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-0=http://10.0.0.1:8000", "vllm-1=http://[fd00::2]:8000")
}

// A pod's status.podIP passes the same filter, with a selector.
func TestPodAddressFiltered(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lbl := map[string]string{"role": "vllm"}
	objs := []*corev1.Pod{pod("a", "10.3.0.1", true, lbl), pod("b", "fd00::4", true, lbl)}
	for i, a := range []string{"127.0.0.1", "169.254.169.254", "0.0.0.0", "::1", "fe80::1", "not-an-ip", "224.0.0.1"} {
		objs = append(objs, pod(fmt.Sprintf("bad-%d", i), a, true, lbl))
	}
	c := fake.NewClientset()
	for _, p := range objs {
		if err := c.Tracker().Add(p); err != nil {
			t.Fatal(err)
		}
	}
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Selector: "role=vllm", Port: 8000})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "a=http://10.3.0.1:8000", "b=http://[fd00::4]:8000")
}

// Two slices claiming the same pod do not replace each other: with
// another controller's slices trusted, a pod a Kubernetes-written slice
// names keeps that slice's address whatever the other says or when it
// says it; the other's endpoints naming no pod are not read, its own
// pods are. An endpoint naming a pod of another namespace is not read.
func TestOnePodOneIdentity(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const mgr = "slicer.example.com"
	elsewhere := endpoint("vllm-2", "10.0.0.2", true)
	elsewhere.TargetRef.Namespace = "kube-system"
	kube := slice("vllm-a", 8000, endpoint("vllm-0", "10.0.0.9", true), elsewhere)
	mine := func(eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
		es := slice("vllm-x", 8000, append([]discoveryv1.Endpoint{endpoint("vllm-0", "10.0.0.1", true),
			{Addresses: []string{"10.0.0.7"}}, endpoint("vllm-5", "10.0.0.5", true)}, eps...)...)
		es.Labels[discoveryv1.LabelManagedBy] = mgr
		return es
	}
	c := fake.NewClientset(kube, mine())
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Service: "vllm", PortName: "http", TrustedManagers: []string{mgr}})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-0=http://10.0.0.9:8000", "vllm-5=http://10.0.0.5:8000")
	// The other slice written again, last, with one more pod of its own.
	if _, err := c.DiscoveryV1().EndpointSlices(ns).Update(ctx, mine(endpoint("vllm-6", "10.0.0.6", true)), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-0=http://10.0.0.9:8000", "vllm-5=http://10.0.0.5:8000", "vllm-6=http://10.0.0.6:8000")
}

// logBuf is an io.Writer for a test's logger, safe for concurrent use.
type logBuf struct{ testlog.Buffer }

// count is how many lines of the log hold s.
func (l *logBuf) count(s string) int { return strings.Count(l.String(), s) }

// 20 slices of 1,000 endpoints are at most DefaultMaxReplicas replicas
// (MaxReplicas zero), the same ones on every call, and one warning
// however often they are read.
func TestReplicaBoundDefault(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := fake.NewClientset()
	for i := range 20 {
		es := slice(fmt.Sprintf("vllm-%02d", i), 8000)
		for j := range 1000 {
			es.Endpoints = append(es.Endpoints, endpoint(fmt.Sprintf("vllm-%02d-%04d", i, j), fmt.Sprintf("10.%d.%d.%d", i, j/250, j%250+1), true))
		}
		if err := c.Tracker().Add(es); err != nil {
			t.Fatal(err)
		}
	}
	var logs logBuf
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Service: "vllm", PortName: "http", Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var first []string
	for i := range 5 {
		specs, err := s.Specs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(specs) != DefaultMaxReplicas {
			t.Fatalf("%d replicas, want %d", len(specs), DefaultMaxReplicas)
		}
		names := make([]string, len(specs))
		for k, sp := range specs {
			names[k] = sp.Name
		}
		if i == 0 {
			first = names
		} else if strings.Join(names, ",") != strings.Join(first, ",") {
			t.Fatalf("call %d named other replicas", i)
		}
	}
	if n := logs.count("level=WARN"); n != 1 {
		t.Errorf("%d warnings, want 1:\n%s", n, logs.String())
	}
}

// Past MaxReplicas the replicas already named stay and a new one waits
// (even if its name sorts first); the warning comes once per crossing:
// again after the count went back within the bound and over it again.
func TestReplicaBoundCrossings(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ep := func(n int) discoveryv1.Endpoint {
		return endpoint(fmt.Sprintf("p%d", n), fmt.Sprintf("10.0.0.%d", n), true)
	}
	pods := func(eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice { return slice("vllm-a", 8000, eps...) }
	c := fake.NewClientset(pods(ep(1), ep(2), ep(3), ep(4)))
	var logs logBuf
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Service: "vllm", PortName: "http", MaxReplicas: 3,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "p1=http://10.0.0.1:8000", "p2=http://10.0.0.2:8000", "p3=http://10.0.0.3:8000")
	es := c.DiscoveryV1().EndpointSlices(ns)
	update := func(eps ...discoveryv1.Endpoint) {
		t.Helper()
		if _, err := es.Update(ctx, pods(eps...), metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// p0 joins and p3 moves: p0 waits, p3 stays (at its new address).
	update(ep(0), ep(1), ep(2), endpoint("p3", "10.0.0.33", true), ep(4))
	waitSpecs(t, s, "p1=http://10.0.0.1:8000", "p2=http://10.0.0.2:8000", "p3=http://10.0.0.33:8000")
	if n := logs.count("level=WARN"); n != 1 {
		t.Errorf("%d warnings over the bound, want 1:\n%s", n, logs.String())
	}
	update(ep(1))
	waitSpecs(t, s, "p1=http://10.0.0.1:8000")
	update(ep(1), ep(2), ep(4), ep(5))
	waitSpecs(t, s, "p1=http://10.0.0.1:8000", "p2=http://10.0.0.2:8000", "p4=http://10.0.0.4:8000")
	if n := logs.count("level=WARN"); n != 2 {
		t.Errorf("%d warnings after crossing twice, want 2:\n%s", n, logs.String())
	}
	if n := logs.count("level=INFO"); n != 1 {
		t.Errorf("%d notes of the way back, want 1:\n%s", n, logs.String())
	}
}

// Trust options that cannot be honoured are refused.
func TestTrustOptionsRefused(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := fake.NewClientset()
	for i, o := range []Options{
		{Client: c, Namespace: ns, Service: "vllm", MaxReplicas: -1},
		{Client: c, Namespace: ns, Service: "vllm", TrustedManagers: []string{"not a label value!"}},
		{Client: c, Namespace: ns, Service: "not a service!"},
	} {
		if _, err := Start(ctx, o); err == nil {
			t.Errorf("options %d accepted", i)
		}
	}
}
