package router

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/semroute/semroute/apikey"
	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// heldRouter is a router, over sockets, with flow control, in front of one
// replica of one slot that holds each request it receives until the test
// lets one go (next): what the replica received, in order, comes out of
// arrived (each request's first message). Safe for one test goroutine.
type heldRouter struct {
	t       *testing.T
	core    *Core
	url     string
	arrived chan string   // buffered: every request the replica received
	release chan struct{} // one send lets one held request answer
}

// newHeldRouter starts a heldRouter whose requests need keys (nil: none)
// and whose objectives name priorities. Its flow control keeps no slots
// for higher priorities (CoreOptions.Reserve −1): the order the queue
// gives is the one the test sees.
func newHeldRouter(t *testing.T, keys *apikey.Set, priorities map[string]int) *heldRouter {
	t.Helper()
	h := &heldRouter{t: t, arrived: make(chan string, 64), release: make(chan struct{})}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Messages []struct{ Content string } }
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || len(req.Messages) == 0 {
			http.Error(w, "no message", http.StatusBadRequest)
			return
		}
		h.arrived <- req.Messages[0].Content
		<-h.release
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`)
	}))
	e, err := routing.New(routing.Options{Replicas: []replica.Spec{{Name: "r0", URL: up.URL, MaxRunning: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	rr, _ := routing.NewPolicy(routing.PolicySpec{Type: "round_robin"})
	h.core, err = NewCore(CoreOptions{Engine: e, Arms: []Arm{{Name: "default", Policy: rr, Weight: 1}}, Flow: &flow.Options[*replica.Replica]{}, Reserve: -1})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := NewServer(ServerOptions{Core: h.core, Keys: keys, Priorities: priorities,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	h.url = ts.URL
	t.Cleanup(up.Close) // last: after the held requests were let go
	t.Cleanup(ts.Close)
	t.Cleanup(func() { close(h.release) })
	return h
}

// post sends a chat request whose message is content with headers, and
// returns where its status comes (0: it failed).
func (h *heldRouter) post(content string, headers map[string]string) <-chan int {
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{{"role": "user", "content": content}}})
	req, err := http.NewRequest(http.MethodPost, h.url+"/v1/chat/completions", strings.NewReader(string(body)))
	if err != nil {
		h.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	code := make(chan int, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			code <- 0
			return
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		code <- resp.StatusCode
	}()
	return code
}

// next lets the request the replica holds answer, and returns the message
// of the request the freed slot went to.
func (h *heldRouter) next() string {
	h.release <- struct{}{}
	return <-h.arrived
}

// answeredUnqueued returns the status that comes from code, or false if
// the request is queued first (the queue holds more than queued requests).
func (h *heldRouter) answeredUnqueued(code <-chan int, queued int) (int, bool) {
	h.t.Helper()
	var c int
	answered := false
	testwait.Until(h.t, "an answer or the request queued", func() bool {
		select {
		case c = <-code:
			answered = true
			return true
		default:
		}
		n, _ := h.core.q.Len()
		return n > queued
	})
	return c, answered
}
