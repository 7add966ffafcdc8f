package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/semroute/semroute/simreplica"
)

// priorityDemo starts the demo over two simulated replicas, sim-0
// scheduling by priority and sim-1 first come, first served, with the
// objective interactive at priority 10, and its gRPC listener.
func priorityDemo(t *testing.T) *demo {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "prio.yaml")
	if err := os.WriteFile(cfg, []byte("flow_control:\n  priorities: {interactive: 10}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return startTestDemo(t, demoOptions{sim: fastSim, replicas: 2, config: cfg, grpcListen: "127.0.0.1:0",
		simFor: func(i int, o *simreplica.Options) {
			if i == 0 {
				o.Scheduling = simreplica.SchedulingPriority
			}
		}})
}

// Through the endpoint picker, the body Envoy forwards carries the
// request's priority when its destination schedules by priority, never a
// client's, and the destination's fallbacks are replicas of the same
// scheduling, since one body goes to them all: pinned to either replica
// by a subset, or free to go to either.
func TestExtProcEnginePriority(t *testing.T) {
	d := priorityDemo(t)
	waitModels(t, d)
	names := endpoints(d)
	var prio, fcfs string
	for ep, name := range names {
		if name == "sim-0" {
			prio = ep
		} else {
			fcfs = ep
		}
	}
	model := d.sims[0].Options().Model
	env := newEnvoy(t, d)
	hdr := map[string]string{"X-Gateway-Inference-Objective": "interactive"}
	for i, subset := range [][]string{{prio}, {fcfs}, nil, nil, nil, nil} {
		body := []byte(`{"model":"` + model + `","priority":-1000,"max_tokens":2,"messages":[{"role":"user","content":"hello ` + strings.Repeat("x", i) + `"}]}`)
		md := subsetMD(subset...)
		if subset == nil {
			md = nil
		}
		p := env.do("/v1/chat/completions", body, hdr, md, true, "")
		var sent struct {
			Priority *int `json:"priority"`
		}
		if err := json.Unmarshal(p.upstream, &sent); err != nil || p.status != 200 {
			t.Fatalf("request %d: %d, upstream %s (%v)", i, p.status, p.upstream, err)
		}
		dest := strings.Split(p.dest, ",")
		for _, ep := range dest[1:] {
			if (ep == prio) != (dest[0] == prio) {
				t.Errorf("request %d: destinations %v mix the priority replica with the fcfs one", i, dest)
			}
		}
		switch {
		case dest[0] == prio && (sent.Priority == nil || *sent.Priority != -10):
			t.Errorf("request %d to the priority replica: upstream %s, want priority -10", i, p.upstream)
		case dest[0] == fcfs && sent.Priority != nil:
			t.Errorf("request %d to the fcfs replica: upstream %s, want no priority", i, p.upstream)
		}
	}
}
