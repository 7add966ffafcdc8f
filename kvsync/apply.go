// Package kvsync keeps the cache picture of a replica right from its
// engine's own KV events (vLLM's, see package kvevents): the blocks the
// engine stores and removes become the replica's picture, keyed by the
// token ids the events carry exactly as a precise request's blocks are
// keyed (blockhash.TokenBlockHash), so that what the engine reports and
// what a request looks up are the same blocks.
//
// The engine's own block hashes are opaque names: an Applier keeps, per
// replica, the router key of every block the engine holds under its hash,
// only to apply the engine's removals and to chain a stored block after
// its parent.
package kvsync

import (
	"encoding/binary"
	"strings"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/kvevents"
)

// DefaultMaxBlocks bounds the engine blocks an Applier tracks: past it
// (an engine that never reports removals), the picture is reset.
const DefaultMaxBlocks = 1 << 21

// Counts are an Applier's counters since it was made.
type Counts struct {
	// Stored and Removed count the blocks applied.
	Stored, Removed uint64
	// Orphans counts stored blocks whose parent the picture does not know
	// (stored before the router listened, or after a reset): their prefix
	// is unknown, so they cannot be keyed and are skipped.
	Orphans uint64
	// Skipped counts events that could not be applied: token ids that do
	// not fill their blocks, a block size other than the router's,
	// extra_keys that do not have one entry per block.
	Skipped uint64
	// Ignored counts events that are not this picture's to apply: another
	// data-parallel rank's, or a KV cache group other than full attention
	// (a sliding-window or Mamba group's blocks are no reusable prefix).
	Ignored uint64
	// Cleared counts AllBlocksCleared events and resets.
	Cleared uint64
}

// Picture is what the events change: the router's picture of its
// replicas' caches (routing.Picture, its owner's named operations; a
// cachemodel.Model in a test). Safe for concurrent use.
type Picture interface {
	Store(id int, parent uint64, hasParent bool, blocks []blockhash.Block, cpu bool, now int64) (ok bool, evicted int)
	Remove(id int, key uint64, cpu bool) (removed, left bool)
	Clear(id int)
	SetEventDriven(id int, on bool)
	ExpirePending(now int64)
	Stats(id int) (cachemodel.Stats, bool)
}

// Applier applies one replica's KV events to the cache picture. It is not
// safe for concurrent use: one goroutine (the Subscriber's) applies; Counts
// may be read from any.
type Applier struct {
	model     Picture
	id        int
	blockSize int
	maxBlocks int
	onLoRA    func(string)

	keys     keyIndex // engine block hash → router key, of the blocks the engine holds
	lastLoRA string
	buf      []blockhash.Block
	extra    [][]byte
	hbuf     [8]byte
	at       []place // each block's parent in buf, store's
	// seen remembers where the blocks the engine stored lately sit in
	// their chain, by engine hash, after they are removed too. An engine
	// hashes a block by its content and its place, so one it stores again
	// under a hash seen before is that block again: llm-d's simulator,
	// refilling holes its eviction left in a chain, lists those blocks
	// with the new ones after its last cached block and names that block
	// as the parent of all (pkg/kv-cache/block_cache.go startRequest);
	// chained after it they would be keyed wrong and lost.
	seen  *lru.Cache[uint64, stored]
	rank  int   // the data-parallel rank followed; -1 any
	group int64 // the full-attention group's group_idx once seen; -1 before

	stored, removed, orphans, skipped, cleared, ignored atomic.Uint64
}

// place is a block's parent in the picture: a router key, or none (ok
// false: the chain's first block).
type place struct {
	key uint64
	ok  bool
}

// stored is where a block the engine stored sits: its router key and its
// parent.
type stored struct {
	key    uint64
	parent place
}

// seenBlocks bounds Applier.seen: the blocks stored lately (3 MiB or so at most).
const seenBlocks = 1 << 15

// NewApplier returns an Applier for replica id of model, whose engine
// caches blocks of blockSize tokens (the router's precise block size:
// events of another size are skipped). onLoRA, if set, hears every LoRA
// adapter named by a stored block. maxBlocks ≤ 0 means DefaultMaxBlocks.
func NewApplier(model Picture, id, blockSize, maxBlocks int, onLoRA func(string)) *Applier {
	if maxBlocks <= 0 {
		maxBlocks = DefaultMaxBlocks
	}
	seen, _ := lru.New[uint64, stored](seenBlocks) // only a size ≤ 0 fails
	return &Applier{model: model, id: id, blockSize: blockSize, maxBlocks: maxBlocks, onLoRA: onLoRA, keys: newKeyIndex(), seen: seen, rank: -1, group: -1}
}

// FollowRank makes the Applier apply only the batches of one data-parallel
// rank (vLLM puts data_parallel_rank in each batch; a batch without one is
// applied); rank < 0 applies every batch. Call it before Apply.
func (a *Applier) FollowRank(rank int) { a.rank = rank }

// Counts returns the counters.
func (a *Applier) Counts() Counts {
	return Counts{Stored: a.stored.Load(), Removed: a.removed.Load(), Orphans: a.orphans.Load(), Skipped: a.skipped.Load(), Cleared: a.cleared.Load(), Ignored: a.ignored.Load()}
}

// Tracked returns the engine blocks tracked now.
func (a *Applier) Tracked() int { return a.keys.Len() }

// Reset forgets the replica's picture and every key: the events no longer
// describe the engine (a restart, a gap replay could not fill).
func (a *Applier) Reset() {
	a.model.Clear(a.id)
	a.keys = newKeyIndex()
	a.seen.Purge() // a restarted engine may hash with another seed
	a.cleared.Add(1)
}

// Apply applies a batch, at now (nanoseconds on the picture's clock).
func (a *Applier) Apply(b *kvevents.Batch, now int64) {
	if a.rank >= 0 && b.DPRank != nil && *b.DPRank != a.rank {
		a.ignored.Add(uint64(len(b.Events)))
		return
	}
	for i := range b.Events {
		e := &b.Events[i]
		if e.Kind != kvevents.AllBlocksCleared && !a.fullAttention(e) {
			a.ignored.Add(1)
			continue
		}
		switch e.Kind {
		case kvevents.BlockStored:
			a.store(e, now)
		case kvevents.BlockRemoved:
			cpu := isCPU(e.Medium)
			for _, h := range e.BlockHashes {
				k, ok := a.keys.Get(h)
				if !ok {
					continue
				}
				if _, left := a.model.Remove(a.id, k, cpu); !left {
					a.keys.Delete(h)
				}
				a.removed.Add(1)
			}
		case kvevents.AllBlocksCleared:
			a.Reset()
		}
	}
}

// fullAttention reports whether an event is of the KV cache group whose
// blocks are a reusable prefix. vLLM (vllm/distributed/kv_events.py) tags
// each event with its group's group_idx and, on BlockStored,
// kv_cache_spec_kind: "full_attention", "mla_attention" and
// "sink_full_attention" hold every token's KV; "sliding_window",
// "sliding_window_mla", "mamba" and "unknown" do not, and a hybrid model's
// prefix is reusable only as far as its full-attention group holds it. The
// group of the first full-attention BlockStored is followed; before one
// is seen, and from engines that send no group, only group 0 (or none).
func (a *Applier) fullAttention(e *kvevents.Event) bool {
	switch e.SpecKind {
	case "":
	case "full_attention", "mla_attention", "sink_full_attention":
		if a.group < 0 && e.HasGroupIdx {
			a.group = e.GroupIdx
		}
	default:
		return false
	}
	if !e.HasGroupIdx {
		return true
	}
	if a.group >= 0 {
		return e.GroupIdx == a.group
	}
	return e.GroupIdx == 0
}

// isCPU reports whether a medium is a slower tier than the GPU: vLLM names
// the GPU "GPU" (None in older versions) and its offloading "CPU"; SGLang
// sends "GPU", "CPU_PINNED" and "EXTERNAL" (a storage backend); connectors
// name disks their own way. Anything but the GPU is a slower copy.
func isCPU(medium string) bool {
	return medium != "" && !strings.EqualFold(medium, "GPU")
}

// store applies a BlockStored event: keys its blocks after their parent
// and stores them in the picture.
func (a *Applier) store(e *kvevents.Event, now int64) {
	n := len(e.BlockHashes)
	if n == 0 {
		return
	}
	if int(e.BlockSize) != a.blockSize || len(e.TokenIDs) != n*a.blockSize {
		a.skipped.Add(1)
		return
	}
	parent, ok := a.parent(e)
	if !ok {
		a.orphans.Add(uint64(n))
		return
	}
	extra, ok := e.BlockExtraKeys(a.extra[:0])
	a.extra = extra
	if !ok {
		a.skipped.Add(1)
		return
	}
	a.noteLoRA(e.LoraName)
	a.keyBlocks(e, parent, extra)
	a.storeRuns(e.BlockHashes, isCPU(e.Medium), now)
	if a.keys.Len() > a.maxBlocks {
		a.Reset()
	}
}

// parent returns the place of the event's parent block: none when it has
// none, false when the picture does not know it.
func (a *Applier) parent(e *kvevents.Event) (place, bool) {
	if !e.HasParent {
		return place{}, true
	}
	if p, ok := a.keys.Get(e.ParentHash); ok {
		return place{p, true}, true
	}
	// No parent: llm-d's simulator sends 0 (its EmptyBlockHash) where
	// vLLM sends None, in its positional format
	// (pkg/kv-cache/kv_cache_sender.go). An engine block hash of 0 the
	// picture does not know is read as that.
	return place{}, e.ParentHash == 0
}

// noteLoRA tells onLoRA of the adapter a stored block names, when it is
// another than the last one told.
func (a *Applier) noteLoRA(lora string) {
	if lora != "" && lora != a.lastLoRA {
		a.lastLoRA = lora
		if a.onLoRA != nil {
			a.onLoRA(lora)
		}
	}
}

// keyBlocks keys each of the event's blocks after the one before it, from
// parent on, into a.buf, and puts each one's parent in a.at; a block
// stored before in another place of the chain keeps that place (see seen).
func (a *Applier) keyBlocks(e *kvevents.Event, parent place, extra [][]byte) {
	bl, at := a.buf[:0], a.at[:0]
	cursor := parent
	for j, hash := range e.BlockHashes {
		h := a.blockKey(cursor, e.LoraName, e.TokenIDs[j*a.blockSize:(j+1)*a.blockSize], extra[j])
		from := cursor
		if was, ok := a.seen.Peek(hash); ok && was.parent != cursor {
			h, from = was.key, was.parent // a hole refilled: its own place; the chain goes on from the cursor
		} else {
			cursor = place{h, true}
		}
		bl = append(bl, blockhash.Block{Hash: h, Tokens: int32(a.blockSize), Kind: blockhash.KindOther})
		at = append(at, from)
	}
	a.buf, a.at = bl, at
}

// blockKey returns the router key of a block of tokens after parent (the
// LoRA adapter's seed for the first block), with extra, what vLLM hashed
// besides the tokens, if any.
func (a *Applier) blockKey(parent place, lora string, tokens []uint32, extra []byte) uint64 {
	h := parent.key
	if !parent.ok {
		h = blockhash.TokenSeed(lora)
	}
	h = blockhash.TokenBlockHash(h, tokens)
	if extra != nil {
		// What vLLM hashed besides the tokens (images, cache_salt):
		// such a block is another block than the same tokens without
		// it, and requests, keyed by their tokens alone, never match it.
		var d xxhash.Digest
		d.Reset()
		_, _ = d.Write(extra)
		_, _ = d.Write(binary.LittleEndian.AppendUint64(a.hbuf[:0], h))
		h = d.Sum64()
	}
	return h
}

// storeRuns stores the keyed blocks (a.buf, their parents a.at, their
// engine hashes hashes) in the picture, each run of blocks that follow one
// another at once, and remembers the keys of those stored.
func (a *Applier) storeRuns(hashes []uint64, cpu bool, now int64) {
	bl, at := a.buf, a.at
	for i := 0; i < len(bl); {
		j := i + 1
		for j < len(bl) && at[j] == (place{bl[j-1].Hash, true}) {
			j++
		}
		if ok, _ := a.model.Store(a.id, at[i].key, at[i].ok, bl[i:j], cpu, now); !ok {
			a.orphans.Add(uint64(j - i)) // the parent left the picture (evicted there)
		} else {
			for k := i; k < j; k++ {
				a.keys.Put(hashes[k], bl[k].Hash)
				a.seen.Add(hashes[k], stored{bl[k].Hash, at[k]})
			}
			a.stored.Add(uint64(j - i))
		}
		i = j
	}
}
