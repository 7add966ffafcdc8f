package simreplica

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/valyala/fastjson"

	"github.com/semroute/semroute/blockhash"
)

// Tool calls, in the three APIs that take tools (chat, Responses,
// Messages), deterministic in the prompt as the text answers are.
//
// A request whose tools (its RoleTools part) hold at least one function
// answers with one tool call rather than text when its tool_choice asks
// for one or allows one:
//
//   - none: never (text, as without tools);
//   - required (Anthropic's any), or a named tool: always, to the named
//     tool if named;
//   - auto, the default when tools are given: decided by the call seed,
//     the hash of the whole prompt's token ids (BlockHash from 0; not the
//     generation's seed, the last full block's, which is 0 for every
//     prompt shorter than a block): a call when seed mod 3 ≠ 0 (two
//     requests in three), except after a tool result (the prompt's last
//     part a tool's output), when it calls when bit 32 of the seed is set
//     (one in two), the other half answering in text.
//
// The tool is the named one, else the seed's pick among the functions
// (seed>>16 mod their count). Its arguments are a compact JSON object
// with one member per property of its parameters' "properties", in the
// schema's order ({} when none): the value is the generation's word i
// (its text, "w123") for property i, a number ("123") for an integer or
// number property, a boolean (the word's parity) for a boolean one. The
// call's id is "call_" (Anthropic's "toolu_"; the Responses item's
// "fc_") and 16 hex digits of a value mixed from the seed.
//
// A call is an engine's output tokens as it streams: one for its name,
// then one for each fragment of its arguments (the opening and each
// member's key, each value, the closing: 2×properties + 1, or 1 for {}).
// It stops by itself, so its output tokens are those, whatever max_tokens
// (absent: as many as it needs); a call that does not fit in max_tokens
// is not made, and the answer is text cut at max_tokens, as a model cut
// off mid-call gives no call its parser can read.

// choiceMode is what a request's tool_choice allows.
type choiceMode uint8

const (
	choiceAuto     choiceMode = iota // the model decides (the default)
	choiceNone                       // no tool call
	choiceRequired                   // a tool call, to toolChoice.name if set
)

// toolChoice is a request's tool_choice.
type toolChoice struct {
	mode choiceMode
	name string // the tool named; "" for any
}

var errToolChoice = errors.New(`tool_choice: must be "none", "auto", "required" or a named function`)

// readToolChoice reads the tool_choice v (nil: absent) of a request of
// endpoint ep: chat's and the Responses API's "none" | "auto" |
// "required" | a named function ({"type": "function", "function":
// {"name"}} in chat, {"type": "function", "name"} in Responses), or
// Anthropic's {"type": "auto" | "any" | "tool" | "none", "name"}.
func readToolChoice(v *fastjson.Value, ep blockhash.Endpoint) (toolChoice, error) {
	switch {
	case v == nil || v.Type() == fastjson.TypeNull || ep == blockhash.Completion:
		return toolChoice{}, nil
	case ep == blockhash.Messages:
		return anthropicChoice(v)
	case v.Type() == fastjson.TypeString:
		switch string(v.GetStringBytes()) {
		case "auto":
			return toolChoice{mode: choiceAuto}, nil
		case "none":
			return toolChoice{mode: choiceNone}, nil
		case "required":
			return toolChoice{mode: choiceRequired}, nil
		}
	case string(v.GetStringBytes("type")) == "function":
		name := v.GetStringBytes("name")
		if ep == blockhash.Chat {
			name = v.GetStringBytes("function", "name")
		}
		if len(name) > 0 {
			return toolChoice{mode: choiceRequired, name: string(name)}, nil
		}
	}
	return toolChoice{}, errToolChoice
}

// anthropicChoice reads a Messages request's tool_choice, as vLLM turns
// it into chat's: auto, any (required), none, or tool with its name.
func anthropicChoice(v *fastjson.Value) (toolChoice, error) {
	name := string(v.GetStringBytes("name"))
	switch string(v.GetStringBytes("type")) {
	case "auto":
		return toolChoice{mode: choiceAuto}, nil
	case "any":
		return toolChoice{mode: choiceRequired}, nil
	case "none":
		return toolChoice{mode: choiceNone}, nil
	case "tool":
		if name != "" {
			return toolChoice{mode: choiceRequired, name: name}, nil
		}
		return toolChoice{}, errors.New("tool_choice.name is required when type is 'tool'")
	}
	return toolChoice{}, errors.New(`tool_choice: type must be "auto", "any", "tool" or "none"`)
}

// toolPlan is the tool call an answer makes, decided before the request
// waits (its output length counts in its place and its context length):
// the tool, its parameters' properties in the schema's order, and the
// call seed.
type toolPlan struct {
	name  string
	props []toolProp
	seed  uint64
}

// toolProp is one property of a tool's parameters: its name as a JSON
// string, and its type ("" when not one string).
type toolProp struct {
	key []byte
	typ string
}

// tokens is the call's output tokens: its name, then its arguments'
// fragments.
func (p *toolPlan) tokens() int { return 1 + 2*len(p.props) + 1 }

// planCall decides whether the answer to a request of parts (the tool
// schemas in chat's form in its RoleTools part), choice and prompt ids is
// a tool call, by the rule above, and plans it; nil: text. maxTokens is
// the body's (0: absent). A choice that names a tool the request does not
// give, or requires a call of a request without tools, is an error, as
// vLLM refuses it.
func planCall(parts []blockhash.Part, choice toolChoice, ids []int32, maxTokens int) (*toolPlan, error) {
	tools, given := functionTools(parts)
	if !given && choice.mode == choiceRequired {
		return nil, errors.New("When using `tool_choice`, `tools` must be set.")
	}
	pick := slices.IndexFunc(tools, func(t toolPlan) bool { return t.name == choice.name })
	if choice.name != "" && pick < 0 {
		return nil, fmt.Errorf("Tool '%s' has not been passed in `tools`.", choice.name)
	}
	if len(tools) == 0 || choice.mode == choiceNone {
		return nil, nil // the prompt is not hashed: most requests have no tools
	}
	seed := BlockHash(0, ids)
	if !callsTool(choice.mode, seed, parts) {
		return nil, nil
	}
	if pick < 0 {
		pick = int((seed >> 16) % uint64(len(tools)))
	}
	p := tools[pick]
	p.seed = seed
	if maxTokens > 0 && p.tokens() > maxTokens {
		return nil, nil // cut off before the call ends: no call a parser reads
	}
	return &p, nil
}

// callsTool says whether a request with tools whose tool_choice is mode
// (auto or required), with call seed seed and prompt parts, calls a tool:
// see the rule above.
func callsTool(mode choiceMode, seed uint64, parts []blockhash.Part) bool {
	switch {
	case mode == choiceRequired:
		return true
	case len(parts) > 0 && parts[len(parts)-1].Role == blockhash.RoleTool:
		return seed>>32&1 == 1
	}
	return seed%3 != 0
}

// functionTools returns the function tools of parts' RoleTools part,
// names and properties (seeds unset), and whether parts have tools.
func functionTools(parts []blockhash.Part) (tools []toolPlan, given bool) {
	for _, p := range parts {
		if p.Role != blockhash.RoleTools {
			continue
		}
		var pr fastjson.Parser
		v, err := pr.ParseBytes(p.Text)
		if err != nil {
			return nil, true
		}
		arr, _ := v.Array()
		for _, t := range arr {
			if fn := t.Get("function"); fn != nil && len(fn.GetStringBytes("name")) > 0 {
				tools = append(tools, toolPlan{name: string(fn.GetStringBytes("name")), props: properties(fn.Get("parameters", "properties"))})
			}
		}
		return tools, len(arr) > 0
	}
	return nil, false
}

// properties returns the properties of a JSON schema's "properties"
// object (nil: none), in its order.
func properties(v *fastjson.Value) []toolProp {
	if v == nil || v.Type() != fastjson.TypeObject {
		return nil
	}
	o, _ := v.Object()
	var props []toolProp
	o.Visit(func(k []byte, s *fastjson.Value) {
		key, _ := json.Marshal(string(k))
		props = append(props, toolProp{key: key, typ: string(s.GetStringBytes("type"))})
	})
	return props
}

// toolCall is a tool call an answer makes.
type toolCall struct {
	name string
	// frags are the arguments' JSON in the pieces it is streamed in, one
	// an output token; the call's first token is its name.
	frags []string
	key   uint64 // its ids' hex digits
}

// call makes the planned call, its values from word (the generation's
// words).
func (p *toolPlan) call(word func(i int) string) *toolCall {
	c := &toolCall{name: p.name, key: (p.seed ^ 0x5851f42d4c957f2d) * 0x9e3779b97f4a7c15}
	open := "{"
	for i, prop := range p.props {
		value, quote := argValue(prop.typ, strings.TrimSpace(word(i)))
		c.frags = append(c.frags, open+string(prop.key)+":"+quote, value)
		open = quote + ","
	}
	c.frags = append(c.frags, strings.TrimSuffix(open, ",")+"}")
	return c
}

// argValue is the value of an argument of JSON type typ made of word (a
// "w" and digits), and the quote around it ("" for a number or boolean).
func argValue(typ, word string) (value, quote string) {
	n, _ := strconv.Atoi(strings.TrimPrefix(word, "w"))
	switch typ {
	case "integer", "number":
		return strconv.Itoa(n), ""
	case "boolean":
		return strconv.FormatBool(n%2 == 1), ""
	}
	return word, `"`
}

// arguments is the call's arguments, a JSON object.
func (c *toolCall) arguments() string { return strings.Join(c.frags, "") }

// id is the call's id, behind prefix ("call_", "toolu_", "fc_").
func (c *toolCall) id(prefix string) string { return fmt.Sprintf("%s%016x", prefix, c.key) }

// chatCall is the call in a chat message's tool_calls.
func (c *toolCall) chatCall() map[string]any {
	return map[string]any{"id": c.id("call_"), "type": "function", "function": map[string]any{"name": c.name, "arguments": c.arguments()}}
}

// chatDelta is a streamed chat chunk's delta for the call's output token
// i: its id, type and name first (with empty arguments), then each
// fragment of its arguments, as vLLM streams a tool call.
func (c *toolCall) chatDelta(i int) map[string]any {
	if i == 0 {
		call := map[string]any{"index": 0, "id": c.id("call_"), "type": "function", "function": map[string]any{"name": c.name, "arguments": ""}}
		return map[string]any{"role": "assistant", "tool_calls": []any{call}}
	}
	return map[string]any{"tool_calls": []any{map[string]any{"index": 0, "function": map[string]any{"arguments": c.frags[i-1]}}}}
}
