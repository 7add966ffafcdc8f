package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
)

// poisonFront serves a simulated replica, except that it answers 500 to a
// request whose body says "poison", as vLLM does to some inputs, and, if
// metrics is not empty, serves it as the replica's /metrics.
func poisonFront(t *testing.T, metrics string) *httptest.Server {
	t.Helper()
	sims := startSims(t, 1, fastSim)
	target, _ := url.Parse(sims[0].URL)
	proxy := httputil.NewSingleHostReverseProxy(target)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if metrics != "" && r.URL.Path == "/metrics" {
			_, _ = io.WriteString(w, metrics)
			return
		}
		if r.Method == http.MethodPost {
			b, _ := io.ReadAll(r.Body)
			if bytes.Contains(b, []byte("poison")) {
				http.Error(w, `{"error":{"message":"internal error"}}`, http.StatusInternalServerError)
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(b))
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)
	return front
}

// clientFrom returns an HTTP client whose connections come from the
// loopback address ip (Linux routes all of 127.0.0.0/8 to lo), so that the
// router sees a client of that address.
func clientFrom(t *testing.T, ip string) *http.Client {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Skipf("no loopback address %s here: %v", ip, err)
	}
	l.Close()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	tr := &http.Transport{DialContext: d.DialContext}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: time.Minute}
}

// postFrom posts a chat request with content to the router at base with c.
func postFrom(t *testing.T, c *http.Client, base, content string) int {
	t.Helper()
	b, _ := json.Marshal(chat([2]string{"user", content}))
	resp, err := c.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// Attack 10 of issue 30, at volume, over sockets: one client sending 30
// requests in a row that make the replica answer 500 (past the default
// eject_min_volume of 20, every answer failed) leaves it in rotation; the
// 500s reach the client, and the replica serves everyone else.
func TestPoisonFromOneClientAtVolumeDoesNotEject(t *testing.T) {
	front := poisonFront(t, "")
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("health: {check_interval: 1h}\nreplicas:\n  - {name: a, url: %q}\n", front.URL))
	r := serveConfig(t, cfg)
	c := clientFrom(t, "127.0.0.1")
	for i := range 30 {
		if code := postFrom(t, c, r.http.URL(), fmt.Sprint("poison ", i)); code != 500 {
			t.Fatalf("poison request %d: %d, want the replica's 500", i, code)
		}
	}
	rep, _ := r.app.pool.Get("a")
	if !rep.Available(time.Now()) {
		t.Fatal("30 poison requests from one client ejected the replica")
	}
	if code := postFrom(t, clientFrom(t, "127.0.0.2"), r.http.URL(), "hello"); code != 200 {
		t.Fatalf("another client's request after the poison: %d", code)
	}
}

// A replica failing the requests of two clients is ejected: with
// eject_min_volume 4 and eject_consecutive 2, six failures in a row from
// one address do not, one more from a second address does.
func TestFailuresFromTwoClientsEject(t *testing.T) {
	front := poisonFront(t, "")
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf(`health: {check_interval: 1h, eject_base: 10m, eject_max: 1h, eject_consecutive: 2, eject_min_volume: 4}
replicas:
  - {name: a, url: %q}
`, front.URL))
	r := serveConfig(t, cfg)
	one, two := clientFrom(t, "127.0.0.1"), clientFrom(t, "127.0.0.2")
	rep, _ := r.app.pool.Get("a")
	for i := range 6 {
		if code := postFrom(t, one, r.http.URL(), fmt.Sprint("poison ", i)); code != 500 {
			t.Fatalf("poison request %d: %d", i, code)
		}
	}
	if !rep.Available(time.Now()) {
		t.Fatal("one client's failures ejected the replica")
	}
	if code := postFrom(t, two, r.http.URL(), "poison 6"); code != 500 {
		t.Fatalf("the second client's request: %d", code)
	}
	if rep.Available(time.Now()) {
		t.Fatal("failures from two clients, every answer failed, and the replica stayed in rotation")
	}
}

// Attack 9 of issue 30, over sockets: a replica whose /metrics reports a
// KV cache of 2^40 tokens (num_gpu_blocks × block_size) gets a picture
// bounded by cache.max_budget_tokens, and the clamp is counted.
func TestReportedBudgetIsClampedAndCounted(t *testing.T) {
	front := poisonFront(t, "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"68719476736\"} 1\n")
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf(`cache: {max_budget_tokens: 65536}
health: {check_interval: 1h, scrape_interval: 50ms}
replicas:
  - {name: a, url: %q}
`, front.URL))
	r := serveConfig(t, cfg)
	rep, _ := r.app.pool.Get("a")
	testwait.Until(t, "the replica's reported budget taken", func() bool { return rep.Budget() != 0 })
	st, _ := r.app.pic.Stats(rep.ID)
	if rep.Budget() != 65536 || st.Budget != 65536 {
		t.Fatalf("reported 2^40 tokens: replica budget %d, picture budget %d; want the bound 65536", rep.Budget(), st.Budget)
	}
	if m := scrapeURL(t, r.http.URL()); !strings.Contains(m, `semroute_replica_budget_clamped_total{replica="a"} 1`) {
		t.Fatalf("the clamp was not counted once:\n%s", grepLines(m, "budget"))
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
