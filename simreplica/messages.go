package simreplica

// Anthropic's Messages API's answer: the message, and the events that
// stream it (message_start, content_block_start, a content_block_delta
// for each output token, content_block_stop, message_delta with the stop
// reason and the output tokens, message_stop), as vLLM's Anthropic
// endpoint converts its chat answer.

// messageObject is the Messages API's message, done or as message_start
// gives it (no content, no stop reason, no output tokens); Anthropic's
// input_tokens leave out the cached ones (cache_read_input_tokens).
func (g *generation) messageObject(done bool) map[string]any {
	obj := map[string]any{"id": g.id, "type": "message", "role": "assistant", "model": g.model, "content": []any{},
		"stop_reason": nil, "stop_sequence": nil,
		"usage": map[string]any{"input_tokens": g.tokens - g.cached, "cache_read_input_tokens": g.cached, "cache_creation_input_tokens": 0, "output_tokens": 0}}
	if done {
		obj["content"] = []any{map[string]any{"type": "text", "text": g.text()}}
		obj["stop_reason"] = "max_tokens"
		obj["usage"].(map[string]any)["output_tokens"] = g.out
	}
	return obj
}

// messagesEvents are the Messages API's events.
var messagesEvents = agenticEvents{open: messagesOpen, token: messagesToken, close: messagesClose}

func messagesOpen(g *generation) []sse {
	return []sse{
		{"message_start", map[string]any{"message": g.messageObject(false)}},
		{"content_block_start", map[string]any{"index": 0, "content_block": map[string]any{"type": "text", "text": ""}}},
	}
}

func messagesToken(g *generation, i int) []sse {
	return []sse{{"content_block_delta", map[string]any{"index": 0, "delta": map[string]any{"type": "text_delta", "text": g.word(i)}}}}
}

func messagesClose(g *generation) []sse {
	return []sse{
		{"content_block_stop", map[string]any{"index": 0}},
		{"message_delta", map[string]any{"delta": map[string]any{"stop_reason": "max_tokens", "stop_sequence": nil}, "usage": map[string]any{"output_tokens": g.out}}},
		{"message_stop", map[string]any{}},
	}
}
