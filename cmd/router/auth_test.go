package main

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/apikey"
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
		code, b, _, err := postChat(r.http.url(), body, c.hdr)
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
	scraped := scrapeURL(t, r.http.url())
	for _, want := range []string{`semroute_tenant_requests_total{tenant="acme"} 4`, `semroute_auth_refused_total{reason="missing"} 2`, `semroute_auth_refused_total{reason="invalid"} 2`} {
		if !strings.Contains(scraped, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	// The file changes (a Secret rotated): the new key works, the old not.
	writeConfig(t, keys, fmt.Sprintf("keys:\n  - {name: a2, tenant: acme, sha256: %s}\n", apikey.Hash("sk-rotated")))
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, _, err := postURL(r.http.url(), body, map[string]string{"Authorization": "Bearer sk-rotated"})
		if err == nil && code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the rotated key is still refused: %d %v", code, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if code, _, _ := postURL(r.http.url(), body, map[string]string{"Authorization": "Bearer sk-acme"}); code != 401 {
		t.Fatalf("the removed key got %d", code)
	}
	// A broken file fails closed: no key is accepted until it is valid.
	if err := os.WriteFile(keys, []byte("keys: [broken"), 0o600); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); ; {
		if code, _, _ := postURL(r.http.url(), body, map[string]string{"Authorization": "Bearer sk-rotated"}); code == 401 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a broken keys file kept the key before it")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
