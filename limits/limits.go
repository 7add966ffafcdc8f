// Package limits holds the bounds and timeouts of the router's front doors
// (HTTP and gRPC) with their defaults: the one home of each, which the
// server, the config loader and the flags' help read. It depends on nothing
// but the parser's own limits, so the config loader can read it without the
// servers.
package limits

import (
	"cmp"
	"time"

	"github.com/semroute/semroute/blockhash"
)

// Request bounds every request a front door takes. Zero fields take the
// defaults.
type Request struct {
	// MaxBodyBytes limits request bodies; larger ones get 413, refused from
	// their Content-Length when they declare one. Default DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// MaxBodyBytesInFlight caps the bytes of request bodies the HTTP front
	// door holds at once, across requests, from the first byte read until
	// the request ends (its answer sent or abandoned). A body that would
	// pass it, as it arrives, gets 503 with Retry-After rather than the
	// process growing. It counts the bodies' own buffers (a body of unknown
	// length in steps of doubling size, from 64 KiB); parsing and
	// forwarding may hold about as much again. It should be at least
	// MaxBodyBytes, or the largest bodies are never taken. Default
	// DefaultMaxBodyBytesInFlight.
	MaxBodyBytesInFlight int64
	// MaxHeaderBytes bounds a request's headers; larger ones get 431.
	// Default DefaultMaxHeaderBytes.
	MaxHeaderBytes int
	// MaxOutputTokens rejects requests asking for more (max_tokens or
	// max_completion_tokens) with 400. Default DefaultMaxOutputTokens.
	MaxOutputTokens int
	// Parse bounds what the parser accepts (messages, nesting, values),
	// and the values being parsed at once across requests (a nil
	// Parse.Budget means one of blockhash.DefaultBudgetValues).
	Parse blockhash.Limits
}

// Defaults of Request.
const (
	DefaultMaxBodyBytes         = 16 << 20  // 16 MiB
	DefaultMaxBodyBytesInFlight = 512 << 20 // 512 MiB
	DefaultMaxHeaderBytes       = 64 << 10  // 64 KiB
	DefaultMaxOutputTokens      = 1 << 20   // 1,048,576
	DefaultMaxMessages          = 4096
)

// WithDefaults returns r with zero fields set to their defaults.
func (r Request) WithDefaults() Request {
	if r.Parse.Budget == nil {
		r.Parse.Budget = blockhash.NewBudget(blockhash.DefaultBudgetValues)
	}
	r.MaxBodyBytes = cmp.Or(max(r.MaxBodyBytes, 0), DefaultMaxBodyBytes)
	r.MaxBodyBytesInFlight = cmp.Or(max(r.MaxBodyBytesInFlight, 0), DefaultMaxBodyBytesInFlight)
	r.MaxHeaderBytes = cmp.Or(max(r.MaxHeaderBytes, 0), DefaultMaxHeaderBytes)
	r.MaxOutputTokens = cmp.Or(max(r.MaxOutputTokens, 0), DefaultMaxOutputTokens)
	return r
}

// Timeouts bound each upstream request. Zero fields take the defaults.
type Timeouts struct {
	// Connect bounds dialing a replica; FirstByte the wait for its response
	// headers (a non-streaming answer's come when it is complete); Idle the
	// silence between response chunks, on every forwarded route.
	Connect, FirstByte, Idle time.Duration
	// ClientWrite bounds each write of the answer to the client: a client
	// that stops reading is cut off after it, and the replica's request
	// cancelled, rather than hold both for good.
	ClientWrite time.Duration
	// PrefillFloor and PrefillTokensPerSecond bound a disaggregated
	// request's prefill: its prefill replica's whole answer (one token
	// and the KV's kv_transfer_params) must come within
	//
	//	min(PrefillFloor + uncached / PrefillTokensPerSecond, FirstByte)
	//
	// of sending it, where uncached is the prompt's tokens that replica
	// does not hold (the router's estimate, as it routed the request).
	// The floor covers what does not grow with the prompt: the round
	// trip, the engine's queue and its fixed costs. The throughput is a
	// conservative one, well below what any engine would compute: a
	// prefill that outlasts the bound is the replica's fault (hung, or
	// far behind), not the request's. A prefill past its bound is
	// cancelled and the request served by its decode replica alone;
	// consecutive ones eject the replica (replica.Ejection.Timeouts).
	// Defaults DefaultPrefillFloor (10 s) and
	// DefaultPrefillTokensPerSecond (500 tokens a second): a
	// 1,000-token prompt gets 12 s, a 32,000-token one 74 s, and from
	// 145,000 tokens the bound is FirstByte's (300 s by default).
	PrefillFloor           time.Duration
	PrefillTokensPerSecond float64
}

// Defaults of Timeouts.
const (
	DefaultConnect                = 5 * time.Second
	DefaultFirstByte              = 300 * time.Second
	DefaultIdle                   = 60 * time.Second
	DefaultClientWrite            = 60 * time.Second
	DefaultPrefillFloor           = 10 * time.Second
	DefaultPrefillTokensPerSecond = 500.0
)

// WithDefaults returns t with zero (or negative) fields set to their
// defaults.
func (t Timeouts) WithDefaults() Timeouts {
	t.Connect = cmp.Or(max(t.Connect, 0), DefaultConnect)
	t.FirstByte = cmp.Or(max(t.FirstByte, 0), DefaultFirstByte)
	t.Idle = cmp.Or(max(t.Idle, 0), DefaultIdle)
	t.ClientWrite = cmp.Or(max(t.ClientWrite, 0), DefaultClientWrite)
	t.PrefillFloor = cmp.Or(max(t.PrefillFloor, 0), DefaultPrefillFloor)
	t.PrefillTokensPerSecond = cmp.Or(max(t.PrefillTokensPerSecond, 0), DefaultPrefillTokensPerSecond)
	return t
}

// Prefill returns the bound of a prefill whose replica would compute
// uncached tokens of its prompt (negative or NaN counts as 0):
// PrefillFloor plus uncached / PrefillTokensPerSecond seconds, at most
// FirstByte. Zero fields count as their defaults; the result is always
// positive.
func (t Timeouts) Prefill(uncached float64) time.Duration {
	t = t.WithDefaults()
	if !(uncached > 0) {
		uncached = 0
	}
	sec := uncached / t.PrefillTokensPerSecond
	if sec >= t.FirstByte.Seconds() { // also what would overflow a Duration
		return t.FirstByte
	}
	return min(t.PrefillFloor+time.Duration(sec*float64(time.Second)), t.FirstByte)
}

// Unreleased bounds the decisions a front end keeps recorded while the caller
// has not reported their end (the gRPC API's Route and Release). Zero
// fields take the defaults.
type Unreleased struct {
	// Max caps the unreleased decisions and MaxBlocks the blocks they keep
	// (about 24 bytes each, for the decision log); past either the oldest
	// is finished as expired.
	Max, MaxBlocks int
	// ReleaseAfter finishes an unreleased decision never released.
	ReleaseAfter time.Duration
}

// Defaults of Unreleased: 10,000 decisions, 4 Mi blocks among them (about
// 100 MB of block lists), 10 minutes.
const (
	DefaultMaxUnreleased       = 10000
	DefaultMaxUnreleasedBlocks = 4 << 20
	DefaultReleaseAfter        = 10 * time.Minute
)

// WithDefaults returns h with zero fields set to their defaults.
func (h Unreleased) WithDefaults() Unreleased {
	h.Max = cmp.Or(max(h.Max, 0), DefaultMaxUnreleased)
	h.MaxBlocks = cmp.Or(max(h.MaxBlocks, 0), DefaultMaxUnreleasedBlocks)
	h.ReleaseAfter = cmp.Or(max(h.ReleaseAfter, 0), DefaultReleaseAfter)
	return h
}

// DefaultMaxReplyBytes caps how much of a response the router keeps to
// learn the assistant's reply: 1 MiB.
const DefaultMaxReplyBytes = 1 << 20

// DefaultExtProcBufferBytes caps the bytes of request bodies the endpoint
// picker (Envoy's ext_proc) buffers at once across all of its streams:
// 256 MiB, sixteen bodies of DefaultMaxBodyBytes.
const DefaultExtProcBufferBytes = 256 << 20
