package simreplica

import (
	"slices"

	"github.com/cespare/xxhash/v2"
	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/kvevents"
)

// KVEventType is the kind of a KVEvent: vLLM's event tag, as package
// kvevents names it.
type KVEventType = kvevents.Kind

// The KV-cache events, named as vLLM names them
// (vllm/distributed/kv_events.py): BlockStored when full blocks newly
// enter the prefix cache, BlockRemoved when they leave it (evicted),
// AllBlocksCleared when it is emptied (Restart, DropCache), as vLLM reports
// a prefix-cache reset.
const (
	BlockStored      = kvevents.BlockStored
	BlockRemoved     = kvevents.BlockRemoved
	AllBlocksCleared = kvevents.AllBlocksCleared
)

// MediumGPU is the medium of every block the simulated replica caches, as
// vLLM's MEDIUM_GPU.
const MediumGPU = "GPU"

// KVEvent is one change of the prefix cache, carrying what vLLM's event of
// the same name carries:
//
//	BlockStored       block_hashes, parent_block_hash, token_ids, block_size,
//	                  lora_id, medium, lora_name
//	BlockRemoved      block_hashes, medium
//	AllBlocksCleared  nothing
//
// vLLM's extra_keys, per stored block, are (lora_name,) for an adapter's
// blocks and None otherwise, so they follow from LoRAName; group_idx and
// the kv_cache_spec fields are left unset (one KV-cache group, full
// attention). A batch's timestamp and sequence number are the publisher's.
//
// The slices are the event's own: a hook may keep them.
type KVEvent struct {
	Type KVEventType
	// BlockHashes are the blocks stored or removed. BlockStored lists the
	// newly stored full blocks of one prompt in prefix order: every block
	// after the first is the child of the one before it.
	BlockHashes []uint64
	// ParentBlockHash is the hash of the block before BlockHashes[0], nil
	// when BlockHashes[0] is the first block of its prompt
	// (BlockStored only).
	ParentBlockHash *uint64
	// TokenIDs are the token ids of the stored blocks, concatenated:
	// BlockSize of them per block (BlockStored only).
	TokenIDs []int32
	// BlockSize is the tokens per block (BlockStored only).
	BlockSize int
	// LoRAID is vLLM's lora_int_id: 1 + the adapter's index in
	// Options.LoRAs, 0 (vLLM: None) for the base model (BlockStored only).
	LoRAID int
	// LoRAName is the adapter's name, "" (None) for the base model
	// (BlockStored only).
	LoRAName string
	// Medium is MediumGPU (BlockStored, BlockRemoved).
	Medium string
}

// RootHash is the hash that chains before the first block of a prompt
// sent to model (the served name: the base model's or an adapter's), so
// that the same token ids under another model or adapter are other blocks,
// as vLLM's extra keys (the LoRA name) make them. It is xxhash64 of
// "simreplica\x00" + model.
func RootHash(model string) uint64 {
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString("simreplica\x00")
	_, _ = d.WriteString(model)
	return d.Sum64()
}

// BlockHash is the hash of a full block of token ids whose prefix hashes
// to parent (RootHash for a prompt's first block): xxhash64 of parent as 8
// little-endian bytes followed by each id as 4 little-endian bytes. It is
// the key of the prefix cache and the block hash of the KV events, chained
// as vLLM chains its block hashes (hash(parent, token ids, extra keys)).
func BlockHash(parent uint64, ids []int32) uint64 { return blockhash.TokenBlockHash(parent, ids) }

// storeLocked enters a finished prefill's blocks (keys, the chained hashes
// of the full blocks of ids) into the cache with s.mu held, and reports
// the changes to OnKVEvent: first BlockRemoved for what it evicted, then
// BlockStored for the blocks that were not cached, in prefix order.
//
// The blocks the prompt already had cached are refreshed first, so that
// its new blocks evict other prompts' blocks, not its own (a running
// request's blocks cannot be evicted in vLLM); then all are refreshed tail
// first, so the head of the prompt is the most recently used and outlives
// its tail, as in vLLM's free-block queue. The blocks other running
// requests use are not evicted: when too few others are free, only the
// prompt's head that fits is cached. It returns the keys cached, a prefix
// of keys.
func (s *Server) storeLocked(keys []uint64, ids []int32, m model) []uint64 {
	keys = keys[:s.roomLocked(keys)]
	hook := s.o.OnKVEvent
	var fresh []bool // fresh[i]: keys[i] was not cached before (hook only)
	if hook != nil {
		fresh = make([]bool, len(keys))
	}
	s.refreshLocked(keys, fresh)
	evicted := s.addLocked(keys)
	if hook != nil {
		s.reportLocked(hook, keys, ids, m, fresh, evicted)
	}
	return keys
}

// roomLocked returns how many of a prompt's blocks keys, from the first,
// the cache can hold beside the blocks other running requests use (their
// pins; the prompt's own pinned blocks count as its). s.mu must be held.
func (s *Server) roomLocked(keys []uint64) int {
	others := len(s.pins) // blocks in use, the prompt's own ones taken out below
	for _, k := range keys {
		if s.pins[k] > 0 {
			others--
		}
	}
	return min(len(keys), max(s.o.NumBlocks-others, 0))
}

// refreshLocked makes the blocks of keys the cache holds the most recently
// used, tail first, and marks in fresh (nil: not asked) those it does not
// hold. s.mu must be held.
func (s *Server) refreshLocked(keys []uint64, fresh []bool) {
	for i := len(keys) - 1; i >= 0; i-- {
		if _, ok := s.cache.Get(keys[i]); !ok && fresh != nil {
			fresh[i] = true
		}
	}
}

// addLocked adds the blocks of keys to the cache tail first, evicting the
// least recently used blocks no running request uses, and returns those it
// evicted, in order (s.evicted's memory: read them before the next call). A
// block finds no room when every cached block is in use, and is not
// cached. s.mu must be held.
func (s *Server) addLocked(keys []uint64) []uint64 {
	evicted := s.evicted[:0]
	for i := len(keys) - 1; i >= 0; i-- {
		k := keys[i]
		if !s.cache.Contains(k) && s.cache.Len() >= s.o.NumBlocks {
			old, ok := s.evictLocked()
			if !ok {
				continue // every block is in use: this one is not cached
			}
			evicted = append(evicted, old)
		}
		s.cache.Add(k, struct{}{})
	}
	s.evicted = evicted[:0]
	return evicted
}

// reportLocked tells hook what a store of keys (ids' full blocks, for m)
// changed, fresh marking the blocks it found uncached: BlockRemoved for
// the blocks it evicted, then one BlockStored for each run of newly cached
// blocks, in prefix order. s.mu must be held.
func (s *Server) reportLocked(hook func(KVEvent), keys []uint64, ids []int32, m model, fresh []bool, evicted []uint64) {
	if removed := removedBlocks(keys, fresh, evicted); len(removed) > 0 {
		hook(KVEvent{Type: BlockRemoved, BlockHashes: removed, Medium: MediumGPU})
	}
	bs := s.o.BlockSize
	stored := func(i int) bool { return fresh[i] && s.cache.Contains(keys[i]) }
	for i := 0; i < len(keys); {
		if !stored(i) {
			i++
			continue
		}
		j := i + 1
		for j < len(keys) && stored(j) {
			j++
		}
		ev := KVEvent{
			Type: BlockStored, BlockHashes: slices.Clone(keys[i:j]), TokenIDs: slices.Clone(ids[i*bs : j*bs]),
			BlockSize: bs, LoRAID: m.loraID, LoRAName: m.lora, Medium: MediumGPU,
		}
		if i > 0 {
			p := keys[i-1]
			ev.ParentBlockHash = &p
		}
		hook(ev)
		i = j
	}
}

// removedBlocks returns the blocks of evicted to report removed: those
// cached before the store of keys. A block of the prompt added and evicted
// within the store (a prompt larger than the cache) was never reported
// stored and is not reported; one of its cached blocks evicted and added
// again is marked fresh, to be reported stored again after its removal.
func removedBlocks(keys []uint64, fresh []bool, evicted []uint64) []uint64 {
	index := make(map[uint64]int, len(keys))
	for i, k := range keys {
		index[k] = i
	}
	var removed []uint64
	for _, k := range evicted {
		if i, ours := index[k]; ours {
			if fresh[i] {
				continue
			}
			fresh[i] = true
		}
		removed = append(removed, k)
	}
	return removed
}
