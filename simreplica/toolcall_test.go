package simreplica

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/responses"
)

// The tools of the loops, in chat's form: their calls' arguments, as the
// replica makes them, and their output tokens.
var (
	loopTools = []struct {
		name   string
		params map[string]any
		args   *regexp.Regexp
		tokens int
	}{
		{"get_weather", map[string]any{"type": "object", "properties": map[string]any{
			"city": map[string]any{"type": "string"}, "days": map[string]any{"type": "integer"}, "metric": map[string]any{"type": "boolean"}}},
			regexp.MustCompile(`^\{"city":"w\d+","days":\d+,"metric":(true|false)\}$`), 8},
		{"now", nil, regexp.MustCompile(`^\{\}$`), 2},
		{"search", map[string]any{"type": "object", "properties": map[string]any{"query": map[string]any{"type": "string"}}},
			regexp.MustCompile(`^\{"query":"w\d+"\}$`), 4},
	}
)

// toolsFor returns the loop's tools in the form of the API of path.
func toolsFor(path string) []any {
	var out []any
	for _, t := range loopTools {
		switch path {
		case "/v1/chat/completions":
			fn := map[string]any{"name": t.name, "description": "Tool " + t.name + "."}
			if t.params != nil {
				fn["parameters"] = t.params
			}
			out = append(out, map[string]any{"type": "function", "function": fn})
		case "/v1/responses":
			out = append(out, map[string]any{"type": "function", "name": t.name, "description": "Tool " + t.name + ".", "parameters": t.params})
		default:
			schema := t.params
			if schema == nil {
				schema = map[string]any{"type": "object"}
			}
			out = append(out, map[string]any{"name": t.name, "description": "Tool " + t.name + ".", "input_schema": schema})
		}
	}
	return out
}

// checkCall checks a tool call's name, arguments and output tokens, and
// its id's prefix and 16 hex digits.
func checkCall(t *testing.T, step int, id, prefix, name, args string, tokens int64) {
	t.Helper()
	if !regexp.MustCompile("^" + prefix + "[0-9a-f]{16}$").MatchString(id) {
		t.Fatalf("step %d: call id %q, want %s and 16 hex digits", step, id, prefix)
	}
	for _, tool := range loopTools {
		if tool.name == name {
			if !tool.args.MatchString(args) || tokens != int64(tool.tokens) {
				t.Fatalf("step %d: %s(%s) in %d tokens, want arguments like %s in %d", step, name, args, tokens, tool.args, tool.tokens)
			}
			return
		}
	}
	t.Fatalf("step %d: a call of %q, not a tool given", step, name)
}

// events posts body to path and returns its stream's data payloads (but
// [DONE]).
func events(t *testing.T, r *Running, path string, body any) [][]byte {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(r.URL+path, "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d", path, resp.StatusCode)
	}
	var out [][]byte
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok && d != "[DONE]" {
			out = append(out, []byte(d))
		}
	}
	return out
}

// unmarshal decodes b into v, an SDK type, or fails.
func unmarshal(t *testing.T, b []byte, v any) {
	t.Helper()
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%v: %s", err, b)
	}
}

// loopStep is one step of a tool loop as the tests check it.
type loopStep struct {
	id, name, args, text string
	output, prompt       int64
	cached               int64
}

// checkLoop checks the steps of a 5-step loop: four calls, then text;
// from the second step the prompt before it cached in full blocks, when
// cachedAll (a prompt that continues the last whole), or in part.
func checkLoop(t *testing.T, steps []loopStep, prefix string, cachedAll bool) {
	t.Helper()
	for i, s := range steps[:4] {
		checkCall(t, i, s.id, prefix, s.name, s.args, s.output)
	}
	if steps[1].name != "now" || steps[4].text == "" || steps[4].id != "" {
		t.Fatalf("steps %+v: the second calls the named tool, the last answers in text", steps)
	}
	for i := 1; i < 5; i++ {
		prev := steps[i-1].prompt / 16 * 16
		if cachedAll && steps[i].cached != prev || steps[i].cached < prev-16 || steps[i].cached == 0 {
			t.Fatalf("step %d: %d of %d prompt tokens cached, the last prompt's %d", i, steps[i].cached, steps[i].prompt, steps[i-1].prompt)
		}
	}
}

// chatLoop runs a 5-step tool loop on chat, streamed every other step,
// each answer read with the openai-go SDK's types and accumulator.
func chatLoop(t *testing.T, r *Running) []loopStep {
	msgs := []any{map[string]any{"role": "system", "content": "You plan trips with the tools you have."},
		map[string]any{"role": "user", "content": "Plan a week in Lisbon."}}
	choices := []any{"required", map[string]any{"type": "function", "function": map[string]any{"name": "now"}}, "required", "required", "none"}
	var steps []loopStep
	for step, choice := range choices {
		body := map[string]any{"model": "sim-model", "messages": msgs, "tools": toolsFor("/v1/chat/completions"), "tool_choice": choice, "max_tokens": 12}
		var cc openai.ChatCompletion
		if step%2 == 1 {
			body["stream"], body["stream_options"] = true, map[string]any{"include_usage": true}
			var acc openai.ChatCompletionAccumulator
			for _, d := range events(t, r, "/v1/chat/completions", body) {
				var chunk openai.ChatCompletionChunk
				unmarshal(t, d, &chunk)
				if !acc.AddChunk(chunk) {
					t.Fatalf("step %d: the SDK's accumulator refused %s", step, d)
				}
			}
			cc = acc.ChatCompletion
		} else if code := postJSON(t, r, "/v1/chat/completions", body, &cc); code != http.StatusOK {
			t.Fatalf("step %d: %d", step, code)
		}
		ch := cc.Choices[0]
		s := loopStep{text: ch.Message.Content, output: cc.Usage.CompletionTokens, prompt: cc.Usage.PromptTokens, cached: cc.Usage.PromptTokensDetails.CachedTokens}
		if step == 4 {
			if ch.FinishReason != "length" || len(ch.Message.ToolCalls) != 0 {
				t.Fatalf("step %d: %+v", step, ch)
			}
			return append(steps, s)
		}
		if ch.FinishReason != "tool_calls" || len(ch.Message.ToolCalls) != 1 || ch.Message.Content != "" {
			t.Fatalf("step %d: finish %q, message %+v", step, ch.FinishReason, ch.Message)
		}
		tc := ch.Message.ToolCalls[0]
		s.id, s.name, s.args = tc.ID, tc.Function.Name, tc.Function.Arguments
		steps = append(steps, s)
		msgs = append(msgs, map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
			"id": tc.ID, "type": "function", "function": map[string]any{"name": tc.Function.Name, "arguments": tc.Function.Arguments}}}},
			map[string]any{"role": "tool", "tool_call_id": tc.ID, "content": fmt.Sprintf("result %d: sunny", step)})
	}
	return steps
}

// responsesAnswer posts a Responses request, whole or streamed, and
// returns its response as the openai-go SDK reads it; streamed, it checks
// a function call's events.
func responsesAnswer(t *testing.T, r *Running, body map[string]any, stream bool) responses.Response {
	t.Helper()
	var resp responses.Response
	if !stream {
		if code := postJSON(t, r, "/v1/responses", body, &resp); code != http.StatusOK {
			t.Fatalf("responses: %d", code)
		}
		return resp
	}
	body["stream"] = true
	var types []string
	var args strings.Builder
	var raw []map[string]any
	for _, d := range events(t, r, "/v1/responses", body) {
		var ev responses.ResponseStreamEventUnion
		unmarshal(t, d, &ev)
		var m map[string]any
		unmarshal(t, d, &m)
		raw = append(raw, m)
		types = append(types, ev.Type)
		switch ev.Type {
		case "response.function_call_arguments.delta":
			args.WriteString(ev.Delta)
		case "response.completed":
			resp = ev.Response
		}
	}
	if snap, final := accumulate(t, raw); !sameItems(snap, final) {
		t.Fatalf("the JS SDK's snapshot %v, the completed output %v", snap, final)
	}
	if it := resp.Output[0]; it.Type == "function_call" {
		frags := strings.Count(strings.Join(types, " "), "arguments.delta")
		want := "response.created response.in_progress response.output_item.added" + strings.Repeat(" response.function_call_arguments.delta", frags) +
			" response.function_call_arguments.done response.output_item.done response.completed"
		if strings.Join(types, " ") != want || args.String() != it.Arguments.OfString || int64(frags+1) != resp.Usage.OutputTokens {
			t.Fatalf("a function call's events %v, arguments %q, want %q and %d tokens", types, args.String(), it.Arguments.OfString, resp.Usage.OutputTokens)
		}
	}
	return resp
}

// responsesLoop runs a 5-step tool loop on the Responses API, streamed
// every other step: continuing each response by its id with the call's
// output alone (stored), or sending the whole conversation each time,
// the calls among it (not stored).
func responsesLoop(t *testing.T, r *Running, stored bool) []loopStep {
	choices := []any{"required", map[string]any{"type": "function", "name": "now"}, "required", "required", "none"}
	input := []any{map[string]any{"role": "user", "content": "Plan a week in Lisbon."}}
	prev := ""
	var steps []loopStep
	for step, choice := range choices {
		body := map[string]any{"model": "sim-model", "input": input, "tools": toolsFor("/v1/responses"), "tool_choice": choice, "max_output_tokens": 12, "store": stored}
		if prev != "" {
			body["previous_response_id"] = prev
		}
		resp := responsesAnswer(t, r, body, step%2 == 1)
		it := resp.Output[0]
		s := loopStep{text: resp.OutputText(), output: resp.Usage.OutputTokens, prompt: resp.Usage.InputTokens, cached: resp.Usage.InputTokensDetails.CachedTokens}
		if step == 4 {
			if it.Type != "message" {
				t.Fatalf("step %d: %+v", step, it)
			}
			return append(steps, s)
		}
		if len(resp.Output) != 1 || it.Type != "function_call" || it.Status != "completed" || !strings.HasPrefix(it.ID, "fc_") || it.CallID == "" {
			t.Fatalf("step %d: %s", step, resp.RawJSON())
		}
		s.id, s.name, s.args = it.CallID, it.Name, it.Arguments.OfString
		steps = append(steps, s)
		out := map[string]any{"type": "function_call_output", "call_id": it.CallID, "output": fmt.Sprintf("result %d: sunny", step)}
		if stored {
			input, prev = []any{out}, resp.ID
		} else {
			input = append(input, map[string]any{"type": "function_call", "call_id": it.CallID, "name": it.Name, "arguments": it.Arguments.OfString}, out)
		}
	}
	return steps
}

// messagesLoop runs a 5-step tool loop on the Messages API, streamed
// every other step, each answer read with the Anthropic SDK's types (a
// stream through its Accumulate).
func messagesLoop(t *testing.T, r *Running) []loopStep {
	choices := []any{map[string]any{"type": "any"}, map[string]any{"type": "tool", "name": "now"}, map[string]any{"type": "any"},
		map[string]any{"type": "any"}, map[string]any{"type": "none"}}
	msgs := []any{map[string]any{"role": "user", "content": "Plan a week in Lisbon."}}
	var steps []loopStep
	for step, choice := range choices {
		body := map[string]any{"model": "sim-model", "max_tokens": 12, "system": "You plan trips with the tools you have.",
			"messages": msgs, "tools": toolsFor("/v1/messages"), "tool_choice": choice}
		var m anthropic.Message
		if step%2 == 1 {
			body["stream"] = true
			for _, d := range events(t, r, "/v1/messages", body) {
				var ev anthropic.MessageStreamEventUnion
				unmarshal(t, d, &ev)
				if err := m.Accumulate(ev); err != nil {
					t.Fatalf("step %d: the SDK's Accumulate: %v", step, err)
				}
			}
		} else if code := postJSON(t, r, "/v1/messages", body, &m); code != http.StatusOK {
			t.Fatalf("step %d: %d", step, code)
		}
		u := m.Usage
		s := loopStep{output: u.OutputTokens, prompt: u.InputTokens + u.CacheReadInputTokens, cached: u.CacheReadInputTokens}
		if step == 4 {
			if m.StopReason != "max_tokens" || m.Content[0].Type != "text" {
				t.Fatalf("step %d: %+v", step, m)
			}
			s.text = m.Content[0].Text
			return append(steps, s)
		}
		b := m.Content[0]
		if len(m.Content) != 1 || m.StopReason != "tool_use" || b.Type != "tool_use" {
			t.Fatalf("step %d: %s", step, m.RawJSON())
		}
		s.id, s.name, s.args = b.ID, b.Name, string(b.Input)
		steps = append(steps, s)
		msgs = append(msgs, map[string]any{"role": "assistant", "content": []any{map[string]any{"type": "tool_use", "id": b.ID, "name": b.Name, "input": b.Input}}},
			map[string]any{"role": "user", "content": []any{map[string]any{"type": "tool_result", "tool_use_id": b.ID, "content": fmt.Sprintf("result %d: sunny", step)}}})
	}
	return steps
}

// A 5-step tool loop runs end to end on each API: four calls (the second
// to the tool named), each sent back with its result, then text; every
// call's arguments are made from its tool's schema, its output tokens are
// those it streams, each step's prompt continues the last (cached), and
// the same loop on another replica makes the same calls.
func TestToolLoops(t *testing.T) {
	loops := []struct {
		name      string
		run       func(*testing.T, *Running) []loopStep
		prefix    string
		cachedAll bool
	}{
		{"chat", chatLoop, "call_", true},
		{"responses, continued by id", func(t *testing.T, r *Running) []loopStep { return responsesLoop(t, r, true) }, "call_", false},
		{"responses, whole conversations", func(t *testing.T, r *Running) []loopStep { return responsesLoop(t, r, false) }, "call_", true},
		{"messages", messagesLoop, "toolu_", true},
	}
	for _, l := range loops {
		t.Run(l.name, func(t *testing.T) {
			steps := l.run(t, start(t, agentic))
			checkLoop(t, steps, l.prefix, l.cachedAll)
			again := l.run(t, start(t, agentic))
			for i := range steps {
				if steps[i].id != again[i].id || steps[i].args != again[i].args || steps[i].text != again[i].text {
					t.Fatalf("step %d on another replica: %+v, then %+v", i, steps[i], again[i])
				}
			}
		})
	}
}

// auto, the default when tools are given, calls a tool by the documented
// rule: the call seed is the hash of the prompt's token ids; a call when
// seed mod 3 ≠ 0, or, after a tool result, when its bit 32 is set. The
// same request gets the same answer again.
func TestToolChoiceAuto(t *testing.T) {
	r := start(t, agentic)
	tools := toolsFor("/v1/chat/completions")
	calls := map[bool]int{}
	for i := range 60 {
		afterTool := i%2 == 1
		msgs := []any{map[string]any{"role": "user", "content": fmt.Sprintf("Question number %d, please.", i)}}
		if afterTool {
			msgs = append(msgs, map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
				"id": "call_1", "type": "function", "function": map[string]any{"name": "now", "arguments": "{}"}}}},
				map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "noon"})
		}
		body := map[string]any{"model": "sim-model", "messages": msgs, "tools": tools}
		var cc, again openai.ChatCompletion
		postJSON(t, r, "/v1/chat/completions", body, &cc)
		postJSON(t, r, "/v1/chat/completions", body, &again)
		seed := BlockHash(0, chatTokens(t, r, msgs, tools))
		want := seed%3 != 0
		if afterTool {
			want = seed>>32&1 == 1
		}
		called := len(cc.Choices[0].Message.ToolCalls) == 1
		if called != want || (cc.Choices[0].FinishReason == "tool_calls") != want || cc.RawJSON() == "" {
			t.Fatalf("request %d (after a tool: %v): called %v, the rule says %v", i, afterTool, called, want)
		}
		if again.Choices[0].Message.Content != cc.Choices[0].Message.Content || len(again.Choices[0].Message.ToolCalls) != len(cc.Choices[0].Message.ToolCalls) ||
			called && again.Choices[0].Message.ToolCalls[0].ID != cc.Choices[0].Message.ToolCalls[0].ID {
			t.Fatalf("request %d answered %s, then %s", i, cc.RawJSON(), again.RawJSON())
		}
		if called {
			calls[afterTool]++
		}
	}
	// About two in three, and one in two after a tool's result.
	if calls[false] < 14 || calls[false] > 26 || calls[true] < 8 || calls[true] > 22 {
		t.Fatalf("calls out of 30: %d, and after a tool result %d", calls[false], calls[true])
	}
}

// A call that does not fit in max_tokens is not made (the text is cut
// there); none, or no tools, answer in text; a tool_choice the request
// cannot have is refused, as vLLM refuses it.
func TestToolChoiceLimits(t *testing.T) {
	r := start(t, agentic)
	user := []any{map[string]any{"role": "user", "content": "What is the weather?"}}
	named := func(name string) any {
		return map[string]any{"type": "function", "function": map[string]any{"name": name}}
	}
	cases := []struct {
		name   string
		body   map[string]any
		status int
		finish string
	}{
		{"the call fits", map[string]any{"tool_choice": named("get_weather"), "max_tokens": 8}, 200, "tool_calls"},
		{"the call does not fit", map[string]any{"tool_choice": named("get_weather"), "max_tokens": 7}, 200, "length"},
		{"none", map[string]any{"tool_choice": "none"}, 200, "length"},
		{"no tools", map[string]any{"tools": nil}, 200, "length"},
		{"required without tools", map[string]any{"tools": nil, "tool_choice": "required"}, 400, ""},
		{"a tool not given", map[string]any{"tool_choice": named("fly")}, 400, ""},
		{"not a choice", map[string]any{"tool_choice": "sometimes"}, 400, ""},
	}
	for _, tc := range cases {
		body := map[string]any{"model": "sim-model", "messages": user, "tools": toolsFor("/v1/chat/completions")}
		for k, v := range tc.body {
			if v == nil {
				delete(body, k)
			} else {
				body[k] = v
			}
		}
		var cc openai.ChatCompletion
		code := postJSON(t, r, "/v1/chat/completions", body, &cc)
		if code != tc.status || code == 200 && string(cc.Choices[0].FinishReason) != tc.finish {
			t.Fatalf("%s: %d %s", tc.name, code, cc.RawJSON())
		}
	}
	// Anthropic's tool choice without its name, and a Responses named tool.
	code, _, raw := call(t, r, "/v1/messages", `{"model":"sim-model","max_tokens":9,"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"f","input_schema":{"type":"object"}}],"tool_choice":{"type":"tool"}}`)
	if code != 400 || !strings.Contains(string(raw), `"type":"error"`) {
		t.Fatalf("a Messages tool choice without a name: %d %s", code, raw)
	}
	var resp responses.Response
	postJSON(t, r, "/v1/responses", map[string]any{"model": "sim-model", "input": "hi", "tools": toolsFor("/v1/responses"),
		"tool_choice": map[string]any{"type": "function", "name": "search"}}, &resp)
	if fc := resp.Output[0].AsFunctionCall(); fc.Name != "search" || resp.Usage.OutputTokens != 4 {
		t.Fatalf("a Responses named tool: %s", resp.RawJSON())
	}
}
