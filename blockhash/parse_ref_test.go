package blockhash

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// This file keeps a slow reference parser on encoding/json that reads a
// body as the replica does (FastAPI and pydantic over Python's json.loads):
// keys match exactly, case-sensitively, and the last of duplicate keys wins.
// It decodes each object the router reads into a map[string]json.RawMessage,
// which is json.loads's reading of the keys, and each leaf into a Go value
// as the encoding/json parser the fastjson one replaced did.
// FuzzParseMatchesReference holds the parser to it: a body the parser
// accepts reads as the same request both ways (and gives no key the router
// reads twice, so that no parser's rule for duplicates can matter).

type refChatBody struct {
	Model               string
	Messages            []refMessage
	Tools               json.RawMessage
	Prompt              json.RawMessage
	User                string
	Stream              bool
	MaxTokens           *int
	MaxCompletionTokens *int
}

type refMessage struct {
	Role string
	// Content is a string, an array of content parts (each a
	// map[string]any for an object), or nil.
	Content   any
	Name      string
	ToolCalls []refToolCall
}

type refToolCall struct {
	ID       string
	Function struct {
		Name      string
		Arguments string
	}
}

// refObject decodes a JSON object (or null, to a nil map) as json.loads
// does: exact keys, the last of duplicates winning.
func refObject(raw []byte) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	err := json.Unmarshal(raw, &m)
	return m, err
}

// refField decodes o[key], if present, into dst as encoding/json does (a
// null leaves dst alone).
func refField(o map[string]json.RawMessage, key string, dst any) error {
	raw, ok := o[key]
	if !ok {
		return nil
	}
	if err := json.Unmarshal(raw, dst); err != nil {
		return inputErr(key, "%v", err)
	}
	return nil
}

func refReadMessage(raw json.RawMessage, i int) (refMessage, error) {
	var m refMessage
	o, err := refObject(raw)
	if err != nil {
		return m, inputErr(fmt.Sprintf("messages[%d]", i), "must be an object")
	}
	for _, f := range []struct {
		key string
		dst any
	}{{"role", &m.Role}, {"content", &m.Content}, {"name", &m.Name}} {
		if err := refField(o, f.key, f.dst); err != nil {
			return m, err
		}
	}
	var calls []json.RawMessage
	if err := refField(o, "tool_calls", &calls); err != nil {
		return m, err
	}
	for _, c := range calls {
		var tc refToolCall
		co, err := refObject(c)
		if err != nil {
			return m, inputErr("tool_calls", "%v", err)
		}
		if err := refField(co, "id", &tc.ID); err != nil {
			return m, err
		}
		var fn json.RawMessage
		if err := refField(co, "function", &fn); err != nil {
			return m, err
		}
		if len(fn) > 0 {
			fo, err := refObject(fn)
			if err != nil {
				return m, inputErr("function", "%v", err)
			}
			if err := refField(fo, "name", &tc.Function.Name); err != nil {
				return m, err
			}
			if err := refField(fo, "arguments", &tc.Function.Arguments); err != nil {
				return m, err
			}
		}
		m.ToolCalls = append(m.ToolCalls, tc)
	}
	return m, nil
}

func refDecode(body []byte, chat bool) (*refChatBody, *Request, error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, nil, inputErr("", "empty request body")
	}
	o, err := refObject(body)
	if err != nil {
		return nil, nil, inputErr("", "invalid JSON: %v", err)
	}
	var b refChatBody
	var msgs []json.RawMessage
	fs := []struct {
		key string
		dst any
	}{{"model", &b.Model}, {"user", &b.User}, {"stream", &b.Stream},
		{"max_tokens", &b.MaxTokens}, {"max_completion_tokens", &b.MaxCompletionTokens}}
	if chat {
		fs = append(fs, []struct {
			key string
			dst any
		}{{"messages", &msgs}, {"tools", &b.Tools}}...)
	} else {
		fs = append(fs, struct {
			key string
			dst any
		}{"prompt", &b.Prompt})
	}
	for _, f := range fs {
		if err := refField(o, f.key, f.dst); err != nil {
			return nil, nil, err
		}
	}
	for i, raw := range msgs {
		m, err := refReadMessage(raw, i)
		if err != nil {
			return nil, nil, err
		}
		b.Messages = append(b.Messages, m)
	}
	r := &Request{Model: b.Model, User: b.User, Stream: b.Stream}
	switch {
	case b.MaxCompletionTokens != nil:
		r.MaxTokens = *b.MaxCompletionTokens
	case b.MaxTokens != nil:
		r.MaxTokens = *b.MaxTokens
	}
	if r.MaxTokens < 0 {
		return nil, nil, inputErr("max_tokens", "must not be negative")
	}
	if r.Model == "" {
		return nil, nil, inputErr("model", "is required")
	}
	if len(r.Model) > MaxModelBytes {
		return nil, nil, inputErr("model", "is %d bytes, more than the limit of %d", len(r.Model), MaxModelBytes)
	}
	return &b, r, nil
}

// refParseChat is the reference chat parser: the replica's reading of the
// body, which the differential fuzz test holds the parser to.
func refParseChat(body []byte, lim Limits) (*Request, error) {
	b, r, err := refDecode(body, true)
	if err != nil {
		return nil, err
	}
	if len(b.Messages) == 0 {
		return nil, inputErr("messages", "is required and must not be empty")
	}
	if lim.MaxMessages > 0 && len(b.Messages) > lim.MaxMessages {
		return nil, inputErr("messages", "has %d entries, more than the limit of %d", len(b.Messages), lim.MaxMessages)
	}
	r.Parts = make([]Part, 0, len(b.Messages)+1)
	if t := bytes.TrimSpace(b.Tools); len(t) > 0 && !bytes.Equal(t, []byte("null")) {
		if t[0] != '[' {
			return nil, inputErr("tools", "must be an array")
		}
		var buf bytes.Buffer
		if err := json.Compact(&buf, t); err != nil {
			return nil, inputErr("tools", "invalid JSON: %v", err)
		}
		r.Parts = append(r.Parts, Part{Role: RoleTools, Base: KindTools, Text: buf.Bytes()})
	}
	lastUser := -1
	for i := range b.Messages {
		if b.Messages[i].Role == "user" {
			lastUser = i
		}
	}
	for i := range b.Messages {
		m := &b.Messages[i]
		field := fmt.Sprintf("messages[%d]", i)
		var p Part
		switch m.Role {
		case "system", "developer":
			p.Role, p.Base = RoleSystem, KindSystem
		case "user":
			p.Role, p.Base = RoleUser, KindUserHistory
			if i == lastUser {
				p.Base = KindUserQuery
			}
		case "assistant":
			p.Role, p.Base = RoleAssistant, KindAssistantHistory
		case "tool", "function":
			p.Role, p.Base = RoleTool, KindToolOutput
		case "":
			return nil, inputErr(field+".role", "is required")
		default:
			return nil, inputErr(field+".role", "unknown role %q", m.Role)
		}
		text, err := refMessageText(m, field)
		if err != nil {
			return nil, err
		}
		p.Text = text
		r.Parts = append(r.Parts, p)
	}
	return r, nil
}

func refMessageText(m *refMessage, field string) ([]byte, error) {
	var buf []byte
	if m.Name != "" {
		buf = append(buf, m.Name...)
		buf = append(buf, 0)
	}
	switch c := m.Content.(type) {
	case nil:
	case string:
		buf = append(buf, c...)
	case []any:
		for j, part := range c {
			cp, ok := part.(map[string]any)
			if !ok {
				return nil, inputErr(fmt.Sprintf("%s.content[%d]", field, j), "invalid content part: not an object")
			}
			if cp["type"] == "text" {
				text, ok := cp["text"].(string)
				if !ok && cp["text"] != nil {
					return nil, inputErr(fmt.Sprintf("%s.content[%d].text", field, j), "must be a string")
				}
				buf = append(buf, text...)
				continue
			}
			// Images, audio and files are hashed by their JSON (keys in
			// sorted order), so the same image URL or data is the same block.
			raw, err := json.Marshal(cp)
			if err != nil {
				return nil, inputErr(fmt.Sprintf("%s.content[%d]", field, j), "invalid content part: %v", err)
			}
			buf = append(buf, raw...)
		}
	default:
		return nil, inputErr(field+".content", "must be a string, an array of content parts, or null")
	}
	for _, tc := range m.ToolCalls {
		buf = append(buf, 0)
		buf = append(buf, tc.Function.Name...)
		buf = append(buf, 0)
		buf = append(buf, tc.Function.Arguments...)
	}
	return buf, nil
}

// refParseCompletion is refParseChat for /v1/completions bodies.
func refParseCompletion(body []byte, lim Limits) (*Request, error) {
	b, r, err := refDecode(body, false)
	if err != nil {
		return nil, err
	}
	p := bytes.TrimSpace(b.Prompt)
	if len(p) == 0 || bytes.Equal(p, []byte("null")) {
		return nil, inputErr("prompt", "is required")
	}
	switch p[0] {
	case '"':
		var s string
		if err := json.Unmarshal(p, &s); err != nil {
			return nil, inputErr("prompt", "invalid string: %v", err)
		}
		r.Parts = []Part{{Role: RolePrompt, Base: KindOther, Text: []byte(s)}}
		return r, nil
	case '[':
	default:
		return nil, inputErr("prompt", "must be a string, an array of strings, or an array of token ids")
	}
	var items []json.RawMessage
	if err := json.Unmarshal(p, &items); err != nil {
		return nil, inputErr("prompt", "invalid array: %v", err)
	}
	if len(items) == 0 {
		return nil, inputErr("prompt", "must not be empty")
	}
	if c := items[0][0]; c != '"' && c != '[' { // one array of token ids: one prompt, not MaxMessages of them
		var ids []int32
		if err := json.Unmarshal(p, &ids); err != nil {
			return nil, inputErr("prompt", "mixed or invalid token ids: %v", err)
		}
		r.Parts = []Part{TokenPart(ids)}
		return r, nil
	}
	if lim.MaxMessages > 0 && len(items) > lim.MaxMessages {
		return nil, inputErr("prompt", "has %d entries, more than the limit of %d", len(items), lim.MaxMessages)
	}
	for i, it := range items {
		field := fmt.Sprintf("prompt[%d]", i)
		switch it[0] {
		case '"':
			var s string
			if err := json.Unmarshal(it, &s); err != nil {
				return nil, inputErr(field, "invalid string: %v", err)
			}
			r.Parts = append(r.Parts, Part{Role: RolePrompt, Base: KindOther, Text: []byte(s)})
		case '[':
			var ids []int32
			if err := json.Unmarshal(it, &ids); err != nil {
				return nil, inputErr(field, "invalid token ids: %v", err)
			}
			r.Parts = append(r.Parts, TokenPart(ids))
		default:
			return nil, inputErr(field, "must be a string or an array of token ids")
		}
	}
	return r, nil
}

// lenient reports the bodies the fastjson parser may decode differently
// from the reference: those with UTF-16 surrogate escapes (unpaired ones
// decode to U+FFFD in the reference and are kept as written, or paired
// differently, here). Raw control characters in strings, which the replica
// rejects, are no leniency since prescan rejects them too; nor are duplicate
// keys: both read the last of unread keys, and the parser refuses duplicates
// of read keys (see refDuplicates).
func lenient(body []byte) bool {
	lower := bytes.ToLower(body)
	for _, p := range [][]byte{[]byte(`\ud8`), []byte(`\ud9`), []byte(`\uda`), []byte(`\udb`), []byte(`\udc`), []byte(`\udd`), []byte(`\ude`), []byte(`\udf`)} {
		if bytes.Contains(lower, p) {
			return true
		}
	}
	return false
}

// refNode is a JSON value read token by token, keeping what a map loses:
// every key of an object in order, duplicates included.
type refNode struct {
	delim byte // '{', '[', or 0 for a scalar
	keys  []string
	elems []*refNode // an object's values (keys[i]'s is elems[i]) or an array's
}

// refTree reads one JSON value with encoding/json's tokenizer.
func refTree(dec *json.Decoder) (*refNode, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return &refNode{}, nil
	}
	n := &refNode{delim: byte(d)}
	for dec.More() {
		if n.delim == '{' {
			k, err := dec.Token()
			if err != nil {
				return nil, err
			}
			n.keys = append(n.keys, k.(string))
		}
		e, err := refTree(dec)
		if err != nil {
			return nil, err
		}
		n.elems = append(n.elems, e)
	}
	if _, err := dec.Token(); err != nil { // the closing delimiter
		return nil, err
	}
	return n, nil
}

// last is an object's value under key as json.loads reads it: the last.
func (n *refNode) last(key string) *refNode {
	var v *refNode
	for i, k := range n.keys {
		if k == key {
			v = n.elems[i]
		}
	}
	return v
}

// The keys the router reads, per object, written out again here.
var (
	refChatKeys       = []string{"model", "messages", "tools", "user", "stream", "max_tokens", "max_completion_tokens", "stream_options"}
	refCompletionKeys = []string{"model", "prompt", "user", "stream", "max_tokens", "max_completion_tokens", "stream_options"}
	refMessageKeys    = []string{"role", "content", "name", "tool_calls"}
	refToolCallKeys   = []string{"id", "function"}
	refFunctionKeys   = []string{"name", "arguments"}
	refPartKeys       = []string{"type", "text"}
)

// refDuplicates lists the JSON paths (as InputError.Field names them) of the
// keys the router reads that body gives more than once in an object the
// router reads, following the replica's reading (the last of duplicates) down
// the tree. ok is false when encoding/json cannot tokenize body.
func refDuplicates(body []byte, chat bool) (paths []string, ok bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	root, err := refTree(dec)
	if err != nil {
		return nil, false
	}
	check := func(n *refNode, prefix string, keys []string) {
		for _, key := range keys {
			count := 0
			for _, k := range n.keys {
				if k == key {
					count++
				}
			}
			if count > 1 {
				paths = append(paths, prefix+key)
			}
		}
	}
	if root.delim != '{' {
		return nil, true
	}
	if !chat {
		check(root, "", refCompletionKeys)
		return paths, true
	}
	check(root, "", refChatKeys)
	msgs := root.last("messages")
	if msgs == nil || msgs.delim != '[' {
		return paths, true
	}
	for i, m := range msgs.elems {
		if m.delim != '{' {
			continue
		}
		mp := fmt.Sprintf("messages[%d].", i)
		check(m, mp, refMessageKeys)
		if calls := m.last("tool_calls"); calls != nil && calls.delim == '[' {
			for j, c := range calls.elems {
				if c.delim != '{' {
					continue
				}
				cp := fmt.Sprintf("%stool_calls[%d].", mp, j)
				check(c, cp, refToolCallKeys)
				if fn := c.last("function"); fn != nil && fn.delim == '{' {
					check(fn, cp+"function.", refFunctionKeys)
				}
			}
		}
		if content := m.last("content"); content != nil && content.delim == '[' {
			for j, p := range content.elems {
				if p.delim == '{' {
					check(p, fmt.Sprintf("%scontent[%d].", mp, j), refPartKeys)
				}
			}
		}
	}
	return paths, true
}

// refDepth is the deepest nesting of arrays and objects in valid JSON,
// counted on encoding/json's tokens.
func refDepth(body []byte) int {
	dec := json.NewDecoder(bytes.NewReader(body))
	depth, deepest := 0, 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return deepest
		}
		switch tok {
		case json.Delim('['), json.Delim('{'):
			depth++
			deepest = max(deepest, depth)
		case json.Delim(']'), json.Delim('}'):
			depth--
		}
	}
}

// isDup and isDepth tell the parser's refusals for a repeated key and for
// nesting past the limit.
func isDup(ie *InputError) bool   { return ie.Msg == "is given more than once" }
func isDepth(ie *InputError) bool { return strings.HasPrefix(ie.Msg, "JSON nesting is deeper than") }

// maxErrorLen bounds Error() of every InputError: Msg's bound, the ": ",
// and the longest Field (a function argument's path, with two 19-digit
// indices).
const maxErrorLen = maxErrMsg + 2 + len("messages[9223372036854775807].tool_calls[9223372036854775807].function.arguments")

// refLimit is the message limit both fuzz targets parse with.
var refLimit = Limits{MaxMessages: 64}

// FuzzParseMatchesReference holds the fastjson parser to the replica's
// reading of the body (refParseChat, refParseCompletion), on valid UTF-8:
//
//   - a body the parser accepts, the reference accepts too (but for the
//     documented leniencies), with the same model, user, stream, max tokens
//     and parts; and the body gives no key the router reads twice;
//   - a body the parser refuses for a repeated key really repeats that key;
//     for nesting, really nests past the limit;
//   - a body the reference accepts, the parser accepts, unless it refuses it
//     for one of those two reasons.
func FuzzParseMatchesReference(f *testing.F) {
	deep := func(n int, open, close, inner string) string {
		return strings.Repeat(open, n) + inner + strings.Repeat(close, n)
	}
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"system","content":"hi"},{"role":"user","content":"q\n\"x\"\u00e9"}]}`,
		`{"model":"m","tools":[ {"a" : 1.50e3, "b":"\u003c"} ],"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url","image_url":{"url":"u","z":1e2,"a":[true,null]}}]}]}`,
		`{"MODEL":"m","Messages":[{"ROLE":"user","Content":"x","content":"y"}],"stream":true,"max_tokens":5,"max_completion_tokens":null}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true},"stream_options":{}}`,
		`{"model":"m","model":"n","user":"u","messages":[{"role":"assistant","name":"bot","content":null,"tool_calls":[null,{"id":"1","function":{"name":"f","arguments":"{}"}}]},{"role":"user","content":"q"}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text"},{"type":"text","text":null},{"type":5}]}]}`,
		`{"model":"m","max_tokens":1.0,"messages":[{"role":"user","content":"x"}]}`,
		`{"model":"m","max_tokens":1e2,"messages":[{"role":"user","content":"x"}]}`,
		`{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"extra":[1,{"a":01}]}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"extra":NaN}`,
		`{"model":"m","messages":[{"role":"user","content":"\q"}]}`,
		`null`, `[]`, `"x"`, `{"model":5}`, `{"model":"m","messages":{}}`,
		`{"model":"m","prompt":"a\tb"}`, `{"model":"m","prompt":["a","b"]}`, `{"model":"m","prompt":[[1,2],[3,null]]}`,
		`{"model":"m","prompt":[1,2,null]}`, `{"model":"m","prompt":[2147483648]}`, `{"model":"m","prompt":[1.5]}`, `{"model":"m","prompt":[-0]}`,
		// Case variants are other keys, for the replica as for the router.
		`{"model":"m","MODEL":"x","Model":"y","messages":[{"role":"user","content":"x"}],"MESSAGES":[{"role":"system","content":"decoy"}],"max_tokens":99999999,"MAX_TOKENS":5}`,
		`{"Model":"m","messages":[{"role":"user","content":"x"}]}`,
		`{"model":"m","messages":[{"Role":"system","role":"user","CONTENT":"decoy","content":"x","Tool_Calls":[{}]}]}`,
		`{"model":"m","ſtream":true,"max_toKens":3,"messages":[{"role":"user","content":"x"}]}`,
		`{"model":"m","Prompt":"decoy","prompt":"p"}`,
		// Duplicates of read keys, at each level; unread ones pass.
		`{"max_tokens":99999999,"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}]}`,
		`{"model":"a","mod\u0065l":"b","messages":[{"role":"user","content":"x"}]}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"messages":[{"role":"user","content":"decoy"}]}`,
		`{"model":"m","messages":[{"role":"user","content":"x","content":"y"}]}`,
		`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"1","id":"2","function":{"name":"f"}}]}]}`,
		`{"model":"m","messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"{}","arguments":"{\"x\":1}"}}]}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a","text":"b"}]}]}`,
		`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","type":"text","text":"b"}]}]}`,
		`{"model":"m","x":1,"x":2,"prompt":"p","prompt":"q"}`,
		`{"model":"m","x":1,"x":{"y":2},"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a","url":"b"}}],"tool_call_id":"a","tool_call_id":"b"}],"tools":[{"a":1,"a":2}]}`,
		`{"model":"m","prompt":"p","messages":[],"messages":5,"tools":1,"tools":2}`,
		// Nesting: at the limit, past it, and not nesting inside strings.
		`{"model":"m","messages":[{"role":"user","content":"x"}],"extra":` + deep(63, "[", "]", "1") + `}`,
		`{"model":"m","messages":[{"role":"user","content":"x"}],"extra":` + deep(64, "[", "]", "1") + `}`,
		`{"model":"m","prompt":"p","extra":` + deep(63, `{"a":`, "}", "null") + `}`,
		`{"model":"m","prompt":"p","extra":` + deep(64, `{"a":`, "}", "null") + `}`,
		`{"model":"m","prompt":"p","extra":"` + strings.Repeat("[{", 100) + `\"\\"}`,
		strings.Repeat("[", 200),
		`{"model":"m","prompt":"p","extra":[tru]}`,
	} {
		f.Add([]byte(s), true)
		f.Add([]byte(s), false)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		if !utf8.Valid(body) {
			return
		}
		parse, ref := ParseChat, refParseChat
		if !chat {
			parse, ref = ParseCompletion, refParseCompletion
		}
		want, werr := ref(body, refLimit)
		got, gerr := parse(body, refLimit)
		var ie *InputError
		if gerr != nil {
			if !errors.As(gerr, &ie) {
				t.Fatalf("error of type %T: %v", gerr, gerr)
			}
			if n := len(gerr.Error()); n > maxErrorLen {
				t.Fatalf("error message of %d bytes", n)
			}
		}
		dups, tokenized := refDuplicates(body, chat)
		switch {
		case gerr != nil && isDup(ie):
			if tokenized && !slices.Contains(dups, ie.Field) {
				t.Fatalf("refused for a repeated %s, but the repeated read keys are %q", ie.Field, dups)
			}
			return
		case gerr != nil && isDepth(ie):
			if json.Valid(body) && refDepth(body) <= refLimit.maxDepth() {
				t.Fatalf("refused for nesting %d deep (%v)", refDepth(body), gerr)
			}
			return
		case werr != nil && gerr != nil:
			return
		case werr == nil && gerr != nil:
			t.Fatalf("reference accepts, parser rejects: %v", gerr)
		}
		defer got.Recycle()
		if tokenized && len(dups) > 0 {
			t.Fatalf("accepted with repeated read keys %q", dups)
		}
		if werr != nil {
			if !lenient(body) {
				t.Fatalf("reference rejects (%v), parser accepts", werr)
			}
			return
		}
		if lenient(body) {
			return
		}
		if got.Model != want.Model || got.User != want.User || got.Stream != want.Stream || got.MaxTokens != want.MaxTokens {
			t.Fatalf("fields: got %q %q %v %d, want %q %q %v %d", got.Model, got.User, got.Stream, got.MaxTokens,
				want.Model, want.User, want.Stream, want.MaxTokens)
		}
		if len(got.Parts) != len(want.Parts) {
			t.Fatalf("%d parts, want %d", len(got.Parts), len(want.Parts))
		}
		for i := range got.Parts {
			g, w := got.Parts[i], want.Parts[i]
			if g.Role != w.Role || g.Base != w.Base || g.Tokens != w.Tokens || !bytes.Equal(g.Text, w.Text) {
				t.Fatalf("part %d: got %c %v %d %q, want %c %v %d %q", i, g.Role, g.Base, g.Tokens, g.Text, w.Role, w.Base, w.Tokens, w.Text)
			}
		}
	})
}
