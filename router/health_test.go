package router

import (
	"context"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// The health names an endpoint picker is probed by: liveness while the
// process runs; readiness and the ExternalProcessor service only while a
// replica can take a request.
func TestHealthNames(t *testing.T) {
	f := newFixture(t, 2, "semantic")
	c := newCore(t, f, CoreOptions{})
	hs := health.NewServer()
	for _, n := range []string{"", healthLiveness, healthReadiness, extprocv3.ExternalProcessor_ServiceDesc.ServiceName} {
		hs.SetServingStatus(n, healthpb.HealthCheckResponse_SERVING)
	}
	h := healthService{Server: hs, ready: c.ready}
	status := func(name string) healthpb.HealthCheckResponse_ServingStatus {
		r, err := h.Check(context.Background(), &healthpb.HealthCheckRequest{Service: name})
		if err != nil {
			t.Fatalf("%q: %v", name, err)
		}
		return r.GetStatus()
	}
	ext := extprocv3.ExternalProcessor_ServiceDesc.ServiceName
	for _, n := range []string{healthLiveness, healthReadiness, ext} {
		if s := status(n); s != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("%q: %v with replicas up", n, s)
		}
	}
	for _, r := range f.e.Pool().Replicas() {
		r.Drain()
	}
	for n, want := range map[string]healthpb.HealthCheckResponse_ServingStatus{
		healthLiveness: healthpb.HealthCheckResponse_SERVING, healthReadiness: healthpb.HealthCheckResponse_NOT_SERVING, ext: healthpb.HealthCheckResponse_NOT_SERVING,
	} {
		if s := status(n); s != want {
			t.Errorf("%q: %v with every replica drained, want %v", n, s, want)
		}
	}
	if _, err := h.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "nothing"}); err == nil {
		t.Error("an unknown service name answered")
	}
}
