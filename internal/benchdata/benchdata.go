// Package benchdata makes the request bodies the benchmarks of several
// packages share, so that their figures are about the same bodies.
package benchdata

import (
	"encoding/json"
	"fmt"
	"strings"
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
