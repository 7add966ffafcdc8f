package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"

	"github.com/semroute/semroute/apikey"
	"github.com/semroute/semroute/router"
)

// The official OpenAI Go SDK's Responses API and Anthropic's Go SDK's
// Messages API, unchanged, through the demo in precise mode: the second
// of two requests sharing a long system prompt goes to the same replica,
// with the tokens the router matched in X-Semroute-Matched-Tokens and the
// engine's own cached tokens in the SDK's usage. A response continued by
// previous_response_id, and fetched by its id, reaches the replica that
// stored it.
func TestAgenticAPIsThroughTheOfficialSDKs(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, picture: "events", grpcListen: "127.0.0.1:0"})
	waitSubscribed(t, d)
	ctx := context.Background()
	system := text("You are the support assistant of a bicycle shop; answer in two sentences.", 400)
	model := d.sims[0].Options().Model

	oa := openai.NewClient(option.WithBaseURL(d.router.URL()+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	var got [2]struct {
		replica string
		matched int
		cached  int64
		id      string
	}
	for i := range got {
		var hr *http.Response
		r, err := oa.Responses.New(ctx, responses.ResponseNewParams{Model: model, Instructions: openai.String(system),
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Do you rent e-bikes? " + strconv.Itoa(i))}, MaxOutputTokens: openai.Int(4)},
			option.WithResponseInto(&hr))
		if err != nil {
			t.Fatalf("responses %d: %v", i, err)
		}
		got[i].replica, got[i].id = hr.Header.Get("X-Semroute-Replica"), r.ID
		got[i].matched, _ = strconv.Atoi(hr.Header.Get("X-Semroute-Matched-Tokens"))
		got[i].cached = r.Usage.InputTokensDetails.CachedTokens
		if r.OutputText() == "" || r.Usage.InputTokens == 0 {
			t.Fatalf("responses %d: no text or usage: %+v", i, r)
		}
		waitEventsApplied(t, d)
	}
	t.Logf("responses: %+v", got)
	if got[1].replica != got[0].replica || got[1].matched == 0 || got[1].cached == 0 {
		t.Fatalf("the second Responses request: replica %q (first %q), matched %d, engine cached %d", got[1].replica, got[0].replica, got[1].matched, got[1].cached)
	}
	// previous_response_id: on the replica that stored it, whatever the
	// prefix says (a short new input, no instructions).
	for i := 0; i < 4; i++ {
		var hr *http.Response
		r, err := oa.Responses.New(ctx, responses.ResponseNewParams{Model: model, PreviousResponseID: openai.String(got[0].id),
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("and on Sundays? " + strconv.Itoa(i))}}, option.WithResponseInto(&hr))
		if err != nil {
			t.Fatalf("continuing %s: %v", got[0].id, err)
		}
		if rep := hr.Header.Get("X-Semroute-Replica"); rep != got[0].replica || r.Usage.InputTokensDetails.CachedTokens == 0 {
			t.Fatalf("continuing a response of %s went to %s, cached %d", got[0].replica, rep, r.Usage.InputTokensDetails.CachedTokens)
		}
	}
	var hr *http.Response
	if r, err := oa.Responses.Get(ctx, got[0].id, responses.ResponseGetParams{}, option.WithResponseInto(&hr)); err != nil || r.ID != got[0].id {
		t.Fatalf("GET the stored response: %v %v", r, err)
	}

	an := anthropic.NewClient(aoption.WithBaseURL(d.router.URL()), aoption.WithAPIKey("unused"), aoption.WithMaxRetries(0))
	var replicas [2]string
	for i := range replicas {
		var hr *http.Response
		m, err := an.Messages.New(ctx, anthropic.MessageNewParams{Model: anthropic.Model(model), MaxTokens: 4,
			System:   []anthropic.TextBlockParam{{Text: system + " Messages."}},
			Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Opening hours? " + strconv.Itoa(i)))}},
			aoption.WithResponseInto(&hr))
		if err != nil {
			t.Fatalf("messages %d: %v", i, err)
		}
		replicas[i] = hr.Header.Get("X-Semroute-Replica")
		matched, _ := strconv.Atoi(hr.Header.Get("X-Semroute-Matched-Tokens"))
		if len(m.Content) == 0 || !strings.HasPrefix(m.ID, "msg_") {
			t.Fatalf("messages %d: %+v", i, m)
		}
		if i == 1 && (replicas[1] != replicas[0] || matched == 0 || m.Usage.CacheReadInputTokens == 0) {
			t.Fatalf("the second Messages request: replica %q (first %q), matched %d, engine cached %d", replicas[1], replicas[0], matched, m.Usage.CacheReadInputTokens)
		}
		waitEventsApplied(t, d)
	}
	// Streamed, through the SDK's event reader.
	st := an.Messages.NewStreaming(ctx, anthropic.MessageNewParams{Model: anthropic.Model(model), MaxTokens: 3,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("stream, please"))}})
	var msg anthropic.Message
	for st.Next() {
		if err := msg.Accumulate(st.Current()); err != nil {
			t.Fatal(err)
		}
	}
	if st.Err() != nil || len(msg.Content) == 0 || msg.Usage.OutputTokens != 3 {
		t.Fatalf("streamed message: %v, %+v", st.Err(), msg)
	}
	rs := oa.Responses.NewStreaming(ctx, responses.ResponseNewParams{Model: model, Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("stream too")}, MaxOutputTokens: openai.Int(3)})
	completed := false
	for rs.Next() {
		if ev := rs.Current(); ev.Type == "response.completed" && ev.Response.Usage.OutputTokens == 3 {
			completed = true
		}
	}
	if rs.Err() != nil || !completed {
		t.Fatalf("streamed response: %v, completed %v", rs.Err(), completed)
	}
	// The endpoint picker routes both APIs too: a continuation of a stored
	// response is sent to the replica that stored it, and a Messages
	// request sharing the system prompt above to the replica that holds it.
	env := newEnvoy(t, d)
	names := endpoints(d)
	cont, _ := json.Marshal(map[string]any{"model": model, "previous_response_id": got[0].id, "input": "one more"})
	if p := env.do("/v1/responses", cont, nil, nil, false, ""); names[strings.Split(p.dest, ",")[0]] != got[0].replica {
		t.Fatalf("the picker sent a continuation of a response of %s to %q (%s)", got[0].replica, p.dest, names[strings.Split(p.dest, ",")[0]])
	}
	again, _ := json.Marshal(map[string]any{"model": model, "max_tokens": 4, "system": system + " Messages.",
		"messages": []any{map[string]any{"role": "user", "content": "Opening hours? picker"}}})
	if p := env.do("/v1/messages", again, nil, nil, false, ""); names[strings.Split(p.dest, ",")[0]] != replicas[0] || p.reqHdr[router.HeaderMatchedTokens] == "0" {
		t.Fatalf("the picker sent a Messages request to %s (matched %q), the prefix is on %s", names[strings.Split(p.dest, ",")[0]], p.reqHdr[router.HeaderMatchedTokens], replicas[0])
	}
	// GET /v1/models/{id}, from the merged list.
	m, err := oa.Models.Get(ctx, model)
	if err != nil || m.ID != model {
		t.Fatalf("models/%s: %v %v", model, m, err)
	}
	var apiErr *openai.Error
	if _, err := oa.Models.Get(ctx, "no-such-model"); !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" {
		t.Fatalf("an unknown model: %v", err)
	}
}

// In a fleet, every router knows where a response is stored and whose it
// is, at once and with no word from its peers: the id says so. Two routers
// with API keys over one embedded NATS server: a response acme stored
// through one is continued, fetched and deleted by acme through either,
// at the replica that stores it, from the first request; bob's requests
// for it are refused at both, before any replica.
func TestResponseHomesAcrossTheFleet(t *testing.T) {
	dir := t.TempDir()
	keys, cfg := filepath.Join(dir, "keys.yaml"), filepath.Join(dir, "router.yaml")
	writeConfig(t, keys, fmt.Sprintf("keys:\n  - {tenant: acme, sha256: %s}\n  - {tenant: bob, sha256: %s}\n",
		apikey.Hash("sk-acme"), apikey.Hash("sk-bob")))
	writeConfig(t, cfg, fmt.Sprintf("auth: {api_keys_file: %q}\n", keys))
	d := startTestDemo(t, demoOptions{sim: fastSim, routers: 2, config: cfg})
	model := d.sims[0].Options().Model
	call := func(url, method, path, key string, body map[string]any) (int, string, string) {
		t.Helper()
		var rd io.Reader
		if body != nil {
			b, _ := json.Marshal(body)
			rd = bytes.NewReader(b)
		}
		req, _ := http.NewRequest(method, url+path, rd)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var r struct {
			ID string `json:"id"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&r)
		return resp.StatusCode, r.ID, resp.Header.Get("X-Semroute-Replica")
	}
	routers := []string{d.runs[0].http.URL(), d.runs[1].http.URL()}
	st, id, home := call(routers[0], "POST", "/v1/responses", "sk-acme", map[string]any{"model": model, "input": "first turn", "max_output_tokens": 2})
	if st != 200 || home == "" {
		t.Fatalf("first turn: %d via %q", st, home)
	}
	requests := func() (n int64) {
		for _, s := range d.sims {
			n += s.Stats().Requests
		}
		return n
	}
	for i, url := range routers {
		before := requests()
		if st, _, rep := call(url, "POST", "/v1/responses", "sk-bob", map[string]any{"model": model, "previous_response_id": id, "input": "mine now"}); st != 404 || rep != "" {
			t.Fatalf("router %d: bob's continuation: %d via %q, want 404 from the router", i, st, rep)
		}
		for _, m := range []string{"GET", "DELETE"} {
			if st, _, rep := call(url, m, "/v1/responses/"+id, "sk-bob", nil); st != 404 || rep != "" {
				t.Fatalf("router %d: bob's %s: %d via %q, want 404 from the router", i, m, st, rep)
			}
		}
		if requests() != before {
			t.Fatalf("router %d: bob's continuation reached a replica", i)
		}
		for j := range 5 {
			if st, _, rep := call(url, "POST", "/v1/responses", "sk-acme", map[string]any{"model": model, "previous_response_id": id, "input": "again", "max_output_tokens": 2}); st != 200 || rep != home {
				t.Fatalf("router %d: acme's continuation %d: %d via %s, the response is on %s", i, j, st, rep, home)
			}
		}
		if st, _, rep := call(url, "GET", "/v1/responses/"+id, "sk-acme", nil); st != 200 || rep != home {
			t.Fatalf("router %d: acme's GET: %d via %s, want 200 via %s", i, st, rep, home)
		}
	}

}
