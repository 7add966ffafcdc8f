package kubedisc

import (
	"context"
	"testing"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// A dual-stack Service has an IPv4 and an IPv6 slice for one pod: the
// pod is one replica, on the same URL every time (its IPv4 one).
func TestDualStackPodIsOneReplica(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	v4 := slice("vllm-v4", 8000, endpoint("vllm-0", "10.0.0.1", true))
	v6 := slice("vllm-v6", 8000, endpoint("vllm-0", "fd00::1", true))
	v6.AddressType = discoveryv1.AddressTypeIPv6
	c := fake.NewClientset(v4, v6)
	s, err := Start(ctx, Options{Client: c, Namespace: ns, Service: "vllm", PortName: "http"})
	if err != nil {
		t.Fatal(err)
	}
	waitSpecs(t, s, "vllm-0=http://10.0.0.1:8000")
	seen := map[string]int{}
	for i := 0; i < 200; i++ {
		sp, _ := s.Specs(ctx)
		for _, x := range sp {
			seen[x.Name+"="+x.URL]++
		}
	}
	t.Logf("%v", seen)
	if len(seen) > 1 {
		t.Errorf("the same pod's URL flaps between calls: %v", seen)
	}
}
