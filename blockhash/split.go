package blockhash

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/cespare/xxhash/v2"
)

// Block is one cut of the prompt.
type Block struct {
	// Hash is the chained key: it names this block and everything before it.
	Hash uint64
	// Tokens is the block's estimated token count, at least 1.
	Tokens int32
	// Kind is the block's semantic type; not part of Hash.
	Kind Kind
	// Seg is the block's key within its segment (a message, or one of a
	// message's content parts): chained from the segment's own start, not
	// from the prompt's, so that the same segment has the same Seg keys
	// wherever it appears in whatever prompt. It names what an engine
	// that reuses KV beyond the exact prefix (CacheBlend's position-
	// independent segments) may reuse. 0 unless the splitter computes it
	// (Options.Segments).
	Seg uint64
}

// Options configure a Splitter. The zero value means the defaults.
type Options struct {
	// BlockTokens is the block size in estimated tokens. Default 64.
	BlockTokens int
	// BytesPerToken is the token estimate: one token per this many bytes of
	// text. Default 4.
	BytesPerToken int
	// Segments: compute each block's Block.Seg (a second hash of the
	// prompt's bytes). Off, Seg is 0.
	Segments bool
}

// Splitter cuts requests into blocks. It is immutable and safe for concurrent use.
type Splitter struct {
	blockTokens   int
	bytesPerToken int
	segments      bool
}

// Defaults for Options.
const (
	DefaultBlockTokens   = 64
	DefaultBytesPerToken = 4
)

// NewSplitter validates o and returns a Splitter.
func NewSplitter(o Options) (*Splitter, error) {
	if o.BlockTokens == 0 {
		o.BlockTokens = DefaultBlockTokens
	}
	if o.BytesPerToken == 0 {
		o.BytesPerToken = DefaultBytesPerToken
	}
	if o.BlockTokens < 1 || o.BlockTokens > 1<<20 {
		return nil, fmt.Errorf("block tokens %d out of range [1, 1048576]", o.BlockTokens)
	}
	if o.BytesPerToken < 1 || o.BytesPerToken > 64 {
		return nil, fmt.Errorf("bytes per token %d out of range [1, 64]", o.BytesPerToken)
	}
	return &Splitter{blockTokens: o.BlockTokens, bytesPerToken: o.BytesPerToken, segments: o.Segments}, nil
}

// SegSeed is the hash that chains before a segment's first block in
// Block.Seg.
var SegSeed = xxhash.Sum64String("semroute segment")

// BlockTokens returns the block size in estimated tokens.
func (s *Splitter) BlockTokens() int { return s.blockTokens }

// Seed returns the hash that chains before a model's first block.
func Seed(model string) uint64 { return xxhash.Sum64String(model) }

// ChainHash returns xxhash(parent ‖ role ‖ b), the key of a block whose
// prefix has key parent. It does not allocate.
func ChainHash(parent uint64, role byte, b []byte) uint64 {
	var hdr [9]byte
	binary.LittleEndian.PutUint64(hdr[:8], parent)
	hdr[8] = role
	var d xxhash.Digest
	d.Reset()
	_, _ = d.Write(hdr[:])
	_, _ = d.Write(b)
	return d.Sum64()
}

// Split appends r's blocks to dst and returns the extended slice. With a dst of
// enough capacity it does not allocate.
func (s *Splitter) Split(dst []Block, r *Request) []Block {
	h := Seed(r.Model)
	for i := range r.Parts {
		dst = s.AppendPart(dst, h, &r.Parts[i])
		if n := len(dst); n > 0 {
			h = dst[n-1].Hash
		}
	}
	return dst
}

// Count returns the number of blocks Split makes of r, for sizing its dst.
func (s *Splitter) Count(r *Request) int {
	n := 0
	for i := range r.Parts {
		n += s.CountPart(&r.Parts[i])
	}
	return n
}

// CountPart returns the number of blocks AppendPart appends for p.
func (s *Splitter) CountPart(p *Part) int {
	step := s.blockTokens * s.bytesPerToken
	if p.Role == RoleTokens {
		step = 4 * s.blockTokens
	}
	n := 0
	p.EachSeg(func(from, to int) { n += (to - from + step - 1) / step })
	return max(n, 1)
}

// ReusableEnd returns where p's segments that an engine may reuse in
// another prompt end (its text up to there): a tool message's content, or
// a user message's content parts other than its last (the question about
// them). It returns 0 for any other part.
func (p *Part) ReusableEnd() int {
	switch {
	case p.Role == RoleTool:
		return len(p.Text)
	case p.Role == RoleUser && len(p.Segs) > 0:
		return int(p.Segs[len(p.Segs)-1])
	}
	return 0
}

// EachSeg calls f with the bounds of each non-empty segment of p's text
// (Segs), in order.
func (p *Part) EachSeg(f func(from, to int)) {
	from := 0
	for _, at := range p.Segs {
		if a := min(max(int(at), from), len(p.Text)); a > from {
			f(from, a)
			from = a
		}
	}
	if from < len(p.Text) {
		f(from, len(p.Text))
	}
}

// segTokens returns the estimated tokens of n bytes of p's text.
func (s *Splitter) segTokens(p *Part, n int) int {
	if p.Role == RoleTokens {
		return max(n/4, 1)
	}
	return max((n+s.bytesPerToken-1)/s.bytesPerToken, 1)
}

// AppendPart appends the blocks of one part, chained after parent, to dst.
// An empty part is one block of one token: templates render a few tokens of
// framing for every message.
func (s *Splitter) AppendPart(dst []Block, parent uint64, p *Part) []Block {
	text := p.Text
	step := s.blockTokens * s.bytesPerToken
	perToken := s.bytesPerToken
	if p.Role == RoleTokens {
		step, perToken = 4*s.blockTokens, 4
	}
	if len(text) == 0 {
		return append(dst, Block{Hash: ChainHash(parent, p.Role, nil), Tokens: 1, Kind: p.Base})
	}
	refine := p.Role == RoleUser || p.Role == RolePrompt
	// Blocks are searched for ``` fences only in a part that has one.
	k := kinder{refine: refine, fenced: refine && bytes.Contains(text, fence)}
	h := parent
	last := len(text) // where the last segment ends
	p.EachSeg(func(from, to int) {
		seg := text[from:to]
		// A segment that reads as a document, or a content part of at
		// least a block followed by another, is retrieved context: all of
		// it unless it ends the part (then its last block is the question
		// asked about it).
		doc := refine && p.Role == RoleUser &&
			(looksLikeDocument(seg, s.segTokens(p, len(seg))) || (to < last && len(seg) >= step))
		sh := SegSeed
		for off := from; off < to; off += step {
			end := min(off+step, to)
			b := text[off:end]
			h = ChainHash(h, p.Role, b)
			var sk uint64
			if s.segments {
				sh = ChainHash(sh, p.Role, b)
				sk = sh
			}
			kind := k.kind(b, p.Base, doc && (end < to || to < last))
			dst = append(dst, Block{Hash: h, Tokens: int32((len(b) + perToken - 1) / perToken), Kind: kind, Seg: sk})
		}
	})
	return dst
}

// kinder refines the kinds of a user or prompt part's blocks, in order:
// code, by ``` fences where the part has any (fenced) or else by symbol
// density, and retrieved context, for the blocks of a document but its
// last.
type kinder struct {
	refine, fenced, inFence bool
}

// kind returns the kind of block b of a part whose kind is base; doc says
// it is a document's block, not its last.
func (k *kinder) kind(b []byte, base Kind, doc bool) Kind {
	if !k.refine {
		return base
	}
	out := base
	switch {
	case k.fenced && looksLikeCode(b, k.inFence), !k.fenced && symbolDense(b):
		out = KindCode
	case doc:
		out = KindRetrievedContext
	}
	if k.fenced && bytes.Count(b, fence)%2 == 1 {
		k.inFence = !k.inFence
	}
	return out
}
