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
