package main

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/semroute/semroute/apikey"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/router"
)

// API keys at the router: a request without a key the router holds is
// answered 401 before any replica is touched; one with a key reaches a
// replica that wants its own key (vLLM's --api-key), which only the router
// knows, and counts for the key's tenant; the keys file is followed as it
// changes.
func TestAPIKeysAtTheRouter(t *testing.T) {
	o := fastSim
	o.APIKey = "upstream-secret"
	sims := startSims(t, 2, o)
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys.yaml")
	writeConfig(t, keys, fmt.Sprintf("keys:\n  - {name: a, tenant: acme, sha256: %s}\n", apikey.Hash("sk-acme")))
	cfg := filepath.Join(dir, "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("auth: {api_keys_file: %q, upstream_api_key: upstream-secret}\nreplicas:\n  - {name: a, url: %q}\n  - {name: b, url: %q}\n",
		keys, sims[0].URL, sims[1].URL))
	r := serveConfig(t, cfg)
	body := chat([2]string{"system", text("keys", 100)}, [2]string{"user", "hello"})
	for _, c := range []struct {
		name string
		hdr  map[string]string
		want int
	}{
		{"no key", nil, 401},
		{"a wrong key", map[string]string{"Authorization": "Bearer sk-nope"}, 401},
		{"the replicas' own key", map[string]string{"Authorization": "Bearer upstream-secret"}, 401},
		{"the key", map[string]string{"Authorization": "Bearer sk-acme", "X-Tenant-ID": "someone-else"}, 200},
		{"the key as x-api-key", map[string]string{"X-Api-Key": "sk-acme"}, 200},
		{"the key without a scheme", map[string]string{"Authorization": "sk-acme"}, 401},
		{"the key, the scheme in lower case", map[string]string{"Authorization": "bearer sk-acme"}, 200},
		{"the key as x-api-key beside a Basic Authorization", map[string]string{"Authorization": "Basic eDp5", "X-Api-Key": "sk-acme"}, 200},
	} {
		code, b, _, err := postChat(r.http.URL(), body, c.hdr)
		if err != nil || code != c.want {
			t.Fatalf("%s: %d %s (%v), want %d", c.name, code, b, err, c.want)
		}
		if c.want == 401 && !strings.Contains(b, `"code":"invalid_api_key"`) {
			t.Fatalf("%s: the 401 is not OpenAI's shape: %s", c.name, b)
		}
	}
	var requests, refused int64
	for _, s := range sims {
		requests, refused = requests+s.Stats().Requests, refused+s.Stats().Unauthorized
	}
	if requests != 4 || refused != 0 {
		t.Fatalf("the replicas saw %d requests and refused %d keys; want 4 and 0 (no refused request reaches one)", requests, refused)
	}
	scraped := scrapeURL(t, r.http.URL())
	// The unauthenticated /metrics names no tenant: a hash of its name.
	acme := router.TenantLabel(router.TenantHash, "acme")
	for _, want := range []string{`semroute_tenant_requests_total{tenant="` + acme + `"} 4`, `semroute_auth_refused_total{reason="missing"} 2`, `semroute_auth_refused_total{reason="invalid"} 2`} {
		if !strings.Contains(scraped, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(scraped, "acme") {
		t.Error("/metrics names the tenant acme")
	}
	// The file changes (a Secret rotated): the new key works, the old not.
	writeConfig(t, keys, fmt.Sprintf("keys:\n  - {name: a2, tenant: acme, sha256: %s}\n", apikey.Hash("sk-rotated")))
	testwait.Value(t, "the rotated key accepted", func() (string, bool) {
		code, _, err := postURL(r.http.URL(), body, map[string]string{"Authorization": "Bearer sk-rotated"})
		return fmt.Sprint(code, " ", err), err == nil && code == http.StatusOK
	})
	if code, _, _ := postURL(r.http.URL(), body, map[string]string{"Authorization": "Bearer sk-acme"}); code != 401 {
		t.Fatalf("the removed key got %d", code)
	}
	// A broken file fails closed: no key is accepted until it is valid.
	if err := os.WriteFile(keys, []byte("keys: [broken"), 0o600); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "a broken keys file to refuse the key before it", func() bool {
		code, _, _ := postURL(r.http.URL(), body, map[string]string{"Authorization": "Bearer sk-rotated"})
		return code == 401
	})
}

// The metrics on the admin listener alone, behind its token, and tenants
// by name or not at all, as configured.
func TestMetricsOnTheAdminListener(t *testing.T) {
	sims := startSims(t, 1, fastSim)
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys.yaml")
	writeConfig(t, keys, fmt.Sprintf("keys:\n  - {tenant: acme, sha256: %s}\n", apikey.Hash("sk-acme")))
	for _, labels := range []string{"name", "omit"} {
		cfg := filepath.Join(dir, labels+".yaml")
		writeConfig(t, cfg, fmt.Sprintf("auth: {api_keys_file: %q}\nadmin: {listen: 127.0.0.1:0, token: admin-secret}\n"+
			"metrics: {listener: admin, tenant_labels: %s}\nreplicas:\n  - {name: a, url: %q}\n", keys, labels, sims[0].URL))
		r := serveConfig(t, cfg)
		if code, _, _, err := postChat(r.http.URL(), chat([2]string{"user", "hello"}), map[string]string{"Authorization": "Bearer sk-acme"}); err != nil || code != 200 {
			t.Fatalf("%s: a request: %d %v", labels, code, err)
		}
		get := func(url, token string) (int, string) { return adminCall(t, url, token, "GET", "/metrics", "") }
		if code, _ := get(r.http.URL(), ""); code == 200 {
			t.Fatalf("%s: /metrics served on the main listener", labels)
		}
		if code, _ := get(r.admin.URL(), ""); code != 401 {
			t.Fatalf("%s: the admin listener's /metrics without its token: %d", labels, code)
		}
		code, scraped := get(r.admin.URL(), "admin-secret")
		want := map[string]string{"name": `semroute_tenant_requests_total{tenant="acme"} 1`, "omit": `semroute_tenant_requests_total{tenant="all"} 1`}[labels]
		if code != 200 || !strings.Contains(scraped, want) {
			t.Fatalf("%s: the admin listener's /metrics: %d, lacks %s", labels, code, want)
		}
	}
}
