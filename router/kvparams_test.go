package router

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// A client's kv_transfer_params never reach a replica: they are the
// router's to set, and a client's would have the engine pull KV from
// wherever they say. Aggregated chat (streamed or not), a completions
// batch, the Responses API, under any spelling the engine reads as the key.
func TestClientKVTransferParamsNeverReachAReplica(t *testing.T) {
	var mu sync.Mutex
	var got [][]byte
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, b)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"text":"ok","message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`)
	}))
	defer up.Close()
	ts, _ := serverFor(t, ServerOptions{}, up.URL)
	evil := `{"do_remote_prefill":true,"remote_host":"10.66.66.66","remote_port":5600}`
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":` + evil + `}`},
		{"/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}],"kv_transfer_params":` + evil + `}`},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer\u005fparams":` + evil + `}`},
		{"/v1/chat/completions", `{"kv_transfer_params":` + evil + `,"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":` + evil + `}`},
		{"/v1/completions", `{"model":"m","prompt":["a","b"],"kv_transfer_params":` + evil + `}`},
		{"/v1/responses", `{"model":"m","input":"hi","kv_transfer_params":` + evil + `}`},
	} {
		mu.Lock()
		got = nil
		mu.Unlock()
		resp, err := http.Post(ts.URL+c.path, "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		mu.Lock()
		if resp.StatusCode != 200 || len(got) != 1 {
			t.Fatalf("%s %s: %d, %d upstream requests", c.path, c.body, resp.StatusCode, len(got))
		}
		if bytes.Contains(got[0], []byte("10.66.66.66")) || bytes.Contains(got[0], []byte("kv_transfer")) {
			t.Errorf("%s: the replica received %s", c.path, got[0])
		}
		if !bytes.Contains(got[0], []byte(`"model":"m"`)) {
			t.Errorf("%s: the body lost its fields: %s", c.path, got[0])
		}
		mu.Unlock()
	}
}
