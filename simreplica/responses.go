package simreplica

import (
	"encoding/json"

	"github.com/valyala/fastjson"
)

// The Responses API's answer: the response object, its output item, and
// the events that stream it, in the order and shapes of OpenAI's
// specification (the openai-go SDK's ResponseStreamEventUnion and its
// variants name the fields):
//
//	response.created, response.in_progress       the response, in progress, no output
//	response.output_item.added                   the item, in progress, empty
//	response.content_part.added                  {type: output_text, text: "", annotations: []}
//	response.output_text.delta × output tokens   item_id, output_index, content_index, delta, logprobs
//	response.output_text.done                    the whole text
//	response.content_part.done                   the whole part
//	response.output_item.done                    the item, completed
//	response.completed                           the response, its output and usage
//
// and, for a tool call (toolcall.go), in place of the content part's and
// text's events:
//
//	response.output_item.added                   {type: function_call, id, call_id, name, arguments: "", status: in_progress}
//	response.function_call_arguments.delta × fragments   item_id, output_index, delta
//	response.function_call_arguments.done        arguments
//	response.output_item.done                    the call, completed
//
// every event with its type and a sequence_number from 0. The item's id
// is the same in every event, the response completed and the one GET
// /v1/responses/{id} gives.

// responseEchoDefaults are the fields of a response that repeat its
// request's, as vLLM's ResponsesResponse.from_request fills them, and
// their values when the request does not give them.
var responseEchoDefaults = map[string]any{
	"instructions": nil, "tools": []any{}, "tool_choice": "auto", "previous_response_id": nil,
	"max_output_tokens": nil, "temperature": 1.0, "top_p": 1.0, "metadata": map[string]any{},
	"parallel_tool_calls": true, "store": true, "truncation": "disabled",
	"text": map[string]any{"format": map[string]any{"type": "text"}},
}

// responseEcho returns the fields of the Responses body v that its
// response repeats: each as the body gives it (its JSON, copied), or its
// default.
func responseEcho(v *fastjson.Value) map[string]any {
	echo := make(map[string]any, len(responseEchoDefaults))
	for k, def := range responseEchoDefaults {
		echo[k] = def
		if x := v.Get(k); x != nil && x.Type() != fastjson.TypeNull {
			echo[k] = json.RawMessage(x.MarshalTo(nil))
		}
	}
	return echo
}

// responseObject is the Responses API's response: in progress, with no
// output (as response.created and response.in_progress give it), or done,
// completed with its output item and usage.
func (g *generation) responseObject(done bool) map[string]any {
	obj := make(map[string]any, len(g.echo)+10)
	for k, v := range g.echo {
		obj[k] = v
	}
	for k, v := range map[string]any{"id": g.id, "object": "response", "created_at": g.created, "model": g.model,
		"status": "in_progress", "output": []any{}, "usage": nil, "error": nil, "incomplete_details": nil} {
		obj[k] = v
	}
	if done {
		obj["status"] = "completed"
		obj["output"] = []any{g.responseItem(true)}
		obj["usage"] = map[string]any{"input_tokens": g.tokens, "input_tokens_details": map[string]any{"cached_tokens": g.cached},
			"output_tokens": g.out, "output_tokens_details": map[string]any{"reasoning_tokens": 0}, "total_tokens": g.tokens + g.out}
	}
	return obj
}

// itemID is the id of the response's output item.
func (g *generation) itemID() string {
	if g.call != nil {
		return g.call.id("fc_")
	}
	return "msg_" + g.id
}

// responseItem is the response's output item, its message or its
// function call: completed, with its text or arguments, when done, else
// in progress and empty (as response.output_item.added gives it).
func (g *generation) responseItem(done bool) map[string]any {
	status := "in_progress"
	if done {
		status = "completed"
	}
	if c := g.call; c != nil {
		args := ""
		if done {
			args = c.arguments()
		}
		return map[string]any{"type": "function_call", "id": g.itemID(), "call_id": c.id("call_"), "name": c.name, "arguments": args, "status": status}
	}
	content := []any{}
	if done {
		content = []any{outputText(g.text())}
	}
	return map[string]any{"type": "message", "id": g.itemID(), "status": status, "role": "assistant", "content": content}
}

// outputText is an output_text content part of text.
func outputText(text string) map[string]any {
	return map[string]any{"type": "output_text", "text": text, "annotations": []any{}}
}

// responsesEvents are the Responses API's events (see above).
var responsesEvents = agenticEvents{open: responsesOpen, token: responsesToken, close: responsesClose, sequenced: true}

// responsesOpen are the events before the first output token: the
// response created and in progress, its item added, and a message's
// content part added.
func responsesOpen(g *generation) []sse {
	evs := []sse{
		{"response.created", map[string]any{"response": g.responseObject(false)}},
		{"response.in_progress", map[string]any{"response": g.responseObject(false)}},
		{"response.output_item.added", map[string]any{"output_index": 0, "item": g.responseItem(false)}},
	}
	if g.call != nil {
		return evs
	}
	return append(evs, sse{"response.content_part.added", g.partEvent(outputText(""))})
}

// responsesToken is output token i's text delta, or the call's arguments'
// fragment (none for its first token, its name, in the item added).
func responsesToken(g *generation, i int) []sse {
	switch {
	case g.call == nil:
		ev := g.partEvent(nil)
		ev["delta"], ev["logprobs"] = g.word(i), []any{}
		return []sse{{"response.output_text.delta", ev}}
	case i == 0:
		return nil
	}
	return []sse{{"response.function_call_arguments.delta", map[string]any{"item_id": g.itemID(), "output_index": 0, "delta": g.call.frags[i-1]}}}
}

// responsesClose are the events after the last output token: the text
// and the part done (or the arguments), the item done, and the response
// completed.
func responsesClose(g *generation) []sse {
	var evs []sse
	if g.call != nil {
		evs = []sse{{"response.function_call_arguments.done", map[string]any{"item_id": g.itemID(), "output_index": 0, "arguments": g.call.arguments()}}}
	} else {
		text := g.text()
		done := g.partEvent(nil)
		done["text"], done["logprobs"] = text, []any{}
		evs = []sse{{"response.output_text.done", done}, {"response.content_part.done", g.partEvent(outputText(text))}}
	}
	return append(evs,
		sse{"response.output_item.done", map[string]any{"output_index": 0, "item": g.responseItem(true)}},
		sse{"response.completed", map[string]any{"response": g.responseObject(true)}})
}

// partEvent is the body of an event about the item's content part:
// item_id, output_index, content_index, and part unless nil.
func (g *generation) partEvent(part map[string]any) map[string]any {
	ev := map[string]any{"item_id": g.itemID(), "output_index": 0, "content_index": 0}
	if part != nil {
		ev["part"] = part
	}
	return ev
}
