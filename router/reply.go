package router

import (
	"bytes"
	"errors"
	"io"
	"sort"
	"time"

	"github.com/valyala/fastjson"

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
	p       *fastjson.Parser // lent by replyParsers until release
}

// usageJSON is a response's usage: prompt, completion and cached prompt
// tokens.
type usageJSON struct {
	PromptTokens, CompletionTokens, CachedTokens int64
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
	if c.parse(data) != nil {
		c.bad = true
	}
}

func (c *replyCapture) parseJSON() {
	if c.parse(c.buf.Bytes()) != nil {
		c.bad = true
		return
	}
	c.done = true
}

// errShape is a response whose JSON is valid but not shaped like an OpenAI
// response.
var errShape = errors.New("unexpected response shape")

// parse adds a response's or stream chunk's reply text, tool calls and
// usage: choices[0].text, choices[0].message (or .delta) content and
// tool_calls, and usage. A field of the wrong type makes it an error, with
// nothing taken.
func (c *replyCapture) parse(data []byte) error {
	if c.p == nil {
		c.p = replyParsers.Get()
	}
	v, err := c.p.ParseBytes(data)
	if err != nil {
		return err
	}
	if v.Type() != fastjson.TypeObject {
		return errShape
	}
	var usage *usageJSON
	if u := v.Get("usage"); !isNull(u) {
		usage = &usageJSON{}
		if u.Type() != fastjson.TypeObject {
			return errShape
		}
		d := u.Get("prompt_tokens_details")
		if !isNull(d) && d.Type() != fastjson.TypeObject {
			return errShape
		}
		if err := firstErr(intField(u, "prompt_tokens", &usage.PromptTokens), intField(u, "completion_tokens", &usage.CompletionTokens),
			intField(d, "cached_tokens", &usage.CachedTokens)); err != nil {
			return err
		}
	}
	var text, content []byte // alias the parser's memory until the next parse
	var calls []toolCallJSON
	if ch := v.Get("choices"); !isNull(ch) {
		a, err := ch.Array()
		if err != nil {
			return errShape
		}
		if len(a) > 0 && !isNull(a[0]) {
			c0 := a[0]
			if c0.Type() != fastjson.TypeObject {
				return errShape
			}
			if text, err = bytesField(c0, "text"); err != nil {
				return err
			}
			m := c0.Get("message")
			if isNull(m) {
				m = c0.Get("delta")
			}
			if !isNull(m) {
				if m.Type() != fastjson.TypeObject {
					return errShape
				}
				if content, err = bytesField(m, "content"); err != nil {
					return err
				}
				if calls, err = toolCalls(m.Get("tool_calls")); err != nil {
					return err
				}
			}
		}
	}
	if usage != nil {
		c.usage = *usage
	}
	add := func(s []byte) {
		if c.content.Len()+len(s) > c.limit {
			c.over = true
			return
		}
		c.content.Write(s)
	}
	add(text)
	add(content)
	for _, tc := range calls {
		if c.calls == nil {
			c.calls = map[int]*[2]string{}
		}
		cl := c.calls[tc.index]
		if cl == nil {
			cl = &[2]string{}
			c.calls[tc.index] = cl
		}
		cl[0] += tc.name
		cl[1] += tc.arguments
	}
	return nil
}

// release returns the capture's parser; call it once the capture is done.
func (c *replyCapture) release() {
	if c.p != nil {
		replyParsers.Put(c.p)
		c.p = nil
	}
}

// replyParsers lends response parsers to captures.
var replyParsers fastjson.ParserPool

type toolCallJSON struct {
	index           int
	name, arguments string
}

func toolCalls(v *fastjson.Value) ([]toolCallJSON, error) {
	if isNull(v) {
		return nil, nil
	}
	a, err := v.Array()
	if err != nil {
		return nil, errShape
	}
	out := make([]toolCallJSON, len(a))
	for i, tc := range a {
		if isNull(tc) {
			continue
		}
		if tc.Type() != fastjson.TypeObject {
			return nil, errShape
		}
		var idx int64
		if err := intField(tc, "index", &idx); err != nil {
			return nil, err
		}
		out[i].index = int(idx)
		fn := tc.Get("function")
		if isNull(fn) {
			continue
		}
		if fn.Type() != fastjson.TypeObject {
			return nil, errShape
		}
		if out[i].name, err = strField(fn, "name"); err != nil {
			return nil, err
		}
		if out[i].arguments, err = strField(fn, "arguments"); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func isNull(v *fastjson.Value) bool { return v == nil || v.Type() == fastjson.TypeNull }

// bytesField reads o's string field key, aliasing the parser's memory;
// absent or null is nil.
func bytesField(o *fastjson.Value, key string) ([]byte, error) {
	v := o.Get(key)
	if isNull(v) {
		return nil, nil
	}
	b, err := v.StringBytes()
	if err != nil {
		return nil, errShape
	}
	return b, nil
}

// strField is bytesField as a string of its own.
func strField(o *fastjson.Value, key string) (string, error) {
	b, err := bytesField(o, key)
	return string(b), err
}

// intField reads o's integer field key into dst; absent or null (or a nil
// o) leaves dst alone.
func intField(o *fastjson.Value, key string, dst *int64) error {
	if o == nil {
		return nil
	}
	v := o.Get(key)
	if isNull(v) {
		return nil
	}
	n, err := v.Int64()
	if err != nil {
		return errShape
	}
	*dst = n
	return nil
}

func firstErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
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
	return u.PromptTokens, u.CompletionTokens, u.CachedTokens
}
