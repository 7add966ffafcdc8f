package kvevents

import (
	"context"
	"fmt"
)

// Limits bound what one message from an engine may hold. A message past
// any of them is skipped whole, counted by the bound it broke
// (Stats.OverLimit), and its sequence number counts as received: it is no
// gap to replay, and replaying it would only bring the same bytes. The
// bounds are checked from lengths alone (the message's, then each msgpack
// array header's) before anything is allocated for what they declare, so a
// message past them costs the bytes read up to the header that broke one.
//
// A batch is skipped whole rather than the one event that broke a bound:
// the defaults are well above what vLLM publishes at its own defaults, so
// a message past them comes from a peer that is not a vLLM engine, from
// one gone wrong, or from one configured past them (then raise them); the
// rest of its step is not worth reading on for, and what was read of it is
// not applied in part.
//
// The sizes below are reasoned from what one batch holds: the events of one
// scheduler step (vllm/v1/core/sched/scheduler.py takes the block pool's
// events after each step). A step computes at most max_num_batched_tokens
// tokens (vLLM v1 defaults to 2048 to 16384, by GPU and entry point), and
// a BlockStored names the blocks one request filled in the step, in one KV
// cache group: its token ids (at most 5 bytes each in msgpack) and block
// hashes (9 bytes each) come to under 100 KiB a step at the defaults. A
// BlockRemoved is sent per evicted block (about 30 bytes as an array, 70 as
// a map), so a step has at most as many as the blocks it allocates. The
// big events are those that name a request's whole prefix at once: the
// blocks a KV connector loaded in one step, or with kv_cache_report_mode
// "full" the cached prefix a request hit, up to max_model_len tokens
// (about 1.3 MiB of msgpack per 256k tokens).
//
// The zero Limits are the defaults; a field ≤ 0 takes its default.
type Limits struct {
	// MaxMessageBytes bounds one message, all its frames together (topic,
	// sequence, payload), in bytes. Default DefaultMaxMessageBytes, 8 MiB:
	// a step at vLLM's defaults publishes well under 1 MiB, and 8 MiB holds
	// several whole 256k-token prefixes besides. On tcp:// endpoints it is
	// enforced while the bytes arrive: the frame that would pass it is
	// dropped as it comes, never buffered whole, and the message reaches
	// the Subscriber with the payload elided, to be counted and skipped.
	// Other transports (ipc://) are bounded only when decoded.
	MaxMessageBytes int
	// MaxEventsPerBatch bounds the events of one batch. Default
	// DefaultMaxEventsPerBatch, 16384: a step has one BlockStored per
	// scheduled request and KV cache group (max_num_seqs is 256 to 1024 by
	// default) and one BlockRemoved per block it evicts, at most the blocks
	// it allocates (1024 for 16384 tokens in blocks of 16); the bound leaves
	// room for larger steps and connector loads. Each event takes about 200
	// bytes of a Decoder's memory, 3.2 MiB at the bound.
	MaxEventsPerBatch int
	// MaxBlocksPerEvent bounds the block hashes of one event. Default
	// DefaultMaxBlocksPerEvent, 32768: MaxTokensPerEvent's default in
	// blocks of 8 tokens (vLLM's default block size is 16).
	MaxBlocksPerEvent int
	// MaxTokensPerEvent bounds the token ids of one BlockStored. Default
	// DefaultMaxTokensPerEvent, 262144 (256k): a whole prefix reported at
	// once, as long as the longest context most served models take. An
	// engine that reports whole prefixes of a longer context needs more.
	MaxTokensPerEvent int
}

// The defaults of Limits.
const (
	DefaultMaxMessageBytes   = 8 << 20
	DefaultMaxEventsPerBatch = 1 << 14
	DefaultMaxBlocksPerEvent = 1 << 15
	DefaultMaxTokensPerEvent = 1 << 18
)

// orDefaults returns l with every field ≤ 0 at its default.
func (l Limits) orDefaults() Limits {
	or := func(v, def int) int {
		if v <= 0 {
			return def
		}
		return v
	}
	return Limits{
		MaxMessageBytes:   or(l.MaxMessageBytes, DefaultMaxMessageBytes),
		MaxEventsPerBatch: or(l.MaxEventsPerBatch, DefaultMaxEventsPerBatch),
		MaxBlocksPerEvent: or(l.MaxBlocksPerEvent, DefaultMaxBlocksPerEvent),
		MaxTokensPerEvent: or(l.MaxTokensPerEvent, DefaultMaxTokensPerEvent),
	}
}

// Limit names one bound of Limits.
type Limit uint8

// The bounds, in the order of Limits' fields.
const (
	LimitMessageBytes Limit = iota // MaxMessageBytes
	LimitEvents                    // MaxEventsPerBatch
	LimitBlocks                    // MaxBlocksPerEvent
	LimitTokens                    // MaxTokensPerEvent
	// NumLimits is how many bounds there are.
	NumLimits
)

// String is the bound's name as a metric label: "message_bytes",
// "events_per_batch", "blocks_per_event", "tokens_per_event".
func (l Limit) String() string {
	switch l {
	case LimitMessageBytes:
		return "message_bytes"
	case LimitEvents:
		return "events_per_batch"
	case LimitBlocks:
		return "blocks_per_event"
	case LimitTokens:
		return "tokens_per_event"
	}
	return fmt.Sprintf("Limit(%d)", uint8(l))
}

// LimitError is the error of a payload past one of its Decoder's Limits,
// returned as soon as a length declares the excess (the payload's own, or
// an array header's), before anything is allocated for it.
type LimitError struct {
	Limit Limit
	// N is what the payload declared (bytes, events, block hashes or token
	// ids) and Max the bound it passed.
	N, Max int64
}

func (e *LimitError) Error() string {
	return fmt.Sprintf("kvevents: %s %d over the limit of %d", e.Limit, e.N, e.Max)
}

// elided is the payload the guarded transport hands on in place of a frame
// that would pass MaxMessageBytes: one byte that msgpack never uses, so
// that no batch can be mistaken for it.
const elided = 0xc1

// isElided reports whether a frame is one the guarded transport elided.
func isElided(frame []byte) bool { return len(frame) == 1 && frame[0] == elided }

// messageLimitKey carries a socket's MaxMessageBytes to the guarded
// transport: zmq4 hands the socket's context to the transport's Dial and
// Listen.
type messageLimitKey struct{}

func withMessageLimit(ctx context.Context, n int) context.Context {
	return context.WithValue(ctx, messageLimitKey{}, n)
}

// messageLimit is the MaxMessageBytes a socket's context carries, or the
// default.
func messageLimit(ctx context.Context) uint64 {
	if n, ok := ctx.Value(messageLimitKey{}).(int); ok && n > 0 {
		return uint64(n)
	}
	return DefaultMaxMessageBytes
}
