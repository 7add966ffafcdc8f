package router

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
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
//     keeps responses in the memory of the instance that made them.
//     responseHomes remembers which replica answered each response id.

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
		Messages []message `json:"messages"`
		Tools    []any     `json:"tools,omitempty"`
	}
	calls := 0
	for _, p := range req.Parts {
		text := string(p.Text)
		m := message{Content: &text}
		switch p.Role {
		case blockhash.RoleTools:
			tools, err := chatTools(p.Text)
			if err != nil {
				return nil, err
			}
			body.Tools = tools
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

// chatTools turns the tool schemas of a Responses body ({type: function,
// name, description, parameters}) or a Messages body ({name,
// description, input_schema}) into chat's ({type: function, function:
// {name, description, parameters}}), as vLLM does before rendering them.
func chatTools(raw []byte) ([]any, error) {
	var tools []map[string]any
	if err := json.Unmarshal(raw, &tools); err != nil {
		return nil, err
	}
	out := make([]any, 0, len(tools))
	for _, t := range tools {
		if _, ok := t["function"]; ok { // chat's own shape already
			out = append(out, t)
			continue
		}
		fn := map[string]any{"name": t["name"]}
		if d, ok := t["description"]; ok {
			fn["description"] = d
		}
		switch {
		case t["parameters"] != nil:
			fn["parameters"] = t["parameters"]
		case t["input_schema"] != nil:
			fn["parameters"] = t["input_schema"]
		}
		out = append(out, map[string]any{"type": "function", "function": fn})
	}
	return out, nil
}

// maxResponseHomes bounds the response ids remembered (about 100 bytes
// each).
const maxResponseHomes = 1 << 16

// responseHome is where a response is stored, and whose it is: the
// tenant of the request that made it ("" for none).
type responseHome struct{ replica, tenant string }

// responseHomes maps a Responses API response id to the replica that
// answered it, the most recent maxResponseHomes. Safe for concurrent use.
type responseHomes struct {
	c *lru.Cache[string, responseHome]
}

func newResponseHomes() responseHomes {
	c, _ := lru.New[string, responseHome](maxResponseHomes) // a positive size never fails
	return responseHomes{c}
}

// put remembers that replica answered response id for tenant.
func (h responseHomes) put(id, replica, tenant string) {
	if id != "" && len(id) <= 256 {
		h.c.Add(id, responseHome{replica, tenant})
	}
}

// get returns where response id is stored, if remembered.
func (h responseHomes) get(id string) (responseHome, bool) { return h.c.Get(id) }

// chatLike reports whether api is chat's or completions': the APIs whose
// streams take stream_options and whose requests vLLM's
// kv_transfer_params disaggregate.
func chatLike(api blockhash.Endpoint) bool {
	return api == blockhash.Chat || api == blockhash.Completion
}

// readyCapture readies c, the capture of rt's answer from replica, for
// the API rt's request was made in: a Responses or Messages answer's usage
// is read where that API puts it, and a Responses answer's id is
// remembered as stored on replica for rt's tenant.
func (c *Core) readyCapture(cp *replyCapture, rt *Routed, replica string) {
	switch rt.req.API {
	case blockhash.Responses:
		cp.agentic, cp.onID = true, func(id string) { c.rememberHome(id, replica, rt.req.Tenant) }
	case blockhash.Messages:
		cp.agentic = true
	}
}

// rememberHome notes that replica answered response id for tenant, here
// and, in a fleet, at every peer.
func (c *Core) rememberHome(id, replica, tenant string) {
	c.homes.put(id, replica, tenant)
	if c.o.ShareHome != nil {
		c.o.ShareHome(id, replica, tenant)
	}
}

// NoteHome notes that replica answered response id for tenant: a peer
// router saw it. Safe for concurrent use.
func (c *Core) NoteHome(id, replica, tenant string) { c.homes.put(id, replica, tenant) }

// errNotYours answers a request about a stored response another tenant
// made: as if it were not there.
var errNotYours = apiError{http.StatusNotFound, "invalid_request_error", "response_not_found", "no response with that id"}

// home returns a filter that admits only the replica that answered
// response id, when it is remembered and still in the pool; else nil (the
// request is routed as any other, and a replica that does not hold the
// response answers for itself). A request given it sets routing.Request.
// Home: the replica is used while it drains (it holds the response), and
// while it is down the request is refused as no replica can take it (a
// 503 the client may retry), not sent where the response is not. A
// response another tenant made is not the request's: refused is true.
func (c *Core) home(id, tenant string) (allow func(*replica.Replica) bool, refused bool) {
	h, ok := c.homes.get(id)
	if !ok {
		return nil, false
	}
	if h.tenant != "" && h.tenant != tenant {
		return nil, true
	}
	if _, in := c.e.Pool().Get(h.replica); !in {
		return nil, false
	}
	return func(r *replica.Replica) bool { return r.Name == h.replica }, false
}

// storedResponse passes a request about a stored response (GET or DELETE
// /v1/responses/{id}, POST /v1/responses/{id}/cancel) to the replica that
// made it.
func (s *Server) storedResponse(w http.ResponseWriter, r *http.Request) {
	allow, refused := s.core.home(r.PathValue("id"), r.Header.Get(HeaderTenantID))
	if refused {
		writeError(w, errNotYours)
		return
	}
	s.passTo(w, r, allow)
}
