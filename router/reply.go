package router

import (
	"bytes"
	"cmp"
	"errors"
	"io"
	"math"
	"slices"

	"github.com/valyala/fastjson"

	"github.com/semroute/semroute/blockhash"
)

// replyCapture passes a response body through, calls first when its first
// bytes arrive, and reads the reply and usage out of it: a JSON body is kept
// (up to limit bytes) and parsed at its end; an event stream is parsed line
// by line as it passes, keeping only the reply's text (up to limit bytes).
//
// Everything kept of the reply (content, text, and every tool call's name
// and arguments, plus toolCallCost per distinct tool call) counts against
// the one cap, limit; past it the reply is marked over and what was kept is
// dropped. Each piece is appended to a growable buffer, so keeping a reply
// costs time linear in its length however finely it is split. The stream
// itself always passes through untouched.
type replyCapture struct {
	rc    io.ReadCloser
	sse   bool
	limit int
	first func() // called at the first byte; may be nil
	end   func() // called when the body has ended whole; may be nil
	// agentic: the body is a Responses or Messages API answer: its usage
	// is read (at the top, or in a stream's response or message), and no
	// reply is learned. onID, if set, is given the Responses API
	// response's id.
	agentic bool
	onID    func(id string)
	// onStored, if set, is given a Responses API response's id and the
	// texts of its output messages once it has ended (completed or
	// incomplete): at the top of a whole answer, or in a stream's
	// response.completed or response.incomplete.
	onStored func(id string, out [][]byte)

	buf     bytes.Buffer // JSON body, or the current partial SSE line (at most limit bytes)
	skip    bool         // discarding the rest of an SSE line longer than limit
	over    bool         // the body or reply was longer than limit
	eof     bool         // the body was read to its end
	done    bool         // an SSE stream ended with [DONE]
	bad     bool         // an SSE data line did not parse, or a tool call index was absurd
	kept    int          // bytes of the reply counted against limit
	content []byte
	calls   []toolCall     // by index
	last    int            // position in calls of the call last added to
	scratch []toolCallJSON // a chunk's tool calls, reused
	usage   usageJSON
	p       *fastjson.Parser // lent by replyParsers until release
	// lim bounds each answer or chunk parsed (blockhash.Admit): the
	// bounds and budget of client bodies. Zero: the default bounds, no
	// budget.
	lim blockhash.Limits
}

// A reply's tool calls are bounded: each distinct index costs toolCallCost
// bytes of the cap, there are at most maxToolCalls of them, and an index
// below 0 or above maxToolIndex makes the reply bad.
const (
	maxToolCalls = 128
	toolCallCost = 64
	maxToolIndex = math.MaxInt32
)

// toolCall is one tool call of the reply, gathered from its deltas.
type toolCall struct {
	index      int
	name, args []byte
}

// usageJSON is a response's usage: prompt, completion and cached prompt
// tokens.
type usageJSON struct {
	PromptTokens, CompletionTokens, CachedTokens int64
	CachedReported                               bool // the usage had prompt_tokens_details.cached_tokens
}

func (c *replyCapture) Read(p []byte) (int, error) {
	n, err := c.rc.Read(p)
	c.feed(p[:n], err == io.EOF)
	return n, err
}

// feed takes the next bytes of the body; eof says the body ended with
// them. Read feeds what it reads; a front end that is handed the body in
// chunks (ext_proc) feeds them itself, with rc nil.
func (c *replyCapture) feed(p []byte, eof bool) {
	if len(p) > 0 {
		if c.first != nil {
			c.first()
			c.first = nil
		}
		if c.sse {
			c.feedSSE(p)
		} else if !c.over {
			if c.buf.Len()+len(p) > c.limit {
				c.markOver()
				c.buf = bytes.Buffer{}
			} else {
				c.buf.Write(p)
			}
		}
	}
	if eof && !c.eof {
		c.eof = true
		if !c.sse && !c.over {
			c.parseJSON()
		}
		if c.end != nil {
			c.end()
			c.end = nil
		}
	}
}

func (c *replyCapture) Close() error { return c.rc.Close() }

// feedSSE consumes stream bytes, handling every complete line. A line
// longer than limit makes the reply bad and is skipped to its end, so the
// partial-line buffer never holds more than limit bytes.
func (c *replyCapture) feedSSE(p []byte) {
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			if c.skip {
				return
			}
			if c.buf.Len()+len(p) > c.limit {
				c.tooLong()
				return
			}
			c.buf.Write(p)
			return
		}
		switch {
		case c.skip:
			c.skip = false
		case c.buf.Len()+i > c.limit:
			c.markBad()
			c.buf.Reset()
		case c.buf.Len() == 0: // a whole line in p: parsed without a copy
			c.line(p[:i])
		default:
			c.buf.Write(p[:i])
			c.line(c.buf.Bytes())
			c.buf.Reset()
		}
		p = p[i+1:]
	}
}

// tooLong drops an SSE line longer than limit and marks the reply bad.
func (c *replyCapture) tooLong() {
	c.markBad()
	c.buf.Reset()
	c.skip = true
}

// markOver and markBad say the reply cannot be learned, and drop what was
// kept of it.
func (c *replyCapture) markOver() { c.over = true; c.drop() }
func (c *replyCapture) markBad()  { c.bad = true; c.drop() }

func (c *replyCapture) drop() {
	c.content, c.calls, c.kept = nil, nil, 0
}

// keeping says whether the reply may still be learned.
func (c *replyCapture) keeping() bool { return !c.over && !c.bad }

// keep appends s to *dst if the reply stays within limit, and otherwise
// marks it over.
func (c *replyCapture) keep(dst *[]byte, s []byte) {
	if len(s) == 0 || !c.keeping() {
		return
	}
	if len(s) > c.limit-c.kept {
		c.markOver()
		return
	}
	c.kept += len(s)
	*dst = append(*dst, s...)
}

// call returns the tool call of index, adding it (at toolCallCost bytes of
// the cap) if new; nil when the reply cannot be learned, or the new call
// would take it over its limits.
func (c *replyCapture) call(index int) *toolCall {
	if !c.keeping() {
		return nil
	}
	if c.last < len(c.calls) && c.calls[c.last].index == index {
		return &c.calls[c.last]
	}
	i, found := slices.BinarySearchFunc(c.calls, index, func(tc toolCall, k int) int { return cmp.Compare(tc.index, k) })
	if !found {
		if len(c.calls) >= maxToolCalls || toolCallCost > c.limit-c.kept {
			c.markOver()
			return nil
		}
		c.kept += toolCallCost
		c.calls = slices.Insert(c.calls, i, toolCall{index: index})
	}
	c.last = i
	return &c.calls[i]
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
		c.markBad()
	}
}

func (c *replyCapture) parseJSON() {
	if c.parse(c.buf.Bytes()) != nil {
		c.markBad()
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
	release, err := blockhash.Admit(data, c.lim)
	defer release()
	if err != nil {
		return err
	}
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
	u := v.Get("usage")
	if c.agentic {
		u = c.agenticUsage(v)
	}
	usage, hasUsage, err := parseUsage(u)
	if err != nil {
		return err
	}
	if c.agentic {
		if hasUsage {
			if usage.PromptTokens == 0 && !usage.CachedReported { // a later event's output count alone (message_delta)
				usage.PromptTokens, usage.CachedTokens, usage.CachedReported = c.usage.PromptTokens, c.usage.CachedTokens, c.usage.CachedReported
			}
			c.usage = usage
		}
		return nil
	}
	// text, content and the tool calls alias the parser's memory until the
	// next parse.
	text, content, calls, err := c.parseChoice(v.Get("choices"))
	if err != nil {
		return err
	}
	if hasUsage {
		c.usage = usage
	}
	c.keep(&c.content, text)
	c.keep(&c.content, content)
	c.keepCalls(calls)
	clear(calls) // let go of the parser's memory
	return nil
}

// agenticUsage finds a Responses or Messages API answer's usage, and
// hands the Responses API response's id to onID: at the top of a whole
// answer, or in a stream event's response (response.created,
// response.completed) or message (message_start); a message_delta event
// has its own at the top.
func (c *replyCapture) agenticUsage(v *fastjson.Value) *fastjson.Value {
	inner := v
	for _, k := range []string{"response", "message"} {
		if o := v.Get(k); o != nil && o.Type() == fastjson.TypeObject {
			inner = o
		}
	}
	if string(inner.GetStringBytes("object")) == "response" {
		id := inner.GetStringBytes("id")
		if c.onID != nil && len(id) > 0 {
			c.onID(string(id))
			c.onID = nil
		}
		if st := string(inner.GetStringBytes("status")); c.onStored != nil && len(id) > 0 && (st == "completed" || st == "incomplete") {
			c.onStored(string(id), outputTexts(inner.GetArray("output")))
			c.onStored = nil
		}
	}
	if u := inner.Get("usage"); u != nil {
		return u
	}
	return v.Get("usage")
}

// outputTexts returns copies of the texts of a response's output
// messages, each message's output_text contents joined by newlines (as
// vLLM carries them into a continuation); other items (tool calls,
// reasoning) are left out.
func outputTexts(items []*fastjson.Value) [][]byte {
	var out [][]byte
	for _, it := range items {
		if string(it.GetStringBytes("type")) != "message" {
			continue
		}
		var text []byte
		n := 0
		for _, c := range it.GetArray("content") {
			if string(c.GetStringBytes("type")) == "output_text" {
				if n > 0 {
					text = append(text, '\n')
				}
				text = append(text, c.GetStringBytes("text")...)
				n++
			}
		}
		if n > 0 {
			out = append(out, text)
		}
	}
	return out
}

// parseUsage reads a usage object (null or absent: none): chat's
// (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens),
// the Responses API's (input_tokens, output_tokens,
// input_tokens_details.cached_tokens) or Anthropic's (input_tokens, which
// leaves out cache_read_input_tokens and cache_creation_input_tokens,
// both prompt tokens too; the first is the cached ones).
func parseUsage(u *fastjson.Value) (usage usageJSON, has bool, err error) {
	if isNull(u) {
		return usage, false, nil
	}
	if u.Type() != fastjson.TypeObject {
		return usage, false, errShape
	}
	prompt, output, details := "prompt_tokens", "completion_tokens", "prompt_tokens_details"
	if u.Get("prompt_tokens") == nil && u.Get("input_tokens") != nil || u.Get("output_tokens") != nil {
		prompt, output, details = "input_tokens", "output_tokens", "input_tokens_details"
	}
	d := u.Get(details)
	if !isNull(d) && d.Type() != fastjson.TypeObject {
		return usage, false, errShape
	}
	if err := firstErr(intField(u, prompt, &usage.PromptTokens), intField(u, output, &usage.CompletionTokens),
		intField(d, "cached_tokens", &usage.CachedTokens)); err != nil {
		return usage, false, err
	}
	usage.CachedReported = d != nil && !isNull(d.Get("cached_tokens"))
	if read := u.Get("cache_read_input_tokens"); !isNull(read) {
		var created int64
		if err := firstErr(intField(u, "cache_read_input_tokens", &usage.CachedTokens), intField(u, "cache_creation_input_tokens", &created)); err != nil {
			return usage, false, err
		}
		usage.PromptTokens += usage.CachedTokens + created
		usage.CachedReported = true
	}
	return usage, true, nil
}

// parseChoice reads choices[0]: its text, its message's (or delta's)
// content and tool calls, in c.scratch. All alias the parser's memory.
func (c *replyCapture) parseChoice(ch *fastjson.Value) (text, content []byte, calls []toolCallJSON, err error) {
	calls = c.scratch[:0]
	if isNull(ch) {
		return nil, nil, calls, nil
	}
	a, err := ch.Array()
	if err != nil {
		return nil, nil, calls, errShape
	}
	if len(a) == 0 || isNull(a[0]) {
		return nil, nil, calls, nil
	}
	c0 := a[0]
	if c0.Type() != fastjson.TypeObject {
		return nil, nil, calls, errShape
	}
	if text, err = bytesField(c0, "text"); err != nil {
		return nil, nil, calls, err
	}
	m := c0.Get("message")
	if isNull(m) {
		m = c0.Get("delta")
	}
	if isNull(m) {
		return text, nil, calls, nil
	}
	if m.Type() != fastjson.TypeObject {
		return nil, nil, calls, errShape
	}
	if content, err = bytesField(m, "content"); err != nil {
		return nil, nil, calls, err
	}
	calls, err = appendToolCalls(calls, m.Get("tool_calls"))
	c.scratch = calls[:0]
	if err != nil {
		clear(calls)
		return nil, nil, calls[:0], err
	}
	return text, content, calls, nil
}

// keepCalls adds a chunk's tool calls to the reply's, by index; an index
// out of bounds marks the reply bad.
func (c *replyCapture) keepCalls(calls []toolCallJSON) {
	for i := range calls {
		tc := &calls[i]
		if tc.index < 0 || tc.index > maxToolIndex {
			c.markBad()
			return
		}
		cl := c.call(int(tc.index))
		if cl == nil {
			return
		}
		c.keep(&cl.name, tc.name)
		c.keep(&cl.args, tc.arguments)
	}
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

// toolCallJSON is one entry of a chunk's tool_calls, aliasing the parser's
// memory.
type toolCallJSON struct {
	index           int64
	name, arguments []byte
}

// appendToolCalls appends the tool calls of a tool_calls array to out. An
// entry without an index (as in a whole message) is numbered by its place in
// the array; null entries are skipped.
func appendToolCalls(out []toolCallJSON, v *fastjson.Value) ([]toolCallJSON, error) {
	if isNull(v) {
		return out, nil
	}
	a, err := v.Array()
	if err != nil {
		return out, errShape
	}
	for i, tc := range a {
		if isNull(tc) {
			continue
		}
		if tc.Type() != fastjson.TypeObject {
			return out, errShape
		}
		t := toolCallJSON{index: int64(i)}
		if err := intField(tc, "index", &t.index); err != nil {
			return out, err
		}
		if fn := tc.Get("function"); !isNull(fn) {
			if fn.Type() != fastjson.TypeObject {
				return out, errShape
			}
			if t.name, err = bytesField(fn, "name"); err != nil {
				return out, err
			}
			if t.arguments, err = bytesField(fn, "arguments"); err != nil {
				return out, err
			}
		}
		out = append(out, t)
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
	if err != nil || n < 0 { // a token count: never negative
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
	if !c.eof || c.over || c.bad || !c.done || c.agentic {
		return nil, false
	}
	var tcs [][2]string
	if len(c.calls) > 0 {
		tcs = make([][2]string, len(c.calls))
		for i, tc := range c.calls { // in index order
			tcs[i] = [2]string{string(tc.name), string(tc.args)}
		}
	}
	return blockhash.AssistantText(string(c.content), tcs), true
}

// tokens returns the usage the replica reported: prompt, output and cached
// prompt tokens (zeros when it reported none), and whether it reported
// the cached ones.
func (c *replyCapture) tokens() (prompt, output, cached int64, cachedReported bool) {
	u := c.usage
	return u.PromptTokens, u.CompletionTokens, u.CachedTokens, u.CachedReported
}
