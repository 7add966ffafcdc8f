// Package benchdata makes the request bodies the tests and benchmarks of
// several packages share, so that they are about the same bodies.
package benchdata

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
)

// ChatBody is a chat body of about tokens estimated tokens (4 bytes each):
// a system prompt of a quarter of them, a document, and a short question.
// Lines end in a newline (escaped in the JSON) and carry a quotation, so
// that unescaping and the code heuristic's symbol count do their real work.
func ChatBody(tokens int) []byte {
	prose := func(seed string, n int) string {
		var sb strings.Builder
		for i := 0; sb.Len() < n*4; i++ {
			fmt.Fprintf(&sb, "%s line %d says \"something worth caching\" (once).\n", seed, i)
		}
		return sb.String()[:n*4]
	}
	b, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{
		{"role": "system", "content": prose("system", tokens/4)},
		{"role": "user", "content": prose("document", tokens*3/4-16) + "\nWhat does it say?"},
	}})
	return b
}

// ParseChat parses a chat body of model "m" with the messages given as
// role, content pairs, failing tb if it does not parse.
func ParseChat(tb testing.TB, msgs ...string) *blockhash.Request {
	tb.Helper()
	m := make([]map[string]string, 0, len(msgs)/2)
	for i := 0; i+1 < len(msgs); i += 2 {
		m = append(m, map[string]string{"role": msgs[i], "content": msgs[i+1]})
	}
	b, _ := json.Marshal(map[string]any{"model": "m", "messages": m})
	r, err := blockhash.ParseChat(b, blockhash.Limits{})
	if err != nil {
		tb.Fatal(err)
	}
	return r
}
