package router

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/semroute/semroute/blockhash"
)

// retained is how many bytes of the reply c holds: its content and its tool
// calls' names and arguments.
func (c *replyCapture) retained() int {
	n := len(c.content)
	for _, tc := range c.calls {
		n += len(tc.name) + len(tc.args)
	}
	return n
}

// checkBounds fails t if c holds more of the reply than its cap allows.
func checkBounds(t *testing.T, c *replyCapture) {
	t.Helper()
	if r := c.retained(); r+toolCallCost*len(c.calls) != c.kept || c.kept > c.limit {
		t.Fatalf("retained %d bytes in %d calls, kept %d, limit %d", r, len(c.calls), c.kept, c.limit)
	}
	if len(c.calls) > maxToolCalls {
		t.Fatalf("%d tool calls kept", len(c.calls))
	}
	if c.buf.Len() > c.limit {
		t.Fatalf("partial line of %d bytes, limit %d", c.buf.Len(), c.limit)
	}
}

// feedChecked reads all of c in reads of step bytes, checking c's bounds
// after each, and returns what passed through.
func feedChecked(t *testing.T, c *replyCapture, step int) []byte {
	t.Helper()
	var out []byte
	buf := make([]byte, step)
	for {
		n, err := c.Read(buf)
		out = append(out, buf[:n]...)
		checkBounds(t, c)
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
	}
}

func sseCapture(body []byte, limit int) *replyCapture {
	return &replyCapture{rc: io.NopCloser(bytes.NewReader(body)), sse: true, limit: limit}
}

// deltaChunk is one stream chunk with choices[0].delta = delta.
func deltaChunk(delta string) string {
	return "data: {\"choices\":[{\"index\":0,\"delta\":" + delta + "}]}\n\n"
}

// TestReplyToolCallArgumentsShareTheCap: tool-call arguments count against
// the reply's cap like content; past it the reply is over, nothing more is
// kept (what was kept is dropped), the usage is still read, and the stream
// passes through untouched.
func TestReplyToolCallArgumentsShareTheCap(t *testing.T) {
	const limit = 4096
	stream := toolDeltaStream(5*limit, 20, 1)
	c := sseCapture(stream, limit)
	defer c.release()
	maxKept, maxRetained := 0, 0
	buf := make([]byte, 97)
	var out []byte
	for {
		n, err := c.Read(buf)
		out = append(out, buf[:n]...)
		checkBounds(t, c)
		maxKept, maxRetained = max(maxKept, c.kept), max(maxRetained, c.retained())
		if err == io.EOF {
			break
		}
	}
	if !bytes.Equal(out, stream) {
		t.Fatal("the stream was changed in passing")
	}
	if !c.over || c.retained() != 0 || c.calls != nil || c.kept != 0 {
		t.Fatalf("over %v, retained %d, %d calls, kept %d: want over with nothing kept", c.over, c.retained(), len(c.calls), c.kept)
	}
	if maxRetained < limit-100 || maxRetained > limit-toolCallCost || maxKept > limit {
		t.Fatalf("at most %d bytes retained (%d kept) at once, limit %d", maxRetained, maxKept, limit)
	}
	if _, ok := c.reply(); ok {
		t.Fatal("an over-cap reply was learned")
	}
	if p, o, _, _ := c.tokens(); p != 10 || o != 5 {
		t.Fatalf("usage %d %d after the cap", p, o)
	}

	// Content, text and tool calls all share the one cap.
	for name, body := range map[string]string{
		"content then arguments": deltaChunk(`{"content":"`+strings.Repeat("c", 600)+`"}`) +
			deltaChunk(`{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"`+strings.Repeat("a", 400)+`"}}]}`),
		"arguments then content": deltaChunk(`{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"`+strings.Repeat("a", 600)+`"}}]}`) +
			deltaChunk(`{"content":"`+strings.Repeat("c", 400)+`"}`),
		"text and a name": "data: {\"choices\":[{\"text\":\"" + strings.Repeat("t", 900) + "\"}]}\n\n" +
			deltaChunk(`{"tool_calls":[{"index":0,"function":{"name":"`+strings.Repeat("n", 100)+`"}}]}`),
		"two calls": deltaChunk(`{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"`+strings.Repeat("a", 450)+`"}}]}`) +
			deltaChunk(`{"tool_calls":[{"index":1,"function":{"name":"g","arguments":"`+strings.Repeat("b", 450)+`"}}]}`),
	} {
		t.Run(name, func(t *testing.T) {
			// Under a 1,000-byte cap each part fits; together they do not.
			c := sseCapture([]byte(body+"data: [DONE]\n\n"), 1000)
			feedChecked(t, c, 64)
			if _, ok := c.reply(); ok || !c.over {
				t.Fatalf("learned, or not over (kept %d)", c.kept)
			}
			big := sseCapture([]byte(body+"data: [DONE]\n\n"), 2000)
			feedChecked(t, big, 64)
			if _, ok := big.reply(); !ok {
				t.Fatalf("not learned under a 2,000-byte cap: over %v bad %v", big.over, big.bad)
			}
		})
	}
}

// TestReplyToolCallIndexesBounded: a stream of ever new tool-call indexes
// keeps at most maxToolCalls of them, each costing toolCallCost bytes of the
// cap; a negative or absurd index makes the reply bad.
func TestReplyToolCallIndexesBounded(t *testing.T) {
	var b strings.Builder
	for i := 0; i < 100_000; i++ {
		fmt.Fprintf(&b, "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":%d,\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}}]}\n\n", i)
	}
	b.WriteString("data: [DONE]\n\n")
	stream := []byte(b.String())
	for _, limit := range []int{1 << 20, 4096} {
		c := sseCapture(stream, limit)
		maxCalls, n := 0, 0
		buf := make([]byte, 32<<10)
		for {
			step := 64 // line by line until over, to see every call kept
			if c.over {
				step = len(buf)
			}
			k, err := c.Read(buf[:step])
			n += k
			checkBounds(t, c)
			maxCalls = max(maxCalls, len(c.calls))
			if err == io.EOF {
				break
			}
		}
		want := min(maxToolCalls, limit/(toolCallCost+3)) // 3 bytes a call: "f", "{}"
		if n != len(stream) || !c.over || c.calls != nil || maxCalls != want {
			t.Fatalf("limit %d: passed %d of %d bytes, over %v, at most %d calls kept (want %d)", limit, n, len(stream), c.over, maxCalls, want)
		}
		if _, ok := c.reply(); ok {
			t.Fatal("learned")
		}
		c.release()
	}
	for _, idx := range []string{"-1", "2147483648", "9223372036854775807"} {
		body := deltaChunk(`{"tool_calls":[{"index":0,"function":{"name":"f"}},{"index":`+idx+`,"function":{"name":"g"}}]}`) + "data: [DONE]\n\n"
		c := sseCapture([]byte(body), 1<<20)
		feedChecked(t, c, 7)
		if _, ok := c.reply(); ok || !c.bad || c.calls != nil {
			t.Fatalf("index %s: learned, or bad %v with %d calls", idx, c.bad, len(c.calls))
		}
		c.release()
	}
	// A sparse index within bounds is kept; calls render in index order.
	body := deltaChunk(`{"tool_calls":[{"index":1000,"function":{"name":"g","arguments":"2"}}]}`) +
		deltaChunk(`{"tool_calls":[{"index":3,"function":{"name":"f","arguments":"1"}}]}`) + "data: [DONE]\n\n"
	c := sseCapture([]byte(body), 1<<20)
	defer c.release()
	feedChecked(t, c, 5)
	if r, ok := c.reply(); !ok || string(r) != "\x00f\x001\x00g\x002" {
		t.Fatalf("reply %q %v", r, ok)
	}
}

// TestReplyStreamedToolCallsRender: normal streamed tool calls (the name in
// a call's first delta, its arguments over several, two calls interleaved)
// render exactly as blockhash renders the same assistant message, however
// the stream is split into reads.
func TestReplyStreamedToolCallsRender(t *testing.T) {
	stream := deltaChunk(`{"role":"assistant","content":"Let me check."}`) +
		deltaChunk(`{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"get_weather","arguments":""}}]}`) +
		deltaChunk(`{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\": "}}]}`) +
		deltaChunk(`{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"get_time","arguments":"{\"tz\""}}]}`) +
		deltaChunk(`{"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\u00e9\"}"}}]}`) +
		deltaChunk(`{"tool_calls":[{"index":1,"function":{"arguments":": \"CET\"}"}}]}`) +
		"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n" +
		"data: [DONE]\n\n"
	want := blockhash.AssistantText("Let me check.", [][2]string{{"get_weather", `{"city": "Parisé"}`}, {"get_time", `{"tz": "CET"}`}})
	for _, step := range []int{1, 3, 17, 64, len(stream)} {
		c := sseCapture([]byte(stream), 1<<20)
		if out := feedChecked(t, c, step); string(out) != stream {
			t.Fatal("the stream was changed in passing")
		}
		got, ok := c.reply()
		if !ok || !bytes.Equal(got, want) {
			t.Fatalf("step %d: reply %q %v, want %q", step, got, ok, want)
		}
		if p, o, _, _ := c.tokens(); p != 3 || o != 4 {
			t.Fatalf("usage %d %d", p, o)
		}
		if c.retained() != len(got)-4 { // two NULs a call are rendering
			t.Fatalf("retained %d for a %d-byte reply", c.retained(), len(got))
		}
		c.release()
	}
}

// TestReplyJSONToolCallsRenderAsTheNextTurn: a whole (not streamed)
// response's tool calls carry no index; each is its own call, numbered by
// its place, and the reply renders as the same assistant message does when
// the client sends it back.
func TestReplyJSONToolCallsRenderAsTheNextTurn(t *testing.T) {
	calls := `[{"id":"a","type":"function","function":{"name":"f","arguments":"{\"x\":1}"}},{"id":"b","type":"function","function":{"name":"g","arguments":"{}"}}]`
	resp := `{"choices":[{"message":{"role":"assistant","content":"ok","tool_calls":` + calls + `}}]}`
	c := &replyCapture{rc: io.NopCloser(strings.NewReader(resp)), limit: 1 << 20}
	defer c.release()
	io.Copy(io.Discard, c)
	got, ok := c.reply()
	next, err := blockhash.ParseChat([]byte(`{"model":"m","messages":[{"role":"user","content":"q"},{"role":"assistant","content":"ok","tool_calls":`+calls+`}]}`), blockhash.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	defer next.Recycle()
	if want := next.Parts[len(next.Parts)-1].Text; !ok || !bytes.Equal(got, want) {
		t.Fatalf("reply %q %v, the next turn renders %q", got, ok, want)
	}
}

// TestReplySSELineBounded: a line longer than the cap, arriving in pieces,
// is never buffered past the cap: it makes the reply bad and is skipped to
// its end, and the lines after it are read as before (the usage).
func TestReplySSELineBounded(t *testing.T) {
	const limit = 1000
	stream := deltaChunk(`{"content":"a"}`) + "data: {\"choices\":[{\"delta\":{\"content\":\"" + strings.Repeat("x", 10*limit) + "\"}}]}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":8}}\n\ndata: [DONE]\n\n"
	for _, step := range []int{1, 13, 999, 1001, 32 << 10} {
		c := sseCapture([]byte(stream), limit)
		if out := feedChecked(t, c, step); string(out) != stream {
			t.Fatal("the stream was changed in passing")
		}
		if _, ok := c.reply(); ok || !c.bad {
			t.Fatalf("step %d: a line over the cap was not refused", step)
		}
		if p, o, _, _ := c.tokens(); p != 7 || o != 8 {
			t.Fatalf("step %d: usage %d %d after a long line", step, p, o)
		}
		c.release()
	}
}

// TestReplyChunkAllocs: once warm, a tool-call delta costs no allocation
// (amortized over its buffer's growth).
func TestReplyChunkAllocs(t *testing.T) {
	line := []byte(deltaChunk(`{"tool_calls":[{"index":0,"function":{"arguments":"aaaaaaaaaaaaaaaaaaaa"}}]}`))
	c := &replyCapture{sse: true, limit: 1 << 30}
	defer c.release()
	c.feedSSE(line)
	if a := testing.AllocsPerRun(5000, func() { c.feedSSE(line) }); a != 0 {
		t.Fatalf("%v allocations per delta", a)
	}
	if len(c.calls) != 1 || len(c.calls[0].args) != 20*5002 {
		t.Fatalf("%d calls, %d bytes of arguments", len(c.calls), len(c.calls[0].args))
	}
}

// FuzzReplyCaptureBounded: any response, read in any sizes, passes through
// unchanged, never holds more of the reply than its cap, and reads the same
// reply and usage as when read whole.
func FuzzReplyCaptureBounded(f *testing.F) {
	f.Add(toolDeltaStream(400, 20, 3), true, uint8(5), uint16(300))
	f.Add([]byte(deltaChunk(`{"tool_calls":[{"index":5,"function":{"name":"f"}},{"index":-1}]}`)+"data: [DONE]\n\n"), true, uint8(1), uint16(64))
	f.Add([]byte(`{"choices":[{"message":{"content":"x","tool_calls":[{"function":{"name":"f"}},{"function":{"name":"g"}}]}}]}`), false, uint8(2), uint16(200))
	f.Fuzz(func(t *testing.T, body []byte, sse bool, step uint8, limit uint16) {
		lim := int(limit)%2048 + 1
		c := &replyCapture{rc: io.NopCloser(&chunked{b: body, step: int(step%64) + 1}), sse: sse, limit: lim}
		defer c.release()
		if out := feedChecked(t, c, 256); !bytes.Equal(out, body) {
			t.Fatalf("passed through %q, want %q", out, body)
		}
		whole := &replyCapture{rc: io.NopCloser(bytes.NewReader(body)), sse: sse, limit: lim}
		defer whole.release()
		io.Copy(io.Discard, whole)
		r1, ok1 := c.reply()
		r2, ok2 := whole.reply()
		if ok1 != ok2 || !bytes.Equal(r1, r2) || c.usage != whole.usage {
			t.Fatalf("read in pieces: %q %v %+v; whole: %q %v %+v", r1, ok1, c.usage, r2, ok2, whole.usage)
		}
	})
}

// toolDeltaStream is an event stream, shaped as vLLM streams a tool call,
// whose tool calls' arguments total about total bytes sent delta bytes at a
// time: the first chunk of each call carries its name, the calls take turns
// (call i%calls), and the stream ends with a usage chunk and [DONE].
func toolDeltaStream(total, delta, calls int) []byte {
	var b bytes.Buffer
	chunk := func(tc string) {
		fmt.Fprintf(&b, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[%s]},\"finish_reason\":null}]}\n\n", tc)
	}
	for i := 0; i < calls; i++ {
		chunk(fmt.Sprintf(`{"index":%d,"id":"call_%d","type":"function","function":{"name":"fn%d","arguments":""}}`, i, i, i))
	}
	piece := strings.Repeat("a", delta)
	for i := 0; i*delta < total; i++ {
		chunk(fmt.Sprintf(`{"index":%d,"function":{"arguments":"%s"}}`, i%calls, piece))
	}
	b.WriteString("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":5}}\n\n")
	b.WriteString("data: [DONE]\n\n")
	return b.Bytes()
}

// drain reads c to its end in 32 KiB reads, as the proxy does.
func drain(tb testing.TB, c io.Reader) int {
	tb.Helper()
	buf := make([]byte, 32<<10)
	n := 0
	for {
		k, err := c.Read(buf)
		n += k
		if err == io.EOF {
			return n
		}
		if err != nil {
			tb.Fatal(err)
		}
	}
}

// BenchmarkReplyToolCallDeltas: a stream of one tool call whose arguments
// (10 KB, 100 KB, 1 MB) come 20 bytes a delta, through a capture with the
// default 1 MiB cap. SetBytes is the stream's length, so MB/s is the
// router's throughput over the stream; time per op should grow linearly.
func BenchmarkReplyToolCallDeltas(b *testing.B) {
	for _, total := range []int{10_000, 100_000, 1_000_000} {
		stream := toolDeltaStream(total, 20, 1)
		b.Run(fmt.Sprintf("args=%dKB", total/1000), func(b *testing.B) {
			b.SetBytes(int64(len(stream)))
			b.ReportAllocs()
			var rd bytes.Reader
			for b.Loop() {
				rd.Reset(stream)
				c := &replyCapture{rc: io.NopCloser(&rd), sse: true, limit: 1 << 20}
				drain(b, c)
				if _, ok := c.reply(); !ok {
					b.Fatal("reply not whole")
				}
				c.release()
			}
		})
	}
}

func TestReplyCapture(t *testing.T) {
	cases := []struct {
		name string
		sse  bool
		body string
		want string
		ok   bool
	}{
		{"chat json", false, `{"choices":[{"message":{"role":"assistant","content":"hello"}}]}`, "hello", true},
		{"completion json", false, `{"choices":[{"text":"abc"}]}`, "abc", true},
		{"tool calls json", false, `{"choices":[{"message":{"content":null,"tool_calls":[{"function":{"name":"f","arguments":"{}"}}]}}]}`, "\x00f\x00{}", true},
		{"chat sse", true, "data: {\"choices\":[{\"delta\":{\"content\":\"he\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"llo\"}}]}\n\ndata: {\"choices\":[],\"usage\":{}}\n\ndata: [DONE]\n\n", "hello", true},
		{"sse tool call pieces", true, "data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\"}}]}}]}\n\ndata: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\":1}\"}}]}}]}\n\ndata: [DONE]\n\n", "\x00f\x00{\"a\":1}", true},
		{"sse cut short", true, "data: {\"choices\":[{\"delta\":{\"content\":\"he\"}}]}\n\n", "", false},
		{"bad json", false, `{"choices":`, "", false},
		{"escaped json", false, `{"choices":[{"message":{"content":"a\nb\u00e9\"c"}}]}`, "a\nbé\"c", true},
		{"content of the wrong type", false, `{"choices":[{"message":{"content":5}}]}`, "", false},
		{"choices not an array", false, `{"choices":{"text":"x"}}`, "", false},
		{"not an object", false, `["x"]`, "", false},
		{"sse chunk of the wrong shape", true, "data: {\"choices\":[{\"delta\":{\"content\":\"he\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":\"0\"}]}}]}\n\ndata: [DONE]\n\n", "", false},
		{"null fields", false, `{"choices":[{"text":null,"message":null,"delta":{"content":"d","tool_calls":null}}],"usage":null}`, "d", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := &replyCapture{rc: io.NopCloser(strings.NewReader(tc.body)), sse: tc.sse, limit: 1 << 20}
			if _, err := io.Copy(io.Discard, c); err != nil {
				t.Fatal(err)
			}
			got, ok := c.reply()
			if ok != tc.ok || string(got) != tc.want {
				t.Fatalf("reply = %q, %v; want %q, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
	over := &replyCapture{rc: io.NopCloser(strings.NewReader(`{"choices":[{"text":"abcdefgh"}]}`)), limit: 10}
	io.Copy(io.Discard, over)
	if _, ok := over.reply(); ok {
		t.Fatal("a reply over the limit was learned")
	}
	// Usage, from a JSON body and from a stream's last chunk; a stream fed
	// in one-byte reads parses the same.
	u := &replyCapture{rc: io.NopCloser(strings.NewReader(`{"choices":[{"text":"x"}],"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}`)), limit: 1 << 20}
	io.Copy(io.Discard, u)
	if p, o, c, rep := u.tokens(); p != 9 || o != 2 || c != 4 || !rep {
		t.Fatalf("usage %d %d %d", p, o, c)
	}
	stream := "data: {\"choices\":[{\"delta\":{\"content\":\"ab\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\ndata: [DONE]\n\n"
	sc := &replyCapture{rc: io.NopCloser(iotest.OneByteReader(strings.NewReader(stream))), sse: true, limit: 1 << 20}
	io.Copy(io.Discard, sc)
	if p, o, c, _ := sc.tokens(); p != 5 || o != 1 || c != 3 {
		t.Fatalf("stream usage %d %d %d", p, o, c)
	}
	if r, ok := sc.reply(); !ok || string(r) != "ab" {
		t.Fatalf("stream reply %q %v", r, ok)
	}
}

// The capture says once when the replica's body has ended whole (the
// engine is done with the request), and not for a body cut short.
func TestReplyCaptureEnd(t *testing.T) {
	for _, tc := range []struct {
		body io.Reader
		want int
	}{
		{strings.NewReader(`{"choices":[{"message":{"content":"hi"}}]}`), 1},
		{io.MultiReader(strings.NewReader(`{"choices":[{"message":`), iotest.ErrReader(errors.New("connection reset"))), 0},
	} {
		ends := 0
		c := &replyCapture{rc: io.NopCloser(tc.body), limit: 1 << 20, end: func() { ends++ }}
		_, _ = io.Copy(io.Discard, c)
		_, _ = c.Read(make([]byte, 8)) // a read past the end
		if ends != tc.want {
			t.Fatalf("end called %d times, want %d", ends, tc.want)
		}
	}
}
