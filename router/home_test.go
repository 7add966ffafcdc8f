package router

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// fakeResponses is a replica that stores responses in memory, as vLLM does,
// under the body's request_id when it has one (vLLM's ResponsesRequest),
// else under an id of its own.
func fakeResponses(t *testing.T, name string) *httptest.Server {
	return newFakeResponses(t, name, true).Server
}

// responsesReplica is fakeResponses with its requests counted; honour says
// it takes request_id as vLLM does (false: as an engine that makes every
// id itself).
type responsesReplica struct {
	*httptest.Server
	hits atomic.Int64 // every request received
}

func newFakeResponses(t *testing.T, name string, honour bool) *responsesReplica {
	var mu sync.Mutex
	stored := map[string]bool{}
	var n atomic.Int64
	rr := &responsesReplica{}
	rr.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rr.hits.Add(1)
		if r.Method == "POST" && r.URL.Path == "/v1/responses" {
			var body struct {
				Prev      string `json:"previous_response_id"`
				RequestID string `json:"request_id"`
			}
			b, _ := io.ReadAll(r.Body)
			_ = json.Unmarshal(b, &body)
			mu.Lock()
			defer mu.Unlock()
			if body.Prev != "" && !stored[body.Prev] {
				w.WriteHeader(404)
				fmt.Fprintf(w, `{"error":{"message":"previous response %s not found"}}`, body.Prev)
				return
			}
			id := fmt.Sprintf("resp_%s_%d", name, n.Add(1))
			if honour && body.RequestID != "" {
				id = body.RequestID
			}
			stored[id] = true
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":%q,"object":"response","usage":{"input_tokens":3,"output_tokens":1}}`, id)
			return
		}
		if strings.HasPrefix(r.URL.Path, "/v1/responses/") {
			id := strings.TrimPrefix(r.URL.Path, "/v1/responses/")
			mu.Lock()
			defer mu.Unlock()
			if !stored[id] {
				w.WriteHeader(404)
				return
			}
			if r.Method == http.MethodDelete {
				delete(stored, id)
			}
			fmt.Fprintf(w, `{"id":%q,"object":"response"}`, id)
			return
		}
		w.WriteHeader(404)
	}))
	t.Cleanup(rr.Close)
	return rr
}

// A stored response's replica is used for its continuations and fetches
// while it drains (it still holds the response); while it is down they
// are refused 503, which the client may retry, not sent where the
// response is not (a 404).
func TestStoredResponseHomeDrainingOrDown(t *testing.T) {
	a, b := fakeResponses(t, "a"), fakeResponses(t, "b")
	defer a.Close()
	defer b.Close()
	ts, e := serverFor(t, ServerOptions{}, a.URL, b.URL)
	resp, err := http.Post(ts.URL+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	var r struct{ ID string }
	_ = json.NewDecoder(resp.Body).Decode(&r)
	resp.Body.Close()
	home := resp.Header.Get(HeaderReplica)
	rep, _ := e.Pool().Get(home)
	rep.Drain()
	for i := 0; i < 3; i++ {
		g, _ := http.Get(ts.URL + "/v1/responses/" + r.ID)
		g.Body.Close()
		c, _ := http.Post(ts.URL+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"more","previous_response_id":"`+r.ID+`"}`))
		cb, _ := io.ReadAll(c.Body)
		c.Body.Close()
		if g.StatusCode != 200 || c.StatusCode != 200 || g.Header.Get(HeaderReplica) != home || c.Header.Get(HeaderReplica) != home {
			t.Fatalf("home %s draining: GET %d via %s; continue %d via %s %s", home, g.StatusCode, g.Header.Get(HeaderReplica), c.StatusCode, c.Header.Get(HeaderReplica), cb)
		}
	}
	// New requests keep off the draining replica.
	n, _ := http.Post(ts.URL+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"a new conversation"}`))
	n.Body.Close()
	if n.StatusCode != 200 || n.Header.Get(HeaderReplica) == home {
		t.Fatalf("a new request went to the draining %s (%d)", n.Header.Get(HeaderReplica), n.StatusCode)
	}
	// Down: refused, retryable.
	rep.Undrain()
	rep.Checked(false, 1, 1) // its active check failed: down
	c, _ := http.Post(ts.URL+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"more","previous_response_id":"`+r.ID+`"}`))
	c.Body.Close()
	if c.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("a continuation of a response on the down %s: %d via %s", home, c.StatusCode, c.Header.Get(HeaderReplica))
	}
}

// A stored response is its tenant's: another tenant's continuation or
// fetch of it is answered 404, without touching a replica.
func TestStoredResponseIsItsTenants(t *testing.T) {
	a, b := fakeResponses(t, "a"), fakeResponses(t, "b")
	defer a.Close()
	defer b.Close()
	ts, _ := serverFor(t, ServerOptions{}, a.URL, b.URL)
	do := func(method, path, tenant, body string) *http.Response {
		req, _ := http.NewRequest(method, ts.URL+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set(HeaderTenantID, tenant)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	resp, err := http.Post(ts.URL+"/v1/responses", "application/json", strings.NewReader(`{"model":"m","input":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	req, _ := http.NewRequest(http.MethodPost, ts.URL+"/v1/responses", strings.NewReader(`{"model":"m","input":"mine"}`))
	req.Header.Set(HeaderTenantID, "acme")
	req.Header.Set("Content-Type", "application/json")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var r struct{ ID string }
	_ = json.NewDecoder(resp.Body).Decode(&r)
	resp.Body.Close()
	cont := `{"model":"m","input":"more","previous_response_id":"` + r.ID + `"}`
	for _, c := range []struct {
		method, path, tenant, body string
		want                       int
	}{
		{"POST", "/v1/responses", "globex", cont, 404},
		{"GET", "/v1/responses/" + r.ID, "globex", "", 404},
		{"DELETE", "/v1/responses/" + r.ID, "", "", 404},
		{"POST", "/v1/responses", "acme", cont, 200},
		{"GET", "/v1/responses/" + r.ID, "acme", "", 200},
	} {
		if got := do(c.method, c.path, c.tenant, c.body); got.StatusCode != c.want {
			t.Errorf("%s %s as %q: %d, want %d", c.method, c.path, c.tenant, got.StatusCode, c.want)
		}
	}
}
