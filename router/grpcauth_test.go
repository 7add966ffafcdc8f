package router

import (
	"testing"

	"google.golang.org/grpc/metadata"
)

// ext_proc_without_token opens the endpoint picker only: the Route API
// still takes the token, and the picker does too when it is off.
func TestExtProcWithoutToken(t *testing.T) {
	open := false
	a := authenticator{token: func() string { return "secret" }, extProcOpen: func() bool { return open }}
	none := metadata.MD{}
	const process, route = "/envoy.service.ext_proc.v3.ExternalProcessor/Process", "/semroute.v1.Router/Route"
	if a.check(none, process) == nil {
		t.Fatal("the picker without a token, not opened")
	}
	open = true
	if err := a.check(none, process); err != nil {
		t.Fatalf("the picker opened: %v", err)
	}
	if a.check(none, route) == nil {
		t.Fatal("Route without a token")
	}
	if err := a.check(metadata.Pairs("authorization", "Bearer secret"), route); err != nil {
		t.Fatal(err)
	}
}
