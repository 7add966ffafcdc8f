package blockhash

import (
	"encoding/json"
	"fmt"
	"testing"
)

// BenchmarkParseMessages parses a 100-message Anthropic conversation with
// a system prompt and tool calls: the cost per message of ParseMessages.
func BenchmarkParseMessages(b *testing.B) {
	var msgs []map[string]any
	for i := range 100 {
		switch i % 4 {
		case 0:
			msgs = append(msgs, map[string]any{"role": "user", "content": fmt.Sprintf("turn %d says a few words.\nAnd a second line.", i)})
		case 1:
			msgs = append(msgs, map[string]any{"role": "assistant", "content": []map[string]any{
				{"type": "text", "text": "Let me look."},
				{"type": "tool_use", "id": fmt.Sprintf("t%d", i), "name": "lookup", "input": map[string]any{"q": i}}}})
		case 2:
			msgs = append(msgs, map[string]any{"role": "user", "content": []map[string]any{
				{"type": "tool_result", "tool_use_id": fmt.Sprintf("t%d", i-1), "content": "found it"}}})
		default:
			msgs = append(msgs, map[string]any{"role": "assistant", "content": fmt.Sprintf("answer %d", i)})
		}
	}
	body, err := json.Marshal(map[string]any{"model": "m", "max_tokens": 100, "system": "You are terse.",
		"tools": []map[string]any{{"name": "lookup", "input_schema": map[string]any{"type": "object"}}}, "messages": msgs})
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		r, err := ParseMessages(body, Limits{})
		if err != nil {
			b.Fatal(err)
		}
		r.Recycle()
	}
}
