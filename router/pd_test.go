package router

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// pdEngine is a vLLM with a NIXL connector as the router sees it: a
// request with kv_transfer_params.do_remote_decode computes the prompt
// and answers one token with the parameters of its KV (unless mode says
// otherwise); any other is answered whole, its content saying whether it
// came with a prefill's parameters ("remote") or not ("local"). It keeps
// every body it received.
type pdEngine struct {
	name string
	mode string // "": answers; "fail": 503 to prefills; "fail500": 500; "noparams": prefills answered without kv_transfer_params

	mu     sync.Mutex
	bodies []map[string]any
	ids    []string // X-Request-Id of each
}

func (e *pdEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var m map[string]any
	if err := json.NewDecoder(r.Body).Decode(&m); err != nil {
		http.Error(w, err.Error(), 400)
		return
	}
	e.mu.Lock()
	e.bodies = append(e.bodies, m)
	e.ids = append(e.ids, r.Header.Get("X-Request-Id"))
	e.mu.Unlock()
	kv, _ := m["kv_transfer_params"].(map[string]any)
	if kv["do_remote_decode"] == true {
		switch e.mode {
		case "fail": // the replica's: failed over
			http.Error(w, "engine unavailable", 503)
			return
		case "fail500": // maybe the request's own: not tried elsewhere
			http.Error(w, "engine failed", 500)
			return
		case "noparams":
			fmt.Fprint(w, `{"id":"p","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":1}}`)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"p","object":"chat.completion","kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"remote_engine_id":%q,"remote_block_ids":[1,2],"remote_host":"10.0.0.1","remote_port":5600},"choices":[{"index":0,"message":{"role":"assistant","content":"PREFILL-TOKEN"},"finish_reason":"remote_decode"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`, e.name)
		return
	}
	content := "local"
	if kv["do_remote_prefill"] == true {
		content = "remote from " + kv["remote_engine_id"].(string)
	}
	if m["stream"] == true {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":%q}}]}\n\ndata: [DONE]\n\n", content)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"id":"d","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1}}`, content)
}

func (e *pdEngine) received() []map[string]any {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]map[string]any(nil), e.bodies...)
}

// pdServer is a Server over prefill engines ps and decode engines ds
// (named p0…, d0…), with metrics.
func pdServer(t *testing.T, o PDOptions, ps, ds []*pdEngine) (*httptest.Server, *Metrics) {
	ts, m, _ := pdServerLog(t, o, ps, ds)
	return ts, m
}

// pdLog keeps the decision log's records.
type pdLog struct {
	mu   sync.Mutex
	recs []*decisionlog.Record
}

func (l *pdLog) Log(r *decisionlog.Record) { l.mu.Lock(); l.recs = append(l.recs, r); l.mu.Unlock() }

func (l *pdLog) records() []*decisionlog.Record {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]*decisionlog.Record(nil), l.recs...)
}

// wait returns the records once there are n: the decode's is written when
// its handler ends, which may be after the client read the answer.
func (l *pdLog) wait(t *testing.T, n int) []*decisionlog.Record {
	t.Helper()
	testwait.Until(t, fmt.Sprint(n, " decision records"), func() bool { return len(l.records()) >= n })
	return l.records()
}

func pdServerLog(t *testing.T, o PDOptions, ps, ds []*pdEngine) (*httptest.Server, *Metrics, *pdLog) {
	t.Helper()
	var specs []replica.Spec
	for _, group := range []struct {
		es   []*pdEngine
		role replica.Role
	}{{ps, replica.RolePrefill}, {ds, replica.RoleDecode}} {
		for _, e := range group.es {
			ts := httptest.NewServer(e)
			t.Cleanup(ts.Close)
			specs = append(specs, replica.Spec{Name: e.name, URL: ts.URL, Role: group.role})
		}
	}
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	log := &pdLog{}
	ts, _ := serveRouter(t, specs, "semantic", CoreOptions{Metrics: m, PD: o, Log: log}, ServerOptions{})
	return ts, m, log
}

// pdChat is a chat request of a long document, streamed with usage.
var pdChat = `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":50,"min_tokens":5,"messages":[{"role":"system","content":"` +
	strings.Repeat("a long shared document ", 400) + `"},{"role":"user","content":"question"}]}`

func postPD(t *testing.T, url, body string) (*http.Response, string) {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// A request goes to a prefill replica rewritten as vLLM's reference proxy
// rewrites it, then to a decode replica with the kv_transfer_params the
// prefill returned; the client gets the decode replica's stream alone,
// and both replicas are named in the answer's headers.
func TestDisaggregated(t *testing.T) {
	p0, d0 := &pdEngine{name: "p0"}, &pdEngine{name: "d0"}
	ts, m, log := pdServerLog(t, PDOptions{}, []*pdEngine{p0}, []*pdEngine{d0})
	resp, body := postPD(t, ts.URL, pdChat)
	if resp.StatusCode != 200 || resp.Header.Get(HeaderPrefillReplica) != "p0" || resp.Header.Get(HeaderReplica) != "d0" {
		t.Fatalf("status %d, prefill %q, decode %q: %s", resp.StatusCode, resp.Header.Get(HeaderPrefillReplica), resp.Header.Get(HeaderReplica), body)
	}
	if !strings.Contains(body, "remote from p0") || strings.Contains(body, "PREFILL-TOKEN") {
		t.Fatalf("the client's stream is not the decode replica's alone: %s", body)
	}
	pb := p0.received()
	if len(pb) != 1 {
		t.Fatalf("the prefill replica got %d requests", len(pb))
	}
	kv, _ := pb[0]["kv_transfer_params"].(map[string]any)
	if kv["do_remote_decode"] != true || kv["do_remote_prefill"] != false || pb[0]["stream"] != false || pb[0]["max_tokens"] != 1.0 {
		t.Fatalf("prefill request: kv_transfer_params %v, stream %v, max_tokens %v", kv, pb[0]["stream"], pb[0]["max_tokens"])
	}
	for _, k := range []string{"stream_options", "min_tokens"} {
		if _, ok := pb[0][k]; ok {
			t.Errorf("the prefill request kept %s", k)
		}
	}
	db := d0.received()
	if len(db) != 1 {
		t.Fatalf("the decode replica got %d requests", len(db))
	}
	kv, _ = db[0]["kv_transfer_params"].(map[string]any)
	if kv["remote_engine_id"] != "p0" || kv["remote_port"] != 5600.0 || db[0]["stream"] != true || db[0]["max_tokens"] != 50.0 || db[0]["min_tokens"] != 5.0 {
		t.Fatalf("decode request: kv_transfer_params %v, stream %v, max_tokens %v, min_tokens %v", kv, db[0]["stream"], db[0]["max_tokens"], db[0]["min_tokens"])
	}
	if n := counterValue(m.pdRequests.WithLabelValues("disaggregated")); n != 1 {
		t.Fatalf("%v disaggregated requests counted", n)
	}
	if p, d := histogramCount(m.pdPrefill), histogramCount(m.pdDecodeFirst); p != 1 || d != 1 {
		t.Fatalf("timed %d prefills and %d decode first bytes, want 1 and 1", p, d)
	}
	p0.mu.Lock()
	d0.mu.Lock()
	if p0.ids[0] == "" || p0.ids[0] != d0.ids[0] {
		t.Errorf("X-Request-Id: prefill %q, decode %q; vLLM pairs them by one", p0.ids[0], d0.ids[0])
	}
	d0.mu.Unlock()
	p0.mu.Unlock()
	recs := log.wait(t, 2) // the prefill's first: it ends first
	if len(recs) != 2 || recs[0].Stage != "prefill" || recs[0].Chosen != "p0" || recs[1].Stage != "decode" || recs[1].Chosen != "d0" ||
		recs[0].Pair != recs[1].ID || recs[1].Pair != recs[0].ID || recs[1].Prefill != "p0" || recs[0].Outcome.PromptTokens != 9 {
		for _, r := range recs {
			t.Logf("%+v %+v", r, r.Outcome)
		}
		t.Fatal("the decision log does not link the prefill and decode decisions")
	}
}

// A prefill replica that fails is retried on another; when every one
// fails, or one answers without kv_transfer_params, the decode replica
// computes the prompt itself: the client gets its answer, the fallback is
// counted. A short prompt goes to the decode replica alone.
func TestDisaggregationFallbacks(t *testing.T) {
	t.Run("one prefill replica fails", func(t *testing.T) {
		bad, good, d0 := &pdEngine{name: "p0", mode: "fail"}, &pdEngine{name: "p1"}, &pdEngine{name: "d0"}
		ts, _ := pdServer(t, PDOptions{MinPrefillTokens: -1}, []*pdEngine{bad, good}, []*pdEngine{d0})
		for i := range 8 { // new prompts: the ranking puts either first
			resp, body := postPD(t, ts.URL, strings.ReplaceAll(pdChat, "a long shared document", fmt.Sprint("document ", i)))
			if resp.StatusCode != 200 || resp.Header.Get(HeaderPrefillReplica) != "p1" || !strings.Contains(body, "remote from p1") {
				t.Fatalf("status %d, prefill %q: %s", resp.StatusCode, resp.Header.Get(HeaderPrefillReplica), body)
			}
		}
		if len(bad.received()) == 0 {
			t.Fatal("no request was ranked to the failing prefill replica first: the failover went untested")
		}
	})
	t.Run("a 500 is not tried elsewhere", func(t *testing.T) {
		p0, p1, d0 := &pdEngine{name: "p0", mode: "fail500"}, &pdEngine{name: "p1", mode: "fail500"}, &pdEngine{name: "d0"}
		ts, m := pdServer(t, PDOptions{}, []*pdEngine{p0, p1}, []*pdEngine{d0})
		resp, body := postPD(t, ts.URL, pdChat)
		if resp.StatusCode != 200 || !strings.Contains(body, "local") || len(p0.received())+len(p1.received()) != 1 {
			t.Fatalf("status %d, prefills sent %d: %s", resp.StatusCode, len(p0.received())+len(p1.received()), body)
		}
		if n := counterValue(m.pdFallbacks.WithLabelValues(pdPrefillFailed)); n != 1 {
			t.Fatalf("%v fallbacks counted", n)
		}
	})
	t.Run("the client's own kv_transfer_params never reach a decode replica", func(t *testing.T) {
		p0, d0 := &pdEngine{name: "p0"}, &pdEngine{name: "d0"}
		ts, _ := pdServer(t, PDOptions{}, []*pdEngine{p0}, []*pdEngine{d0})
		resp, body := postPD(t, ts.URL, `{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"evil","remote_host":"169.254.169.254"}}`)
		if resp.StatusCode != 200 || !strings.Contains(body, "local") {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		if _, ok := d0.received()[0]["kv_transfer_params"]; ok {
			t.Fatal("the client's kv_transfer_params reached the decode replica")
		}
	})
	t.Run("a batch of prompts is served whole", func(t *testing.T) {
		p0, d0 := &pdEngine{name: "p0"}, &pdEngine{name: "d0"}
		ts, m := pdServer(t, PDOptions{MinPrefillTokens: -1}, []*pdEngine{p0}, []*pdEngine{d0})
		doc := strings.Repeat("a long shared document ", 400)
		resp, err := http.Post(ts.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":["`+doc+` one","`+doc+` two"]}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 || len(p0.received()) != 0 || counterValue(m.pdRequests.WithLabelValues("batch")) != 1 {
			t.Fatalf("status %d, %d prefills", resp.StatusCode, len(p0.received()))
		}
	})
	for _, c := range []struct{ mode, reason string }{{"fail", pdPrefillFailed}, {"noparams", pdNoParams}} {
		t.Run(c.reason, func(t *testing.T) {
			p0, d0 := &pdEngine{name: "p0", mode: c.mode}, &pdEngine{name: "d0"}
			ts, m := pdServer(t, PDOptions{}, []*pdEngine{p0}, []*pdEngine{d0})
			resp, body := postPD(t, ts.URL, pdChat)
			if resp.StatusCode != 200 || !strings.Contains(body, "local") {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			if _, ok := d0.received()[0]["kv_transfer_params"]; ok {
				t.Fatal("the decode replica was sent kv_transfer_params it cannot use")
			}
			if n := counterValue(m.pdFallbacks.WithLabelValues(c.reason)); n != 1 {
				t.Fatalf("%v fallbacks counted as %s", n, c.reason)
			}
		})
	}
	t.Run("short prompt", func(t *testing.T) {
		p0, d0 := &pdEngine{name: "p0"}, &pdEngine{name: "d0"}
		ts, m := pdServer(t, PDOptions{}, []*pdEngine{p0}, []*pdEngine{d0})
		resp, body := postPD(t, ts.URL, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
		if resp.StatusCode != 200 || resp.Header.Get(HeaderPrefillReplica) != "" || !strings.Contains(body, "local") || len(p0.received()) != 0 {
			t.Fatalf("status %d, prefill %q, %d prefills: %s", resp.StatusCode, resp.Header.Get(HeaderPrefillReplica), len(p0.received()), body)
		}
		if n := counterValue(m.pdRequests.WithLabelValues("short")); n != 1 {
			t.Fatalf("%v short requests counted", n)
		}
		if n := histogramCount(m.pdDecodeFirst); n != 0 {
			t.Fatalf("a request aggregated on its decode replica timed as disaggregated (%d)", n)
		}
	})
	t.Run("never a prefill replica for the rest", func(t *testing.T) {
		p0, d0 := &pdEngine{name: "p0"}, &pdEngine{name: "d0"}
		ts, _ := pdServer(t, PDOptions{}, []*pdEngine{p0}, []*pdEngine{d0})
		resp, err := http.Post(ts.URL+"/v1/embeddings", "application/json", strings.NewReader(`{"model":"m","input":"x"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.Header.Get(HeaderReplica) != "d0" || len(p0.received()) != 0 {
			t.Fatalf("an embeddings request went to %q", resp.Header.Get(HeaderReplica))
		}
	})
}

// histogramCount returns how many values histogram h observed.
func histogramCount(h prometheus.Histogram) uint64 {
	var m dto.Metric
	if err := h.Write(&m); err != nil {
		return 0
	}
	return m.GetHistogram().GetSampleCount()
}

// counterValue returns counter c's value.
func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

// The rewritten bodies keep the client's text as it came (no \u003c for
// every <), so a rewrite costs the body's size, not six times it.
func TestPrefillBodyKeepsText(t *testing.T) {
	in := []byte(`{"model":"m","prompt":"<a> & <b>","echo":true,"prompt_logprobs":5,"max_completion_tokens":9}`)
	m, err := fieldsOf(in)
	if err != nil {
		t.Fatal(err)
	}
	out, err := prefillBody(m, len(in))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), `"<a> & <b>"`) || strings.Contains(string(out), "echo") || strings.Contains(string(out), "prompt_logprobs") ||
		!strings.Contains(string(out), `"max_completion_tokens":1`) {
		t.Fatalf("prefill body: %s", out)
	}
}

// TestDisaggregatesOnlyWhenSooner: a request goes through a prefill
// replica when that replica and the KV's transfer are predicted to bring
// its first token sooner than its decode replica computing the prompt
// (each replica's learned service time), and stays aggregated, counted
// local, when its decode replica is the faster.
func TestDisaggregatesOnlyWhenSooner(t *testing.T) {
	for _, tc := range []struct {
		name              string
		prefill, decode   time.Duration // seconds a prompt token on each
		wantDisaggregated bool
	}{
		{"prefill replica 10x faster", 100 * time.Microsecond, time.Millisecond, true},
		{"decode replica 10x faster", time.Millisecond, 100 * time.Microsecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			now := time.Unix(1000, 0)
			e, err := routing.New(routing.Options{Replicas: []replica.Spec{
				{Name: "p0", URL: "http://127.0.0.1:9000", Role: replica.RolePrefill},
				{Name: "d0", URL: "http://127.0.0.1:9001", Role: replica.RoleDecode}},
				Engine: routing.EngineOptions{Now: func() time.Time { return now }}})
			if err != nil {
				t.Fatal(err)
			}
			pol, _ := routing.NewPolicy(routing.PolicySpec{Type: "semantic"})
			c, _ := NewCore(CoreOptions{Engine: e, Arms: []Arm{{Name: "default", Policy: pol, Weight: 1}}})
			rs := e.Pool().Replicas()
			teach(rs[0], now, tc.prefill)
			teach(rs[1], now, tc.decode)
			in := e.Prepare(parseChat(t, "user", strings.Repeat("a long document to prefill ", 300)), "", false)
			p, err := c.Place(CoreRequest{Input: in, Route: "chat", Disaggregate: true})
			if err != nil {
				t.Fatal(err)
			}
			if got := p.Prefill != nil; got != tc.wantDisaggregated {
				t.Fatalf("disaggregated %v, want %v", got, tc.wantDisaggregated)
			}
			if p.Prefill != nil {
				c.Finish(p.Prefill, Outcome{Status: 200}, nil)
			}
			c.Finish(p.Routed, Outcome{Status: 200}, nil)
		})
	}
}
