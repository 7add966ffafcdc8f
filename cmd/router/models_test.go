package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/simreplica"
)

// Two models on four replicas (two each) and a LoRA adapter of one of
// them: no request reaches a replica that does not serve its model (the
// simulated replicas, as vLLM, refuse a model they do not serve with 404);
// a model nobody serves is a 404 in OpenAI's shape that touches no replica;
// the adapter's requests go to the replica that has it loaded while it
// does; /v1/models lists each model once.
func TestE2EModelAwarePools(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "models.yaml")
	os.WriteFile(cfg, []byte("health:\n  scrape_interval: 50ms\n"), 0o600)
	sim := fastSim
	sim.InterToken = 5 * time.Millisecond
	d := startTestDemo(t, demoOptions{sim: sim, config: cfg, models: []string{"alpha", "beta"},
		simFor: func(i int, o *simreplica.Options) {
			if o.Model == "alpha" {
				o.LoRAs = []string{"alpha-sql"} // registered on both alpha replicas
			}
		}})
	waitModels(t, d)
	serves := map[string][]string{"alpha": {"sim-0", "sim-2"}, "alpha-sql": {"sim-0", "sim-2"}, "beta": {"sim-1", "sim-3"}}

	// Mixed traffic, four at a time.
	var wg sync.WaitGroup
	errs := make(chan string, 64)
	for i := 0; i < 48; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			model := []string{"alpha", "beta", "alpha-sql"}[i%3]
			b := chat([2]string{"system", text(fmt.Sprintf("%s system %d", model, i%4), 200)}, [2]string{"user", fmt.Sprint("q", i)})
			b["model"] = model
			r := post(t, d, "/v1/chat/completions", b, nil)
			if r.status != 200 || !contains(serves[model], r.replica) {
				errs <- fmt.Sprintf("%s went to %s: %d %s", model, r.replica, r.status, r.body)
			}
		}()
		if i%4 == 3 {
			wg.Wait()
		}
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	var before int64
	for _, s := range d.sims {
		before += s.Stats().Requests
	}
	if before != 48 {
		t.Fatalf("the replicas admitted %d requests of 48", before)
	}

	// A model nobody serves.
	b := chat([2]string{"user", "hi"})
	b["model"] = "gamma"
	r := post(t, d, "/v1/chat/completions", b, nil)
	var e struct {
		Error struct{ Message, Type, Code string }
	}
	if r.status != http.StatusNotFound || json.Unmarshal(r.body, &e) != nil || e.Error.Code != "model_not_found" ||
		e.Error.Type != "invalid_request_error" || !strings.Contains(e.Error.Message, "`gamma` does not exist") {
		t.Fatalf("unknown model: %d %s", r.status, r.body)
	}
	var after int64
	for _, s := range d.sims {
		after += s.Stats().Requests
	}
	if after != before {
		t.Fatalf("an unknown model reached a replica")
	}

	// The adapter: a long stream loads it on one replica; while it runs,
	// every other request for it goes there, whatever its prompt. First the
	// router's picture of the adapters must have caught up with the end of
	// the traffic above (the metrics are scraped every 50 ms).
	testwait.Until(t, "the adapters to look idle after the traffic ended", func() bool {
		for _, rep := range d.app.core.Engine().Pool().Replicas() {
			if m := rep.Models(); m != nil && (len(m.Running) > 0 || len(m.Waiting) > 0) {
				return false
			}
		}
		return true
	})
	long := chat([2]string{"user", text("long adapter stream", 50)})
	long["model"], long["stream"], long["max_tokens"] = "alpha-sql", true, 400 // 2 s
	first := make(chan result, 1)
	go func() { first <- post(t, d, "/v1/chat/completions", long, nil) }()
	loaded := testwait.Value(t, "the router to see the adapter running", func() (string, bool) {
		for _, rep := range d.app.core.Engine().Pool().Replicas() {
			if m := rep.Models(); m != nil && contains(m.Running, "alpha-sql") {
				return rep.Name, true
			}
		}
		return "", false
	})
	for i := 0; i < 8; i++ {
		b := chat([2]string{"system", text(fmt.Sprint("other prompt ", i), 200)}, [2]string{"user", "x"})
		b["model"] = "alpha-sql"
		if r := post(t, d, "/v1/chat/completions", b, nil); r.status != 200 || r.replica != loaded {
			t.Fatalf("adapter request %d went to %s (%d), the adapter is loaded on %s", i, r.replica, r.status, loaded)
		}
	}
	if r := <-first; r.status != 200 || r.replica != loaded {
		t.Fatalf("the long stream: %d on %s", r.status, r.replica)
	}

	// /v1/models: each model once.
	resp, err := http.Get(d.router.URL() + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct{ ID string } `json:"data"`
	}
	json.NewDecoder(resp.Body).Decode(&list)
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if strings.Join(ids, ",") != "alpha,alpha-sql,beta" {
		t.Fatalf("/v1/models: %v", ids)
	}
}

// GET /v1/models/{id} answers from the merged list, for ids with slashes
// too, sent as they are or encoded.
func TestModelByID(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, models: []string{"org/model-a", "beta"}})
	waitModels(t, d)
	for _, c := range []struct {
		path string
		code int
		id   string
	}{
		{"/v1/models/org/model-a", 200, "org/model-a"},
		{"/v1/models/org%2Fmodel-a", 200, "org/model-a"},
		{"/v1/models/beta", 200, "beta"},
		{"/v1/models/nope", 404, ""},
		{"/v1/models/%2e%2e/x", 400, ""},
	} {
		resp, err := http.Get(d.router.URL() + c.path)
		if err != nil {
			t.Fatal(err)
		}
		var m struct {
			ID    string `json:"id"`
			Error struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		json.NewDecoder(resp.Body).Decode(&m)
		resp.Body.Close()
		if resp.StatusCode != c.code || m.ID != c.id || (c.code == 404 && m.Error.Code != "model_not_found") {
			t.Errorf("%s: %d %+v, want %d %q", c.path, resp.StatusCode, m, c.code, c.id)
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// An adapter loaded while serving (vLLM's /v1/load_lora_adapter) is
// routed at once, not after the next scrape: a request for a model no
// replica lists has the lists read again before it is refused.
func TestE2EAdapterLoadedAtRuntime(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "models.yaml")
	os.WriteFile(cfg, []byte("health:\n  scrape_interval: 1h\n"), 0o600) // only the first scrape, at start
	d := startTestDemo(t, demoOptions{sim: fastSim, config: cfg, models: []string{"alpha", "beta"},
		simFor: func(i int, o *simreplica.Options) { o.EnableLoRA = o.Model == "alpha" }})
	waitModels(t, d)
	b := chat([2]string{"user", "hi"})
	b["model"] = "alpha-new"
	if r := post(t, d, "/v1/chat/completions", b, nil); r.status != http.StatusNotFound {
		t.Fatalf("before the adapter is loaded: %d %s", r.status, r.body)
	}
	resp, err := http.Post(d.sims[2].URL+"/v1/load_lora_adapter", "application/json",
		strings.NewReader(`{"lora_name":"alpha-new","lora_path":"/adapters/new"}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("load: %v %v", resp, err)
	}
	resp.Body.Close()
	// A request for a model no replica lists refreshes the lists, paced at
	// one a second: it is routed once a refresh after the load has run.
	testwait.Until(t, "the new adapter routed to sim-2", func() bool {
		r := post(t, d, "/v1/chat/completions", b, nil)
		if r.status == 200 && r.replica == "sim-2" {
			return true
		}
		if r.status != http.StatusNotFound {
			t.Fatalf("after the adapter was loaded on sim-2: %d on %s: %s", r.status, r.replica, r.body)
		}
		return false
	})
}

// Without a tracer the router makes no span, and a client's traceparent
// reaches the replica unchanged.
func TestTraceparentPassesThroughWithoutTracing(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, replicas: 1})
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	if r := post(t, d, "/v1/chat/completions", chat([2]string{"user", "hi"}), map[string]string{"traceparent": tp}); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if got := d.sims[0].LastTraceparent(); got != tp {
		t.Fatalf("the replica saw traceparent %q, want %q", got, tp)
	}
}
