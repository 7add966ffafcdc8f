package blockhash

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"unicode/utf8"

	"github.com/valyala/fastjson"
)

// This file keeps the encoding/json parser that the fastjson one replaced, as
// the reference FuzzParseMatchesReference holds the new parser to: for every
// body both accept, the same parts in the same order.

type refChatBody struct {
	Model               string          `json:"model"`
	Messages            []refMessage    `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	Prompt              json.RawMessage `json:"prompt"`
	User                string          `json:"user"`
	Stream              bool            `json:"stream"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
}

type refMessage struct {
	Role string `json:"role"`
	// Content is decoded in the same pass as the body: a string (the
	// common case, unquoted once), an array of content parts, or nil.
	Content   any           `json:"content"`
	Name      string        `json:"name"`
	ToolCalls []refToolCall `json:"tool_calls"`
}

type refToolCall struct {
	ID       string `json:"id"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

func refDecode(body []byte) (*refChatBody, *Request, error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, nil, inputErr("", "empty request body")
	}
	var b refChatBody
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, nil, inputErr("", "invalid JSON: %v", err)
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
	return &b, r, nil
}

// refParseChat is the encoding/json parser the fastjson one replaced: the
// reference the differential fuzz test holds the parser to.
func refParseChat(body []byte, lim Limits) (*Request, error) {
	b, r, err := refDecode(body)
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
	b, r, err := refDecode(body)
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
	if lim.MaxMessages > 0 && len(items) > lim.MaxMessages {
		return nil, inputErr("prompt", "has %d entries, more than the limit of %d", len(items), lim.MaxMessages)
	}
	if c := items[0][0]; c != '"' && c != '[' { // one array of token ids
		var ids []int32
		if err := json.Unmarshal(p, &ids); err != nil {
			return nil, inputErr("prompt", "mixed or invalid token ids: %v", err)
		}
		r.Parts = []Part{TokenPart(ids)}
		return r, nil
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

// lenient reports the bodies the fastjson parser may accept where the
// reference rejects them, or decode differently: bytes below 0x20 (raw
// control characters inside strings, which the replica's own parser
// rejects), UTF-16 surrogate escapes (unpaired ones decode to U+FFFD in
// the reference and are kept as written, or paired differently, here), and
// objects with duplicate keys (the last simply wins here; encoding/json
// merges duplicate objects and ignores a later null for a string).
func lenient(body []byte) bool {
	if v, err := fastjson.ParseBytes(body); err == nil && duplicateKeys(v) {
		return true
	}
	for _, c := range body {
		if c < 0x20 && c != ' ' && c != '\t' && c != '\n' && c != '\r' {
			return true
		}
	}
	lower := bytes.ToLower(body)
	for _, p := range [][]byte{[]byte(`\ud8`), []byte(`\ud9`), []byte(`\uda`), []byte(`\udb`), []byte(`\udc`), []byte(`\udd`), []byte(`\ude`), []byte(`\udf`)} {
		if bytes.Contains(lower, p) {
			return true
		}
	}
	// Whitespace is legal between tokens but not inside strings.
	inString, esc := false, false
	for _, c := range body {
		switch {
		case esc:
			esc = false
		case inString && c == '\\':
			esc = true
		case c == '"':
			inString = !inString
		case inString && c < 0x20:
			return true
		}
	}
	return false
}

// duplicateKeys reports whether any object in v has two keys equal under
// case folding.
func duplicateKeys(v *fastjson.Value) bool {
	switch v.Type() {
	case fastjson.TypeObject:
		var keys [][]byte
		dup := false
		v.GetObject().Visit(func(k []byte, e *fastjson.Value) {
			for _, o := range keys {
				dup = dup || bytes.EqualFold(o, k)
			}
			keys = append(keys, k)
			dup = dup || duplicateKeys(e)
		})
		return dup
	case fastjson.TypeArray:
		a, _ := v.Array()
		for _, e := range a {
			if duplicateKeys(e) {
				return true
			}
		}
	}
	return false
}

// FuzzParseMatchesReference holds the fastjson parser to the encoding/json
// one it replaced: on valid UTF-8, a body the reference accepts parses to
// the same request, and a body it rejects is rejected too (but for the
// documented leniencies above).
func FuzzParseMatchesReference(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"system","content":"hi"},{"role":"user","content":"q\n\"x\"\u00e9"}]}`,
		`{"model":"m","tools":[ {"a" : 1.50e3, "b":"\u003c"} ],"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url","image_url":{"url":"u","z":1e2,"a":[true,null]}}]}]}`,
		`{"MODEL":"m","Messages":[{"ROLE":"user","Content":"x","content":"y"}],"stream":true,"max_tokens":5,"max_completion_tokens":null}`,
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
		want, werr := ref(body, Limits{MaxMessages: 64})
		got, gerr := parse(body, Limits{MaxMessages: 64})
		if gerr != nil {
			var ie *InputError
			if !errors.As(gerr, &ie) {
				t.Fatalf("error of type %T: %v", gerr, gerr)
			}
		}
		switch {
		case werr != nil && gerr != nil:
			return
		case werr == nil && gerr != nil:
			t.Fatalf("reference accepts, parser rejects: %v", gerr)
		case werr != nil && gerr == nil:
			if !lenient(body) {
				t.Fatalf("reference rejects (%v), parser accepts", werr)
			}
			return
		}
		defer got.Release()
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
