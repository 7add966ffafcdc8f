// Package kvevents is the wire layer of vLLM's KV cache events: it decodes
// and encodes the msgpack batches an engine publishes, publishes them as an
// engine does (for the simulated replica and the tests), and subscribes to an
// engine's stream with gap detection and replay. It holds no routing logic:
// what a batch means for a replica's cache picture is the consumer's business.
//
// # The wire, as vLLM defines it
//
// vllm/distributed/kv_events.py (read at vllm-project/vllm commits
// b4e69e0af33f4698e157a262cc787fe61983cd3d, the first version, and
// 0181ea3173e53eea8cf04a86891488e3dc89bb34, a recent one; the repository's
// git history was too large to bring here, so the versions between are known
// from the forks and the consumers' issues cited below) publishes on a ZMQ PUB
// socket messages of three frames:
//
//	[topic, seq as 8 bytes big-endian, payload]
//
// seq counts from 0 per engine process (itertools.count()), so it goes back
// to 0 when the engine restarts. The payload is msgspec-msgpack of
//
//	EventBatch{ts: float, events: list, data_parallel_rank: int | None = None}
//
// whose events are tagged structs (tag field "type", the class name):
//
//	BlockStored{block_hashes, parent_block_hash, token_ids, block_size,
//	            lora_id, medium, lora_name, extra_keys = None,
//	            group_idx = None, kv_cache_spec_kind = None,
//	            kv_cache_spec_sliding_window = None}
//	BlockRemoved{block_hashes, medium, group_idx = None}
//	AllBlocksCleared{}
//
// All are declared omit_defaults=True, so a field still equal to its default
// is left out (in an array, only from the end). Three shapes have been on the
// wire, and Decode reads each (at either level, independently):
//
//   - ShapeArray: the versions before vLLM PR #42892 (b4e69e0 on) declared both
//     EventBatch and KVCacheEvent with array_like=True: a batch is
//     [ts, [events...], dp_rank] and an event ["BlockStored", block_hashes,
//     parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
//     ...], fields in declaration order, tag first. The oldest events stop at
//     lora_id (BlockStored) and at block_hashes (BlockRemoved); the oldest
//     batches have no dp_rank (added by vLLM PR #18925).
//   - ShapeMixed: vLLM PR #42892 (merged 2026-06-09, in vLLM 0.26) dropped
//     array_like from KVCacheEvent only: the batch stays an array and each
//     event becomes a map {"type": "BlockStored", "block_hashes": ..., ...}
//     (see volcano-sh/kthena#1535 for a capture from vLLM 0.26.0,
//     sgl-project/sglang#40684, llm-d/llm-d-kv-cache#661).
//   - ShapeMap: at commit 0181ea3 EventBatch is declared without array_like
//     too, so the batch is a map {"ts": ..., "events": [...],
//     "data_parallel_rank": ...}.
//
// Block hashes are ExternalBlockHash = bytes | int. The first versions sent
// Python hash() values (signed 64-bit ints, possibly negative); since about
// vLLM 0.10.2 (vLLM PR #23673; see ai-dynamo/dynamo#3180 and
// llm-d/llm-d-kv-cache#127, which followed it) the engine hashes to bytes
// and, unless
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, publishes
// int.from_bytes(hash, "big") & (2**64-1), an unsigned 64-bit int. Decode
// keeps every hash as an opaque uint64: an int is kept as its 64-bit two's
// complement pattern (a negative int64 -1 reads as 0xffffffffffffffff), and a
// bytes value as the big-endian number of its last 8 bytes (all of them when
// shorter), which is exactly the int vLLM itself would have published for
// those bytes, so two engines configured either way agree. Encode always
// writes ints, as vLLM does by default.
//
// # The replay socket
//
// With a replay endpoint the engine binds a ROUTER there. A client (REQ, or a
// DEALER that sends the empty delimiter itself) sends the start sequence as 8
// bytes big-endian; the engine reads [identity, "", start] (exactly 3
// frames) and answers, for each buffered batch with seq >= start in order,
// [identity, "", seq, payload], then the end marker [identity, "", -1 as 8
// bytes, ""]. The identity frame is the ROUTER's own; a DEALER receives
// ["", seq, payload] and a REQ [seq, payload]. The engine keeps the last
// buffer_steps batches (default 10000).
package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/tinylib/msgp/msgp"
)

// Bounds on a payload besides its Limits: a payload past one is malformed.
// Every list is also checked against the bytes left before anything is
// allocated for it, so a decode allocates at most a small multiple of
// len(payload).
const (
	// MaxStringBytes is the longest string field (the tag, a map key,
	// medium, lora_name, kv_cache_spec_kind).
	MaxStringBytes = 256
	// MaxUnknownFields is the most fields an event or a batch may carry that
	// this package does not know (skipped), so that a future vLLM adding
	// fields still decodes.
	MaxUnknownFields = 64
)

// Kind is an event's type, the msgspec tag.
type Kind uint8

// The kinds of event. The zero Kind is no event.
const (
	BlockStored Kind = iota + 1
	BlockRemoved
	AllBlocksCleared
)

// String returns the tag vLLM writes for k.
func (k Kind) String() string {
	switch k {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

// Event is one KV cache event. Which fields are meaningful depends on Kind:
// BlockStored uses all of them, BlockRemoved BlockHashes, Medium and
// GroupIdx, AllBlocksCleared none. A Python None reads as the zero value with
// its Has flag false; an empty string is the same as None.
type Event struct {
	Kind Kind
	// BlockHashes are the blocks stored or removed, in order (opaque; see
	// the package doc for how ints and bytes become a uint64).
	BlockHashes []uint64
	// ParentHash is the block before BlockHashes[0] in the prefix chain,
	// when HasParent.
	ParentHash uint64
	HasParent  bool
	// TokenIDs are the tokens of the stored blocks, block after block
	// (len(BlockHashes)*BlockSize of them when vLLM sends them).
	TokenIDs []uint32
	// BlockSize is the engine's block size in tokens.
	BlockSize int64
	// LoraID (deprecated by vLLM in favour of LoraName), when HasLoraID.
	LoraID    int64
	HasLoraID bool
	// Medium is where the blocks live ("GPU", "CPU", ...); "" for None.
	Medium string
	// LoraName is the adapter's name; "" for None or no adapter.
	LoraName string
	// ExtraKeys is extra_keys as raw msgpack (one entry per block: the
	// multimodal ids, LoRA name, cache salt that entered the hash), nil for
	// None. Decode copies it; Encode writes it back verbatim.
	ExtraKeys []byte
	// GroupIdx is the KV cache group (hybrid models), when HasGroupIdx.
	GroupIdx    int64
	HasGroupIdx bool
	// SpecKind is kv_cache_spec_kind ("full_attention", ...); "" for None.
	SpecKind string
	// SlidingWindow is kv_cache_spec_sliding_window, when HasSlidingWindow.
	SlidingWindow    int64
	HasSlidingWindow bool
}

// Batch is one published message: the events of one engine step.
type Batch struct {
	// TS is the engine's wall clock when it built the batch, in seconds
	// since the Unix epoch.
	TS     float64
	Events []Event
	// DPRank is the engine's data-parallel rank; nil when the batch has
	// none (the oldest vLLM versions).
	DPRank *int
}

// Shape is how a payload lays out the batch and its events (see the package
// doc).
type Shape uint8

const (
	// ShapeArray: batch and events are msgpack arrays (vLLM before #42892).
	ShapeArray Shape = iota
	// ShapeMixed: the batch is an array and each event a map (vLLM 0.26).
	ShapeMixed
	// ShapeMap: batch and events are msgpack maps.
	ShapeMap
)

// ErrMalformed is wrapped by every error Decode returns but a *LimitError.
var ErrMalformed = errors.New("kvevents: malformed payload")

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// Decode reads one payload in any shape, within the default Limits. The
// Batch it returns shares nothing with payload. Decode is safe for
// concurrent use; a Decoder is faster when batches are read one after
// another.
func Decode(payload []byte) (Batch, error) {
	var d Decoder
	return d.decode(payload, false)
}

// Decoder decodes payloads reusing its memory: the Batch that Decode returns
// (its Events, their hash, token and ExtraKeys slices) is valid only until
// the next call. After a few batches of a steady shape, a Decoder decodes
// without allocating; what it keeps between batches is bounded
// (maxRetained), so that one huge batch does not stay in memory. The zero
// Decoder is ready; it is not safe for concurrent use.
type Decoder struct {
	// Limits bound the payloads the Decoder reads; the zero Limits are the
	// defaults. A payload past one is refused with a *LimitError.
	Limits Limits

	lim    Limits // Limits with the defaults filled in, for this decode
	events []Event
	raw    []byte // the ExtraKeys of the batch, one after another
	dp     int
}

// maxRetained bounds the memory, in bytes, a Decoder keeps from one batch
// for the next: a busy engine's batches fit many times over (the realistic
// batch of the benchmarks takes 21 KiB), while one of the largest the
// default Limits let through would keep up to 64 MiB (8 MiB of one-byte
// hashes, 8 bytes each decoded) per engine followed.
const maxRetained = 4 << 20

// trim lets go of the memory the last batch grew past maxRetained.
func (d *Decoder) trim() {
	held := cap(d.events)*int(unsafe.Sizeof(Event{})) + cap(d.raw)
	for _, e := range d.events[:cap(d.events)] {
		held += 8*cap(e.BlockHashes) + 4*cap(e.TokenIDs)
	}
	if held > maxRetained {
		d.events, d.raw = nil, nil
	}
}

// Decode reads one payload in any shape into memory the Decoder reuses.
func (d *Decoder) Decode(payload []byte) (Batch, error) {
	return d.decode(payload, true)
}

func (d *Decoder) decode(p []byte, reuse bool) (Batch, error) {
	var b Batch
	d.lim = d.Limits.orDefaults()
	if len(p) > d.lim.MaxMessageBytes {
		return b, &LimitError{Limit: LimitMessageBytes, N: int64(len(p)), Max: int64(d.lim.MaxMessageBytes)}
	}
	if len(p) == 0 {
		return b, malformed("empty payload")
	}
	if reuse {
		d.trim()
	} else {
		d.events, d.raw = nil, nil
	}
	d.raw = d.raw[:0]
	var err error
	var rest []byte
	switch {
	case isArray(p[0]):
		rest, err = d.batchArray(p, &b, reuse)
	case isMap(p[0]):
		rest, err = d.batchMap(p, &b, reuse)
	default:
		return b, malformed("batch is msgpack type %v, not an array or a map", msgp.NextType(p))
	}
	if err != nil {
		return Batch{}, err
	}
	if len(rest) != 0 {
		return Batch{}, malformed("%d bytes after the batch", len(rest))
	}
	return b, nil
}

func isArray(c byte) bool { return c&0xf0 == 0x90 || c == 0xdc || c == 0xdd }
func isMap(c byte) bool   { return c&0xf0 == 0x80 || c == 0xde || c == 0xdf }

// arrayLen reads an array header and checks n against limit and against
// the bytes left (every element takes at least one).
func arrayLen(p []byte, limit int, what string) (int, []byte, error) {
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return 0, p, malformed("%s: %v", what, err)
	}
	if int64(n) > int64(limit) {
		return 0, p, malformed("%s: %d elements (limit %d)", what, n, limit)
	}
	return checkLen(n, p, what)
}

// limitedLen is arrayLen for a list a Limit bounds: past it, the error is
// a *LimitError.
func limitedLen(p []byte, l Limit, limit int, what string) (int, []byte, error) {
	n, p, err := msgp.ReadArrayHeaderBytes(p)
	if err != nil {
		return 0, p, malformed("%s: %v", what, err)
	}
	if int64(n) > int64(limit) {
		return 0, p, &LimitError{Limit: l, N: int64(n), Max: int64(limit)}
	}
	return checkLen(n, p, what)
}

// checkLen checks an array's n elements against the bytes left.
func checkLen(n uint32, p []byte, what string) (int, []byte, error) {
	if int(n) > len(p) {
		return 0, p, malformed("%s: %d elements in %d bytes", what, n, len(p))
	}
	return int(n), p, nil
}

func mapLen(p []byte, what string) (int, []byte, error) {
	n, p, err := msgp.ReadMapHeaderBytes(p)
	if err != nil {
		return 0, p, malformed("%s: %v", what, err)
	}
	if int64(n)*2 > int64(len(p)) {
		return 0, p, malformed("%s: %d entries in %d bytes", what, n, len(p))
	}
	return int(n), p, nil
}

func readStr(p []byte, what string) ([]byte, []byte, error) {
	s, p, err := msgp.ReadStringZC(p)
	if err != nil {
		return nil, p, malformed("%s: %v", what, err)
	}
	if len(s) > MaxStringBytes {
		return nil, p, malformed("%s: string of %d bytes (limit %d)", what, len(s), MaxStringBytes)
	}
	return s, p, nil
}

// optStr reads nil or a string; common values do not allocate.
func optStr(p []byte, what string) (string, []byte, error) {
	if len(p) > 0 && p[0] == 0xc0 {
		return "", p[1:], nil
	}
	s, p, err := readStr(p, what)
	if err != nil {
		return "", p, err
	}
	return intern(s), p, nil
}

func intern(s []byte) string {
	switch string(s) {
	case "":
		return ""
	case "GPU":
		return "GPU"
	case "CPU":
		return "CPU"
	case "full_attention":
		return "full_attention"
	case "sliding_window":
		return "sliding_window"
	case "mamba":
		return "mamba"
	}
	return string(s)
}

// readInt reads any msgpack int (signed or unsigned) as its two's complement
// uint64 pattern.
func readInt(p []byte, what string) (uint64, []byte, error) {
	if len(p) == 0 {
		return 0, p, malformed("%s: %v", what, msgp.ErrShortBytes)
	}
	c := p[0]
	if c <= 0x7f { // positive fixint, the common token id case for small ids
		return uint64(c), p[1:], nil
	}
	if c >= 0xe0 { // negative fixint
		return uint64(int64(int8(c))), p[1:], nil
	}
	if len(p) < 9 {
		return readIntNearEnd(p, what)
	}
	// The longest int's bytes are there: no type needs its own check.
	switch c {
	case 0xcc:
		return uint64(p[1]), p[2:], nil
	case 0xcd:
		return uint64(binary.BigEndian.Uint16(p[1:])), p[3:], nil
	case 0xce:
		return uint64(binary.BigEndian.Uint32(p[1:])), p[5:], nil
	case 0xcf:
		return binary.BigEndian.Uint64(p[1:]), p[9:], nil
	case 0xd0:
		return uint64(int64(int8(p[1]))), p[2:], nil
	case 0xd1:
		return uint64(int64(int16(binary.BigEndian.Uint16(p[1:])))), p[3:], nil
	case 0xd2:
		return uint64(int64(int32(binary.BigEndian.Uint32(p[1:])))), p[5:], nil
	case 0xd3:
		return binary.BigEndian.Uint64(p[1:]), p[9:], nil
	}
	return 0, p, malformed("%s: msgpack type %v, not an int", what, msgp.NextType(p))
}

// readIntNearEnd is readInt for the sized ints (types 0xcc-0xd3) when p is
// shorter than the longest: it checks that the type's bytes are all there
// and reads the int from a copy of p padded to the longest's length.
func readIntNearEnd(p []byte, what string) (uint64, []byte, error) {
	c := p[0]
	if c < 0xcc || c > 0xd3 {
		return 0, p, malformed("%s: msgpack type %v, not an int", what, msgp.NextType(p))
	}
	// uint8 to uint64, then int8 to int64: the low two bits give the width.
	n := 1 + 1<<(c&3)
	if len(p) < n {
		return 0, p, malformed("%s: %v", what, msgp.ErrShortBytes)
	}
	var padded [9]byte
	copy(padded[:], p)
	v, _, err := readInt(padded[:], what)
	return v, p[n:], err
}

// signedNeg reports whether an int whose first byte is c is encoded as a
// signed type; with readInt it tells a negative int64 from a large uint64.
func signedNeg(c byte) bool { return c >= 0xe0 || (c >= 0xd0 && c <= 0xd3) }

// readSigned reads an int that must fit an int64.
func readSigned(p []byte, what string) (int64, []byte, error) {
	c := byte(0)
	if len(p) > 0 {
		c = p[0]
	}
	u, rest, err := readInt(p, what)
	if err != nil {
		return 0, rest, err
	}
	if !signedNeg(c) && u > math.MaxInt64 {
		return 0, p, malformed("%s: %d overflows int64", what, u)
	}
	return int64(u), rest, nil
}

func optSigned(p []byte, what string) (int64, bool, []byte, error) {
	if len(p) > 0 && p[0] == 0xc0 {
		return 0, false, p[1:], nil
	}
	v, p, err := readSigned(p, what)
	return v, err == nil, p, err
}

// readHash reads an ExternalBlockHash: an int, or bytes (bin, or str as a
// lenient reading) whose last 8 bytes big-endian are the hash.
func readHash(p []byte, what string) (uint64, []byte, error) {
	if len(p) == 0 {
		return 0, p, malformed("%s: %v", what, msgp.ErrShortBytes)
	}
	switch c := p[0]; {
	case c == 0xc4 || c == 0xc5 || c == 0xc6:
		v, rest, err := msgp.ReadBytesZC(p)
		if err != nil {
			return 0, p, malformed("%s: %v", what, err)
		}
		return bytesHash(v), rest, nil
	default:
		return readInt(p, what)
	}
}

// bytesHash is int.from_bytes(v, "big") & (2**64-1): what vLLM publishes for
// the hash bytes v when it publishes ints.
func bytesHash(v []byte) uint64 {
	if len(v) > 8 {
		v = v[len(v)-8:]
	}
	var h uint64
	for _, c := range v {
		h = h<<8 | uint64(c)
	}
	return h
}

func (d *Decoder) hashes(p []byte, dst []uint64, what string) ([]uint64, []byte, error) {
	n, p, err := limitedLen(p, LimitBlocks, d.lim.MaxBlocksPerEvent, what)
	if err != nil {
		return dst, p, err
	}
	if cap(dst) < n {
		dst = make([]uint64, n)
	}
	dst = dst[:n]
	for i := range dst {
		if dst[i], p, err = readHash(p, what); err != nil {
			return dst[:0], p, err
		}
	}
	return dst, p, nil
}

func (d *Decoder) tokens(p []byte, dst []uint32) ([]uint32, []byte, error) {
	n, p, err := limitedLen(p, LimitTokens, d.lim.MaxTokensPerEvent, "token_ids")
	if err != nil {
		return dst, p, err
	}
	if cap(dst) < n {
		dst = make([]uint32, n)
	}
	dst = dst[:n]
	for i := range dst {
		if len(p) == 0 {
			return dst[:0], p, malformed("token_ids: %v", msgp.ErrShortBytes)
		}
		c := p[0]
		if c <= 0x7f {
			dst[i] = uint32(c)
			p = p[1:]
			continue
		}
		v, rest, err := readInt(p, "token_ids")
		if err != nil {
			return dst[:0], rest, err
		}
		if signedNeg(c) || v > math.MaxUint32 {
			return dst[:0], rest, malformed("token_ids: %d is not a uint32", int64(v))
		}
		dst[i] = uint32(v)
		p = rest
	}
	return dst, p, nil
}

// skipValue skips one msgpack value of any depth without recursion.
func skipValue(p []byte) ([]byte, error) {
	pending := uint64(1)
	for pending > 0 {
		if len(p) == 0 {
			return p, malformed("truncated value: %v", msgp.ErrShortBytes)
		}
		pending--
		c := p[0]
		var n uint64
		var err error
		switch {
		case isArray(c):
			var sz uint32
			sz, p, err = msgp.ReadArrayHeaderBytes(p)
			n = uint64(sz)
		case isMap(c):
			var sz uint32
			sz, p, err = msgp.ReadMapHeaderBytes(p)
			n = 2 * uint64(sz)
		default:
			p, err = msgp.Skip(p) // a scalar: no recursion
		}
		if err != nil {
			return p, malformed("value: %v", err)
		}
		pending += n
		if pending > uint64(len(p)) {
			return p, malformed("value: %d elements in %d bytes", pending, len(p))
		}
	}
	return p, nil
}

func (d *Decoder) eventList(p []byte, b *Batch, reuse bool) ([]byte, error) {
	n, p, err := limitedLen(p, LimitEvents, d.lim.MaxEventsPerBatch, "events")
	if err != nil {
		return p, err
	}
	evs := d.events
	if !reuse || cap(evs) < n {
		grown := make([]Event, n)
		if reuse {
			copy(grown, evs[:cap(evs)])
		}
		evs = grown
	}
	evs = evs[:n]
	for i := range evs {
		if p, err = d.event(p, &evs[i]); err != nil {
			return p, fmt.Errorf("event %d: %w", i, err)
		}
	}
	if reuse {
		d.events = evs
	}
	b.Events = evs
	return p, nil
}

func (d *Decoder) batchArray(p []byte, b *Batch, reuse bool) ([]byte, error) {
	n, p, err := arrayLen(p, 3+MaxUnknownFields, "batch")
	if err != nil {
		return p, err
	}
	if n < 2 {
		return p, malformed("batch array of %d fields, want ts and events", n)
	}
	if b.TS, p, err = readTS(p); err != nil {
		return p, err
	}
	if p, err = d.eventList(p, b, reuse); err != nil {
		return p, err
	}
	if n >= 3 {
		if p, err = d.dpRank(p, b, reuse); err != nil {
			return p, err
		}
	}
	for i := 3; i < n; i++ {
		if p, err = skipValue(p); err != nil {
			return p, err
		}
	}
	return p, nil
}

func (d *Decoder) batchMap(p []byte, b *Batch, reuse bool) ([]byte, error) {
	n, p, err := mapLen(p, "batch")
	if err != nil {
		return p, err
	}
	var haveTS, haveEvents bool
	unknown := 0
	for range n {
		var k []byte
		if k, p, err = readStr(p, "batch key"); err != nil {
			return p, err
		}
		switch string(k) {
		case "ts":
			if haveTS {
				return p, malformed("batch: ts twice")
			}
			b.TS, p, err = readTS(p)
			haveTS = true
		case "events":
			if haveEvents { // each list is bounded, not two
				return p, malformed("batch: events twice")
			}
			p, err = d.eventList(p, b, reuse)
			haveEvents = true
		case "data_parallel_rank":
			p, err = d.dpRank(p, b, reuse)
		default:
			if unknown++; unknown > MaxUnknownFields {
				return p, malformed("batch: more than %d unknown fields", MaxUnknownFields)
			}
			p, err = skipValue(p)
		}
		if err != nil {
			return p, err
		}
	}
	if !haveTS || !haveEvents {
		return p, malformed("batch map without ts or events")
	}
	return p, nil
}

func readTS(p []byte) (float64, []byte, error) {
	if len(p) > 0 && (p[0] == 0xcb || p[0] == 0xca) {
		f, rest, err := msgp.ReadFloat64Bytes(p)
		if err != nil {
			return 0, p, malformed("ts: %v", err)
		}
		return f, rest, nil
	}
	// msgspec reads an int into a float field; so do we.
	c := byte(0)
	if len(p) > 0 {
		c = p[0]
	}
	u, rest, err := readInt(p, "ts")
	if err != nil {
		return 0, p, err
	}
	if signedNeg(c) {
		return float64(int64(u)), rest, nil
	}
	return float64(u), rest, nil
}

func (d *Decoder) dpRank(p []byte, b *Batch, reuse bool) ([]byte, error) {
	v, ok, p, err := optSigned(p, "data_parallel_rank")
	if err != nil || !ok {
		b.DPRank = nil
		return p, err
	}
	if v < math.MinInt32 || v > math.MaxInt32 {
		return p, malformed("data_parallel_rank %d out of range", v)
	}
	if reuse {
		d.dp = int(v)
		b.DPRank = &d.dp
	} else {
		r := int(v)
		b.DPRank = &r
	}
	return p, nil
}

// The fields of an event, by their place in the array shape.
type field uint8

const (
	fHashes field = iota
	fParent
	fTokens
	fBlockSize
	fLoraID
	fMedium
	fLoraName
	fExtraKeys
	fGroupIdx
	fSpecKind
	fSlidingWindow
	fUnknown
)

var (
	storedFields  = [...]field{fHashes, fParent, fTokens, fBlockSize, fLoraID, fMedium, fLoraName, fExtraKeys, fGroupIdx, fSpecKind, fSlidingWindow}
	removedFields = [...]field{fHashes, fMedium, fGroupIdx}
)

// required is how many leading fields of each kind must be present: those
// every vLLM version has sent (msgspec would reject a batch without them).
func required(k Kind) int {
	switch k {
	case BlockStored:
		return 4 // block_hashes, parent_block_hash, token_ids, block_size
	case BlockRemoved:
		return 1 // block_hashes
	}
	return 0
}

func fieldsOf(k Kind) []field {
	switch k {
	case BlockStored:
		return storedFields[:]
	case BlockRemoved:
		return removedFields[:]
	}
	return nil
}

func kindOf(tag []byte) Kind {
	switch string(tag) {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllBlocksCleared
	}
	return 0
}

func fieldByName(k Kind, name []byte) field {
	var f field
	switch string(name) {
	case "block_hashes":
		f = fHashes
	case "parent_block_hash":
		f = fParent
	case "token_ids":
		f = fTokens
	case "block_size":
		f = fBlockSize
	case "lora_id":
		f = fLoraID
	case "medium":
		f = fMedium
	case "lora_name":
		f = fLoraName
	case "extra_keys":
		f = fExtraKeys
	case "group_idx":
		f = fGroupIdx
	case "kv_cache_spec_kind":
		f = fSpecKind
	case "kv_cache_spec_sliding_window":
		f = fSlidingWindow
	default:
		return fUnknown
	}
	for _, g := range fieldsOf(k) {
		if g == f {
			return f
		}
	}
	return fUnknown // a field of another kind: not this event's
}

// resetEvent clears e for kind k, keeping its slices' memory.
func resetEvent(e *Event, k Kind) {
	*e = Event{Kind: k, BlockHashes: e.BlockHashes[:0], TokenIDs: e.TokenIDs[:0]}
}

func (d *Decoder) event(p []byte, e *Event) ([]byte, error) {
	if len(p) == 0 {
		return p, malformed("event: %v", msgp.ErrShortBytes)
	}
	switch {
	case isArray(p[0]):
		return d.eventArray(p, e)
	case isMap(p[0]):
		return d.eventMap(p, e)
	}
	return p, malformed("event is msgpack type %v, not an array or a map", msgp.NextType(p))
}

func (d *Decoder) eventArray(p []byte, e *Event) ([]byte, error) {
	n, p, err := arrayLen(p, 1+len(storedFields)+MaxUnknownFields, "event")
	if err != nil {
		return p, err
	}
	if n == 0 {
		return p, malformed("event: empty array, no tag")
	}
	tag, p, err := readStr(p, "event tag")
	if err != nil {
		return p, err
	}
	k := kindOf(tag)
	if k == 0 {
		return p, malformed("event: unknown tag %q", tag)
	}
	resetEvent(e, k)
	fields := fieldsOf(k)
	if n-1 < required(k) {
		return p, malformed("%v: %d fields, want at least %d", k, n-1, required(k))
	}
	for i := 0; i < n-1; i++ {
		f := fUnknown
		if i < len(fields) {
			f = fields[i]
		}
		if p, err = d.field(p, e, f); err != nil {
			return p, fmt.Errorf("%v: %w", k, err)
		}
	}
	return p, nil
}

func (d *Decoder) eventMap(p []byte, e *Event) ([]byte, error) {
	n, p, err := mapLen(p, "event")
	if err != nil {
		return p, err
	}
	if n > 1+len(storedFields)+MaxUnknownFields {
		return p, malformed("event: %d fields (limit %d)", n, 1+len(storedFields)+MaxUnknownFields)
	}
	// msgspec writes the tag first; find it wherever it is.
	k, err := findTag(p, n)
	if err != nil {
		return p, err
	}
	resetEvent(e, k)
	var seen uint16
	seenTag := false
	for range n {
		var key []byte
		if key, p, err = readStr(p, "event key"); err != nil {
			return p, err
		}
		if string(key) == "type" {
			if seenTag {
				return p, malformed("%v: two tags", k)
			}
			seenTag = true
			if _, p, err = readStr(p, "event tag"); err != nil {
				return p, err
			}
			continue
		}
		f := fieldByName(k, key)
		if f != fUnknown {
			if seen&(1<<f) != 0 {
				return p, malformed("%v: field %q twice", k, key)
			}
			seen |= 1 << f
		}
		if p, err = d.field(p, e, f); err != nil {
			return p, fmt.Errorf("%v: %w", k, err)
		}
	}
	for i, f := range fieldsOf(k)[:required(k)] {
		if seen&(1<<f) == 0 {
			return p, malformed("%v: required field %d missing", k, i)
		}
	}
	return p, nil
}

func findTag(p []byte, n int) (Kind, error) {
	for range n {
		key, rest, err := readStr(p, "event key")
		if err != nil {
			return 0, err
		}
		if string(key) == "type" {
			tag, _, err := readStr(rest, "event tag")
			if err != nil {
				return 0, err
			}
			k := kindOf(tag)
			if k == 0 {
				return 0, malformed("event: unknown tag %q", tag)
			}
			return k, nil
		}
		if p, err = skipValue(rest); err != nil {
			return 0, err
		}
	}
	return 0, malformed("event map without a \"type\" tag")
}

func (d *Decoder) field(p []byte, e *Event, f field) ([]byte, error) {
	var err error
	switch f {
	case fHashes:
		e.BlockHashes, p, err = d.hashes(p, e.BlockHashes, "block_hashes")
	case fParent:
		e.ParentHash, e.HasParent, p, err = optHash(p, "parent_block_hash")
	case fTokens:
		e.TokenIDs, p, err = d.tokens(p, e.TokenIDs)
	case fBlockSize:
		e.BlockSize, p, err = readSigned(p, "block_size")
	case fLoraID:
		e.LoraID, e.HasLoraID, p, err = optSigned(p, "lora_id")
	case fMedium:
		e.Medium, p, err = optStr(p, "medium")
	case fLoraName:
		e.LoraName, p, err = optStr(p, "lora_name")
	case fExtraKeys:
		e.ExtraKeys, p, err = d.extraKeys(p)
	case fGroupIdx:
		e.GroupIdx, e.HasGroupIdx, p, err = optSigned(p, "group_idx")
	case fSpecKind:
		e.SpecKind, p, err = optStr(p, "kv_cache_spec_kind")
	case fSlidingWindow:
		e.SlidingWindow, e.HasSlidingWindow, p, err = optSigned(p, "kv_cache_spec_sliding_window")
	default:
		p, err = skipValue(p)
	}
	return p, err
}

// optHash reads nil or a hash (readHash); ok says it was a hash.
func optHash(p []byte, what string) (h uint64, ok bool, _ []byte, err error) {
	if len(p) > 0 && p[0] == 0xc0 {
		return 0, false, p[1:], nil
	}
	h, p, err = readHash(p, what)
	return h, err == nil, p, err
}

// extraKeys reads nil, or any value kept as its raw msgpack in d's buffer.
func (d *Decoder) extraKeys(p []byte) ([]byte, []byte, error) {
	if len(p) > 0 && p[0] == 0xc0 {
		return nil, p[1:], nil
	}
	rest, err := skipValue(p)
	if err != nil {
		return nil, p, err
	}
	start := len(d.raw)
	d.raw = append(d.raw, p[:len(p)-len(rest)]...)
	return d.raw[start:len(d.raw):len(d.raw)], rest, nil
}

// Encode writes b as msgspec would with the array_like structs (arrayLike,
// ShapeArray) or without them (ShapeMap). See EncodeShape.
func Encode(b Batch, arrayLike bool) []byte {
	if arrayLike {
		return EncodeShape(nil, b, ShapeArray)
	}
	return EncodeShape(nil, b, ShapeMap)
}

// EncodeShape appends b to dst in the given shape, byte for byte as msgspec
// encodes the structs of the current vLLM (the field list of commit 0181ea3)
// with omit_defaults: ints in their shortest form (unsigned types for
// non-negative values), floats as float64, strings as fixstr/str8/16/32, the
// tag first, fields in declaration order, and a field equal to its default
// left out (in an array only from the end). The fields without a default
// (lora_id, medium, lora_name; block_hashes, medium) are always written, nil
// when None. Hashes are written as unsigned ints.
func EncodeShape(dst []byte, b Batch, s Shape) []byte {
	if s == ShapeMap {
		n := uint32(2)
		if b.DPRank != nil {
			n++
		}
		dst = msgp.AppendMapHeader(dst, n)
		dst = msgp.AppendString(dst, "ts")
		dst = msgp.AppendFloat64(dst, b.TS)
		dst = msgp.AppendString(dst, "events")
	} else {
		n := uint32(2)
		if b.DPRank != nil {
			n++
		}
		dst = msgp.AppendArrayHeader(dst, n)
		dst = msgp.AppendFloat64(dst, b.TS)
	}
	dst = msgp.AppendArrayHeader(dst, uint32(len(b.Events)))
	for i := range b.Events {
		dst = appendEvent(dst, &b.Events[i], s == ShapeArray)
	}
	if b.DPRank != nil {
		if s == ShapeMap {
			dst = msgp.AppendString(dst, "data_parallel_rank")
		}
		dst = appendInt(dst, int64(*b.DPRank))
	}
	return dst
}

// appendInt writes v as msgspec does: unsigned types when v >= 0.
func appendInt(dst []byte, v int64) []byte {
	if v >= 0 {
		return msgp.AppendUint64(dst, uint64(v))
	}
	return msgp.AppendInt64(dst, v)
}

func appendOptInt(dst []byte, v int64, ok bool) []byte {
	if !ok {
		return msgp.AppendNil(dst)
	}
	return appendInt(dst, v)
}

func appendOptStr(dst []byte, s string) []byte {
	if s == "" {
		return msgp.AppendNil(dst)
	}
	return msgp.AppendString(dst, s)
}

func appendHashes(dst []byte, hs []uint64) []byte {
	dst = msgp.AppendArrayHeader(dst, uint32(len(hs)))
	for _, h := range hs {
		dst = msgp.AppendUint64(dst, h)
	}
	return dst
}

// present reports whether field f of e differs from its default (None).
func present(e *Event, f field) bool {
	switch f {
	case fExtraKeys:
		return e.ExtraKeys != nil
	case fGroupIdx:
		return e.HasGroupIdx
	case fSpecKind:
		return e.SpecKind != ""
	case fSlidingWindow:
		return e.HasSlidingWindow
	}
	return true // fields without a default
}

var fieldNames = [...]string{
	fHashes:        "block_hashes",
	fParent:        "parent_block_hash",
	fTokens:        "token_ids",
	fBlockSize:     "block_size",
	fLoraID:        "lora_id",
	fMedium:        "medium",
	fLoraName:      "lora_name",
	fExtraKeys:     "extra_keys",
	fGroupIdx:      "group_idx",
	fSpecKind:      "kv_cache_spec_kind",
	fSlidingWindow: "kv_cache_spec_sliding_window",
}

func appendEvent(dst []byte, e *Event, array bool) []byte {
	fields := fieldsOf(e.Kind)
	if array {
		last := 0 // fields written: all up to the last one not at its default
		for i, f := range fields {
			if present(e, f) {
				last = i + 1
			}
		}
		dst = msgp.AppendArrayHeader(dst, uint32(1+last))
		dst = msgp.AppendString(dst, e.Kind.String())
		for _, f := range fields[:last] {
			dst = appendField(dst, e, f)
		}
		return dst
	}
	n := uint32(1)
	for _, f := range fields {
		if present(e, f) {
			n++
		}
	}
	dst = msgp.AppendMapHeader(dst, n)
	dst = msgp.AppendString(dst, "type")
	dst = msgp.AppendString(dst, e.Kind.String())
	for _, f := range fields {
		if present(e, f) {
			dst = msgp.AppendString(dst, fieldNames[f])
			dst = appendField(dst, e, f)
		}
	}
	return dst
}

func appendField(dst []byte, e *Event, f field) []byte {
	switch f {
	case fHashes:
		return appendHashes(dst, e.BlockHashes)
	case fParent:
		if !e.HasParent {
			return msgp.AppendNil(dst)
		}
		return msgp.AppendUint64(dst, e.ParentHash)
	case fTokens:
		dst = msgp.AppendArrayHeader(dst, uint32(len(e.TokenIDs)))
		for _, t := range e.TokenIDs {
			dst = msgp.AppendUint64(dst, uint64(t))
		}
		return dst
	case fBlockSize:
		return appendInt(dst, e.BlockSize)
	case fLoraID:
		return appendOptInt(dst, e.LoraID, e.HasLoraID)
	case fMedium:
		return appendOptStr(dst, e.Medium)
	case fLoraName:
		return appendOptStr(dst, e.LoraName)
	case fExtraKeys:
		if e.ExtraKeys == nil {
			return msgp.AppendNil(dst)
		}
		return append(dst, e.ExtraKeys...)
	case fGroupIdx:
		return appendOptInt(dst, e.GroupIdx, e.HasGroupIdx)
	case fSpecKind:
		return appendOptStr(dst, e.SpecKind)
	case fSlidingWindow:
		return appendOptInt(dst, e.SlidingWindow, e.HasSlidingWindow)
	}
	return dst
}

// BlockExtraKeys appends to dst, for each of the event's blocks, the raw
// msgpack of its extra_keys entry with every string equal to the event's
// LoraName left out (vLLM puts the adapter's name first among a block's
// extra keys, vllm/v1/core/kv_cache_utils.py generate_block_hash_extra_keys,
// and the adapter already seeds the chain): nil for a block whose entry is
// None or held nothing else. The entries that remain are what vLLM hashed
// besides the tokens: multimodal hashes, cache_salt, prompt embeddings.
// With no extra_keys, or a list that does not have one entry per block, it
// appends nils and reports whether the list was usable.
func (e *Event) BlockExtraKeys(dst [][]byte) ([][]byte, bool) {
	n := len(e.BlockHashes)
	start := len(dst)
	for range n {
		dst = append(dst, nil)
	}
	if e.ExtraKeys == nil {
		return dst, true
	}
	p := e.ExtraKeys
	if len(p) > 0 && p[0] == 0xc0 {
		return dst, true
	}
	m, p, err := arrayLen(p, n, "extra_keys")
	if err != nil || m != n {
		return dst, false
	}
	for j := range n {
		entry := p
		if p, err = skipValue(p); err != nil {
			return dst, false
		}
		entry = entry[:len(entry)-len(p)]
		if entry[0] == 0xc0 {
			continue
		}
		if beyondLoRA(entry, e.LoraName) {
			dst[start+j] = entry
		}
	}
	return dst, true
}

// beyondLoRA reports whether an extra-keys entry holds anything but the
// adapter's name (an entry that is not a tuple is kept whole).
func beyondLoRA(entry []byte, lora string) bool {
	k, p, err := arrayLen(entry, MaxUnknownFields, "extra_keys entry")
	if err != nil {
		return true
	}
	for range k {
		s, rest, err := readStr(p, "extra key")
		if err != nil || lora == "" || string(s) != lora {
			return true
		}
		p = rest
	}
	return false
}
