package blockhash

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// Keys of engine token blocks. In precise mode a request's prompt is the
// engine's own token ids (from its /tokenize), cut into the engine's
// blocks (BlockSize ids each; the last partial block is not a cache
// block), and an engine's KV events report the ids of every block it
// stores: both are keyed by the same chain, so the blocks an event
// describes are the blocks a request matches. The engine's own block
// hashes are not used: vLLM seeds them at random unless PYTHONHASHSEED is
// set, and they differ between versions.

// TokenSeed returns the key that chains before the first token block of
// a prompt served by LoRA adapter lora ("" for the base model): the same
// ids under another adapter are other blocks, as vLLM's extra keys make
// them.
func TokenSeed(lora string) uint64 {
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString("semroute-tokens\x00")
	_, _ = d.WriteString(lora)
	return d.Sum64()
}

// TokenBlockHash returns the key of a block of token ids whose prefix has
// key parent: xxhash64 of parent (8 bytes) and each id (4 bytes), little
// endian. It does not allocate.
func TokenBlockHash[T ~int32 | ~uint32](parent uint64, ids []T) uint64 {
	var buf [8 + 4*64]byte
	binary.LittleEndian.PutUint64(buf[:8], parent)
	var d xxhash.Digest
	d.Reset()
	n := 8
	for _, id := range ids {
		if n+4 > len(buf) {
			_, _ = d.Write(buf[:n])
			n = 0
		}
		binary.LittleEndian.PutUint32(buf[n:], uint32(id))
		n += 4
	}
	_, _ = d.Write(buf[:n])
	return d.Sum64()
}

// AppendTokenBlocks appends to dst the cache blocks of a prompt of engine
// token ids: the full blocks of blockSize ids among the first len(ids)−1
// (an engine recomputes the last prompt token, so a block ending on it is
// never a hit), chained from seed. It returns dst and the tokens left
// over, in no block.
//
// Kinds come from r, whose parts are the same prompt as text: the engine's
// template renders the parts in order, so part i is taken to cover the
// share of the ids that its text has of all the parts' text, and a block
// takes the kind of the part its middle token falls in. The template's own
// tokens blur the boundaries by a few tokens; a kind is a weight, not a
// key, so the blocks' keys are exact all the same. r may be nil (every
// block KindOther).
func AppendTokenBlocks(dst []Block, seed uint64, ids []int32, blockSize int, r *Request) ([]Block, int) {
	if blockSize < 1 || len(ids) == 0 {
		return dst, len(ids)
	}
	full := (len(ids) - 1) / blockSize
	var total int
	if r != nil {
		for i := range r.Parts {
			total += max(len(r.Parts[i].Text), 1)
		}
	}
	part, partEnd := 0, 0.0 // the part the current token falls in, and where it ends (in ids)
	scale := 0.0
	if total > 0 {
		scale = float64(len(ids)) / float64(total)
		partEnd = float64(max(len(r.Parts[0].Text), 1)) * scale
	}
	h := seed
	for b := 0; b < full; b++ {
		blk := ids[b*blockSize : (b+1)*blockSize]
		h = TokenBlockHash(h, blk)
		k := KindOther
		if total > 0 {
			mid := float64(b*blockSize) + float64(blockSize)/2
			for mid >= partEnd && part < len(r.Parts)-1 {
				part++
				partEnd += float64(max(len(r.Parts[part].Text), 1)) * scale
			}
			k = r.Parts[part].Base
		}
		dst = append(dst, Block{Hash: h, Tokens: int32(blockSize), Kind: k})
	}
	return dst, len(ids) - full*blockSize
}

// SetTokenSegments gives the token blocks of a prompt (AppendTokenBlocks'
// blocks, of blockSize ids each, for the same r) position-independent
// segment keys (Block.Seg), as Options.Segments gives text blocks: a block
// whose middle token falls in a reusable segment — a user message's content
// part other than its last (then also KindRetrievedContext), or a tool
// message's content — gets a key made of the segment's text and the
// block's ordinal in it, so that the same document has the same keys in
// another prompt, at another offset and after another prefix. Where
// segments fall among the ids is estimated as AppendTokenBlocks estimates
// kinds, by their share of the text: an error in a segment's start shifts
// all its ordinals alike, so two prompts with the same error share the
// keys of all but the blocks at the segment's ends. The error grows with
// how much the parts before it differ in tokens per byte: after a JSON
// system prompt or tool schemas (more tokens per byte than prose) the
// estimate places a document early, keys blocks of the prompt before it,
// and two prompts whose prefixes differ in density share fewer keys. It
// does not allocate.
func SetTokenSegments(blocks []Block, nIDs, blockSize int, r *Request) {
	if r == nil || blockSize < 1 || len(blocks) == 0 {
		return
	}
	total := 0
	for i := range r.Parts {
		total += max(len(r.Parts[i].Text), 1)
	}
	scale := float64(nIDs) / float64(total)
	b := 0
	start := 0.0 // the current part's first id
	for i := range r.Parts {
		p := &r.Parts[i]
		end := start + float64(max(len(p.Text), 1))*scale
		last := p.ReusableEnd()
		p.EachSeg(func(from, to int) {
			if from >= last {
				return
			}
			s0, s1 := start+float64(from)*scale, start+float64(to)*scale
			key := ChainHash(SegSeed, p.Role, p.Text[from:to])
			for ; b < len(blocks); b++ {
				mid := float64(b*blockSize) + float64(blockSize)/2
				if mid < s0 {
					continue
				}
				if mid >= s1 {
					break
				}
				var ord [4]byte
				binary.LittleEndian.PutUint32(ord[:], uint32((mid-s0)/float64(blockSize)))
				blocks[b].Seg = ChainHash(key, p.Role, ord[:])
				if p.Role == RoleUser {
					blocks[b].Kind = KindRetrievedContext
				}
			}
		})
		start = end
		// Blocks whose middle falls before the next part are not in a
		// reusable segment: skip them.
		for b < len(blocks) && float64(b*blockSize)+float64(blockSize)/2 < start {
			b++
		}
	}
}
