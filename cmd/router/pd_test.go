package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/semroute/semroute/router"
)

// The demo with --pd 2:2 serves disaggregated over the simulated
// replicas' own kv_transfer_params: a long prompt is computed by a prefill
// replica and its KV pulled by a decode replica, whose answer the client
// gets; the endpoint picker names the decode replica as the destination
// and the prefill replica in the header llm-d's decode sidecar reads.
func TestDemoDisaggregated(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, pd: "2:2", grpcListen: "127.0.0.1:0"})
	body := chat([2]string{"system", text("a long shared document", 600)}, [2]string{"user", "a question"})
	body["stream"] = true
	res := post(t, d, "/v1/chat/completions", body, nil)
	if res.status != 200 || !strings.HasPrefix(res.replica, "sim-decode-") {
		t.Fatalf("status %d from %q: %s", res.status, res.replica, res.body)
	}
	var remote, transfers int64
	for _, s := range d.sims {
		st := s.Stats()
		remote, transfers = remote+st.RemoteDecodes, transfers+st.Transfers
	}
	if remote != 1 || transfers != 1 {
		t.Fatalf("prefills for a decode replica %d, decodes that pulled a prefill's KV %d; want 1 each", remote, transfers)
	}

	names := endpoints(d)
	env := newEnvoy(t, d)
	body = chat([2]string{"system", text("another long document", 600)}, [2]string{"user", "a question"})
	b, _ := json.Marshal(body)
	p := env.do("/v1/chat/completions", b, nil, nil, false, "")
	dest := strings.Split(p.dest, ",")
	prefill := p.reqHdr[router.HeaderPrefillerHostPort]
	if !strings.HasPrefix(names[dest[0]], "sim-decode-") || !strings.HasPrefix(names[prefill], "sim-prefill-") {
		t.Fatalf("the picker chose %q (%s) with prefill %q (%s)", p.dest, names[dest[0]], prefill, names[prefill])
	}
	for _, e := range dest {
		if !strings.HasPrefix(names[e], "sim-decode-") {
			t.Fatalf("a prefill replica is among the destinations: %q", p.dest)
		}
	}
	// A batch of prompts, which one set of kv_transfer_params cannot
	// carry, goes to a decode replica whole: no prefill named.
	b, _ = json.Marshal(map[string]any{"model": "sim-model", "prompt": []string{text("a first long prompt", 600), text("a second long prompt", 600)}, "max_tokens": 4})
	p = env.do("/v1/completions", b, nil, nil, false, "")
	if h, ok := p.reqHdr[router.HeaderPrefillerHostPort]; ok || !strings.HasPrefix(names[strings.Split(p.dest, ",")[0]], "sim-decode-") {
		t.Fatalf("a batch went to %q with prefill %q (immediate %d: %s)", p.dest, h, p.immediate, p.errBody)
	}
}

func TestParsePD(t *testing.T) {
	if p, d, err := parsePD("3:5"); err != nil || p != 3 || d != 5 {
		t.Fatalf("3:5: %d, %d, %v", p, d, err)
	}
	for _, bad := range []string{"", "2", "2:", ":2", "0:2", "2:0", "-1:3", "2:2x", "2:2:2", "200:100", "a:b"} {
		if _, _, err := parsePD(bad); err == nil || !strings.Contains(err.Error(), "is not P:D") {
			t.Errorf("%q: err %v", bad, err)
		}
	}
	// The replay takes it too, and refuses a replica count it contradicts.
	out, err := runCLIErr(t, "replay", "--trace", "../../replay/testdata/synthetic_head1500.jsonl", "--policies", "semantic", "--pd", "2:2", "--replicas", "8", "--out", t.TempDir())
	if err == nil || !strings.Contains(err.Error(), "--pd 2:2 is 4 replicas, --replicas 8") {
		t.Errorf("replay --pd 2:2 --replicas 8: %v\n%s", err, out)
	}
}
