package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
)

// agentBody is one request of a conversation with a system prompt, one
// tool and a question, in api's own shape.
func agentBody(api, model, system, question string) (path string, body []byte) {
	params := map[string]any{"type": "object", "properties": map[string]any{"path": map[string]any{"type": "string"}}}
	var b map[string]any
	switch api {
	case "chat":
		path, b = chatPath, map[string]any{"model": model, "max_tokens": 4,
			"tools":    []any{map[string]any{"type": "function", "function": map[string]any{"name": "read_file", "description": "Read a file.", "parameters": params}}},
			"messages": []any{map[string]any{"role": "system", "content": system}, map[string]any{"role": "user", "content": question}}}
	case "responses":
		path, b = "/v1/responses", map[string]any{"model": model, "max_output_tokens": 4, "instructions": system, "input": question,
			"tools": []any{map[string]any{"type": "function", "name": "read_file", "description": "Read a file.", "parameters": params, "strict": false}}}
	case "messages":
		path, b = "/v1/messages", map[string]any{"model": model, "max_tokens": 4, "system": system,
			"tools":    []any{map[string]any{"name": "read_file", "description": "Read a file.", "input_schema": params}},
			"messages": []any{map[string]any{"role": "user", "content": question}}}
	}
	b["tool_choice"] = map[string]any{"chat": "none", "responses": "none", "messages": map[string]any{"type": "none"}}[api]
	out, _ := json.Marshal(b)
	return path, out
}

// usageOf reads an answer's prompt and cached tokens in its API's shape.
func usageOf(t *testing.T, api string, resp *http.Response) (prompt, cached int64) {
	t.Helper()
	var u struct {
		Usage struct {
			PromptTokens         int64 `json:"prompt_tokens"`
			InputTokens          int64 `json:"input_tokens"`
			CacheReadInputTokens int64 `json:"cache_read_input_tokens"`
			PromptTokensDetails  struct {
				CachedTokens int64 `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
			InputTokensDetails struct {
				CachedTokens int64 `json:"cached_tokens"`
			} `json:"input_tokens_details"`
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&u); err != nil {
		t.Fatal(err)
	}
	switch api {
	case "chat":
		return u.Usage.PromptTokens, u.Usage.PromptTokensDetails.CachedTokens
	case "responses":
		return u.Usage.InputTokens, u.Usage.InputTokensDetails.CachedTokens
	}
	return u.Usage.InputTokens + u.Usage.CacheReadInputTokens, u.Usage.CacheReadInputTokens
}

// One conversation is one prefix across the three APIs, tools included:
// for every ordered pair, a request in the second API after the same
// conversation in the first finds the first's tools, system prompt and
// question cached on the engine (all but the last block and the template's
// end), and the router predicted it (X-Semroute-Matched-Tokens), in
// precise mode. The engine renders each API as vLLM does: Responses and
// Messages tools as chat function tools, instructions and system as the
// system message.
func TestOnePrefixAcrossTheThreeAPIs(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, picture: "events", replicas: 1, config: patientTokenizer(t)})
	waitSubscribed(t, d)
	model := d.sims[0].Options().Model
	apis := []string{"chat", "responses", "messages"}
	for i, a := range apis {
		for _, b := range apis {
			if a == b {
				continue
			}
			system := text(fmt.Sprintf("You are agent %d of the build team.", i), 200) + b
			var prompt, cached int64
			var matched string
			for _, api := range []string{a, b} {
				path, body := agentBody(api, model, system, "Where is the retry budget set?")
				resp, err := http.Post(d.router.URL()+path, "application/json", bytes.NewReader(body))
				if err != nil {
					t.Fatal(err)
				}
				if resp.StatusCode != 200 {
					t.Fatalf("%s: status %d", api, resp.StatusCode)
				}
				matched = resp.Header.Get("X-Semroute-Matched-Tokens")
				prompt, cached = usageOf(t, api, resp)
				resp.Body.Close()
				waitEventsApplied(t, d)
			}
			if cached < prompt-32 || matched != fmt.Sprint(cached) {
				t.Errorf("%s then %s: the engine cached %d of %d prompt tokens, the router predicted %s", a, b, cached, prompt, matched)
			} else {
				t.Logf("%s then %s: cached %d of %d, predicted %s", a, b, cached, prompt, matched)
			}
		}
	}
}
