package router

import (
	"bytes"
	"encoding/json"
	"io"
	"sort"
	"time"

	"github.com/semroute/semroute/blockhash"
)

// replyCapture passes a response body through, calls first when its first
// bytes arrive, and reads the reply and usage out of it: a JSON body is kept
// (up to limit bytes) and parsed at its end; an event stream is parsed line
// by line as it passes, keeping only the reply's text (up to limit bytes).
type replyCapture struct {
	rc    io.ReadCloser
	sse   bool
	limit int
	first func() // may be nil
	// idle, if set, runs while a Read waits for the replica, and fires
	// after idleFor of silence.
	idle    *time.Timer
	idleFor time.Duration

	buf     bytes.Buffer // JSON body, or the current partial SSE line
	over    bool         // the body or reply was longer than limit
	eof     bool         // the body was read to its end
	done    bool         // an SSE stream ended with [DONE]
	bad     bool         // an SSE data line did not parse
	content bytes.Buffer
	calls   map[int]*[2]string
	usage   usageJSON
}

type usageJSON struct {
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	Details          *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (c *replyCapture) Read(p []byte) (int, error) {
	if c.idle != nil {
		c.idle.Reset(c.idleFor)
	}
	n, err := c.rc.Read(p)
	if c.idle != nil {
		c.idle.Stop()
	}
	if n > 0 {
		if c.first != nil {
			c.first()
			c.first = nil
		}
		if c.sse {
			c.feedSSE(p[:n])
		} else if !c.over {
			if c.buf.Len()+n > c.limit {
				c.over = true
				c.buf = bytes.Buffer{}
			} else {
				c.buf.Write(p[:n])
			}
		}
	}
	if err == io.EOF {
		c.eof = true
		if !c.sse && !c.over {
			c.parseJSON()
		}
	}
	return n, err
}

func (c *replyCapture) Close() error { return c.rc.Close() }

// feedSSE consumes stream bytes, handling every complete line.
func (c *replyCapture) feedSSE(p []byte) {
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			if c.buf.Len()+len(p) <= c.limit {
				c.buf.Write(p)
			} else {
				c.bad = true
			}
			return
		}
		c.buf.Write(p[:i])
		c.line(c.buf.Bytes())
		c.buf.Reset()
		p = p[i+1:]
	}
}

func (c *replyCapture) line(l []byte) {
	data, ok := bytes.CutPrefix(bytes.TrimRight(l, "\r"), []byte("data:"))
	if !ok {
		return
	}
	data = bytes.TrimSpace(data)
	if bytes.Equal(data, []byte("[DONE]")) {
		c.done = true
		return
	}
	var r responseJSON
	if json.Unmarshal(data, &r) != nil {
		c.bad = true
		return
	}
	c.take(&r)
}

func (c *replyCapture) parseJSON() {
	var r responseJSON
	if json.Unmarshal(c.buf.Bytes(), &r) != nil {
		c.bad = true
		return
	}
	c.done = true
	c.take(&r)
}

// take adds a response or chunk's reply text, tool calls and usage.
func (c *replyCapture) take(r *responseJSON) {
	if r.Usage != nil {
		c.usage = *r.Usage
	}
	if len(r.Choices) == 0 {
		return
	}
	ch := r.Choices[0]
	add := func(s string) {
		if c.content.Len()+len(s) > c.limit {
			c.over = true
			return
		}
		c.content.WriteString(s)
	}
	add(ch.Text)
	m := ch.Message
	if m == nil {
		m = ch.Delta
	}
	if m == nil {
		return
	}
	add(m.Content)
	for _, tc := range m.ToolCalls {
		if c.calls == nil {
			c.calls = map[int]*[2]string{}
		}
		cl := c.calls[tc.Index]
		if cl == nil {
			cl = &[2]string{}
			c.calls[tc.Index] = cl
		}
		cl[0] += tc.Function.Name
		cl[1] += tc.Function.Arguments
	}
}

// choiceJSON covers the shapes of choices[0] in chat and completions
// responses and stream chunks.
type choiceJSON struct {
	Text    string      `json:"text"`
	Message *messageOut `json:"message"`
	Delta   *messageOut `json:"delta"`
}

type messageOut struct {
	Content   string `json:"content"`
	ToolCalls []struct {
		Index    int `json:"index"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

type responseJSON struct {
	Choices []choiceJSON `json:"choices"`
	Usage   *usageJSON   `json:"usage"`
}

// reply returns the bytes of the assistant's reply as blockhash renders an
// assistant message, and whether a whole reply was seen.
func (c *replyCapture) reply() ([]byte, bool) {
	if !c.eof || c.over || c.bad || !c.done {
		return nil, false
	}
	idx := make([]int, 0, len(c.calls))
	for i := range c.calls {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	tcs := make([][2]string, len(idx))
	for i, k := range idx {
		tcs[i] = *c.calls[k]
	}
	return blockhash.AssistantText(c.content.String(), tcs), true
}

// tokens returns the usage the replica reported: prompt, output and cached
// prompt tokens (zeros when it reported none).
func (c *replyCapture) tokens() (prompt, output, cached int64) {
	u := c.usage
	if u.Details != nil {
		cached = u.Details.CachedTokens
	}
	return u.PromptTokens, u.CompletionTokens, cached
}
