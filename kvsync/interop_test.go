package kvsync_test

import (
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/kvsync"
)

func applier(t *testing.T) (*cachemodel.Model, int, *kvsync.Applier) {
	t.Helper()
	model := cachemodel.New(cachemodel.Options{})
	id, _ := model.AddReplica("r", 0)
	return model, id, kvsync.NewApplier(model, id, 16, 0, nil)
}

func apply(a *kvsync.Applier, evs ...kvevents.Event) {
	a.Apply(&kvevents.Batch{Events: evs}, 1)
}

// llm-d's simulator, in its positional format, sends parent 0 for a
// chain's first block where vLLM sends None: both start a chain.
func TestParentZeroStartsAChain(t *testing.T) {
	model, id, a := applier(t)
	zero := uint64(0)
	apply(a, chainEvent([]uint64{7, 8}, &zero, 0))
	if got := model.Match(blocksOf(0, 2), nil, nil)[id].Blocks; got != 2 || a.Counts().Orphans != 0 {
		t.Fatalf("matched %d blocks, %+v", got, a.Counts())
	}
	// A parent the picture does not know, other than 0, is still an orphan.
	missing := uint64(99)
	apply(a, chainEvent([]uint64{9}, &missing, 32))
	if a.Counts().Orphans != 1 {
		t.Fatalf("%+v", a.Counts())
	}
}

// Only the full-attention group's blocks are a reusable prefix; another
// data-parallel rank's batches are another engine's.
func TestGroupsAndRanks(t *testing.T) {
	model, id, a := applier(t)
	sw := chainEvent([]uint64{1, 2}, nil, 0)
	sw.SpecKind, sw.GroupIdx, sw.HasGroupIdx = "sliding_window", 0, true
	full := chainEvent([]uint64{11, 12}, nil, 0)
	full.SpecKind, full.GroupIdx, full.HasGroupIdx = "full_attention", 1, true
	apply(a, sw, full)
	if got := model.Match(blocksOf(0, 2), nil, nil)[id].Blocks; got != 2 || a.Counts().Ignored != 1 || a.Tracked() != 2 {
		t.Fatalf("matched %d, tracked %d, %+v", got, a.Tracked(), a.Counts())
	}
	// The sliding-window group's removal of the same tokens' blocks does
	// not touch the full-attention group's.
	apply(a, kvevents.Event{Kind: kvevents.BlockRemoved, BlockHashes: []uint64{1, 2}, GroupIdx: 0, HasGroupIdx: true})
	if got := model.Match(blocksOf(0, 2), nil, nil)[id].Blocks; got != 2 {
		t.Fatalf("a sliding-window removal took %d blocks away", 2-got)
	}
	a.FollowRank(1)
	zero, one := 0, 1
	other := chainEvent([]uint64{21}, nil, 5000)
	a.Apply(&kvevents.Batch{DPRank: &zero, Events: []kvevents.Event{other}}, 2)
	if model.Match(blocksOf(5000, 1), nil, nil)[id].Blocks != 0 {
		t.Fatal("rank 0's batch applied to rank 1's picture")
	}
	a.Apply(&kvevents.Batch{DPRank: &one, Events: []kvevents.Event{other}}, 2)
	if model.Match(blocksOf(5000, 1), nil, nil)[id].Blocks != 1 {
		t.Fatal("rank 1's batch not applied")
	}
}

// A block whose extra keys hold more than the adapter's name (an image's
// hash, a cache_salt) is another block than its tokens alone; one whose
// extra keys are only the adapter's name is the adapter's block.
func TestExtraKeys(t *testing.T) {
	model, id, a := applier(t)
	salted := chainEvent([]uint64{1, 2}, nil, 0)
	// [["salt-1"], None]
	salted.ExtraKeys = []byte{0x92, 0x91, 0xa6, 's', 'a', 'l', 't', '-', '1', 0xc0}
	apply(a, salted)
	if got := model.Match(blocksOf(0, 2), nil, nil)[id].Blocks; got != 0 || a.Tracked() != 2 {
		t.Fatalf("a salted block matched an unsalted request: %d blocks, tracked %d", got, a.Tracked())
	}
	_, _, b := applier(t)
	bad := chainEvent([]uint64{1, 2}, nil, 0)
	bad.ExtraKeys = []byte{0x91, 0xc0} // one entry for two blocks
	apply(b, bad)
	if b.Counts().Skipped != 1 || b.Tracked() != 0 {
		t.Fatalf("%+v", b.Counts())
	}
	model2, id2, c := applier(t)
	lora := chainEvent([]uint64{1}, nil, 0)
	lora.LoraName = "ad"
	lora.ExtraKeys = []byte{0x91, 0x91, 0xa2, 'a', 'd'} // [["ad"]]
	apply(c, lora)
	ids := make([]int32, 17)
	for i := range ids {
		ids[i] = int32(i)
	}
	adapter, _ := blockhash.AppendTokenBlocks(nil, blockhash.TokenSeed("ad"), ids, 16, nil)
	if got := model2.Match(adapter, nil, nil)[id2].Blocks; got != 1 {
		t.Fatalf("an adapter's block whose extra keys name only the adapter: matched %d blocks, %+v", got, c.Counts())
	}
}

// llm-d's simulator refills a hole its eviction left in a chain by storing
// the evicted block again together with the new blocks after its last
// cached one, all under that block as parent: the refilled block is keyed
// in its own place again, the new ones after the parent, and the whole
// prefix matches.
func TestHoleRefilledInItsPlace(t *testing.T) {
	model, id, a := applier(t)
	apply(a, chainEvent([]uint64{10, 11, 12, 13}, nil, 0)) // blocks 0-3
	apply(a, kvevents.Event{Kind: kvevents.BlockRemoved, BlockHashes: []uint64{11}})
	if got := model.Match(blocksOf(0, 4), nil, nil)[id].Blocks; got != 1 {
		t.Fatalf("after the hole: %d blocks match", got)
	}
	// [block 1 (the hole), block 4, block 5], parent block 3.
	refill := kvevents.Event{Kind: kvevents.BlockStored, BlockHashes: []uint64{11, 14, 15}, BlockSize: 16, ParentHash: 13, HasParent: true}
	for _, base := range []int{16, 64, 80} {
		for i := range 16 {
			refill.TokenIDs = append(refill.TokenIDs, uint32(base+i))
		}
	}
	apply(a, refill)
	if got := model.Match(blocksOf(0, 6), nil, nil)[id].Blocks; got != 6 || a.Counts().Orphans != 0 {
		t.Fatalf("after the refill: %d of 6 blocks match, %+v", got, a.Counts())
	}
}
