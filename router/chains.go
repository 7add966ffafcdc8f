package router

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/semroute/semroute/blockhash"
)

// A Responses API request that continues a stored response
// (previous_response_id) carries only its new input: the engine prepends
// the conversation it stored. vLLM (serving_responses.py,
// _construct_input_messages and create_responses) builds a request's chat
// messages as
//
//	[this request's instructions, as a system message]
//	+ the messages stored for the previous response
//	+ the text of each of that response's output messages, as assistant messages
//	+ this request's input
//
// renders them with this request's tools, and, store on (the default),
// stores exactly those messages under this request's id. Tool calls and
// reasoning of the previous response are not carried; a chain that gives
// its instructions on every turn gathers one system message per turn at
// its front (so its prefix is shared only up to the first of them).
//
// The router does the same with what it saw: for each response answered
// through it, the messages the engine stored and the texts of its output
// (chains), so that a continuation's parts are the whole prompt the engine
// renders, matched, predicted and recorded as a chat turn is. A
// continuation of a response the router does not know (answered before it
// started, through another router that did not share it, or forgotten)
// is routed on its new input and marked Unknown: the engine's count of
// its tokens says nothing of the picture's accuracy. In a fleet, a
// continuation of a chain not known yet waits up to ChainWait for the
// peer's record.

// DefaultChainBytes is the memory chains keep by default: 64 MiB.
const DefaultChainBytes = 64 << 20

// partOverhead is what a stored part costs beside its text, in bytes.
const partOverhead = 64

// responseChain is the conversation the engine stored for one response.
// Immutable once stored: its parts' texts are shared by the chains that
// continue it.
type responseChain struct {
	// msgs are the messages the engine stored for the response: its
	// request's parts but the tools, the previous response's chain first.
	msgs []blockhash.Part
	// out are the texts of the response's output messages.
	out [][]byte
	// size counts every byte of the chain, texts shared with earlier
	// chains included: a bound on the memory it keeps alive.
	size int64
}

// chains remembers responses' chains, the most recently used first, within
// a budget of bytes. Safe for concurrent use; the zero value is not
// usable (newChains).
type chains struct {
	mu    sync.Mutex
	lru   *simplelru.LRU[string, *responseChain]
	bytes int64 // the sizes of the chains held
	max   int64
	// waiting are the continuations waiting for a chain (wait), by id.
	waiting map[string]*chainWaiters
}

// chainWaiters are the continuations waiting for one chain: ch is closed
// when it comes; n counts them, and the last to give up removes the entry.
type chainWaiters struct {
	ch chan struct{}
	n  int
}

// ChainWait bounds how long a continuation, in a fleet, waits for a peer's
// record of the chain it continues when this router does not know it yet:
// the peer that saw the answer shares it as the answer ends, so a client
// that continues at once may arrive first.
const ChainWait = 250 * time.Millisecond

// maxChains bounds the chains held, whatever their size.
const maxChains = 1 << 18

// newChains returns chains that keep at most max bytes (0: DefaultChainBytes;
// negative: none).
func newChains(max int64) *chains {
	if max == 0 {
		max = DefaultChainBytes
	}
	c := &chains{max: max}
	c.lru, _ = simplelru.NewLRU(maxChains, func(_ string, ch *responseChain) { c.bytes -= ch.size }) // a positive size never fails
	return c
}

// get returns the chain of response id.
func (c *chains) get(id string) (*responseChain, bool) {
	if c.max < 0 {
		return nil, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Get(id)
}

// put stores the chain of response id: msgs, the messages its request
// made, and out, its output texts (both kept as given: the caller gives
// them up).
func (c *chains) put(id string, msgs []blockhash.Part, out [][]byte) {
	if c.max < 0 || id == "" {
		return
	}
	ch := &responseChain{msgs: msgs, out: out, size: int64(partOverhead * (len(msgs) + len(out)))}
	for _, p := range msgs {
		ch.size += int64(len(p.Text) + 4*len(p.Segs))
	}
	for _, o := range out {
		ch.size += int64(len(o))
	}
	if ch.size > c.max {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.lru.Peek(id); ok {
		c.bytes -= old.size
	}
	c.lru.Add(id, ch)
	c.bytes += ch.size
	for c.bytes > c.max {
		c.lru.RemoveOldest()
	}
	if w := c.waiting[id]; w != nil {
		close(w.ch)
		delete(c.waiting, id)
	}
}

// wait returns the chain of response id, waiting for it at most d (or
// until ctx ends) when it is not held yet.
func (c *chains) wait(ctx context.Context, id string, d time.Duration) (*responseChain, bool) {
	if c.max < 0 {
		return nil, false
	}
	c.mu.Lock()
	if ch, ok := c.lru.Get(id); ok {
		c.mu.Unlock()
		return ch, true
	}
	if c.waiting == nil {
		c.waiting = map[string]*chainWaiters{}
	}
	w := c.waiting[id]
	if w == nil {
		w = &chainWaiters{ch: make(chan struct{})}
		c.waiting[id] = w
	}
	w.n++
	c.mu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-w.ch:
		return c.get(id)
	case <-t.C:
	case <-ctx.Done():
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if w.n--; w.n == 0 && c.waiting[id] == w {
		delete(c.waiting, id)
	}
	return c.lru.Get(id)
}

// held reports the chains held and their bytes.
func (c *chains) held() (n int, size int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len(), c.bytes
}

// chainDraft is what a Responses request makes of its conversation
// before its answer: the messages the engine stores for it, and what a
// peer needs to make them (chains.go's record).
type chainDraft struct {
	prev   string           // the response it continues; "" for none
	instr  int              // own's leading instructions (0 or 1)
	own    []blockhash.Part // its parts but the tools, copied
	stored []blockhash.Part // the messages the engine stores
}

// continued returns req's parts as the engine renders them, continuing
// prev (nil: req starts its conversation), and its draft. The parts'
// texts are prev's, shared, copies of req's own messages (which alias its
// parse, and are kept with the chain), and req's tools part as parsed
// (routed on while the parse lives, and never kept).
func continued(req *blockhash.Request, prev *responseChain) ([]blockhash.Part, *chainDraft) {
	d := &chainDraft{prev: req.PreviousResponseID}
	var tools []blockhash.Part
	for i, p := range req.Parts {
		if i == 0 && p.Role == blockhash.RoleTools {
			tools = append(tools, p) // routed on while the parse lives, never stored: not copied
			continue
		}
		p.Text, p.Segs = bytes.Clone(p.Text), slices.Clone(p.Segs) // kept with the chain
		d.own = append(d.own, p)
	}
	if len(d.own) > 0 && d.own[0].Role == blockhash.RoleSystem {
		d.instr = 1 // the instructions: before the stored conversation
	}
	d.stored = chainOf(d.own, d.instr, prev)
	return append(tools, d.stored...), d
}

// chainOf returns the messages the engine stores for a request whose
// parts but the tools are own, the first instr of them its instructions,
// continuing prev (nil: none).
func chainOf(own []blockhash.Part, instr int, prev *responseChain) []blockhash.Part {
	n := len(own)
	if prev != nil {
		n += len(prev.msgs) + len(prev.out)
	}
	msgs := make([]blockhash.Part, 0, n)
	msgs = append(msgs, own[:instr]...)
	if prev != nil {
		for _, p := range prev.msgs {
			if p.Base == blockhash.KindUserQuery {
				p.Base = blockhash.KindUserHistory // the question it was is history now
			}
			msgs = append(msgs, p)
		}
		for _, o := range prev.out {
			msgs = append(msgs, blockhash.Part{Role: blockhash.RoleAssistant, Base: blockhash.KindAssistantHistory, Text: o})
		}
	}
	return append(msgs, own[instr:]...)
}

// chainRecord is a stored response's conversation as the fleet shares it
// (cluster.Fleet.ShareChain): the response's id, the one it continued,
// its own parts but the tools (the first Instr its instructions) and its
// output texts. A peer makes the stored messages from its own chain of
// Prev, as the router that saw the answer did.
type chainRecord struct {
	ID    string      `json:"id"`
	Prev  string      `json:"prev,omitempty"`
	Instr int         `json:"instr,omitempty"`
	Parts []chainPart `json:"parts"`
	Out   []string    `json:"out,omitempty"`
}

// chainPart is one part of a chainRecord.
type chainPart struct {
	Role byte           `json:"r"`
	Kind blockhash.Kind `json:"k"`
	Text string         `json:"t"`
	Segs []int32        `json:"s,omitempty"`
}

// record encodes the chain of response id, drafted as d, with its output
// texts out.
func (d *chainDraft) record(id string, out [][]byte) []byte {
	rec := chainRecord{ID: id, Prev: d.prev, Instr: d.instr, Parts: make([]chainPart, len(d.own))}
	for i, p := range d.own {
		rec.Parts[i] = chainPart{Role: p.Role, Kind: p.Base, Text: string(p.Text), Segs: p.Segs}
	}
	for _, o := range out {
		rec.Out = append(rec.Out, string(o))
	}
	b, _ := json.Marshal(rec) // strings, numbers and slices of them: never fails
	return b
}

// AddChain keeps a peer's record of a stored response's conversation
// (cluster.Fleet.OnChain), so that a continuation of it that reaches this
// router is routed on its whole prompt. A record that does not decode,
// or continues a response this router does not know, is dropped.
func (c *Core) AddChain(rec []byte) {
	var r chainRecord
	if err := json.Unmarshal(rec, &r); err != nil || r.ID == "" || r.Instr < 0 || r.Instr > len(r.Parts) {
		return
	}
	var prev *responseChain
	if r.Prev != "" {
		var ok bool
		if prev, ok = c.chains.get(r.Prev); !ok {
			return
		}
	}
	own := make([]blockhash.Part, len(r.Parts))
	for i, p := range r.Parts {
		own[i] = blockhash.Part{Role: p.Role, Base: p.Kind, Text: []byte(p.Text), Segs: p.Segs}
	}
	out := make([][]byte, len(r.Out))
	for i, o := range r.Out {
		out[i] = []byte(o)
	}
	c.chains.put(r.ID, chainOf(own, r.Instr, prev), out)
}
