package simreplica

import (
	"bytes"
	"fmt"
	"math"
	"slices"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/internal/enginereuse"
)

// Blend makes a replica reuse the KV of content segments wherever they
// appear in a prompt, as CacheBlend does in LMCache for vLLM (EuroSys 2025;
// LMCache's blending needs the chunks marked, and the documents of a RAG
// prompt are those chunks). A segment is one of a user message's text
// content parts other than its last (the question), or a tool message's
// content: the units a RAG or agent client sends as retrieved documents and
// tool results. Each segment's KV is kept in a store of its own, keyed by
// the segment's tokens alone, so that it is found after another system
// prompt and in another order; when a prompt holds a stored segment past the
// prefix cache's hit, the replica computes only Recompute of its tokens
// again (CacheBlend's selective recompute, which repairs the attention
// across segments), reports the rest in usage's cached_tokens, as vLLM
// counts a KV connector's tokens there, and counts them in
// vllm:external_prefix_cache_hits_total. Time to first token follows the
// tokens computed.
//
// Blending needs the words tokenizer: the bytes tokenizer cuts a segment
// differently at every offset.
type Blend struct {
	// Recompute is the share of a reused segment's tokens computed again,
	// in (0, 1); zero means the default, 0.15 (CacheBlend's).
	Recompute float64
	// BudgetTokens bounds the segments stored (tokens); the least recently
	// used go first. Default NumBlocks × BlockSize.
	BudgetTokens int
}

// DefaultRecompute is Blend.Recompute's default, CacheBlend's share: this
// simulated engine's own (enginereuse.DefaultRecompute), set apart from
// what the router assumes.
const DefaultRecompute = enginereuse.DefaultRecompute

// segmentSalt keeps segment keys apart from block keys.
const segmentSalt = 0x5e6b1e4d

// span is a reusable segment of a prompt: tokens [from, to) of its ids,
// stored under key.
type span struct {
	from, to int
	key      uint64
}

// blendStore is a replica's segment store (enginereuse.Store) and its
// recompute share. Safe for concurrent use.
type blendStore struct {
	recompute float64
	store     *enginereuse.Store
}

func newBlendStore(b Blend, blockSize int) (*blendStore, error) {
	if b.Recompute < 0 || b.Recompute >= 1 || math.IsNaN(b.Recompute) {
		return nil, fmt.Errorf("simreplica: Blend.Recompute %v is not in (0, 1)", b.Recompute)
	}
	// Every stored segment holds at least a block.
	st, err := enginereuse.NewStore(b.BudgetTokens, blockSize)
	if err != nil {
		return nil, err
	}
	return &blendStore{recompute: b.Recompute, store: st}, nil
}

// reuse returns the tokens of spans, past the first cached ones, that the
// store holds and the engine need not compute.
func (s *blendStore) reuse(spans []span, cached int) int {
	n := 0
	for _, sp := range spans {
		if sp.to <= cached {
			continue // inside the prefix cache's hit
		}
		if s.store.Has(sp.key) {
			t := sp.to - max(sp.from, cached)
			n += t - int(math.Ceil(float64(t)*s.recompute))
		}
	}
	return n
}

// put stores spans, evicting the least recently used segments past the
// budget.
func (s *blendStore) put(spans []span) {
	for _, sp := range spans {
		s.store.Put(sp.key, sp.to-sp.from)
	}
}

func (s *blendStore) clear() { s.store.Clear() }

// maxSpans bounds the segments of one prompt looked up.
const maxSpans = 256

// spans appends to dst the reusable segments of req found in ids, the
// prompt's tokens, in order; seg is scratch for a segment's own tokens.
// A segment of less than a block is not worth a lookup, as LMCache's
// chunks are not. A segment is found by its tokens without leading
// whitespace and without its first and last token, which may join the
// template's newline before it or the text after it, in time linear in
// the prompt; at most maxSpans segments are looked up.
func (s *Server) spans(dst []span, seg []int32, req *blockhash.Request, ids []int32, m model) ([]span, []int32) {
	at, looked := 0, 0
	for i := range req.Parts {
		p := &req.Parts[i]
		last := p.ReusableEnd()
		p.EachSeg(func(from, to int) {
			if from >= last || looked >= maxSpans {
				return
			}
			looked++
			seg = s.tok.Encode(seg[:0], bytes.TrimLeft(p.Text[from:to], " \t\r\n"), false)
			if len(seg) < 3 {
				return
			}
			seg = seg[1 : len(seg)-1]
			if len(seg) < s.o.BlockSize {
				return
			}
			j := indexIDs(ids[at:], seg)
			if j < 0 {
				return
			}
			dst = append(dst, span{from: at + j, to: at + j + len(seg), key: blockhash.TokenBlockHash(m.root^segmentSalt, seg)})
			at += j + len(seg)
		})
	}
	return dst, seg
}

// indexIDs returns the first index of needle in hay, or -1: Rabin–Karp,
// linear in len(hay) but for hash collisions.
func indexIDs(hay, needle []int32) int {
	n := len(needle)
	if n == 0 {
		return 0
	}
	if n > len(hay) {
		return -1
	}
	const base = 1000003
	var want, got, pow uint64 = 0, 0, 1
	for i := range n {
		want = want*base + uint64(uint32(needle[i]))
		got = got*base + uint64(uint32(hay[i]))
		if i > 0 {
			pow *= base
		}
	}
	for i := 0; ; i++ {
		if got == want && slices.Equal(hay[i:i+n], needle) {
			return i
		}
		if i+n >= len(hay) {
			return -1
		}
		got = (got-uint64(uint32(hay[i]))*pow)*base + uint64(uint32(hay[i+n]))
	}
}
