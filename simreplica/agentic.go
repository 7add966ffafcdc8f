package simreplica

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/semroute/semroute/blockhash"
)

// The Responses API (/v1/responses) and Anthropic's Messages API
// (/v1/messages), as vLLM serves them: the request is rendered into the
// chat template as the chat of the same conversation (its tools, which
// blockhash gives in chat's form, first), and answered in the API's own
// shape, whole or as its events.
//
// A Responses request is rendered from the messages vLLM builds for it
// (vllm/entrypoints/openai/serving_responses.py, _construct_input_messages):
// its instructions as a system message, if it has them; then, continuing
// a stored response (previous_response_id), the messages that response
// was made from and its output messages' text as assistant messages (its
// function calls and reasoning are not carried); then its input. Those
// messages, tools apart, are what is stored for a later request to
// continue (msg_store), unless its body says store: false; so a chain
// that gives its instructions on every turn gathers one system message
// more each turn, at the front, as vLLM's does. A response is continued
// on the replica that made it only; another answers 404.

// maxStored bounds the responses a replica keeps.
const maxStored = 4096

// storedResponse is what a later request continuing it needs.
type storedResponse struct {
	// msgs are the messages the request was rendered from, its tools
	// apart: its instructions, the conversation it continued, its input.
	msgs []blockhash.Part
	// out is its output messages' text, as assistant messages: what a
	// request continuing it gets after msgs.
	out []blockhash.Part
	obj map[string]any // the response object, for GET
}

// responseStore keeps the replica's responses, the oldest dropped past
// maxStored. It is safe for concurrent use.
type responseStore struct {
	mu    sync.Mutex
	by    map[string]*storedResponse
	order []string
}

func (st *responseStore) get(id string) (*storedResponse, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	r, ok := st.by[id]
	return r, ok
}

func (st *responseStore) put(id string, r *storedResponse) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.by == nil {
		st.by = map[string]*storedResponse{}
	}
	if _, again := st.by[id]; !again {
		st.order = append(st.order, id)
	}
	st.by[id] = r
	if len(st.order) > maxStored {
		delete(st.by, st.order[0])
		st.order = st.order[1:]
	}
}

// agenticPrompt prepares a Responses request's parts as vLLM builds its
// messages (see above): its tools, its instructions (none when they are
// ""), the stored response it continues, its input. It answers 404 and
// reports false for a previous_response_id this replica did not store.
// A Messages request's parts are its prompt as they are.
func (s *Server) agenticPrompt(w http.ResponseWriter, req *blockhash.Request, fl flags) bool {
	if req.Endpoint != blockhash.Responses {
		return true
	}
	head := 0 // the tools part, then the instructions
	for head < len(req.Parts) && req.Parts[head].Role == blockhash.RoleTools {
		head++
	}
	switch {
	case fl.emptyInstructions:
		req.Parts = slices.Delete(req.Parts, head, head+1)
	case fl.instructions:
		head++
	}
	id := req.PreviousResponseID
	if id == "" {
		return true
	}
	prev, ok := s.responses.get(id)
	if !ok {
		writeError(w, http.StatusNotFound, "invalid_request_error", fmt.Sprintf("Response with id '%s' not found.", id))
		return false
	}
	parts := make([]blockhash.Part, 0, len(req.Parts)+len(prev.msgs)+len(prev.out))
	parts = append(parts, req.Parts[:head]...)
	parts = append(parts, prev.msgs...)
	parts = append(parts, prev.out...)
	req.Parts = append(parts, req.Parts[head:]...)
	return true
}

// agentic answers a Responses or Messages request, whole or as its API's
// events, and stores a response.
func (g *generation) agentic(ctx context.Context, w http.ResponseWriter, stream bool) bool {
	g.created = time.Now().Unix()
	if g.ep == blockhash.Responses {
		g.storeResponse()
	}
	if stream {
		return g.agenticStream(ctx, w)
	}
	if !g.decodeAll(ctx) {
		return false
	}
	if g.ep == blockhash.Responses {
		writeJSON(w, http.StatusOK, g.responseObject(true))
	} else {
		writeJSON(w, http.StatusOK, g.messageObject(true))
	}
	return true
}

// storeResponse stores the Responses answer, for a later request's
// previous_response_id and for GET /v1/responses/{id}: the messages the
// request was rendered from (its parts but the tools) and the answer's
// text, unless the body says store: false.
func (g *generation) storeResponse() {
	if g.req.NoStore {
		return
	}
	msgs := make([]blockhash.Part, 0, len(g.req.Parts))
	for _, p := range g.req.Parts {
		if p.Role == blockhash.RoleTools {
			continue // the tools are the request's own, not messages
		}
		p.Text, p.Segs = bytes.Clone(p.Text), slices.Clone(p.Segs) // the request's parse is recycled when it ends
		msgs = append(msgs, p)
	}
	var out []blockhash.Part // a function call is not carried, as in vLLM
	if g.call == nil {
		out = []blockhash.Part{{Role: blockhash.RoleAssistant, Base: blockhash.KindAssistantHistory, Text: []byte(g.text())}}
	}
	g.s.responses.put(g.id, &storedResponse{msgs: msgs, out: out, obj: g.responseObject(true)})
}

// sse is one server-sent event of an agentic answer: its type (the event
// line, and the body's "type") and its body.
type sse struct {
	event string
	data  map[string]any
}

// agenticEvents are the events an agentic API streams an answer in: open
// before its first output token, token for output token i (none, one or
// more events), and close after the last (made then: a response's usage is
// known then).
type agenticEvents struct {
	open  func(g *generation) []sse
	token func(g *generation, i int) []sse
	close func(g *generation) []sse
	// sequenced events carry a sequence_number from 0.
	sequenced bool
}

// agenticStream streams the answer as its API's events, a token every
// InterToken; it reports whether every event reached the client.
func (g *generation) agenticStream(ctx context.Context, w http.ResponseWriter) bool {
	events := messagesEvents
	if g.ep == blockhash.Responses {
		events = responsesEvents
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	seq := 0
	send := func(evs ...sse) bool {
		for _, e := range evs {
			e.data["type"] = e.event
			if events.sequenced {
				e.data["sequence_number"] = seq
				seq++
			}
			b, _ := json.Marshal(e.data)
			if _, err := fmt.Fprintf(w, "event: %s\ndata: %s\n\n", e.event, b); err != nil || rc.Flush() != nil {
				return false
			}
		}
		return true
	}
	if !send(events.open(g)...) {
		return false
	}
	for i := range g.out {
		if i > 0 && !g.decodeNext(ctx, i) {
			return false
		}
		if !send(events.token(g, i)...) {
			return false
		}
	}
	return send(events.close(g)...)
}

// getResponse answers GET /v1/responses/{id} with a stored response.
func (s *Server) getResponse(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	prev, ok := s.responses.get(id)
	if !ok {
		writeError(w, http.StatusNotFound, "invalid_request_error", fmt.Sprintf("Response with id '%s' not found.", id))
		return
	}
	_, _ = io.Copy(io.Discard, r.Body)
	writeJSON(w, http.StatusOK, prev.obj)
}
