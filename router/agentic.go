package router

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/semroute/semroute/blockhash"
)

// The Responses API (/v1/responses) and Anthropic's Messages API
// (/v1/messages), which vLLM serves beside chat completions, are routed by
// prefix as chat is: blockhash reads them into a chat's parts. Two things
// are theirs alone:
//
//   - In precise mode the engine's tokens are asked of /tokenize, which
//     takes a chat: chatForTokenize renders the request as the chat vLLM
//     renders it into (its system, messages, tool calls and results, and
//     tools as chat function tools).
//   - A Responses request that continues a stored response
//     (previous_response_id) must reach the replica that stored it: vLLM
//     keeps responses in the memory of the instance that made them. The
//     router issues each response's id, naming that replica and the
//     tenant (respid.go).

// chatForTokenize renders req, parsed from /v1/responses or /v1/messages,
// as the body of a chat request of the same conversation, for /tokenize.
func chatForTokenize(req *blockhash.Request) ([]byte, error) {
	type call struct {
		ID       string `json:"id"`
		Type     string `json:"type"`
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	}
	type message struct {
		Role       string  `json:"role"`
		Content    *string `json:"content"`
		ToolCalls  []call  `json:"tool_calls,omitempty"`
		ToolCallID string  `json:"tool_call_id,omitempty"`
	}
	var body struct {
		Messages []message       `json:"messages"`
		Tools    json.RawMessage `json:"tools,omitempty"`
	}
	calls := 0
	for _, p := range req.Parts {
		text := string(p.Text)
		m := message{Content: &text}
		switch p.Role {
		case blockhash.RoleTools: // chat's form already (blockhash/tools.go)
			body.Tools = json.RawMessage(p.Text)
			continue
		case blockhash.RoleSystem:
			m.Role = "system"
		case blockhash.RoleUser:
			m.Role = "user"
		case blockhash.RoleTool:
			m.Role, m.ToolCallID = "tool", fmt.Sprintf("call_%d", max(calls-1, 0))
		case blockhash.RoleAssistant:
			m.Role = "assistant"
			// A tool call reads as NUL name NUL arguments (blockhash.AssistantText).
			if rest, ok := bytes.CutPrefix(p.Text, []byte{0}); ok {
				if name, args, ok := bytes.Cut(rest, []byte{0}); ok {
					c := call{ID: fmt.Sprintf("call_%d", calls), Type: "function"}
					c.Function.Name, c.Function.Arguments = string(name), string(args)
					m.Content, m.ToolCalls = nil, []call{c}
					calls++
				}
			}
		default:
			return nil, fmt.Errorf("router: a part of role %q has no chat message", p.Role)
		}
		body.Messages = append(body.Messages, m)
	}
	return json.Marshal(body)
}

// chatLike reports whether api is chat's or completions': the APIs whose
// streams take stream_options and whose requests vLLM's
// kv_transfer_params disaggregate.
func chatLike(api blockhash.Endpoint) bool {
	return api == blockhash.Chat || api == blockhash.Completion
}

// readyCapture readies cp, the capture of rt's answer from replica, for
// the API rt's request was made in: a Responses or Messages answer's usage
// is read where that API puts it, and a Responses answer's id is
// remembered (ids) as stored on replica for rt's tenant, and its
// conversation (chains) once it has ended.
func (c *Core) readyCapture(cp *replyCapture, rt *Routed, replica string) {
	switch rt.req.API {
	case blockhash.Responses:
		cp.agentic, cp.onID = true, func(id string) { c.ids.remember(id, replica, rt.req.Tenant) }
		if d := rt.req.chain; d != nil {
			cp.onStored = func(id string, out [][]byte) {
				c.chains.put(id, d.stored, out)
				if c.o.ShareChain != nil {
					c.o.ShareChain(d.record(id, out))
				}
			}
		}
	case blockhash.Messages:
		cp.agentic = true
	}
}

// storedResponse passes a request about a stored response (GET or DELETE
// /v1/responses/{id}, POST /v1/responses/{id}/cancel) to the replica that
// made it.
func (s *Server) storedResponse(w http.ResponseWriter, r *http.Request) {
	allow, refused := s.core.ids.home(r.PathValue("id"), r.Header.Get(HeaderTenantID))
	if refused {
		writeError(w, errNotYours)
		return
	}
	s.passTo(w, r, allow)
}
