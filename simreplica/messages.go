package simreplica

import "encoding/json"

// Anthropic's Messages API's answer: the message, and the events that
// stream it (message_start, content_block_start, a content_block_delta
// for each output token, content_block_stop, message_delta with the stop
// reason and the output tokens, message_stop), as vLLM's Anthropic
// endpoint converts its chat answer. A tool call (toolcall.go) is a
// tool_use block ({type: tool_use, id: "toolu_...", name, input}), its
// stop reason tool_use; streamed, its block starts with input {} and each
// fragment of its input's JSON is an input_json_delta's partial_json.

// messageObject is the Messages API's message, done or as message_start
// gives it (no content, no stop reason, no output tokens); Anthropic's
// input_tokens leave out the cached ones (cache_read_input_tokens).
func (g *generation) messageObject(done bool) map[string]any {
	obj := map[string]any{"id": g.id, "type": "message", "role": "assistant", "model": g.model, "content": []any{},
		"stop_reason": nil, "stop_sequence": nil,
		"usage": map[string]any{"input_tokens": g.tokens - g.cached, "cache_read_input_tokens": g.cached, "cache_creation_input_tokens": 0, "output_tokens": 0}}
	if done {
		obj["content"] = []any{g.contentBlock(true)}
		obj["stop_reason"] = g.stopReason()
		obj["usage"].(map[string]any)["output_tokens"] = g.out
	}
	return obj
}

// stopReason is the message's stop reason: tool_use for a call, else
// max_tokens (the text runs to it).
func (g *generation) stopReason() string {
	if g.call != nil {
		return "tool_use"
	}
	return "max_tokens"
}

// contentBlock is the message's content block, whole when done, else as
// content_block_start gives it (no text, or the call's input {}).
func (g *generation) contentBlock(done bool) map[string]any {
	if g.call == nil {
		text := ""
		if done {
			text = g.text()
		}
		return map[string]any{"type": "text", "text": text}
	}
	input := json.RawMessage("{}")
	if done {
		input = json.RawMessage(g.call.arguments())
	}
	return map[string]any{"type": "tool_use", "id": g.call.id("toolu_"), "name": g.call.name, "input": input}
}

// messagesEvents are the Messages API's events.
var messagesEvents = agenticEvents{open: messagesOpen, token: messagesToken, close: messagesClose}

func messagesOpen(g *generation) []sse {
	return []sse{
		{"message_start", map[string]any{"message": g.messageObject(false)}},
		{"content_block_start", map[string]any{"index": 0, "content_block": g.contentBlock(false)}},
	}
}

// messagesToken is output token i's text delta, or the call's input's
// fragment (none for its first token, its name, in the block's start).
func messagesToken(g *generation, i int) []sse {
	switch {
	case g.call == nil:
		return []sse{{"content_block_delta", map[string]any{"index": 0, "delta": map[string]any{"type": "text_delta", "text": g.word(i)}}}}
	case i == 0:
		return nil
	}
	return []sse{{"content_block_delta", map[string]any{"index": 0, "delta": map[string]any{"type": "input_json_delta", "partial_json": g.call.frags[i-1]}}}}
}

func messagesClose(g *generation) []sse {
	return []sse{
		{"content_block_stop", map[string]any{"index": 0}},
		{"message_delta", map[string]any{"delta": map[string]any{"stop_reason": g.stopReason(), "stop_sequence": nil}, "usage": map[string]any{"output_tokens": g.out}}},
		{"message_stop", map[string]any{}},
	}
}
