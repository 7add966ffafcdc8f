package blockhash

import (
	"github.com/valyala/fastjson"
)

// Tool schemas in one form for every API.
//
// vLLM renders the tools of a chat, a Responses and a Messages request
// into the chat template the same way: as chat function tools, {type:
// function, function: {name, description, parameters}} (the Responses
// API's {type: function, name, description, parameters, strict} and
// Anthropic's {name, description, input_schema} converted first). So the
// routing bytes of a tools part are that form, whichever API the request
// came in: the same schemas make the same block over all three APIs.
// Each schema's name, description and parameters keep the client's own
// bytes (compacted, their key order kept); the fields vLLM does not
// render (strict, cache_control) are left out. A tool of another type
// (a Responses built-in such as web_search, an Anthropic server tool) is
// kept whole, compacted.

// canonicalTools appends the canonical form of tools, a JSON array, to dst.
func canonicalTools(dst []byte, tools *fastjson.Value) []byte {
	arr, _ := tools.Array()
	dst = append(dst, '[')
	for i, t := range arr {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = appendTool(dst, t)
	}
	return append(dst, ']')
}

// appendTool appends one tool schema in the canonical form.
func appendTool(dst []byte, t *fastjson.Value) []byte {
	if t.Type() != fastjson.TypeObject {
		return t.MarshalTo(dst)
	}
	fn := t
	if f := t.Get("function"); f != nil && f.Type() == fastjson.TypeObject { // chat's own shape
		fn = f
	} else if typ := t.Get("type"); typ != nil && string(typ.GetStringBytes()) != "function" && t.Get("input_schema") == nil {
		return t.MarshalTo(dst) // a built-in or server tool
	}
	name := fn.Get("name")
	if name == nil {
		return t.MarshalTo(dst)
	}
	params := fn.Get("parameters")
	if params == nil {
		params = fn.Get("input_schema")
	}
	dst = append(dst, `{"type":"function","function":{"name":`...)
	dst = name.MarshalTo(dst)
	if d := fn.Get("description"); d != nil {
		dst = append(dst, `,"description":`...)
		dst = d.MarshalTo(dst)
	}
	if params != nil {
		dst = append(dst, `,"parameters":`...)
		dst = params.MarshalTo(dst)
	}
	return append(dst, "}}"...)
}
