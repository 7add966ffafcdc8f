package router

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/routing"
)

// The router's own errors on the Messages API's path are Anthropic's
// shape, with Anthropic's error types; on the other paths they stay
// OpenAI's.
func TestMessagesErrorsInAnthropicShape(t *testing.T) {
	ts, _ := serverFor(t, ServerOptions{}, closedURL(t))
	for _, c := range []struct {
		path, body string
		status     int
		typ        string
	}{
		{"/v1/messages", `{"model":"m","max_tokens":5,"messages":[{"role":"robot","content":"x"}]}`, 400, "invalid_request_error"},
		{"/v1/messages", `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}]}`, 502, "api_error"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"robot","content":"x"}]}`, 400, ""},
	} {
		resp, err := http.Post(ts.URL+c.path, "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var got struct {
			Type  string `json:"type"`
			Error struct {
				Type, Message string
			} `json:"error"`
		}
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("%s: %v: %s", c.path, err, b)
		}
		if resp.StatusCode != c.status {
			t.Errorf("%s: status %d, want %d: %s", c.path, resp.StatusCode, c.status, b)
		}
		if c.typ == "" { // OpenAI's: no top-level type
			if got.Type != "" || got.Error.Message == "" {
				t.Errorf("%s: not OpenAI's shape: %s", c.path, b)
			}
			continue
		}
		if got.Type != "error" || got.Error.Type != c.typ || got.Error.Message == "" {
			t.Errorf("%s: %s, want Anthropic's error of type %s", c.path, b, c.typ)
		}
	}
}

// Shedding, a full queue and no replica are Anthropic's 529
// overloaded_error, which its SDKs retry.
func TestAnthropicOverloaded(t *testing.T) {
	for _, err := range []error{&QueueError{Err: flow.ErrShed}, &QueueError{Err: ErrTooLate}, routing.ErrNoReplica, errors.Join(errors.New("x"), routing.ErrNoReplica)} {
		status, body := anthropicError(classify(err))
		if status != 529 || !strings.Contains(string(body), `"type":"overloaded_error"`) {
			t.Errorf("%v: %d %s", err, status, body)
		}
	}
}
