package router

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/replica"
)

// Issue 43, item 7: a hung prefill replica cost every disaggregated
// request the whole first-byte timeout and was never ejected at low
// traffic; with the prefill pool gone the decode replicas took the work
// unseen. These tests run the router with a general first-byte timeout of
// an hour and a client that gives up after pdClientTimeout: a request
// that waited for the general timeout fails them. The prefill's own
// bound is pdFloor (its throughput term made negligible), far more than
// a healthy replica here takes to answer; no test waits on a clock of
// its own.
const (
	pdFloor         = 500 * time.Millisecond
	pdClientTimeout = 30 * time.Second
)

// hungEngine accepts requests and never answers them: a hung engine. It
// counts the requests it took; each is let go when the router gives up
// on it.
type hungEngine struct {
	took atomic.Int64
}

func (h *hungEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body) // read whole: the server then sees the router hang up
	h.took.Add(1)
	<-r.Context().Done()
}

// pdRig is a router over prefill and decode handlers, bounded as above,
// with its pool and metrics.
type pdRig struct {
	url    string
	pool   *replica.Pool
	m      *Metrics
	reg    *prometheus.Registry
	client *http.Client
}

// pdReplica is a replica of a rig: its name, role and handler (nil: a
// server that is closed, refusing connections).
type pdReplica struct {
	name string
	role replica.Role
	h    http.Handler
}

func newPDRig(t *testing.T, ej replica.Ejection, reps ...pdReplica) *pdRig {
	t.Helper()
	var specs []replica.Spec
	for _, r := range reps {
		ts := httptest.NewServer(orNotFound(r.h))
		if r.h == nil {
			ts.Close() // its address refuses connections
		} else {
			t.Cleanup(ts.Close)
		}
		specs = append(specs, replica.Spec{Name: r.name, URL: ts.URL, Role: r.role})
	}
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	ts, core := serveRouter(t, specs, "semantic", CoreOptions{Metrics: m, PD: PDOptions{MinPrefillTokens: -1}},
		ServerOptions{Ejection: ej, Timeouts: limits.Timeouts{FirstByte: time.Hour, PrefillFloor: pdFloor, PrefillTokensPerSecond: 1e12}})
	return &pdRig{url: ts.URL, pool: core.e.Pool(), m: m, reg: reg, client: &http.Client{Timeout: pdClientTimeout}}
}

func orNotFound(h http.Handler) http.Handler {
	if h == nil {
		return http.NotFoundHandler()
	}
	return h
}

// post sends chat request i (a long prompt of its own) and returns the
// answer's prefill replica and body; it fails the test unless the answer
// is a 200.
func (g *pdRig) post(t *testing.T, i int) (prefill, body string) {
	t.Helper()
	req := strings.ReplaceAll(pdChat, "a long shared document", fmt.Sprint("document ", i))
	resp, err := g.client.Post(g.url+"/v1/chat/completions", "application/json", strings.NewReader(req))
	if err != nil {
		t.Fatalf("request %d: %v (did it wait for the general first-byte timeout?)", i, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("request %d: status %d: %s", i, resp.StatusCode, b)
	}
	return resp.Header.Get(HeaderPrefillReplica), string(b)
}

// fallbacks returns semroute_pd_fallbacks_total by reason.
func (g *pdRig) fallbacks() map[string]float64 {
	out := map[string]float64{}
	for _, r := range pdFallbackReasons {
		out[r] = counterValue(g.m.pdFallbacks.WithLabelValues(r))
	}
	return out
}

// healthy reports whether the named replica is in rotation (not ejected).
func (g *pdRig) healthy(name string) bool {
	r, _ := g.pool.Get(name)
	return r.Healthy(time.Now())
}

// (a) One of two prefill replicas hangs; one client sends a request at a
// time, far below the volume passive ejection weighs. Each request that
// meets the hung replica is answered once the prefill's own bound passes
// (by its decode replica alone: counted as prefill_timeout); the third
// such timeout ejects it, and no request goes to it after; every other
// request is disaggregated through the good one.
func TestHungPrefillReplicaEjectedAtLowTraffic(t *testing.T) {
	hung, good, d0 := &hungEngine{}, &pdEngine{name: "p1"}, &pdEngine{name: "d0"}
	g := newPDRig(t, replica.Ejection{Base: time.Hour}, // out for the rest of the test once ejected
		pdReplica{"p0", replica.RolePrefill, hung}, pdReplica{"p1", replica.RolePrefill, good}, pdReplica{"d0", replica.RoleDecode, d0})
	i := 0
	for ; g.healthy("p0"); i++ {
		if i == 60 {
			t.Fatalf("after %d requests the hung replica, sent %d, is still in rotation", i, hung.took.Load())
		}
		before := hung.took.Load()
		prefill, body := g.post(t, i)
		switch {
		case hung.took.Load() > before: // met the hung replica: served whole by d0, or through p1
			if !strings.Contains(body, "local") && !strings.Contains(body, "remote from p1") {
				t.Fatalf("request %d met p0: prefill %q: %s", i, prefill, body)
			}
		case prefill != "p1" || !strings.Contains(body, "remote from p1"):
			t.Fatalf("request %d: prefill %q: %s", i, prefill, body)
		}
	}
	took := hung.took.Load()
	if took > 3 {
		t.Fatalf("the hung replica took %d requests before it was ejected, want at most 3", took)
	}
	for j := i; j < i+10; j++ {
		if prefill, body := g.post(t, j); prefill != "p1" || !strings.Contains(body, "remote from p1") {
			t.Fatalf("request %d after the ejection: prefill %q: %s", j, prefill, body)
		}
	}
	if hung.took.Load() != took {
		t.Fatalf("the ejected replica took %d more requests", hung.took.Load()-took)
	}
	fb := g.fallbacks()
	if fb[pdPrefillTimeout] != float64(took) || fb[pdNoPrefill]+fb[pdPrefillFailed]+fb[pdRefused]+fb[pdNoParams] != 0 {
		t.Fatalf("fallbacks %v; want %d prefill_timeout alone", fb, took)
	}
	t.Logf("the hung replica took %d of %d requests and was ejected", took, i)
}

// postAggregated sends request i and fails the test unless its decode
// replica alone answered it.
func (g *pdRig) postAggregated(t *testing.T, i int) {
	t.Helper()
	if prefill, body := g.post(t, i); prefill != "" || !strings.Contains(body, "local") {
		t.Fatalf("request %d: prefill %q: %s", i, prefill, body)
	}
}

// Every reason of semroute_pd_fallbacks_total is a series from the
// start, at 0, as the project's other series are.
func TestPDFallbackReasonsFromZero(t *testing.T) {
	g := newPDRig(t, replica.Ejection{}, pdReplica{"p0", replica.RolePrefill, &pdEngine{name: "p0"}}, pdReplica{"d0", replica.RoleDecode, &pdEngine{name: "d0"}})
	fams, err := g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, f := range fams {
		if f.GetName() != "semroute_pd_fallbacks_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				seen[l.GetValue()] = l.GetName() == "reason" && m.GetCounter().GetValue() == 0
			}
		}
	}
	for _, r := range []string{"no_prefill_replica", "prefill_failed", "prefill_timeout", "prefill_refused", "no_transfer_params"} {
		if !seen[r] {
			t.Errorf("semroute_pd_fallbacks_total{reason=%q} is not a series at 0 before any request (have %v)", r, seen)
		}
	}
}

// (b) With every prefill replica hung, down or failing its health
// checks, each request is served by its decode replica alone, counted by
// reason; once the pool is out (ejected, or down), at once: no prefill
// replica is tried.
//
// Both prefill replicas hung: each request meets one (never both: a
// timeout gives the prefill up) until the third timeout of each ejects
// it; from then on none is tried. Every request is served by its decode
// replica, counted as prefill_timeout, then as no_prefill_replica.
func TestHungPrefillPoolServedAggregated(t *testing.T) {
	h0, h1, d0 := &hungEngine{}, &hungEngine{}, &pdEngine{name: "d0"}
	g := newPDRig(t, replica.Ejection{Base: time.Hour},
		pdReplica{"p0", replica.RolePrefill, h0}, pdReplica{"p1", replica.RolePrefill, h1}, pdReplica{"d0", replica.RoleDecode, d0})
	took := func() int64 { return h0.took.Load() + h1.took.Load() }
	n := 0
	for ; g.healthy("p0") || g.healthy("p1"); n++ {
		if n == 20 {
			t.Fatalf("after %d requests the hung replicas, sent %d and %d, are not both ejected", n, h0.took.Load(), h1.took.Load())
		}
		before := took()
		g.postAggregated(t, n)
		if tried := took() - before; tried != 1 {
			t.Fatalf("request %d was sent to %d hung prefill replicas, want 1: a timeout gives the prefill up", n, tried)
		}
	}
	if h0.took.Load() > 3 || h1.took.Load() > 3 {
		t.Fatalf("the hung replicas took %d and %d requests before they were ejected, want at most 3 each", h0.took.Load(), h1.took.Load())
	}
	hung := took()
	for j := n; j < n+5; j++ {
		g.postAggregated(t, j)
	}
	if took() != hung {
		t.Fatal("a prefill replica was tried after the pool was ejected")
	}
	if fb := g.fallbacks(); fb[pdPrefillTimeout] != float64(hung) || fb[pdNoPrefill] != 5 || fb[pdPrefillFailed] != 0 {
		t.Fatalf("fallbacks %v; want prefill_timeout %d, no_prefill_replica 5", fb, hung)
	}
	if n := len(d0.received()); n != int(hung)+5 {
		t.Fatalf("the decode replica served %d requests, want %d", n, hung+5)
	}
}

// (b) Both prefill replicas down (refusing connections): the first
// request tries each (each ejected at once) and is counted
// prefill_failed; the rest find no prefill replica.
func TestDownPrefillPoolServedAggregated(t *testing.T) {
	g := newPDRig(t, replica.Ejection{Base: time.Hour},
		pdReplica{"p0", replica.RolePrefill, nil}, pdReplica{"p1", replica.RolePrefill, nil}, pdReplica{"d0", replica.RoleDecode, &pdEngine{name: "d0"}})
	for i := range 4 {
		g.postAggregated(t, i)
	}
	if fb := g.fallbacks(); fb[pdPrefillFailed] != 1 || fb[pdNoPrefill] != 3 {
		t.Fatalf("fallbacks %v; want prefill_failed 1, no_prefill_replica 3", fb)
	}
}

// (b) The prefill replica fails its health checks: its requests are
// served by their decode replica, counted as no_prefill_replica, none
// sent to it; back up, they are disaggregated again.
func TestUnhealthyPrefillPoolServedAggregated(t *testing.T) {
	p0 := &pdEngine{name: "p0"}
	g := newPDRig(t, replica.Ejection{}, pdReplica{"p0", replica.RolePrefill, p0}, pdReplica{"d0", replica.RoleDecode, &pdEngine{name: "d0"}})
	r, _ := g.pool.Get("p0")
	r.Checked(false, 1, 1) // marked down by an active check
	for i := range 3 {
		g.postAggregated(t, i)
	}
	if fb := g.fallbacks(); fb[pdNoPrefill] != 3 || len(p0.received()) != 0 {
		t.Fatalf("fallbacks %v, prefills sent %d; want no_prefill_replica 3, none sent", fb, len(p0.received()))
	}
	r.Checked(true, 1, 1) // back: disaggregated again
	if prefill, body := g.post(t, 3); prefill != "p0" || !strings.Contains(body, "remote from p0") {
		t.Fatalf("back up: prefill %q: %s", prefill, body)
	}
}
