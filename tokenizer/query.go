package tokenizer

import (
	"encoding/json"
	"errors"
	"io"
	"sync"

	"github.com/cespare/xxhash/v2"

	"github.com/semroute/semroute/blockhash"
)

// query is the body of one POST /tokenize: pieces of JSON that, written one
// after another, make it. Literal pieces are the keys; the values are
// slices of the request body the router parsed, neither copied nor decoded
// again, so /tokenize reads the bytes the engine reads.
type query struct {
	model string // the model asked for, as the router's parse read it (for Pick)
	parts [][]byte
	n     int // bytes in parts
	fix   [2 + 2*maxFields + 1][]byte
}

// The fields of a request body that /tokenize is given, as vLLM's OpenAI
// server reads them from a chat body (ChatCompletionRequest, passed on to
// TokenizeChatRequest's fields of the same names) and from a completions
// body. messages and prompt must be first.
var (
	chatFields       = []string{"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "add_special_tokens"}
	completionFields = []string{"prompt", "add_special_tokens"}
)

// maxFields is the most fields a query takes from a body.
const maxFields = 8

// errNotTokenizable is a body whose prompt /tokenize cannot be asked for.
var errNotTokenizable = errors.New("tokenizer: only a chat body or a completions body with one prompt string can be tokenized")

// bodyQuery returns the /tokenize query for an OpenAI request body of
// endpoint ep whose "model" the router's parse read as model. The body's
// top-level keys are matched as the router's parser (blockhash) and the
// engine's (Python's json.loads) match them: exactly, case-sensitively,
// after unescaping; "MESSAGES" or "Model" is another key, not the field.
// A field given twice is refused: the parser refuses the fields it reads
// given twice (so the engine and the router cannot read two requests from
// one body), and the fields read here are held to the same rule; the
// caller then routes on its estimate. The query aliases body.
func bodyQuery(ep blockhash.Endpoint, model string, body []byte) (*query, error) {
	names := chatFields
	if ep == blockhash.Completion {
		names = completionFields
	}
	var raw [maxFields][]byte
	if err := topLevel(body, names, raw[:len(names)]); err != nil {
		return nil, err
	}
	first := raw[0] // messages or prompt
	if ep == blockhash.Completion && (len(first) == 0 || first[0] != '"') ||
		ep == blockhash.Chat && (len(first) == 0 || first[0] != '[') {
		return nil, errNotTokenizable
	}
	q := newQuery(model)
	for i, name := range names {
		if raw[i] != nil {
			q.field(name, raw[i])
		}
	}
	if ep == blockhash.Chat && raw[2] == nil { // the engine's default, said aloud
		q.field("add_generation_prompt", jsonTrue)
	}
	q.end()
	return q, nil
}

var (
	jsonTrue = []byte("true")
	closing  = []byte("}")
)

// newQuery starts a query for model.
func newQuery(model string) *query {
	q := &query{model: model}
	q.parts = q.fix[:0]
	q.add(modelKey)
	q.add(jsonString(model))
	return q
}

var modelKey = []byte(`{"model":`)

// jsonString is s as a JSON string, as encoding/json writes it.
func jsonString(s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x80 || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			m, _ := json.Marshal(s) // a string always marshals
			return m
		}
	}
	b := make([]byte, 0, len(s)+2)
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// field adds "name": value, value being raw JSON.
func (q *query) field(name string, value []byte) {
	q.add(fieldKeys[name])
	q.add(value)
}

// fieldKeys are the literal pieces `,"name":` of every field.
var fieldKeys = func() map[string][]byte {
	m := map[string][]byte{}
	for _, names := range [][]string{chatFields, completionFields} {
		for _, n := range names {
			m[n] = []byte(`,"` + n + `":`)
		}
	}
	return m
}()

func (q *query) end() { q.add(closing) }

func (q *query) add(p []byte) {
	q.parts = append(q.parts, p)
	q.n += len(p)
}

// key is the cache key of the query: the hash of its bytes.
func (q *query) key() uint64 {
	var d xxhash.Digest
	d.Reset()
	for _, p := range q.parts {
		_, _ = d.Write(p)
	}
	return d.Sum64()
}

// lease guards the memory a call's queries alias: once ended, every reader
// of the call fails rather than read it. An http.Transport may read a
// request's body after Do returned (net/http.RoundTripper: it may close
// the body in another goroutine after returning); the caller lends the
// body only until the call returns, and may then reuse its buffer for
// another request.
type lease struct {
	mu    sync.Mutex
	ended bool
}

// end makes every later read fail; it waits for a read in progress.
func (l *lease) end() {
	l.mu.Lock()
	l.ended = true
	l.mu.Unlock()
}

var errLeaseEnded = errors.New("tokenizer: read of a /tokenize body after its call ended")

// reader returns a reader of q's bytes under l.
func (q *query) reader(l *lease) *queryReader { return &queryReader{l: l, parts: q.parts} }

// queryReader reads a query's pieces in order. Safe for concurrent use.
type queryReader struct {
	l     *lease
	parts [][]byte
	i     int // the piece being read
	off   int // bytes of parts[i] read
}

func (r *queryReader) Read(p []byte) (int, error) {
	r.l.mu.Lock()
	defer r.l.mu.Unlock()
	if r.l.ended {
		return 0, errLeaseEnded
	}
	n := 0
	for n < len(p) && r.i < len(r.parts) {
		k := copy(p[n:], r.parts[r.i][r.off:])
		n += k
		if r.off += k; r.off == len(r.parts[r.i]) {
			r.i, r.off = r.i+1, 0
		}
	}
	if n == 0 && r.i == len(r.parts) {
		return 0, io.EOF
	}
	return n, nil
}

// Close does nothing: the call's lease ends the reads.
func (r *queryReader) Close() error { return nil }
