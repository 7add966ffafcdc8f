package cluster

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/semroute/semroute/blockhash"
)

// The wire format of a batch, one NATS message on <prefix>.records:
//
//	batch  = version:1 sender:str epoch:8 seq:uvarint count:uvarint record*
//	str    = len:uvarint bytes
//	record = type:1 body
//	route  = req:uvarint replica:str prefill:uvarint tokens:uvarint chain
//	reply  = replica:str chain
//	prefill, done = req:uvarint
//	eject  = replica:str cool_ms:uvarint
//	reset  = (empty)
//	home   = response_id:str replica:str tenant:str
//	chain  = prefix:uvarint [prefix_key:8 if prefix > 0] n:uvarint
//	         (key:8 tokens:uvarint)×n runs:uvarint (kind:1 count:uvarint)×runs
//
// A chain is the blocks a record caches on a replica: the first prefix of
// them by the key of the last (the sender matched them there, so its peers
// hold them too and rebuild them from their own picture), then the n new
// ones in full, their kinds run-length coded. Integers are big-endian when
// fixed; uvarint is encoding/binary's. Version changes when the format does;
// a router drops batches of another version (counted as malformed).
const version = 1

// Record types.
const (
	recRoute   = 1 // a decision committed on a replica: blocks and work
	recPrefill = 2 // a request's prefill finished
	recDone    = 3 // a request ended
	recReply   = 4 // a learned reply, chained after its prompt
	recEject   = 5 // a replica was ejected after failing
	recReset   = 6 // forget every request of the sender's in flight
	recHome    = 7 // a Responses API response, stored on a replica: older routers', read and ignored (router/respid.go)
)

// header is a batch's envelope.
type header struct {
	sender string
	epoch  uint64 // random per process: a restarted router is a new peer
	seq    uint64 // the sender's batch number, from 1, no gaps
	count  int
}

// chain is a chain's decoded form. prefix blocks are named by prefixKey;
// blocks are the new ones.
type chain struct {
	prefix    int
	prefixKey uint64
	blocks    []blockhash.Block
}

// record is one decoded record.
type record struct {
	typ     byte
	req     uint64
	replica string
	prefill int64
	tokens  int64
	cool    uint64 // ms
	chain   chain
	id      string // recHome's response id
	tenant  string // and the tenant it is for
}

func appendStr(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func appendHeader(b []byte, h header) []byte {
	b = append(b, version)
	b = appendStr(b, h.sender)
	b = binary.BigEndian.AppendUint64(b, h.epoch)
	b = binary.AppendUvarint(b, h.seq)
	return binary.AppendUvarint(b, uint64(h.count))
}

// appendChain encodes blocks, whose first prefix are named by the key of
// blocks[prefix-1].
func appendChain(b []byte, blocks []blockhash.Block, prefix int) []byte {
	prefix = min(max(prefix, 0), len(blocks))
	b = binary.AppendUvarint(b, uint64(prefix))
	if prefix > 0 {
		b = binary.BigEndian.AppendUint64(b, blocks[prefix-1].Hash)
	}
	rest := blocks[prefix:]
	b = binary.AppendUvarint(b, uint64(len(rest)))
	for _, bl := range rest {
		b = binary.BigEndian.AppendUint64(b, bl.Hash)
		b = binary.AppendUvarint(b, uint64(max(bl.Tokens, 0)))
	}
	runs := 0
	for i := range rest {
		if i == 0 || rest[i].Kind != rest[i-1].Kind {
			runs++
		}
	}
	b = binary.AppendUvarint(b, uint64(runs))
	for i := 0; i < len(rest); {
		j := i + 1
		for j < len(rest) && rest[j].Kind == rest[i].Kind {
			j++
		}
		b = append(b, byte(rest[i].Kind))
		b = binary.AppendUvarint(b, uint64(j-i))
		i = j
	}
	return b
}

// maxPrefix bounds a chain's prefix, maxChain the new blocks of a batch's
// records together and maxBlockTokens a block's tokens: more than any
// router sends (a prompt of the largest body the limits allow has under
// 2^20 blocks; a block has at most 4,096 estimated tokens, times the
// engine's unit), so a batch past them is malformed.
const (
	maxPrefix      = 1 << 20
	maxChain       = 1 << 20
	maxBlockTokens = 1 << 16
)

// errMalformed is returned for any batch that does not decode.
var errMalformed = errors.New("cluster: malformed batch")

// reader decodes a batch; the first error sticks.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail() {
	if r.err == nil {
		r.err = errMalformed
	}
	r.b = nil
}

func (r *reader) byte() byte {
	if len(r.b) < 1 {
		r.fail()
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *reader) u64() uint64 {
	if len(r.b) < 8 {
		r.fail()
		return 0
	}
	v := binary.BigEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *reader) uvarint() uint64 {
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.b = r.b[n:]
	return v
}

// count reads a uvarint that counts items of at least size bytes each, so
// that a hostile count cannot make the reader allocate what the batch
// cannot hold.
func (r *reader) count(size int) int {
	v := r.uvarint()
	if v > uint64(len(r.b)/size) {
		r.fail()
		return 0
	}
	return int(v)
}

func (r *reader) str() string {
	n := r.count(1)
	if r.err != nil {
		return ""
	}
	s := string(r.b[:n])
	r.b = r.b[n:]
	return s
}

func (r *reader) header() header {
	if v := r.byte(); v != version {
		r.fail()
		return header{}
	}
	h := header{sender: r.str(), epoch: r.u64(), seq: r.uvarint()}
	h.count = r.count(1)
	return h
}

// chain decodes a chain, appending its new blocks to dst.
func (r *reader) chain(dst []blockhash.Block) chain {
	var c chain
	if p := r.uvarint(); p > maxPrefix {
		r.fail()
	} else {
		c.prefix = int(p)
	}
	if c.prefix > 0 {
		c.prefixKey = r.u64()
	}
	n := r.count(9)
	if n > maxChain {
		r.fail()
	}
	if r.err != nil {
		return c
	}
	for range n {
		key, tokens := r.u64(), r.uvarint()
		if tokens > maxBlockTokens {
			r.fail()
		}
		dst = append(dst, blockhash.Block{Hash: key, Tokens: int32(tokens)})
	}
	blocks := dst[len(dst)-n:]
	runs, at := r.count(2), 0
	for range runs {
		k, m := blockhash.Kind(r.byte()), r.uvarint()
		if k >= blockhash.NumKinds || m > uint64(n-at) {
			r.fail()
			break
		}
		for i := range int(m) {
			blocks[at+i].Kind = k
		}
		at += int(m)
	}
	if at != n {
		r.fail()
	}
	c.blocks = blocks
	return c
}

// record decodes one record; its chain's blocks are appended to dst.
func (r *reader) record(dst []blockhash.Block) record {
	rec := record{typ: r.byte()}
	switch rec.typ {
	case recRoute:
		rec.req, rec.replica = r.uvarint(), r.str()
		rec.prefill, rec.tokens = int64(min(r.uvarint(), math.MaxInt64)), int64(min(r.uvarint(), math.MaxInt64))
		rec.chain = r.chain(dst)
	case recReply:
		rec.replica = r.str()
		rec.chain = r.chain(dst)
	case recPrefill, recDone:
		rec.req = r.uvarint()
	case recEject:
		rec.replica, rec.cool = r.str(), r.uvarint()
	case recReset:
	case recHome:
		rec.id, rec.replica, rec.tenant = r.str(), r.str(), r.str()
	default:
		r.fail()
	}
	return rec
}

// decode reads batch b: its header, given to head, then, if head returns
// true, each record, given to fn. It stops at the first record that does
// not decode. Records and their blocks are valid only during fn.
func decode(b []byte, head func(header) bool, fn func(*record)) error {
	r := &reader{b: b}
	h := r.header()
	if r.err != nil {
		return r.err
	}
	if !head(h) {
		return nil
	}
	var blocks []blockhash.Block
	total := 0
	for range h.count {
		rec := r.record(blocks[:0])
		if r.err != nil {
			return fmt.Errorf("%w: record of type %d", r.err, rec.typ)
		}
		if total += len(rec.chain.blocks); total > maxChain {
			return fmt.Errorf("%w: more than %d blocks", errMalformed, maxChain)
		}
		if rec.chain.blocks != nil {
			blocks = rec.chain.blocks[:0]
		}
		fn(&rec)
	}
	if len(r.b) != 0 {
		return fmt.Errorf("%w: %d bytes after the last record", errMalformed, len(r.b))
	}
	return nil
}
