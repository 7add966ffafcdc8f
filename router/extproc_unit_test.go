package router

import (
	"fmt"
	"net/url"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/metadata"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
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

// The model label takes at most maxModelLabels values over the process's
// life, only models the serving replica lists, "other" past that.
func TestModelLabelBounded(t *testing.T) {
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse("http://127.0.0.1:1")
	rep := &replica.Replica{Name: "r", URL: u}
	label := func(model string) string {
		return m.modelLabel(&Routed{req: CoreRequest{Model: model}, Served: &routing.Candidate{Replica: rep}})
	}
	if l := label("m0"); l != "other" {
		t.Fatalf("models unknown: %q", l)
	}
	if l := label(""); l != "none" {
		t.Fatalf("no model: %q", l)
	}
	for gen := 0; gen < 3; gen++ { // the replica's models change
		var served []string
		for i := 0; i < 50; i++ {
			served = append(served, fmt.Sprintf("g%d-m%d", gen, i))
		}
		rep.SetServed(served, nil)
		for _, model := range served {
			label(model)
		}
	}
	if len(m.models) != maxModelLabels {
		t.Fatalf("%d model labels, want the cap %d", len(m.models), maxModelLabels)
	}
	rep.SetServed([]string{"g0-m0", "g2-m49"}, nil)
	if l := label("g0-m0"); l != "g0-m0" {
		t.Fatalf("a label given before: %q", l)
	}
	if l := label("g2-m49"); l != "other" {
		t.Fatalf("past the cap: %q", l)
	}
}

// A request shed because the router's parse budget is spent is a 429 to the
// gateway (the protocol's "dropped" answer), not the HTTP front end's 503.
func TestExtProcShedIs429(t *testing.T) {
	if e := shedOr(fmt.Errorf("parse: %w", blockhash.ErrBusy)); e.status != 429 || e.code != "shed" {
		t.Fatalf("shed: %+v", e)
	}
	if e := shedOr(routing.ErrNoReplica); e.status != 503 {
		t.Fatalf("no replica: %+v", e)
	}
}
