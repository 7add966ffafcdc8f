package blockhash

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
)

// Role markers are written into every block hash of a part so that the same
// text under another role is another block.
const (
	RoleTools     byte = 'T'
	RoleSystem    byte = 's'
	RoleUser      byte = 'u'
	RoleAssistant byte = 'a'
	RoleTool      byte = 't'
	RolePrompt    byte = 'p'
	RoleTokens    byte = 'k' // token ids, 4 bytes each, little-endian
)

// InputError is a request body that cannot be routed: malformed JSON, a
// missing field, an unknown role. Field names the offending JSON path.
type InputError struct {
	Field string
	Msg   string
}

func (e *InputError) Error() string {
	if e.Field == "" {
		return e.Msg
	}
	return e.Field + ": " + e.Msg
}

func inputErr(field, format string, args ...any) error {
	return &InputError{Field: field, Msg: fmt.Sprintf(format, args...)}
}

// Part is one piece of the rendered prompt: the tool schemas, one message, or
// one prompt. Text aliases memory owned by the Request.
type Part struct {
	Role byte // one of the Role* markers
	Base Kind // the kind its role implies; refined per block by the heuristics
	Text []byte
	// Tokens holds token ids when Role is RoleTokens; Text is then their
	// 4-byte little-endian encoding.
	Tokens int
}

// Request is the routing-relevant content of an OpenAI request body.
type Request struct {
	Model  string
	User   string // the body's "user" field, a session key of last resort
	Stream bool
	// MaxTokens is max_completion_tokens, else max_tokens; 0 when absent.
	MaxTokens int
	Parts     []Part
}

// Limits bound what a parser accepts. The zero value means no limit.
type Limits struct {
	MaxMessages int // messages in a chat body, or prompts in a completions body
}

type chatBody struct {
	Model               string          `json:"model"`
	Messages            []message       `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	Prompt              json.RawMessage `json:"prompt"`
	User                string          `json:"user"`
	Stream              bool            `json:"stream"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
}

type message struct {
	Role string `json:"role"`
	// Content is decoded in the same pass as the body: a string (the
	// common case, unquoted once), an array of content parts, or nil.
	Content   any        `json:"content"`
	Name      string     `json:"name"`
	ToolCalls []toolCall `json:"tool_calls"`
}

type toolCall struct {
	ID       string `json:"id"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

func decode(body []byte) (*chatBody, *Request, error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, nil, inputErr("", "empty request body")
	}
	var b chatBody
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

// ParseChat parses a /v1/chat/completions body. The parts come out in the
// order a chat template renders them: tool schemas, then the messages in order
// (a system message is normally first already and stays where it is).
func ParseChat(body []byte, lim Limits) (*Request, error) {
	b, r, err := decode(body)
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
		text, err := messageText(m, field)
		if err != nil {
			return nil, err
		}
		p.Text = text
		r.Parts = append(r.Parts, p)
	}
	return r, nil
}

// messageText renders one message's routing bytes: [name NUL] content
// [NUL tool calls]. An assistant reply recorded by the router (see
// AssistantText) renders to the same bytes as the same reply sent back in the
// next request.
func messageText(m *message, field string) ([]byte, error) {
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

// AssistantText renders an assistant reply (its content and tool calls, as
// name/arguments pairs) to the bytes that the same message has when a client
// sends it back as history.
func AssistantText(content string, toolCalls [][2]string) []byte {
	buf := []byte(content)
	for _, tc := range toolCalls {
		buf = append(buf, 0)
		buf = append(buf, tc[0]...)
		buf = append(buf, 0)
		buf = append(buf, tc[1]...)
	}
	return buf
}

// ParseCompletion parses a /v1/completions body. "prompt" may be a string, an
// array of strings, an array of token ids, or an array of token-id arrays; each
// string or token array is one part, in order.
func ParseCompletion(body []byte, lim Limits) (*Request, error) {
	b, r, err := decode(body)
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

// TokenPart makes a part of token ids. Its blocks are cut every BlockTokens
// tokens exactly, rather than by the byte estimate.
func TokenPart(ids []int32) Part {
	buf := make([]byte, 4*len(ids))
	for i, id := range ids {
		binary.LittleEndian.PutUint32(buf[4*i:], uint32(id))
	}
	return Part{Role: RoleTokens, Base: KindOther, Text: buf, Tokens: len(ids)}
}

// Endpoint names the OpenAI API a body belongs to.
type Endpoint int

// The endpoints that carry a prompt.
const (
	Chat       Endpoint = iota // /v1/chat/completions
	Completion                 // /v1/completions
)

// Parse parses body as the given endpoint's request.
func Parse(ep Endpoint, body []byte, lim Limits) (*Request, error) {
	if ep == Completion {
		return ParseCompletion(body, lim)
	}
	return ParseChat(body, lim)
}
