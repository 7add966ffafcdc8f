package blockhash

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/valyala/fastjson"
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
// missing field, an unknown role, nesting past Limits.MaxDepth, a key the
// router reads given twice. Field names the offending JSON path. The errors
// this package makes are short whatever the input: Msg is at most a few
// hundred bytes, any quoted input in it cut.
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
	return &InputError{Field: field, Msg: clip(fmt.Sprintf(format, args...), maxErrMsg)}
}

// jsonErr is an InputError for fastjson's error text, which quotes the input
// and grows with the nesting: its middle is cut.
func jsonErr(err error) error {
	return inputErr("", "invalid JSON: %s", clipMiddle(err.Error(), maxErrQuote))
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
	// Segs are the offsets in Text where a message's second and later
	// content parts begin (nil for a message that is one string): each
	// content part is a segment of its own, cut into blocks from its own
	// start, so that a document sent as a content part makes the same
	// blocks wherever it appears (see Block.Seg).
	Segs []int32
}

// Request is the routing-relevant content of an OpenAI request body.
type Request struct {
	Endpoint Endpoint // the API the body was parsed as
	Model    string
	User     string // the body's "user" field, a session key of last resort
	Stream   bool
	// StreamOptions says the body has a stream_options key; IncludeUsage
	// that it asks for stream_options.include_usage: true (the replica then
	// sends a last chunk with the usage).
	StreamOptions, IncludeUsage bool
	// MaxTokens is max_completion_tokens, else max_tokens (max_output_tokens
	// for /v1/responses); 0 when absent.
	MaxTokens int
	// PreviousResponseID is a /v1/responses body's previous_response_id:
	// the stored response the input continues.
	PreviousResponseID string
	// NoStore says a /v1/responses body has store: false: the engine
	// keeps no response for a later request to continue.
	NoStore bool
	// KVTransferParams and RequestID say the body's object has a
	// top-level kv_transfer_params (vLLM's disaggregation: the router's to
	// set, never a client's) or request_id key (a Responses response's id
	// in vLLM: the router's to issue), under any spelling the engine's
	// JSON parser reads as that key (escapes unescaped).
	KVTransferParams, RequestID bool
	// PriorityKey says the body's object has a top-level priority key
	// (vLLM's scheduling priority: the router's to set, from the
	// request's priority, never a client's), under any spelling, as
	// KVTransferParams.
	PriorityKey bool
	Parts       []Part

	p *fastjson.Parser // holds the memory Parts alias; see Recycle

	budget *Budget // the budget the parse took held values from, or nil
	held   int64
	large  bool // the body was over maxPooledParse bytes: its parser is not pooled
}

// maxPooledParse is the largest body whose parser goes back to the pool:
// a parser keeps a copy of the last body it parsed, so one that parsed a
// 15 MiB prompt would hold 15 MiB for as long as it is pooled.
const maxPooledParse = 1 << 20

// Limits bound what a parser accepts.
type Limits struct {
	// MaxMessages bounds the messages in a chat body, or the prompts in a
	// completions body; zero means no limit.
	MaxMessages int
	// MaxDepth bounds the nesting of arrays and objects (counted together;
	// the body object is depth 1) anywhere in the body. Zero, or less,
	// means DefaultMaxDepth; more than 299 (what the JSON parser itself
	// supports) means 299. A body nested deeper is refused, after a linear
	// scan, before it is parsed.
	MaxDepth int
	// MaxValues bounds the JSON values in a body (strings, keys included,
	// numbers, literals, arrays, objects). Parsing builds a tree of about
	// 300-450 bytes of memory per value, against 2 bytes per value of the
	// body at best ("1,"), so values, not bytes, bound a parse's memory.
	// Zero, or less, means DefaultMaxValues.
	MaxValues int
	// Budget, if set, is shared by the requests parsed at once: a body of
	// more than BudgetFloor values takes its values from it until
	// Request.Recycle, and is refused with ErrBusy when the budget cannot
	// cover it. It bounds the memory of parsing across requests.
	Budget *Budget
}

// MaxModelBytes bounds a request's model name: it is logged, exported as a
// label and part of every block key's seed.
const MaxModelBytes = 512

// DefaultMaxValues is the default Limits.MaxValues: 262,144, room for a
// prompt of 256 Ki token ids.
const DefaultMaxValues = 1 << 18

// DefaultBudgetValues is a budget for a router's requests: 1,048,576
// values, four bodies at DefaultMaxValues, about 330 MB of parse trees.
const DefaultBudgetValues = 1 << 20

// BudgetFloor is the size, in values, under which a body parses without
// taking from a Budget: ordinary chat bodies have a few hundred.
const BudgetFloor = 4096

func (l Limits) maxValues() int {
	if l.MaxValues <= 0 {
		return DefaultMaxValues
	}
	return l.MaxValues
}

// Budget is a number of JSON values that the requests parsed at once may
// hold together (see Limits.Budget). The zero value has no room; use
// NewBudget. Safe for concurrent use.
type Budget struct {
	max  int64
	used atomic.Int64
}

// NewBudget returns a budget of values.
func NewBudget(values int64) *Budget { return &Budget{max: values} }

// Used returns the values held now.
func (b *Budget) Used() int64 { return b.used.Load() }

// take reserves n values if they fit, in one step.
func (b *Budget) take(n int64) bool {
	if b.used.Add(n) > b.max {
		b.used.Add(-n)
		return false
	}
	return true
}

// Admit checks JSON that the router reads but that is not a request body
// (a replica's answer, a prefill's kv_transfer_params) as a body is
// checked before it is parsed: its nesting and its values within lim's
// MaxDepth and MaxValues, after a linear scan, and, past BudgetFloor
// values, its values taken from lim.Budget (ErrBusy when it cannot cover
// them) until release is called. release is never nil and may be called
// more than once; the caller parses data only if err is nil. So every
// JSON tree the router builds is bounded alike, whoever sent it.
func Admit(data []byte, lim Limits) (release func(), err error) {
	values, err := scan(data, lim.maxDepth(), lim.maxValues())
	if err != nil {
		return func() {}, err
	}
	if lim.Budget == nil || values <= BudgetFloor {
		return func() {}, nil
	}
	if !lim.Budget.take(int64(values)) {
		return func() {}, ErrBusy
	}
	var once sync.Once
	return func() { once.Do(func() { lim.Budget.used.Add(-int64(values)) }) }, nil
}

// ErrBusy is returned by the parsers when a Budget cannot cover a large
// body now: the request may be retried.
var ErrBusy = errors.New("too many large request bodies are being parsed at once; retry later")

// parsers lends the fastjson parsers whose memory a parsed Request's parts
// alias until Recycle.
var parsers fastjson.ParserPool

// TokenIDsOnly reports whether the request's prompt is all token ids (a
// completions body with token-id prompts): counted exactly already.
func (r *Request) TokenIDsOnly() bool {
	for i := range r.Parts {
		if r.Parts[i].Role != RoleTokens {
			return false
		}
	}
	return len(r.Parts) > 0
}

// Recycle gives the memory that r's parts alias back for reuse by a later
// parse, and the values it took back to its Budget. Neither r nor any
// Part.Text of it may be used afterwards. Calling it is optional unless the
// request was parsed with a Budget (then its values stay taken until it
// is); an unreleased request is collected as usual. Calling it twice is
// harmless.
func (r *Request) Recycle() {
	if r.p != nil {
		if r.held == 0 && !r.large { // a large parse's tree and copy are left to the collector, not kept in the pool
			parsers.Put(r.p)
		}
		r.p, r.Parts = nil, nil
	}
	if r.budget != nil {
		r.budget.used.Add(-r.held)
		r.budget, r.held = nil, 0
	}
}

// body is a request body's fields, as parsed JSON values; a field absent
// from the body is nil.
type body struct {
	model, user, stream, maxTokens, maxCompletion *fastjson.Value
	streamOptions                                 *fastjson.Value
	messages, tools, prompt                       *fastjson.Value
	system, prevID                                *fastjson.Value // /v1/responses' instructions (and previous_response_id), /v1/messages' system
	store                                         *fastjson.Value // /v1/responses' store
}

// decode checks data's JSON (nesting, escapes, numbers: see prescan; then
// structure) and reads the fields every endpoint shares.
//
// Keys match exactly, case-sensitively, as the replica's JSON parser
// (Python's json.loads under FastAPI and pydantic) matches them; a key
// spelled otherwise ("MODEL", "Messages") is not the field, for the router
// as for the replica. Where json.loads keeps the last of duplicate keys,
// an object the router reads (the body, a message, a tool call, its
// function, a content part) that gives a key the router reads more than
// once is refused: the router and the replica must read one request, and
// refusing is safer than relying on every reader's rule for duplicates.
// Other keys may repeat; they pass through. Strings are unescaped in the
// parser's copy of data, which the request's parts then alias; data itself
// is neither kept nor modified.
func decode(data []byte, ep Endpoint, lim Limits) (*body, *Request, error) {
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, nil, inputErr("", "empty request body")
	}
	// prescan checks what fastjson's parser does not (strings, numbers),
	// and what would cost fastjson too much to find; the parser then
	// checks the structure.
	values, err := scan(data, lim.maxDepth(), lim.maxValues())
	if err != nil {
		return nil, nil, err
	}
	r := &Request{Endpoint: ep, large: len(data) > maxPooledParse}
	if lim.Budget != nil && values > BudgetFloor {
		if !lim.Budget.take(int64(values)) {
			return nil, nil, ErrBusy
		}
		r.budget, r.held = lim.Budget, int64(values)
	}
	r.p = parsers.Get()
	b, err := r.common(data, ep)
	if err != nil {
		r.Recycle()
		return nil, nil, err
	}
	return b, r, nil
}

// common parses data and reads the fields both endpoints share, and ep's.
func (r *Request) common(data []byte, ep Endpoint) (*body, error) {
	b, err := r.top(data, ep)
	if err != nil {
		return nil, err
	}
	if err := r.identity(b); err != nil {
		return nil, err
	}
	if err := r.generation(b); err != nil {
		return nil, err
	}
	if r.Model == "" {
		return nil, inputErr("model", "is required")
	}
	if len(r.Model) > MaxModelBytes {
		return nil, inputErr("model", "is %d bytes, more than the limit of %d", len(r.Model), MaxModelBytes)
	}
	return b, nil
}

// top parses data and finds ep's top-level keys, each at most once.
func (r *Request) top(data []byte, ep Endpoint) (*body, error) {
	root, err := r.p.ParseBytes(data)
	if err != nil {
		return nil, jsonErr(err)
	}
	b := &body{}
	switch root.Type() {
	case fastjson.TypeNull:
	case fastjson.TypeObject:
		var dup string
		switch ep {
		case Completion:
			dup = fields(root, completionKeys, &b.model, &b.prompt, &b.user, &b.stream, &b.maxTokens, &b.maxCompletion, &b.streamOptions)
		case Responses: // input as messages, instructions as system, max_output_tokens as max_tokens
			dup = fields(root, responsesKeys, &b.model, &b.messages, &b.system, &b.tools, &b.user, &b.stream, &b.maxTokens, &b.prevID, &b.store)
		case Messages:
			dup = fields(root, messagesKeys, &b.model, &b.system, &b.messages, &b.tools, &b.stream, &b.maxTokens)
		default:
			dup = fields(root, chatKeys, &b.model, &b.messages, &b.tools, &b.user, &b.stream, &b.maxTokens, &b.maxCompletion, &b.streamOptions)
		}
		if dup != "" {
			return nil, dupErr(dup)
		}
		r.routerKeys(root)
	default:
		return nil, inputErr("", "request body must be a JSON object")
	}
	return b, nil
}

// routerKeys notes the keys of the body object o that a router sets.
func (r *Request) routerKeys(o *fastjson.Value) {
	o.GetObject().Visit(func(k []byte, _ *fastjson.Value) {
		switch string(k) {
		case "kv_transfer_params":
			r.KVTransferParams = true
		case "request_id":
			r.RequestID = true
		case "priority":
			r.PriorityKey = true
		}
	})
}

// identity reads the body's model and user.
func (r *Request) identity(b *body) error {
	m, err := str(b.model, "model")
	if err != nil {
		return err
	}
	u, err := str(b.user, "user")
	if err != nil {
		return err
	}
	r.Model, r.User = string(m), string(u)
	return nil
}

// generation reads how the answer is asked for: streaming, its options and
// the most tokens to generate (max_completion_tokens over max_tokens).
func (r *Request) generation(b *body) error {
	if b.streamOptions != nil {
		r.StreamOptions = true
		if u := b.streamOptions.Get("include_usage"); u != nil && u.Type() == fastjson.TypeTrue {
			r.IncludeUsage = true
		}
	}
	if !isNull(b.stream) {
		var err error
		if r.Stream, err = b.stream.Bool(); err != nil {
			return inputErr("stream", "must be a boolean")
		}
	}
	maxTokens, err := integer(b.maxTokens, "max_tokens")
	if err != nil {
		return err
	}
	maxCompletion, err := integer(b.maxCompletion, "max_completion_tokens")
	if err != nil {
		return err
	}
	r.MaxTokens = maxTokens
	if !isNull(b.maxCompletion) {
		r.MaxTokens = maxCompletion
	}
	if r.MaxTokens < 0 {
		return inputErr("max_tokens", "must not be negative")
	}
	return nil
}

// The keys read from each kind of object: no object the router reads may
// give one of its keys twice.
var (
	chatKeys       = []string{"model", "messages", "tools", "user", "stream", "max_tokens", "max_completion_tokens", "stream_options"}
	completionKeys = []string{"model", "prompt", "user", "stream", "max_tokens", "max_completion_tokens", "stream_options"}
	messageKeys    = []string{"role", "content", "name", "tool_calls"}
	toolCallKeys   = []string{"id", "function"}
	functionKeys   = []string{"name", "arguments"}
	partKeys       = []string{"type", "text"}
)

// fields sets *dst[i] to object o's value under the key names[i] (at most
// 32 names). Keys match exactly, as the replica matches them (see decode).
// A name o lacks leaves its *dst alone. It returns the first name that o
// gives more than once, or "".
func fields(o *fastjson.Value, names []string, dst ...**fastjson.Value) (dup string) {
	var seen uint32
	o.GetObject().Visit(func(k []byte, v *fastjson.Value) {
		for i, n := range names {
			if string(k) == n {
				if seen&(1<<i) != 0 && dup == "" {
					dup = n
				}
				seen |= 1 << i
				*dst[i] = v
				return
			}
		}
	})
	return dup
}

// dupErr is the error for a key given twice; field is its JSON path.
func dupErr(field string) error {
	return &InputError{Field: field, Msg: "is given more than once"}
}

func isNull(v *fastjson.Value) bool { return v == nil || v.Type() == fastjson.TypeNull }

// stringOf returns a string value's unescaped bytes (aliasing the parser's
// memory), nil for null or absent, and false for any other type.
func stringOf(v *fastjson.Value) ([]byte, bool) {
	if isNull(v) {
		return nil, true
	}
	s, err := v.StringBytes()
	return s, err == nil
}

// str is stringOf with an error naming field.
func str(v *fastjson.Value, field string) ([]byte, error) {
	s, ok := stringOf(v)
	if !ok {
		return nil, inputErr(field, "must be a string")
	}
	return s, nil
}

// integer returns a JSON integer that fits an int, 0 for null or absent;
// fractions and exponents are errors, as they are for encoding/json.
func integer(v *fastjson.Value, field string) (int, error) {
	if isNull(v) {
		return 0, nil
	}
	n, err := v.Int()
	if err != nil {
		return 0, inputErr(field, "must be an integer")
	}
	return n, nil
}

// ParseChat parses a /v1/chat/completions body. The parts come out in the
// order a chat template renders them: tool schemas, then the messages in order
// (a system message is normally first already and stays where it is).
// Their Text aliases memory the request holds until Recycle.
func ParseChat(data []byte, lim Limits) (*Request, error) {
	b, r, err := decode(data, Chat, lim)
	if err != nil {
		return nil, err
	}
	if err := r.chat(b, lim); err != nil {
		r.Recycle()
		return nil, err
	}
	return r, nil
}

func (r *Request) chat(b *body, lim Limits) error {
	msgs, err := messagesOf(b, lim)
	if err != nil {
		return err
	}
	r.Parts = make([]Part, 0, len(msgs)+1)
	if !isNull(b.tools) {
		if b.tools.Type() != fastjson.TypeArray {
			return inputErr("tools", "must be an array")
		}
		// Compact JSON with the body's own escapes, in the form every API's
		// tools take (tools.go): the same schemas are the same bytes however
		// the client spaced them, and in whichever API.
		r.Parts = append(r.Parts, Part{Role: RoleTools, Base: KindTools, Text: canonicalTools(nil, b.tools)})
	}
	parsed := make([]message, len(msgs))
	lastUser := -1
	for i, v := range msgs {
		if err := parsed[i].read(v, i); err != nil {
			return err
		}
		if string(parsed[i].role) == "user" {
			lastUser = i
		}
	}
	for i := range parsed {
		m := &parsed[i]
		p, err := m.part(i, i == lastUser)
		if err != nil {
			return err
		}
		if p.Text, p.Segs, err = m.text(i); err != nil {
			return err
		}
		r.Parts = append(r.Parts, p)
	}
	return nil
}

// messagesOf returns the body's messages: a non-empty array within the
// limit.
func messagesOf(b *body, lim Limits) ([]*fastjson.Value, error) {
	var msgs []*fastjson.Value
	if !isNull(b.messages) {
		a, err := b.messages.Array()
		if err != nil {
			return nil, inputErr("messages", "must be an array")
		}
		msgs = a
	}
	if len(msgs) == 0 {
		return nil, inputErr("messages", "is required and must not be empty")
	}
	if lim.MaxMessages > 0 && len(msgs) > lim.MaxMessages {
		return nil, inputErr("messages", "has %d entries, more than the limit of %d", len(msgs), lim.MaxMessages)
	}
	return msgs, nil
}

// part returns the part message i becomes, its role and base kind, by its
// role (lastUser: the last user message, the question).
func (m *message) part(i int, lastUser bool) (Part, error) {
	var p Part
	switch string(m.role) {
	case "system", "developer":
		p.Role, p.Base = RoleSystem, KindSystem
	case "user":
		p.Role, p.Base = RoleUser, KindUserHistory
		if lastUser {
			p.Base = KindUserQuery
		}
	case "assistant":
		p.Role, p.Base = RoleAssistant, KindAssistantHistory
	case "tool", "function":
		p.Role, p.Base = RoleTool, KindToolOutput
	case "":
		return p, inputErr(fmt.Sprintf("messages[%d].role", i), "is required")
	default:
		return p, inputErr(fmt.Sprintf("messages[%d].role", i), "unknown role %s", quoted(m.role, 64))
	}
	return p, nil
}

// message is one chat message's routing fields; byte slices alias the
// parser's memory.
type message struct {
	role, name []byte
	content    *fastjson.Value
	toolCalls  [][2][]byte // function name, arguments
}

func (m *message) read(v *fastjson.Value, i int) error {
	switch v.Type() {
	case fastjson.TypeNull:
		return nil // no fields: "role is required" follows
	case fastjson.TypeObject:
	default:
		return inputErr(fmt.Sprintf("messages[%d]", i), "must be an object")
	}
	var role, name, calls *fastjson.Value
	// Field names are formatted only for an error: this runs for every
	// message of every request.
	if dup := fields(v, messageKeys, &role, &m.content, &name, &calls); dup != "" {
		return dupErr(fmt.Sprintf("messages[%d].%s", i, dup))
	}
	var ok bool
	if m.role, ok = stringOf(role); !ok {
		return inputErr(fmt.Sprintf("messages[%d].role", i), "must be a string")
	}
	if m.name, ok = stringOf(name); !ok {
		return inputErr(fmt.Sprintf("messages[%d].name", i), "must be a string")
	}
	if isNull(calls) {
		return nil
	}
	cs, err := calls.Array()
	if err != nil {
		return inputErr(fmt.Sprintf("messages[%d].tool_calls", i), "must be an array")
	}
	m.toolCalls = make([][2][]byte, len(cs))
	for j, c := range cs {
		if err := readCall(&m.toolCalls[j], c, i, j); err != nil {
			return err
		}
	}
	return nil
}

// readCall reads tool call j of message i into call: its function's name
// and arguments.
func readCall(call *[2][]byte, c *fastjson.Value, i, j int) error {
	field := func(sub string) string { return fmt.Sprintf("messages[%d].tool_calls[%d]%s", i, j, sub) }
	if c.Type() == fastjson.TypeNull {
		return nil
	}
	if c.Type() != fastjson.TypeObject {
		return inputErr(field(""), "must be an object")
	}
	var id, fn *fastjson.Value
	if dup := fields(c, toolCallKeys, &id, &fn); dup != "" {
		return dupErr(field("." + dup))
	}
	if _, ok := stringOf(id); !ok {
		return inputErr(field(".id"), "must be a string")
	}
	if isNull(fn) {
		return nil
	}
	if fn.Type() != fastjson.TypeObject {
		return inputErr(field(".function"), "must be an object")
	}
	var fname, args *fastjson.Value
	if dup := fields(fn, functionKeys, &fname, &args); dup != "" {
		return dupErr(field(".function." + dup))
	}
	var ok bool
	if call[0], ok = stringOf(fname); !ok {
		return inputErr(field(".function.name"), "must be a string")
	}
	if call[1], ok = stringOf(args); !ok {
		return inputErr(field(".function.arguments"), "must be a string")
	}
	return nil
}

// text renders one message's routing bytes: [name NUL] content [NUL tool
// calls]. An assistant reply recorded by the router (see AssistantText)
// renders to the same bytes as the same reply sent back in the next request.
// A message that is one string and nothing else aliases the parser's memory.
// segs are where its second and later content parts begin (Part.Segs).
func (m *message) text(i int) (_ []byte, segs []int32, _ error) {
	c := m.content
	if c != nil && c.Type() == fastjson.TypeString && len(m.name) == 0 && len(m.toolCalls) == 0 {
		b, err := c.StringBytes()
		return b, nil, err
	}
	var buf []byte
	if len(m.name) > 0 {
		buf = append(buf, m.name...)
		buf = append(buf, 0)
	}
	switch {
	case isNull(c):
	case c.Type() == fastjson.TypeString:
		s, _ := c.StringBytes()
		buf = append(buf, s...)
	case c.Type() == fastjson.TypeArray:
		var err error
		if buf, segs, err = appendContentParts(buf, c, i); err != nil {
			return nil, nil, err
		}
	default:
		return nil, nil, inputErr(fmt.Sprintf("messages[%d].content", i), "must be a string, an array of content parts, or null")
	}
	for _, tc := range m.toolCalls {
		buf = append(buf, 0)
		buf = append(buf, tc[0]...)
		buf = append(buf, 0)
		buf = append(buf, tc[1]...)
	}
	return buf, segs, nil
}

// appendContentParts appends the routing bytes of message i's content
// parts, an array, and returns where the second and later ones begin.
func appendContentParts(buf []byte, c *fastjson.Value, i int) (_ []byte, segs []int32, _ error) {
	parts, _ := c.Array()
	for j, part := range parts {
		if j > 0 && len(buf) > 0 && (len(segs) == 0 || int(segs[len(segs)-1]) < len(buf)) {
			segs = append(segs, int32(len(buf)))
		}
		var err error
		if buf, err = appendContentPart(buf, part, i, j); err != nil {
			return nil, nil, err
		}
	}
	return buf, segs, nil
}

// appendContentPart appends one content part's routing bytes: a text part's
// text; any other part (an image, audio, a file) as its JSON with keys in
// sorted order, so that the same image URL or data is the same block.
// i and j place the part, messages[i].content[j], for errors.
func appendContentPart(buf []byte, part *fastjson.Value, i, j int) ([]byte, error) {
	field := func(sub string) string { return fmt.Sprintf("messages[%d].content[%d]%s", i, j, sub) }
	if part.Type() != fastjson.TypeObject {
		return nil, inputErr(field(""), "invalid content part: not an object")
	}
	var typ, text *fastjson.Value
	if dup := fields(part, partKeys, &typ, &text); dup != "" {
		return nil, dupErr(field("." + dup))
	}
	if typ != nil && typ.Type() == fastjson.TypeString && string(typ.GetStringBytes()) == "text" {
		s, ok := stringOf(text)
		if !ok {
			return nil, inputErr(field(".text"), "must be a string")
		}
		return append(buf, s...), nil
	}
	canon, err := json.Marshal(toAny(part))
	if err != nil {
		return nil, inputErr(field(""), "invalid content part: %v", err)
	}
	return append(buf, canon...), nil
}

// toAny converts v to the value encoding/json decodes the same JSON to:
// map[string]any (the last of duplicate keys winning), []any, string,
// float64, bool or nil.
func toAny(v *fastjson.Value) any {
	switch v.Type() {
	case fastjson.TypeObject:
		m := map[string]any{}
		v.GetObject().Visit(func(k []byte, v *fastjson.Value) { m[string(k)] = toAny(v) })
		return m
	case fastjson.TypeArray:
		a, _ := v.Array()
		out := make([]any, len(a))
		for i, e := range a {
			out[i] = toAny(e)
		}
		return out
	case fastjson.TypeString:
		return string(v.GetStringBytes())
	case fastjson.TypeNumber:
		f, _ := strconv.ParseFloat(string(v.MarshalTo(nil)), 64)
		return f
	case fastjson.TypeTrue:
		return true
	case fastjson.TypeFalse:
		return false
	}
	return nil
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
// string or token array is one part, in order. String parts alias memory the
// request holds until Recycle.
func ParseCompletion(data []byte, lim Limits) (*Request, error) {
	b, r, err := decode(data, Completion, lim)
	if err != nil {
		return nil, err
	}
	if err := r.completion(b, lim); err != nil {
		r.Recycle()
		return nil, err
	}
	return r, nil
}

func (r *Request) completion(b *body, lim Limits) error {
	p := b.prompt
	if isNull(p) {
		return inputErr("prompt", "is required")
	}
	switch p.Type() {
	case fastjson.TypeString:
		s, _ := p.StringBytes()
		r.Parts = []Part{{Role: RolePrompt, Base: KindOther, Text: s}}
		return nil
	case fastjson.TypeArray:
	default:
		return inputErr("prompt", "must be a string, an array of strings, or an array of token ids")
	}
	items, _ := p.Array()
	if len(items) == 0 {
		return inputErr("prompt", "must not be empty")
	}
	if t := items[0].Type(); t != fastjson.TypeString && t != fastjson.TypeArray { // one array of token ids
		ids, err := tokenIDs(items) // bounded by Limits.MaxValues, not MaxMessages: they are one prompt
		if err != nil {
			return inputErr("prompt", "mixed or invalid token ids: %v", err)
		}
		r.Parts = []Part{TokenPart(ids)}
		return nil
	}
	if lim.MaxMessages > 0 && len(items) > lim.MaxMessages {
		return inputErr("prompt", "has %d entries, more than the limit of %d", len(items), lim.MaxMessages)
	}
	r.Parts = make([]Part, 0, len(items))
	for i, it := range items {
		switch it.Type() {
		case fastjson.TypeString:
			s, _ := it.StringBytes()
			r.Parts = append(r.Parts, Part{Role: RolePrompt, Base: KindOther, Text: s})
		case fastjson.TypeArray:
			a, _ := it.Array()
			ids, err := tokenIDs(a)
			if err != nil {
				return inputErr(fmt.Sprintf("prompt[%d]", i), "invalid token ids: %v", err)
			}
			r.Parts = append(r.Parts, TokenPart(ids))
		default:
			return inputErr(fmt.Sprintf("prompt[%d]", i), "must be a string or an array of token ids")
		}
	}
	return nil
}

// tokenIDs reads an array of int32 token ids; null reads as 0, as it does
// for encoding/json.
func tokenIDs(items []*fastjson.Value) ([]int32, error) {
	ids := make([]int32, len(items))
	for i, v := range items {
		if v.Type() == fastjson.TypeNull {
			continue
		}
		n, err := v.Int64()
		if err != nil || n < math.MinInt32 || n > math.MaxInt32 {
			return nil, fmt.Errorf("item %d is not a 32-bit integer", i)
		}
		ids[i] = int32(n)
	}
	return ids, nil
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
	Responses                  // /v1/responses
	Messages                   // /v1/messages (Anthropic's)
)

// Parse parses body as the given endpoint's request.
func Parse(ep Endpoint, body []byte, lim Limits) (*Request, error) {
	switch ep {
	case Completion:
		return ParseCompletion(body, lim)
	case Responses:
		return ParseResponses(body, lim)
	case Messages:
		return ParseMessages(body, lim)
	}
	return ParseChat(body, lim)
}
