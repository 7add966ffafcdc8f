package simreplica

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/valyala/fastjson"

	"github.com/semroute/semroute/blockhash"
)

// flags are the switches of a completion request that blockhash does not
// read.
type flags struct {
	includeUsage bool // stream_options.include_usage
	chat         chatOptions
	// remoteDecode and remotePrefill are kv_transfer_params'
	// do_remote_decode (compute the prompt and keep its KV for a decode
	// replica) and do_remote_prefill (take the prompt's KV from a prefill
	// replica instead of computing it).
	remoteDecode, remotePrefill bool
	// requestID is a Responses body's request_id: vLLM's extra parameter
	// that, when set, is the response's id (and the key it is stored
	// under); "" when absent, and a random id is made.
	requestID string
	// instructions says a Responses body has instructions (a string, not
	// null); emptyInstructions that they are "", which vLLM renders as no
	// system message at all.
	instructions, emptyInstructions bool
	// echo are a Responses body's fields its response repeats (see
	// responseEcho); nil for the other APIs.
	echo map[string]any
	// choice is a chat, Responses or Messages body's tool_choice (see
	// readToolChoice); auto when absent.
	choice toolChoice
}

var flagParsers fastjson.ParserPool

// readFlags reads a completion body's switches (the body has parsed as
// JSON already): stream_options.include_usage, add_special_tokens (default
// false for chat, true for completions, as in vLLM's request models) and,
// for chat, add_generation_prompt (default true) and
// continue_final_message. A switch that is not a boolean is
// refused, as are add_generation_prompt and continue_final_message both
// set true, as vLLM refuses them.
func readFlags(body []byte, ep blockhash.Endpoint) (flags, error) {
	p := flagParsers.Get()
	defer flagParsers.Put(p)
	f := flags{chat: chatOptions{addGenerationPrompt: true, addSpecialTokens: ep == blockhash.Completion}}
	v, err := p.ParseBytes(body)
	if err != nil {
		return f, nil
	}
	f.includeUsage = v.GetBool("stream_options", "include_usage")
	f.remoteDecode = v.GetBool("kv_transfer_params", "do_remote_decode")
	f.remotePrefill = v.GetBool("kv_transfer_params", "do_remote_prefill")
	if ep == blockhash.Responses {
		readResponsesFlags(v, &f)
	}
	if f.choice, err = readToolChoice(v.Get("tool_choice"), ep); err != nil {
		return f, err
	}
	if ep == blockhash.Completion { // the chat template's switches are not a completion's fields
		f.chat.addSpecialTokens, err = boolField(v, "add_special_tokens", true)
		return f, err
	}
	return f, readChatOptions(v, &f.chat)
}

// readResponsesFlags reads a Responses body's request_id and whether it
// has instructions.
func readResponsesFlags(v *fastjson.Value, f *flags) {
	f.requestID = string(v.GetStringBytes("request_id"))
	if in := v.Get("instructions"); in != nil && in.Type() == fastjson.TypeString {
		f.instructions, f.emptyInstructions = true, len(in.GetStringBytes()) == 0
	}
	f.echo = responseEcho(v)
}

// readChatOptions reads o's fields from the body object v, leaving absent
// (or null) ones alone.
func readChatOptions(v *fastjson.Value, o *chatOptions) error {
	gen, err := boolField(v, "add_generation_prompt", o.addGenerationPrompt)
	if err != nil {
		return err
	}
	cont, err := boolField(v, "continue_final_message", o.continueFinalMessage)
	if err != nil {
		return err
	}
	if cont && v.GetBool("add_generation_prompt") {
		return errors.New("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	o.addGenerationPrompt, o.continueFinalMessage = gen && !cont, cont
	o.addSpecialTokens, err = boolField(v, "add_special_tokens", o.addSpecialTokens)
	return err
}

// boolField returns the boolean v.key, def when it is absent or null.
func boolField(v *fastjson.Value, key string, def bool) (bool, error) {
	x := v.Get(key)
	switch {
	case x == nil || x.Type() == fastjson.TypeNull:
		return def, nil
	case x.Type() == fastjson.TypeTrue:
		return true, nil
	case x.Type() == fastjson.TypeFalse:
		return false, nil
	}
	return false, fmt.Errorf("%s: must be a boolean", key)
}

// readRequest reads r's body into buf's memory, answering 413 or 400 in
// the shape of endpoint ep's errors and returning false when it cannot.
func (s *Server) readRequest(w http.ResponseWriter, r *http.Request, buf []byte, ep blockhash.Endpoint) ([]byte, bool) {
	body, err := readBody(w, r, s.o.MaxBodyBytes, buf)
	if err != nil {
		if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
			apiError(w, ep, http.StatusRequestEntityTooLarge, "BadRequestError", "request body too large")
		} else {
			apiError(w, ep, http.StatusBadRequest, "BadRequestError", "cannot read the request body: "+err.Error())
		}
		return body, false
	}
	return body, true
}

// tokenBody parses a /tokenize or /detokenize body: a JSON object whose
// optional "model" names a served model (absent or null: the base model).
// It answers the error itself and returns ok false when it cannot.
func (s *Server) tokenBody(w http.ResponseWriter, r *http.Request, p *fastjson.Parser) (v *fastjson.Value, m model, ok bool) {
	body, ok := s.readRequest(w, r, nil, blockhash.Chat) // OpenAI's error shape
	if !ok {
		return nil, m, false
	}
	v, err := p.ParseBytes(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, "BadRequestError", "invalid JSON: "+err.Error())
		return nil, m, false
	}
	if v.Type() != fastjson.TypeObject {
		writeError(w, http.StatusBadRequest, "BadRequestError", "the request body must be a JSON object")
		return nil, m, false
	}
	m, _ = s.model(s.o.Model)
	if x := v.Get("model"); x != nil && x.Type() != fastjson.TypeNull {
		name, err := x.StringBytes()
		if err != nil {
			writeError(w, http.StatusBadRequest, "BadRequestError", "model: must be a string")
			return nil, m, false
		}
		if m, ok = s.model(string(name)); !ok {
			modelNotFound(w, blockhash.Chat, string(name))
			return nil, m, false
		}
	}
	return v, m, true
}

// tokenize answers POST /tokenize as vLLM's OpenAI server does, in either
// of its forms:
//
//	{"model"?, "prompt": "text", "add_special_tokens"?: true, "return_token_strs"?: false}
//	{"model"?, "messages": [...], "tools"?, "add_generation_prompt"?: true,
//	 "continue_final_message"?: false, "add_special_tokens"?: false, "return_token_strs"?: false}
//
// with {"count", "max_model_len", "tokens", "token_strs"} (token_strs null
// unless asked for). The ids are the ones /v1/completions and
// /v1/chat/completions count for the same prompt. A body that is not one
// of the forms is 400, an unknown model 404.
func (s *Server) tokenize(w http.ResponseWriter, r *http.Request) {
	var p fastjson.Parser
	v, m, ok := s.tokenBody(w, r, &p)
	if !ok {
		return
	}
	bad := func(msg string) { writeError(w, http.StatusBadRequest, "BadRequestError", msg) }
	strs, err := boolField(v, "return_token_strs", false)
	if err != nil {
		bad(err.Error())
		return
	}
	var (
		req *blockhash.Request
		ep  blockhash.Endpoint
		co  chatOptions
	)
	if x := v.Get("prompt"); x != nil {
		text, err := x.StringBytes()
		if err != nil {
			bad("prompt: must be a string")
			return
		}
		ep = blockhash.Completion
		if co.addSpecialTokens, err = boolField(v, "add_special_tokens", true); err != nil {
			bad(err.Error())
			return
		}
		req = &blockhash.Request{Model: m.name, Parts: []blockhash.Part{{Role: blockhash.RolePrompt, Base: blockhash.KindOther, Text: text}}}
	} else if x := v.Get("messages"); x != nil {
		ep, co.addGenerationPrompt = blockhash.Chat, true
		if err := readChatOptions(v, &co); err != nil {
			bad(err.Error())
			return
		}
		// The messages (and tools) are read as /v1/chat/completions reads
		// them, by blockhash, from a body that names the resolved model.
		var a fastjson.Arena
		o := a.NewObject()
		o.Set("model", a.NewString(m.name))
		o.Set("messages", x)
		if t := v.Get("tools"); t != nil {
			o.Set("tools", t)
		}
		if req, err = blockhash.ParseChat(o.MarshalTo(nil), blockhash.Limits{}); err != nil {
			bad(err.Error())
			return
		}
		defer req.Recycle()
	} else {
		bad("either prompt or messages is required")
		return
	}
	ids := []int32{}
	var pieces []string
	if strs {
		pieces = []string{}
	}
	s.tok.prompt(nil, req, ep, co, func(id int32, piece []byte) {
		ids = append(ids, id)
		if strs {
			pieces = append(pieces, string(piece))
		}
	})
	writeJSON(w, http.StatusOK, map[string]any{"count": len(ids), "max_model_len": s.o.MaxModelLen, "tokens": ids, "token_strs": pieces})
}

// detokenize answers POST /detokenize as vLLM does: {"model"?, "tokens":
// [ids]} → {"prompt": text}. An id outside the vocabulary, or a tokenizer
// that cannot decode (bytes), is 400.
func (s *Server) detokenize(w http.ResponseWriter, r *http.Request) {
	var p fastjson.Parser
	v, _, ok := s.tokenBody(w, r, &p)
	if !ok {
		return
	}
	bad := func(msg string) { writeError(w, http.StatusBadRequest, "BadRequestError", msg) }
	x := v.Get("tokens")
	if x == nil {
		bad("tokens: is required")
		return
	}
	items, err := x.Array()
	if err != nil {
		bad("tokens: must be an array of integers")
		return
	}
	ids := make([]int32, len(items))
	for i, it := range items {
		n, err := it.Int64()
		if err != nil || n < 0 || n > 1<<31-1 {
			bad(fmt.Sprintf("tokens[%d]: must be an integer in [0, 2^31)", i))
			return
		}
		ids[i] = int32(n)
	}
	text, err := s.tok.Decode(ids)
	if err != nil {
		bad(err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"prompt": text})
}
