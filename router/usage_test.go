package router

import (
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/semroute/semroute/blockhash"
)

func TestWithIncludeUsage(t *testing.T) {
	for _, body := range []string{
		`{"model":"m","stream":true,"messages":[{"role":"user","content":"x"}]}`,
		"  \n{ \"model\":\"m\",\"stream\":true,\"prompt\":\"x\"}",
	} {
		nb := withIncludeUsage([]byte(body))
		req, err := blockhash.Parse(blockhash.Chat, nb.b, blockhash.Limits{})
		if strings.Contains(body, "prompt") {
			req, err = blockhash.Parse(blockhash.Completion, nb.b, blockhash.Limits{})
		}
		if err != nil || !req.IncludeUsage || !req.Stream || req.Model != "m" {
			t.Fatalf("%s -> %s: %v", body, nb.b, err)
		}
		nb.release()
	}
}

func TestUsageStripper(t *testing.T) {
	chunk := func(s string) string { return "data: " + s + "\n\n" }
	content := chunk(`{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}`)
	usage := chunk(`{"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":4}}}`)
	withUsageField := chunk(`{"id":"c","choices":[{"index":0,"delta":{"content":"usage"}}],"usage":null}`)
	done := "data: [DONE]\n\n"
	cases := []struct{ name, in, want string }{
		{"usage chunk dropped", content + usage + done, content + done},
		{"crlf events", strings.ReplaceAll(content+usage+done, "\n", "\r\n"), strings.ReplaceAll(content+done, "\n", "\r\n")},
		{"cr events", strings.ReplaceAll(content+usage+done, "\n", "\r"), strings.ReplaceAll(content+done, "\n", "\r")},
		{"a chunk with choices kept", withUsageField + done, withUsageField + done},
		{"unterminated last event kept", content + "data: {\"x\":1}", content + "data: {\"x\":1}"},
		{"a giant event passes through", content + "data: " + strings.Repeat("x", maxHeldEvent+10) + usage, content + "data: " + strings.Repeat("x", maxHeldEvent+10) + usage},
		// A giant event (vLLM's first chunk with echo on a long prompt) goes
		// out as it comes, and the usage chunk after it is still dropped.
		{"after a giant event", chunk(strings.Repeat("x", 3*maxHeldEvent)) + content + usage + done, chunk(strings.Repeat("x", 3*maxHeldEvent)) + content + done},
		{"after a giant crlf event", strings.ReplaceAll(chunk(strings.Repeat("y", maxHeldEvent+1))+usage+done, "\n", "\r\n"), strings.ReplaceAll(chunk(strings.Repeat("y", maxHeldEvent+1))+done, "\n", "\r\n")},
		{"two giant events", chunk(strings.Repeat("x", maxHeldEvent+5)) + chunk(strings.Repeat("z", maxHeldEvent+5)) + usage + done, chunk(strings.Repeat("x", maxHeldEvent+5)) + chunk(strings.Repeat("z", maxHeldEvent+5)) + done},
	}
	for _, tc := range cases {
		for _, step := range []int{1, 7, 1 << 20} {
			s := newUsageStripper(io.NopCloser(iotest.HalfReader(&chunkReader{b: []byte(tc.in), step: step})), blockhash.Limits{})
			got, err := io.ReadAll(s)
			if err != nil || string(got) != tc.want {
				t.Fatalf("%s, reads of %d: got %q (%v)", tc.name, step, got, err)
			}
		}
	}
}

// chunkReader hands out b step bytes at a time.
type chunkReader struct {
	b    []byte
	step int
}

func (c *chunkReader) Read(p []byte) (int, error) {
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), c.step)], c.b)
	c.b = c.b[n:]
	return n, nil
}
