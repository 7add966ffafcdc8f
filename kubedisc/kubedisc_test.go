package kubedisc

import (
	"context"
	"fmt"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/replica"
)

const ns = "llm"

// waitSpecs polls the source until its replicas are want (names and
// URLs): the informers apply changes on their own goroutines.
func waitSpecs(t *testing.T, s *Source, want ...string) {
	t.Helper()
	testwait.Value(t, fmt.Sprintf("replicas %v", want), func() (string, bool) {
		specs, err := s.Specs(context.Background())
		var got []string
		for _, sp := range specs {
			got = append(got, sp.Name+"="+sp.URL)
		}
		return fmt.Sprintf("replicas %v (err %v)", got, err), err == nil && slices.Equal(got, want)
	})
}

// slice is an EndpointSlice of the Service vllm, as the EndpointSlice
// controller writes it.
func slice(name string, port int32, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	pn := "http"
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: "vllm",
			discoveryv1.LabelManagedBy: ControllerManager}},
		AddressType: discoveryv1.AddressTypeIPv4, Ports: []discoveryv1.EndpointPort{{Name: &pn, Port: &port}}, Endpoints: eps,
	}
}

func endpoint(pod, ip string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{Addresses: []string{ip}, Conditions: discoveryv1.EndpointConditions{Ready: &ready},
		TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: pod, Namespace: ns}}
}

// Replicas join and leave as a Service's EndpointSlices change: a new
// ready endpoint joins, one that turns unready leaves, a deleted slice's
// endpoints leave; another Service's slices are not read.
func TestEndpointSlicesFollowed(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := fake.NewClientset(slice("vllm-a", 8000, endpoint("vllm-0", "10.0.0.1", true), endpoint("vllm-1", "10.0.0.2", false)))
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Service: "vllm", PortName: "http", BudgetTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-0=http://10.0.0.1:8000")
	es := c.DiscoveryV1().EndpointSlices(ns)
	upd := slice("vllm-a", 8000, endpoint("vllm-0", "10.0.0.1", true), endpoint("vllm-1", "10.0.0.2", true))
	if _, err := es.Update(ctx, upd, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-0=http://10.0.0.1:8000", "vllm-1=http://10.0.0.2:8000")
	other := slice("other", 9000, endpoint("x", "10.9.9.9", true))
	other.Labels[discoveryv1.LabelServiceName] = "other"
	if _, err := es.Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := es.Create(ctx, slice("vllm-b", 8000, endpoint("vllm-2", "10.0.0.3", true)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-0=http://10.0.0.1:8000", "vllm-1=http://10.0.0.2:8000", "vllm-2=http://10.0.0.3:8000")
	upd = slice("vllm-a", 8000, endpoint("vllm-0", "10.0.0.1", false), endpoint("vllm-1", "10.0.0.2", true))
	if _, err := es.Update(ctx, upd, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := es.Delete(ctx, "vllm-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-1=http://10.0.0.2:8000")
	specs, _ := s.Specs(ctx)
	if specs[0].BudgetTokens != 1000 {
		t.Errorf("budget %d", specs[0].BudgetTokens)
	}
}

func pod(name, ip string, ready bool, lbl map[string]string) *corev1.Pod {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: lbl},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}}}
}

func pool(selector map[string]string, port int64) *unstructured.Unstructured {
	sel := map[string]any{}
	for k, v := range selector {
		sel[k] = v
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": "pool", "namespace": ns},
		"spec":     map[string]any{"selector": map[string]any{"matchLabels": sel}, "targetPorts": []any{map[string]any{"number": port}}},
	}}
}

// An InferencePool's pods are followed: its selector's ready pods on its
// target port, and when the pool's selector or port changes, the new
// ones.
func TestInferencePoolFollowed(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	qwen, llama := map[string]string{"app": "qwen"}, map[string]string{"app": "llama"}
	c := fake.NewClientset(pod("qwen-0", "10.1.0.1", true, qwen), pod("qwen-1", "10.1.0.2", false, qwen), pod("llama-0", "10.2.0.1", true, llama))
	scheme := runtime.NewScheme()
	dc := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(scheme,
		map[schema.GroupVersionResource]string{InferencePool: "InferencePoolList"}, pool(qwen, 8000))
	s, err := Start(ctx, Options{Client: c, Dynamic: dc, Namespace: ns, InferencePool: "pool"})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "qwen-0=http://10.1.0.1:8000")
	if _, err := c.CoreV1().Pods(ns).UpdateStatus(ctx, pod("qwen-1", "10.1.0.2", true, qwen), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "qwen-0=http://10.1.0.1:8000", "qwen-1=http://10.1.0.2:8000")
	if _, err := dc.Resource(InferencePool).Namespace(ns).Update(ctx, pool(llama, 8001), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "llama-0=http://10.2.0.1:8001")
	if err := c.CoreV1().Pods(ns).Delete(ctx, "llama-0", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s)
}

// Pods by label selector, and the options refused.
func TestSelectorAndBadOptions(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := fake.NewClientset(pod("a", "10.3.0.1", true, map[string]string{"role": "vllm"}), pod("b", "10.3.0.2", true, map[string]string{"role": "other"}))
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Selector: "role=vllm", Port: 8000, Scheme: "https"})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "a=https://10.3.0.1:8000")
	var _ replica.Source = s
	for i, o := range []Options{
		{Client: c, Namespace: ns},
		{Client: c, Namespace: ns, Service: "a", Selector: "b=c", Port: 1},
		{Client: c, Service: "a"},
		{Client: c, Namespace: ns, Selector: "role=vllm"},
		{Client: c, Namespace: ns, Selector: "role in (", Port: 8000},
		{Client: c, Namespace: ns, InferencePool: "p"},
	} {
		if _, err := Start(ctx, o); err == nil {
			t.Errorf("options %d accepted", i)
		}
	}
}
