package router

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/semroute/semroute/apikey"
)

// respRouter is a router over sockets in front of replicas, with API keys
// (nil: none) and, with keys, strict response ids as the binary sets them.
func respRouter(t *testing.T, keys *apikey.Set, urls ...string) (string, *Core) {
	t.Helper()
	ts, core := serverWithCore(t, ServerOptions{Keys: keys}, CoreOptions{StrictResponses: keys != nil}, urls...)
	return ts.URL, core
}

// respCall is one request about stored responses, as a key holder sends it.
func respCall(t *testing.T, method, url, key, body string) (status int, replicaName string, id string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var r struct{ ID string }
	_ = json.NewDecoder(resp.Body).Decode(&r)
	return resp.StatusCode, resp.Header.Get(HeaderReplica), r.ID
}

func tenantKeys(t *testing.T) *apikey.Set {
	return loadKeys(t, "keys:\n"+
		"  - {tenant: acme, sha256: "+apikey.Hash("sk-acme")+"}\n"+
		"  - {tenant: bob, sha256: "+apikey.Hash("sk-bob")+"}\n")
}

// A stored response is its tenant's without any router memory: after a
// router restart, after 70,000 newer responses, and at another router
// (of a fleet, or the same one restarted), another tenant's GET, DELETE
// and continuation are refused before any replica, and the owner's work
// and reach the replica that stores the response.
func TestStoredResponseIsItsTenantsWithoutMemory(t *testing.T) {
	a, b := newFakeResponses(t, "a", true), newFakeResponses(t, "b", true)
	keys := tenantKeys(t)
	first, core := respRouter(t, keys, a.URL, b.URL)
	status, home, id := respCall(t, "POST", first+"/v1/responses", "sk-acme", `{"model":"m","input":"mine"}`)
	if status != 200 || !strings.HasPrefix(id, respIDPrefix) {
		t.Fatalf("created: %d, id %q: want 200 and an id the router issued", status, id)
	}
	// 70,000 newer responses: the router's memory of the engines' own
	// ids (the one thing it remembers) turns over; an id it issued needs
	// none of it.
	for i := range 70_000 {
		core.ids.remember(fmt.Sprintf("resp_engine_%d", i), "r0", "bob")
		if i%10_000 == 0 {
			core.ids.issue("r1", "bob")
		}
	}
	restarted, _ := respRouter(t, keys, a.URL, b.URL) // a new process: nothing remembered
	other, _ := respRouter(t, keys, a.URL, b.URL)     // another router
	cont := `{"model":"m","input":"more","previous_response_id":"` + id + `"}`
	for name, url := range map[string]string{"the first router, 70,000 responses later": first, "a restarted router": restarted, "another router": other} {
		before := a.hits.Load() + b.hits.Load()
		for _, c := range []struct{ method, path, body string }{
			{"POST", "/v1/responses", cont},
			{"GET", "/v1/responses/" + id, ""},
			{"DELETE", "/v1/responses/" + id, ""},
			{"POST", "/v1/responses/" + id + "/cancel", ""},
		} {
			if st, rep, _ := respCall(t, c.method, url+c.path, "sk-bob", c.body); st != http.StatusNotFound || rep != "" {
				t.Errorf("%s: bob's %s %s: %d via %q, want 404 from the router", name, c.method, c.path, st, rep)
			}
		}
		if n := a.hits.Load() + b.hits.Load(); n != before {
			t.Errorf("%s: bob's requests reached the replicas %d times", name, n-before)
		}
		if st, rep, _ := respCall(t, "GET", url+"/v1/responses/"+id, "sk-acme", ""); st != 200 || rep != home {
			t.Errorf("%s: acme's GET: %d via %s, want 200 via %s", name, st, rep, home)
		}
		if st, rep, next := respCall(t, "POST", url+"/v1/responses", "sk-acme", cont); st != 200 || rep != home || !strings.HasPrefix(next, respIDPrefix) {
			t.Errorf("%s: acme's continuation: %d via %s (id %q), want 200 via %s", name, st, rep, next, home)
		}
	}
	if st, rep, _ := respCall(t, "DELETE", other+"/v1/responses/"+id, "sk-acme", ""); st != 200 || rep != home {
		t.Errorf("acme's DELETE: %d via %s, want 200 via %s", st, rep, home)
	}
}

// An id naming a tenant is refused for every other: a MAC that does not
// verify, a changed tag, a truncated id, another tenant's id.
func TestResponseIDsVerify(t *testing.T) {
	k := newResponseIDs(true)
	id := k.issue("r1", "acme")
	if len(id) != respIDLen {
		t.Fatalf("id %q: %d bytes, want %d", id, len(id), respIDLen)
	}
	tag, ours, valid := k.open(id, "acme")
	if !ours || !valid || tag != replicaTag("r1") {
		t.Fatalf("the owner's id: ours %v valid %v tag %x", ours, valid, tag)
	}
	if _, ours, valid := k.open(id, "bob"); !ours || valid {
		t.Fatalf("another tenant's id: ours %v valid %v, want refused", ours, valid)
	}
	if _, ours, valid := k.open(id, ""); !ours || valid {
		t.Fatalf("no tenant: ours %v valid %v, want refused", ours, valid)
	}
	for i := len(respIDPrefix); i < len(id); i++ { // any character changed
		c := byte('A')
		if id[i] == 'A' {
			c = 'B'
		}
		bad := id[:i] + string(c) + id[i+1:]
		if _, _, valid := k.open(bad, "acme"); valid {
			t.Fatalf("id changed at %d verifies", i)
		}
	}
	if _, ours, _ := k.open(id[:len(id)-1], "acme"); ours {
		t.Fatal("a truncated id taken as the router's")
	}
	if k.issue("r1", "acme") == id {
		t.Fatal("two ids alike")
	}
	// Strict: an id neither issued nor remembered is refused; a
	// remembered one is its tenant's alone.
	if _, refused := k.home("resp_0123456789abcdef", "acme"); !refused {
		t.Fatal("an unknown id was not refused")
	}
	k.remember("resp_engine", "r0", "acme")
	if _, refused := k.home("resp_engine", "bob"); !refused {
		t.Fatal("another tenant's remembered id was not refused")
	}
	if allow, refused := k.home("resp_engine", "acme"); refused || allow == nil {
		t.Fatal("the owner's remembered id was refused")
	}
	// Without keys an unknown id is routed as any request.
	if allow, refused := newResponseIDs(false).home("resp_0123456789abcdef", ""); refused || allow != nil {
		t.Fatal("without keys an unknown id was refused")
	}
}

// An engine that ignores request_id (its ids are its own): the router
// remembers its ids for the tenant; once it cannot (a restart), it refuses
// them with keys on rather than let any tenant reach them.
func TestStoredResponseOfAnEngineThatMakesItsOwnIDs(t *testing.T) {
	a := newFakeResponses(t, "a", false)
	keys := tenantKeys(t)
	first, _ := respRouter(t, keys, a.URL)
	status, _, id := respCall(t, "POST", first+"/v1/responses", "sk-acme", `{"model":"m","input":"mine"}`)
	if status != 200 || strings.HasPrefix(id, respIDPrefix) {
		t.Fatalf("created: %d, id %q: want the engine's own", status, id)
	}
	if st, _, _ := respCall(t, "GET", first+"/v1/responses/"+id, "sk-acme", ""); st != 200 {
		t.Fatalf("acme's GET at the router that saw it: %d", st)
	}
	if st, _, _ := respCall(t, "GET", first+"/v1/responses/"+id, "sk-bob", ""); st != 404 {
		t.Fatalf("bob's GET at the router that saw it: %d", st)
	}
	restarted, _ := respRouter(t, keys, a.URL)
	before := a.hits.Load()
	for _, key := range []string{"sk-acme", "sk-bob"} {
		if st, _, _ := respCall(t, "GET", restarted+"/v1/responses/"+id, key, ""); st != 404 {
			t.Fatalf("%s's GET of an id a restarted router cannot prove: %d, want 404", key, st)
		}
	}
	if a.hits.Load() != before {
		t.Fatal("an unproven id reached the replica")
	}
}

// A client's request_id does not become a response's id: the router
// issues it.
func TestClientRequestIDReplaced(t *testing.T) {
	a := newFakeResponses(t, "a", true)
	url, _ := respRouter(t, tenantKeys(t), a.URL)
	status, _, id := respCall(t, "POST", url+"/v1/responses", "sk-acme", `{"model":"m","input":"hi","request_id":"resp_chosen","request\u005fid":"resp_chosen2"}`)
	if status != 200 || !strings.HasPrefix(id, respIDPrefix) {
		t.Fatalf("%d, id %q: want the router's", status, id)
	}
}

// A request that fails over is sent with an id naming the replica that
// took it: its continuations go there.
func TestResponseIDFollowsFailover(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close() // refuses connections: every request to it fails over
	live := newFakeResponses(t, "live", true)
	url, _ := respRouter(t, tenantKeys(t), dead.URL, live.URL)
	for i := range 4 { // round robin: some start at the dead replica
		status, rep, id := respCall(t, "POST", url+"/v1/responses", "sk-acme", `{"model":"m","input":"hi"}`)
		if status != 200 || rep != "r1" {
			t.Fatalf("request %d: %d via %s", i, status, rep)
		}
		st, rep, _ := respCall(t, "POST", url+"/v1/responses", "sk-acme", `{"model":"m","input":"more","previous_response_id":"`+id+`"}`)
		if st != 200 || rep != "r1" {
			t.Fatalf("continuation %d: %d via %s", i, st, rep)
		}
	}
}

// Through the endpoint picker too, a stored response's GET, DELETE and
// cancel are refused for another tenant before any replica, and the
// owner's go to the replica that stores it alone.
func TestExtProcStoredResponseIsItsTenants(t *testing.T) {
	p := startPicker(t, 1<<20, ExtProcOptions{})
	id := p.core.ids.issue("r1", "acme")
	for _, c := range []struct{ method, path, tenant string }{
		{"GET", "/v1/responses/" + id, "bob"},
		{"DELETE", "/v1/responses/" + id, "bob"},
		{"POST", "/v1/responses/" + id + "/cancel", "bob"},
		{"GET", "/v1/responses/" + id + "/", "acme"},
		{"GET", "/v1/responses/" + id + "/a/b", "acme"},
		{"POST", "/v1/messages/count_tokens/", "acme"},
	} {
		cl := p.open(t)
		cl.send(reqHeaders(fullDuplex, epHeaders(":method", c.method, ":path", c.path, "x-tenant-id", c.tenant), true))
		ir, _ := cl.end()
		if ir == nil || ir.GetStatus().GetCode() < 400 || ir.GetStatus().GetCode() >= 500 {
			t.Errorf("%s %s as %s: %v, want refused", c.method, c.path, c.tenant, ir)
		}
	}
	cl := p.open(t)
	cl.send(reqHeaders(fullDuplex, epHeaders(":method", "GET", ":path", "/v1/responses/"+id, "x-tenant-id", "acme"), true))
	r, err := cl.st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var dest string
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == HeaderDestination {
			dest = string(h.GetHeader().GetRawValue())
		}
	}
	if dest != "127.0.0.1:9001" {
		t.Fatalf("acme's GET went to %q, want r1 alone (127.0.0.1:9001)", dest)
	}
}
