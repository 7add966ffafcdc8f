package router

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/semroute/semroute/apikey"
	"github.com/semroute/semroute/replica"
)

func TestAppendPriority(t *testing.T) {
	for _, tc := range []struct {
		in   string
		p    int
		want string
	}{
		{`{}`, -10, `{"priority":-10}`},
		{`{"model":"m"}`, 3, `{"model":"m","priority":3}`},
		{"{\"model\":\"m\"} \n", 1, "{\"model\":\"m\",\"priority\":1} \n"},
		{`{ "a":{"b":[1,{}]} }`, -1, `{ "a":{"b":[1,{}]},"priority":-1}`},
	} {
		got := string(appendPriority(nil, []byte(tc.in), tc.p))
		if got != tc.want {
			t.Errorf("appendPriority(%q, %d) = %q, want %q", tc.in, tc.p, got, tc.want)
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(got), &m); err != nil || m["priority"] != float64(tc.p) {
			t.Errorf("%q: %v, priority %v", got, err, m["priority"])
		}
	}
}

// recorder is a replica that keeps every body it receives and answers
// with status (200 when 0) an answer of any API.
type recorder struct {
	status int
	mu     sync.Mutex
	bodies []map[string]any
	raw    [][]byte
}

func (e *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	e.mu.Lock()
	e.bodies, e.raw = append(e.bodies, m), append(e.raw, b)
	e.mu.Unlock()
	if e.status != 0 {
		http.Error(w, "engine unavailable", e.status)
		return
	}
	if m["stream"] == true {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}],\"usage\":null}\n\ndata: [DONE]\n\n")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	io.WriteString(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"text":"ok","message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`)
}

// take returns the bodies received since the last take, failing the
// test if one holds a client's priority (-1000) under any key.
func (e *recorder) take(t *testing.T) []map[string]any {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, raw := range e.raw {
		if bytes.Contains(raw, []byte("-1000")) {
			t.Errorf("a client's priority reached the replica: %s", raw)
		}
	}
	b := e.bodies
	e.bodies, e.raw = nil, nil
	return b
}

// prioRouter serves a router over recorders, each with its scheduling,
// with the objectives interactive (10) and batch (-1), and API keys when
// keys is set.
func prioRouter(t *testing.T, keys *apikey.Set, reps map[string]*recorder, sched map[string]replica.Scheduling) string {
	t.Helper()
	var specs []replica.Spec
	for _, name := range []string{"p", "f", "p2", "f2"} { // in this order: round robin starts at the first
		if e, ok := reps[name]; ok {
			ts := httptest.NewServer(e)
			t.Cleanup(ts.Close)
			specs = append(specs, replica.Spec{Name: name, URL: ts.URL, Scheduling: sched[name]})
		}
	}
	ts, _ := serveRouter(t, specs, "round_robin", CoreOptions{}, ServerOptions{Keys: keys,
		Priorities: map[string]int{"interactive": 10, "batch": -1}})
	return ts.URL
}

// send posts body to the router's path with headers, and fails the test
// unless it is answered 200.
func send(t *testing.T, url, path, body string, headers map[string]string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
	}
}

// priorityOf returns a body's priority as the engine reads it, "none"
// when absent.
func priorityOf(m map[string]any) string {
	p, ok := m["priority"]
	if !ok {
		return "none"
	}
	return fmt.Sprint(p)
}

// routedAPIs are a request of each routed API, streamed or not, each with
// a client's priority that would jump every queue.
var routedAPIs = []struct{ name, path, body string }{
	{"chat", "/v1/chat/completions", `{"model":"m","priority":-1000,"messages":[{"role":"user","content":"hi"}]}`},
	{"chat streamed", "/v1/chat/completions", `{"model":"m","stream":true,"priority":-1000,"messages":[{"role":"user","content":"hi"}]}`},
	{"completions", "/v1/completions", `{"priority":-1000,"model":"m","prompt":"hi"}`},
	{"completions, priority spelled with an escape", "/v1/completions", `{"model":"m","prompt":"hi","priorit\u0079":-1000}`},
	{"responses", "/v1/responses", `{"model":"m","input":"hi","priority":-1000}`},
	{"messages", "/v1/messages", `{"model":"m","max_tokens":5,"priority":-1000,"messages":[{"role":"user","content":"hi"}]}`},
}

// TestEnginePriorityOverSockets: a replica whose engine schedules by
// priority receives each request's priority, vLLM's negation of the
// router's (objective interactive, 10: -10; batch, -1: 1; none: no field),
// on every routed API but the Messages API, which has none in vLLM; an
// fcfs replica never receives one. A client's own priority reaches
// neither.
func TestEnginePriorityOverSockets(t *testing.T) {
	for _, sched := range []replica.Scheduling{replica.SchedulingPriority, replica.SchedulingFCFS} {
		e := &recorder{}
		url := prioRouter(t, nil, map[string]*recorder{"p": e}, map[string]replica.Scheduling{"p": sched})
		for _, api := range routedAPIs {
			for _, obj := range []struct{ objective, want string }{{"interactive", "-10"}, {"batch", "1"}, {"", "none"}} {
				send(t, url, api.path, api.body, map[string]string{"X-Gateway-Inference-Objective": obj.objective})
				want := obj.want
				if sched != replica.SchedulingPriority || api.path == "/v1/messages" {
					want = "none"
				}
				got := e.take(t)
				if len(got) != 1 || priorityOf(got[0]) != want {
					t.Fatalf("%s replica, %s, objective %q: received %v, want priority %s", sched, api.name, obj.objective, got, want)
				}
				if got[0]["model"] != "m" {
					t.Fatalf("%s: the body lost its fields: %v", api.name, got[0])
				}
			}
		}
	}
}

// TestEnginePriorityIsTheKeysCapped: the priority a priority engine gets
// is the one the router admitted the request at, its key's ceiling
// applied: a key capped at -1 that asks for the interactive objective
// sends 1, not -10.
func TestEnginePriorityIsTheKeysCapped(t *testing.T) {
	keys := loadKeys(t, "keys:\n  - {tenant: batch, max_priority: -1, sha256: "+apikey.Hash("sk-batch")+"}\n")
	e := &recorder{}
	url := prioRouter(t, keys, map[string]*recorder{"p": e}, map[string]replica.Scheduling{"p": replica.SchedulingPriority})
	send(t, url, "/v1/chat/completions", routedAPIs[0].body,
		map[string]string{"Authorization": "Bearer sk-batch", "X-Gateway-Inference-Objective": "interactive", "X-Semroute-Priority": "10"})
	if got := e.take(t); len(got) != 1 || priorityOf(got[0]) != "1" {
		t.Fatalf("received %v, want priority 1", got)
	}
}

// TestEnginePriorityOnFailover: a request failed over from one replica to
// another is sent the body of each: with its priority to the priority
// engine, without to the fcfs one, whichever fails.
func TestEnginePriorityOnFailover(t *testing.T) {
	for _, failing := range []string{"p", "f"} {
		reps := map[string]*recorder{"p": {}, "f": {}}
		reps[failing].status = http.StatusServiceUnavailable
		url := prioRouter(t, nil, reps, map[string]replica.Scheduling{"p": replica.SchedulingPriority})
		for range 2 { // round robin: one of the two starts at the failing replica
			send(t, url, "/v1/chat/completions", routedAPIs[1].body, map[string]string{"X-Gateway-Inference-Objective": "interactive"})
		}
		p, f := reps["p"].take(t), reps["f"].take(t)
		if len(p)+len(f) != 3 {
			t.Fatalf("%s failing: %d requests to p, %d to f; want 3 in all (one failed over)", failing, len(p), len(f))
		}
		for _, b := range p {
			if priorityOf(b) != "-10" {
				t.Errorf("%s failing: the priority replica received priority %s", failing, priorityOf(b))
			}
		}
		for _, b := range f {
			if priorityOf(b) != "none" {
				t.Errorf("%s failing: the fcfs replica received priority %s", failing, priorityOf(b))
			}
		}
	}
}

// TestEnginePriorityDisaggregated: a disaggregated request's prefill and
// decode each carry the priority when their replica schedules by it, and
// not otherwise.
func TestEnginePriorityDisaggregated(t *testing.T) {
	for _, tc := range []struct {
		prefill, decode replica.Scheduling
	}{
		{replica.SchedulingPriority, replica.SchedulingPriority},
		{replica.SchedulingFCFS, replica.SchedulingPriority},
		{replica.SchedulingPriority, replica.SchedulingFCFS},
	} {
		p0, d0 := &pdEngine{name: "p0"}, &pdEngine{name: "d0"}
		var specs []replica.Spec
		for _, r := range []struct {
			e     *pdEngine
			role  replica.Role
			sched replica.Scheduling
		}{{p0, replica.RolePrefill, tc.prefill}, {d0, replica.RoleDecode, tc.decode}} {
			ts := httptest.NewServer(r.e)
			t.Cleanup(ts.Close)
			specs = append(specs, replica.Spec{Name: r.e.name, URL: ts.URL, Role: r.role, Scheduling: r.sched})
		}
		ts, _ := serveRouter(t, specs, "semantic", CoreOptions{PD: PDOptions{MinPrefillTokens: -1}},
			ServerOptions{Priorities: map[string]int{"interactive": 10}})
		body := strings.Replace(pdChat, `"model":"m"`, `"model":"m","priority":-1000`, 1)
		send(t, ts.URL, "/v1/chat/completions", body, map[string]string{"X-Gateway-Inference-Objective": "interactive"})
		pb, db := p0.received(), d0.received()
		if len(pb) != 1 || len(db) != 1 {
			t.Fatalf("%d prefill and %d decode requests, want 1 each", len(pb), len(db))
		}
		want := func(s replica.Scheduling) string {
			if s.Prioritized() {
				return "-10"
			}
			return "none"
		}
		if got := priorityOf(pb[0]); got != want(tc.prefill) {
			t.Errorf("%q prefill replica: priority %s, want %s", tc.prefill, got, want(tc.prefill))
		}
		if got := priorityOf(db[0]); got != want(tc.decode) {
			t.Errorf("%q decode replica: priority %s, want %s", tc.decode, got, want(tc.decode))
		}
		if kv, _ := db[0]["kv_transfer_params"].(map[string]any); kv["remote_engine_id"] != "p0" {
			t.Errorf("the decode lost its kv_transfer_params: %v", db[0])
		}
	}
}

// The client's priority is scrubbed whatever the rest of the body holds,
// and the router adds the engine's as the last key of the same object.
func TestEnginePriorityBodyBytes(t *testing.T) {
	e := &recorder{}
	url := prioRouter(t, nil, map[string]*recorder{"p": e}, map[string]replica.Scheduling{"p": replica.SchedulingPriority})
	body := `{"model":"m","messages":[{"role":"user","content":"\"priority\":-999 is text"}],"priority":-1000,"metadata":{"priority":7}}`
	send(t, url, "/v1/chat/completions", body, map[string]string{"X-Gateway-Inference-Objective": "interactive"})
	got := e.take(t)
	if len(got) != 1 || priorityOf(got[0]) != "-10" {
		t.Fatalf("received %v", got)
	}
	md, _ := got[0]["metadata"].(map[string]any)
	msgs, _ := got[0]["messages"].([]any)
	if md["priority"] != float64(7) || len(msgs) != 1 || !strings.Contains(fmt.Sprint(msgs[0]), `"priority":-999 is text`) {
		t.Fatalf("the body's other fields changed: %v", got[0])
	}
}
