// Package replay judges routing policies before they take traffic: it
// replays a trace through simulated replicas in virtual time, under every
// policy side by side, and reports what each would have done.
//
// Each policy runs through the live router's own engine (routing.Engine), its
// own cache model (the replicas' caches, each under a token budget and an
// eviction policy) and its own replica model; nothing is shared between
// runs, so runs are independent and execute in parallel. Everything is
// deterministic for a given trace, model and seed.
//
// By default the router's cache model stands for the replicas' caches. A
// run with a picture mode (Run.Picture: approximate, feedback, events)
// simulates each replica's engine cache apart from it, and measures how
// well the router's picture, learning in that mode, predicts the tokens
// the engines really find cached (Result.Prediction).
package replay

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"time"

	"github.com/semroute/semroute/routing"

	"github.com/semroute/semroute/blockhash"
)

// Request is one request of a trace, split into blocks.
type Request struct {
	// Arrival is nanoseconds since the trace's start. Readers add the
	// line's index in nanoseconds, so requests with equal timestamps keep
	// their order in every cache's recency.
	Arrival int64
	Session string
	Tenant  string
	Key     uint64 // routing session key (routing.SessionKey)
	Blocks  []blockhash.Block
	Tokens  int // prompt tokens, the sum of the blocks' tokens
	Output  int // output tokens
	// Reply holds the blocks of the assistant's reply, chained after Blocks,
	// when the trace shows them (the session's next request repeats this one
	// and adds the reply); nil otherwise.
	Reply []blockhash.Block
	// Text holds the request's text parts, for the semantic matcher (openai
	// traces only).
	Text [][]byte
	// Logged is what the live router did, for requests read from a decision
	// log; its timings replace the replica model's.
	Logged *Logged
}

// Logged is a decision and its outcome as a decision log recorded them.
type Logged struct {
	Arm, Policy, Chosen string
	Status              int
	TTFTNs, DurationNs  int64 // from the decision
	PromptTokens        int64 // reported by the replica
	CachedTokens        int64 // reported by the replica
}

// maxLine bounds one trace line.
const maxLine = 64 << 20

func lines(r io.Reader, each func(n int, line []byte) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), maxLine)
	n := 0
	for sc.Scan() {
		n++
		if len(sc.Bytes()) == 0 {
			continue
		}
		if err := each(n, sc.Bytes()); err != nil {
			return fmt.Errorf("line %d: %w", n, err)
		}
	}
	return sc.Err()
}

type mooncakeLine struct {
	Timestamp    *int64   `json:"timestamp"`
	InputLength  int      `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
}

// ReadMooncake reads the Mooncake (FAST'25) JSONL trace format: timestamp in
// ms, input_length and output_length in tokens, and hash_ids, one id per
// blockTokens-token block chained by prefix; the last block holds what is
// left of input_length. Ids become chained block hashes, so equal id
// prefixes are equal block prefixes. The trace has no session ids: the
// session key is the first block's hash.
func ReadMooncake(r io.Reader, blockTokens int) ([]Request, error) {
	if blockTokens < 1 {
		return nil, errors.New("block tokens must be positive")
	}
	var out []Request
	seed := blockhash.Seed("mooncake")
	var id [8]byte
	err := lines(r, func(_ int, line []byte) error {
		var m mooncakeLine
		if err := json.Unmarshal(line, &m); err != nil {
			return err
		}
		switch {
		case m.Timestamp == nil:
			return errors.New("timestamp is required")
		case len(m.HashIDs) == 0:
			return errors.New("hash_ids is empty")
		case m.InputLength < 1 || m.OutputLength < 0:
			return fmt.Errorf("input_length %d, output_length %d", m.InputLength, m.OutputLength)
		case m.InputLength > len(m.HashIDs)*blockTokens || m.InputLength <= (len(m.HashIDs)-1)*blockTokens:
			return fmt.Errorf("input_length %d does not fit %d blocks of %d tokens", m.InputLength, len(m.HashIDs), blockTokens)
		}
		req := Request{Arrival: *m.Timestamp*1e6 + int64(len(out)), Tokens: m.InputLength, Output: m.OutputLength}
		h := seed
		for i, hid := range m.HashIDs {
			binary.LittleEndian.PutUint64(id[:], hid)
			h = blockhash.ChainHash(h, blockhash.RoleTokens, id[:])
			tokens := blockTokens
			if i == len(m.HashIDs)-1 {
				tokens = m.InputLength - i*blockTokens
			}
			req.Blocks = append(req.Blocks, blockhash.Block{Hash: h, Tokens: int32(tokens), Kind: blockhash.KindOther})
		}
		req.Key = routing.SessionKey("", "", req.Blocks)
		out = append(out, req)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("mooncake trace: %w", err)
	}
	sortByArrival(out)
	return out, nil
}

type openaiLine struct {
	TimestampMS  *int64          `json:"timestamp_ms"`
	SessionID    string          `json:"session_id"`
	TenantID     string          `json:"tenant_id"`
	Request      json.RawMessage `json:"request"`
	OutputTokens int             `json:"output_tokens"`
	API          string          `json:"api"`
}

// endpoint returns the API l's body is for: its "api", or without one a
// chat body if it has messages, else a completions body.
func (l *openaiLine) endpoint() (blockhash.Endpoint, error) {
	switch l.API {
	case "":
		var probe struct {
			Messages json.RawMessage `json:"messages"`
		}
		_ = json.Unmarshal(l.Request, &probe)
		if probe.Messages != nil {
			return blockhash.Chat, nil
		}
		return blockhash.Completion, nil
	case "chat":
		return blockhash.Chat, nil
	case "completions":
		return blockhash.Completion, nil
	case "responses":
		return blockhash.Responses, nil
	case "messages":
		return blockhash.Messages, nil
	}
	return 0, fmt.Errorf("unknown api %q (have chat, completions, responses, messages)", l.API)
}

// ReadOpenAI reads the openai trace format: one JSON object a line,
// {"timestamp_ms", "session_id", "tenant_id", "request": a request body,
// "output_tokens", "api"}. The optional "api" says what API the body is
// for: "chat" (/v1/chat/completions), "completions" (/v1/completions),
// "responses" (/v1/responses) or "messages" (Anthropic's /v1/messages);
// without it, a body with messages is a chat's, any other a completions'.
// Bodies go through the same parser and splitter as live requests. When a
// session's next request repeats a request's parts and adds an assistant
// part (a chat's assistant message, a Responses function_call item, a
// Messages assistant message), that part's blocks become the request's
// Reply: every API is read into the parts of the chat the engine renders,
// so a Responses or Messages session's history links as a chat's does.
func ReadOpenAI(r io.Reader, s *blockhash.Splitter) ([]Request, error) {
	var out []Request
	var partStarts [][]int // per request: block index where each part starts
	var roles [][]byte
	err := lines(r, func(_ int, line []byte) error {
		var l openaiLine
		if err := json.Unmarshal(line, &l); err != nil {
			return err
		}
		if l.TimestampMS == nil {
			return errors.New("timestamp_ms is required")
		}
		if l.OutputTokens < 0 {
			return errors.New("output_tokens is negative")
		}
		ep, err := l.endpoint()
		if err != nil {
			return err
		}
		body, err := blockhash.Parse(ep, l.Request, blockhash.Limits{})
		if err != nil {
			return fmt.Errorf("request: %w", err)
		}
		req := Request{Arrival: *l.TimestampMS*1e6 + int64(len(out)), Session: l.SessionID, Tenant: l.TenantID, Output: l.OutputTokens}
		h := blockhash.Seed(body.Model)
		starts := make([]int, 0, len(body.Parts))
		rs := make([]byte, 0, len(body.Parts))
		for i := range body.Parts {
			starts = append(starts, len(req.Blocks))
			rs = append(rs, body.Parts[i].Role)
			req.Blocks = s.AppendPart(req.Blocks, h, &body.Parts[i])
			h = req.Blocks[len(req.Blocks)-1].Hash
			req.Text = append(req.Text, body.Parts[i].Text)
		}
		for _, b := range req.Blocks {
			req.Tokens += int(b.Tokens)
		}
		req.Key = routing.SessionKey(l.SessionID, body.User, req.Blocks)
		out = append(out, req)
		partStarts = append(partStarts, starts)
		roles = append(roles, rs)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("openai trace: %w", err)
	}
	linkReplies(out, partStarts, roles)
	sortByArrival(out)
	return out, nil
}

// linkReplies sets each request's Reply from its session's next request.
func linkReplies(reqs []Request, starts [][]int, roles [][]byte) {
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return reqs[order[a]].Arrival < reqs[order[b]].Arrival })
	next := map[string]int{} // session → index of its latest request seen walking backwards
	for k := len(order) - 1; k >= 0; k-- {
		i := order[k]
		cur := &reqs[i]
		if cur.Session == "" {
			continue
		}
		if j, ok := next[cur.Session]; ok {
			n := &reqs[j]
			p := len(starts[i]) // index of the part after cur's parts in n
			if p < len(starts[j]) && roles[j][p] == blockhash.RoleAssistant && len(n.Blocks) > len(cur.Blocks) &&
				n.Blocks[len(cur.Blocks)-1].Hash == cur.Blocks[len(cur.Blocks)-1].Hash {
				end := len(n.Blocks)
				if p+1 < len(starts[j]) {
					end = starts[j][p+1]
				}
				cur.Reply = n.Blocks[len(cur.Blocks):end]
			}
		}
		next[cur.Session] = i
	}
}

// Ties counts the requests of reqs (sorted by arrival) that arrive in the
// same millisecond as the one before them. A trace whose timestamps were
// bucketed has many: the Mooncake conversation trace's come in steps of
// about 3 s, some ten requests to each.
func Ties(reqs []Request) int {
	n := 0
	for i := 1; i < len(reqs); i++ {
		if reqs[i].Arrival/1e6 == reqs[i-1].Arrival/1e6 {
			n++
		}
	}
	return n
}

// MaxSpreadTies is the longest span SpreadTies accepts.
const MaxSpreadTies = time.Hour

// SpreadTies returns a copy of reqs (sorted by arrival) in which each run
// of requests arriving in the same millisecond arrives spread evenly, in
// the same order, from the run's first arrival over span, or up to the next
// run's first arrival if that comes sooner: the arrivals of a trace whose
// timestamps were bucketed to span. Requests alone in their millisecond
// keep their arrival. reqs is not changed; span ≤ 0 returns it as it is.
// span is capped at MaxSpreadTies.
func SpreadTies(reqs []Request, span time.Duration) []Request {
	if span <= 0 {
		return reqs
	}
	span = min(span, MaxSpreadTies)
	out := slices.Clone(reqs)
	for i := 0; i < len(out); {
		start := out[i].Arrival
		j := i + 1
		for j < len(out) && out[j].Arrival/1e6 == start/1e6 {
			j++
		}
		width := int64(span)
		if j < len(out) {
			width = max(0, min(width, out[j].Arrival-start)) // 0: reqs out of order there
		}
		if n := int64(j - i); n > 1 {
			for k := i; k < j; k++ {
				out[k].Arrival = start + int64(k-i)*width/n // < n × MaxSpreadTies: no overflow
			}
		}
		i = j
	}
	return out
}

func sortByArrival(reqs []Request) {
	sort.SliceStable(reqs, func(i, j int) bool { return reqs[i].Arrival < reqs[j].Arrival })
}

// ParseFormat checks a --format value.
func ParseFormat(f string) (string, error) {
	switch f {
	case "mooncake", "openai", "decisions":
		return f, nil
	}
	return "", fmt.Errorf("unknown trace format %q (have mooncake, openai, decisions)", f)
}
