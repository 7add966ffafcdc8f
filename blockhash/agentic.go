package blockhash

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/valyala/fastjson"
)

// The Responses API (/v1/responses) and Anthropic's Messages API
// (/v1/messages), both of which vLLM serves by rendering them into the same
// chat template as /v1/chat/completions: each is read into the parts a chat
// request of the same conversation has (instructions or system, tool
// schemas, one part per message or item), so that the blocks of a
// conversation carried over one API are those the engine caches for it.

// Keys read from the bodies and items of the two APIs.
var (
	responsesKeys    = []string{"model", "input", "instructions", "tools", "user", "stream", "max_output_tokens", "previous_response_id", "store"}
	responseItemKeys = []string{"type", "role", "content", "name", "arguments", "output"}
	messagesKeys     = []string{"model", "system", "messages", "tools", "stream", "max_tokens"}
	anthropicMsgKeys = []string{"role", "content"}
	anthropicBlkKeys = []string{"type", "text", "name", "input", "content"}
)

// ParseResponses parses a /v1/responses body: instructions as the system
// part, tools, and input (a string: the question; or an array of items:
// messages, function calls and their outputs) as the messages of a chat.
// previous_response_id is kept (Request.PreviousResponseID): the response
// it names holds the conversation before this input, on one replica.
func ParseResponses(data []byte, lim Limits) (*Request, error) {
	b, r, err := decode(data, Responses, lim)
	if err != nil {
		return nil, err
	}
	if err := r.responses(b, lim); err != nil {
		r.Recycle()
		return nil, err
	}
	return r, nil
}

func (r *Request) responses(b *body, lim Limits) error {
	if err := r.responsesHead(b); err != nil {
		return err
	}
	in := b.messages
	switch {
	case isNull(in):
		return inputErr("input", "is required")
	case in.Type() == fastjson.TypeString:
		s, _ := in.StringBytes()
		r.Parts = append(r.Parts, Part{Role: RoleUser, Base: KindUserQuery, Text: s})
		return nil
	case in.Type() != fastjson.TypeArray:
		return inputErr("input", "must be a string or an array of items")
	}
	items, _ := in.Array()
	if len(items) == 0 {
		return inputErr("input", "must not be empty")
	}
	if lim.MaxMessages > 0 && len(items) > lim.MaxMessages {
		return inputErr("input", "has %d items, more than the limit of %d", len(items), lim.MaxMessages)
	}
	first := len(r.Parts)
	lastUser := -1
	for i, it := range items {
		p, user, err := responseItem(it, i)
		if err != nil {
			return err
		}
		if user {
			lastUser = len(r.Parts)
		}
		r.Parts = append(r.Parts, p)
	}
	if lastUser >= first {
		r.Parts[lastUser].Base = KindUserQuery
	}
	return nil
}

// responsesHead reads a Responses body's previous_response_id and store,
// and appends its tools and instructions.
func (r *Request) responsesHead(b *body) error {
	prev, err := str(b.prevID, "previous_response_id")
	if err != nil {
		return err
	}
	r.PreviousResponseID = string(prev)
	if !isNull(b.store) {
		if t := b.store.Type(); t != fastjson.TypeTrue && t != fastjson.TypeFalse {
			return inputErr("store", "must be a boolean")
		}
		r.NoStore = b.store.Type() == fastjson.TypeFalse
	}
	if err := r.toolsPart(b); err != nil {
		return err
	}
	if !isNull(b.system) {
		s, ok := stringOf(b.system)
		if !ok {
			return inputErr("instructions", "must be a string")
		}
		r.Parts = append(r.Parts, Part{Role: RoleSystem, Base: KindSystem, Text: s})
	}
	return nil
}

// responseItem reads input item i: a message (type "message", or none
// with a role), a function call (the assistant's: name NUL arguments, as
// a chat tool call renders), a function call's output (a tool message),
// or another item (its JSON). user says the item is a user message.
func responseItem(it *fastjson.Value, i int) (p Part, user bool, _ error) {
	field := func(sub string) string { return fmt.Sprintf("input[%d]%s", i, sub) }
	if it.Type() != fastjson.TypeObject {
		return p, false, inputErr(field(""), "must be an object")
	}
	var typ, role, content, name, args, output *fastjson.Value
	if dup := fields(it, responseItemKeys, &typ, &role, &content, &name, &args, &output); dup != "" {
		return p, false, dupErr(field("." + dup))
	}
	t, ok := stringOf(typ)
	if !ok {
		return p, false, inputErr(field(".type"), "must be a string")
	}
	switch string(t) {
	case "", "message":
		m := message{content: content}
		if m.role, ok = stringOf(role); !ok {
			return p, false, inputErr(field(".role"), "must be a string")
		}
		var err error
		if p, err = m.part(i, false); err != nil {
			return p, false, err
		}
		p.Text, p.Segs, err = blocksText(content, field(".content"))
		return p, string(m.role) == "user", err
	case "function_call":
		n, ok1 := stringOf(name)
		a, ok2 := stringOf(args)
		if !ok1 || !ok2 {
			return p, false, inputErr(field(""), "a function_call's name and arguments must be strings")
		}
		return Part{Role: RoleAssistant, Base: KindAssistantHistory, Text: AssistantText("", [][2]string{{string(n), string(a)}})}, false, nil
	case "function_call_output":
		o, ok := stringOf(output)
		if !ok {
			return p, false, inputErr(field(".output"), "must be a string")
		}
		return Part{Role: RoleTool, Base: KindToolOutput, Text: o}, false, nil
	}
	canon, err := json.Marshal(toAny(it))
	if err != nil {
		return p, false, inputErr(field(""), "invalid item: %v", err)
	}
	return Part{Role: RoleAssistant, Base: KindOther, Text: canon}, false, nil
}

// ParseMessages parses an Anthropic /v1/messages body: system as the
// system part, tools, and messages (user and assistant, their content a
// string or content blocks) as the messages of a chat. A user message of
// tool results alone is a tool part, as vLLM renders it.
func ParseMessages(data []byte, lim Limits) (*Request, error) {
	b, r, err := decode(data, Messages, lim)
	if err != nil {
		return nil, err
	}
	if err := r.anthropic(b, lim); err != nil {
		r.Recycle()
		return nil, err
	}
	return r, nil
}

func (r *Request) anthropic(b *body, lim Limits) error {
	if err := r.toolsPart(b); err != nil {
		return err
	}
	if err := r.systemPart(b); err != nil {
		return err
	}
	msgs, err := messagesOf(b, lim)
	if err != nil {
		return err
	}
	first := len(r.Parts)
	lastUser := -1
	for i, v := range msgs {
		field := func(sub string) string { return fmt.Sprintf("messages[%d]%s", i, sub) }
		if v.Type() != fastjson.TypeObject {
			return inputErr(field(""), "must be an object")
		}
		var role, content *fastjson.Value
		if dup := fields(v, anthropicMsgKeys, &role, &content); dup != "" {
			return dupErr(field("." + dup))
		}
		ro, ok := stringOf(role)
		if !ok {
			return inputErr(field(".role"), "must be a string")
		}
		var p Part
		switch string(ro) {
		case "user":
			p = Part{Role: RoleUser, Base: KindUserHistory}
			if toolResultsOnly(content) {
				p = Part{Role: RoleTool, Base: KindToolOutput}
			} else {
				lastUser = len(r.Parts)
			}
		case "assistant":
			p = Part{Role: RoleAssistant, Base: KindAssistantHistory}
		case "system": // vLLM takes one among the messages too
			p = Part{Role: RoleSystem, Base: KindSystem}
		case "":
			return inputErr(field(".role"), "is required")
		default:
			return inputErr(field(".role"), "unknown role %s (user, assistant or system)", quoted(ro, 64))
		}
		if p.Text, p.Segs, err = blocksText(content, field(".content")); err != nil {
			return err
		}
		r.Parts = append(r.Parts, p)
	}
	if lastUser >= first {
		r.Parts[lastUser].Base = KindUserQuery
	}
	return nil
}

// systemPart appends the body's system prompt, if any, as the system part.
func (r *Request) systemPart(b *body) error {
	if isNull(b.system) {
		return nil
	}
	s, segs, err := blocksText(b.system, "system")
	if err != nil {
		return err
	}
	r.Parts = append(r.Parts, Part{Role: RoleSystem, Base: KindSystem, Text: s, Segs: segs})
	return nil
}

// toolsPart appends the body's tool schemas, in chat's form (tools.go).
func (r *Request) toolsPart(b *body) error {
	if isNull(b.tools) {
		return nil
	}
	if b.tools.Type() != fastjson.TypeArray {
		return inputErr("tools", "must be an array")
	}
	r.Parts = append(r.Parts, Part{Role: RoleTools, Base: KindTools, Text: canonicalTools(nil, b.tools)})
	return nil
}

// toolResultsOnly reports whether an Anthropic message's content is an
// array of tool_result blocks and nothing else.
func toolResultsOnly(c *fastjson.Value) bool {
	if c == nil || c.Type() != fastjson.TypeArray {
		return false
	}
	blocks, _ := c.Array()
	for _, b := range blocks {
		if string(b.GetStringBytes("type")) != "tool_result" {
			return false
		}
	}
	return len(blocks) > 0
}

// billingHeader starts the system block Claude Code adds to every request,
// different each time, which vLLM leaves out of the prompt.
var billingHeader = []byte("x-anthropic-billing-header")

// blocksText renders content, a string or an array of content blocks of
// either API, to routing bytes, each block after the first a segment of
// its own (Part.Segs): a text block (text, input_text, output_text) its
// text; a tool use (Anthropic's) name NUL its input's JSON, as a chat
// tool call; a tool result its content, text or blocks; any other block
// (an image, a file) its JSON with keys in sorted order.
func blocksText(c *fastjson.Value, field string) (buf []byte, segs []int32, _ error) {
	switch {
	case isNull(c):
		return nil, nil, nil
	case c.Type() == fastjson.TypeString:
		s, _ := c.StringBytes()
		return s, nil, nil
	case c.Type() != fastjson.TypeArray:
		return nil, nil, inputErr(field, "must be a string or an array of content blocks")
	}
	blocks, _ := c.Array()
	for j, blk := range blocks {
		if j > 0 && len(buf) > 0 && (len(segs) == 0 || int(segs[len(segs)-1]) < len(buf)) {
			segs = append(segs, int32(len(buf)))
		}
		var err error
		if buf, err = appendBlock(buf, blk, fmt.Sprintf("%s[%d]", field, j)); err != nil {
			return nil, nil, err
		}
	}
	return buf, segs, nil
}

func appendBlock(buf []byte, blk *fastjson.Value, field string) ([]byte, error) {
	if blk.Type() != fastjson.TypeObject {
		return nil, inputErr(field, "must be an object")
	}
	var typ, text, name, input, content *fastjson.Value
	if dup := fields(blk, anthropicBlkKeys, &typ, &text, &name, &input, &content); dup != "" {
		return nil, dupErr(field + "." + dup)
	}
	t, _ := stringOf(typ)
	switch string(t) {
	case "text", "input_text", "output_text":
		s, ok := stringOf(text)
		if !ok {
			return nil, inputErr(field+".text", "must be a string")
		}
		if strings.HasPrefix(field, "system[") && bytes.HasPrefix(s, billingHeader) {
			return buf, nil // as vLLM drops it: it changes with every request
		}
		return append(buf, s...), nil
	case "tool_use":
		n, ok := stringOf(name)
		if !ok {
			return nil, inputErr(field+".name", "must be a string")
		}
		var args []byte
		if !isNull(input) {
			args = input.MarshalTo(nil)
		}
		return append(buf, AssistantText("", [][2]string{{string(n), string(args)}})...), nil
	case "tool_result":
		s, _, err := blocksText(content, field+".content")
		return append(buf, s...), err
	}
	canon, err := json.Marshal(toAny(blk))
	if err != nil {
		return nil, inputErr(field, "invalid content block: %v", err)
	}
	return append(buf, canon...), nil
}
