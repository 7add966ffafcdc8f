package simreplica

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
)

// recorder keeps the KV events a replica reports.
type recorder struct {
	mu     sync.Mutex
	events []KVEvent
}

func (rc *recorder) hook(ev KVEvent) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rc.events = append(rc.events, ev)
}

// take returns the events since the last take.
func (rc *recorder) take() []KVEvent {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	ev := rc.events
	rc.events = nil
	return ev
}

// chain returns the block hashes of the full blocks of ids under model.
func chain(model string, ids []int32) []uint64 {
	var out []uint64
	h := RootHash(model)
	for off := 0; off+16 <= len(ids); off += 16 {
		h = BlockHash(h, ids[off:off+16])
		out = append(out, h)
	}
	return out
}

func completionBody(model, prompt string) string {
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": 1})
	return string(b)
}

func TestKVEventsStored(t *testing.T) {
	var rc recorder
	o := words
	o.OnKVEvent = rc.hook
	r := start(t, o)
	doc := strings.Repeat(englishProse+"\n", 4)
	idsOf := func(prompt string) []int32 {
		b, _ := json.Marshal(map[string]any{"prompt": prompt})
		return mustTokenize(t, r, string(b)).Tokens
	}
	a, b := idsOf(doc+" First question?"), idsOf(doc+" Another, longer question about the keeper and the lamp?")
	ha, hb := chain("sim-model", a), chain("sim-model", b)
	shared := 0
	for shared < len(ha) && ha[shared] == hb[shared] {
		shared++
	}
	if shared < 20 || shared == len(hb) {
		t.Fatalf("the prompts share %d of %d blocks", shared, len(hb))
	}
	ptr := func(h uint64) *uint64 { return &h }
	for _, tc := range []struct {
		name, model, prompt string
		want                []KVEvent
	}{
		{"first prompt: all its full blocks, no parent", "sim-model", doc + " First question?", []KVEvent{{
			Type: BlockStored, BlockHashes: ha, TokenIDs: a[:len(ha)*16], BlockSize: 16, Medium: MediumGPU}}},
		{"the same prompt: nothing new", "sim-model", doc + " First question?", nil},
		{"a longer prompt sharing a prefix: only the new blocks, parented", "sim-model", doc + " Another, longer question about the keeper and the lamp?", []KVEvent{{
			Type: BlockStored, BlockHashes: hb[shared:], ParentBlockHash: ptr(hb[shared-1]), TokenIDs: b[shared*16 : len(hb)*16],
			BlockSize: 16, Medium: MediumGPU}}},
		{"under a LoRA: other blocks, with its name and id", "sql-lora", doc + " First question?", []KVEvent{{
			Type: BlockStored, BlockHashes: chain("sql-lora", a), TokenIDs: a[:len(ha)*16], BlockSize: 16,
			LoRAID: 1, LoRAName: "sql-lora", Medium: MediumGPU}}},
		{"a prompt under a block: nothing", "sim-model", "Short.", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if code, _, body := call(t, r, "/v1/completions", completionBody(tc.model, tc.prompt)); code != 200 {
				t.Fatalf("%d %s", code, body)
			}
			if got := rc.take(); !eventsEqual(got, tc.want) {
				t.Fatalf("events\n got %s\nwant %s", fmtEvents(got), fmtEvents(tc.want))
			}
		})
	}
	if hl := chain("sql-lora", a); hl[0] == ha[0] {
		t.Fatal("the LoRA's first block hashes as the base model's")
	}
	r.DropCache()
	if got := rc.take(); !eventsEqual(got, []KVEvent{{Type: AllBlocksCleared}}) {
		t.Fatalf("DropCache: %s", fmtEvents(got))
	}
	r.Restart()
	if got := rc.take(); !eventsEqual(got, []KVEvent{{Type: AllBlocksCleared}}) {
		t.Fatalf("Restart: %s", fmtEvents(got))
	}
	// After the clear, the first prompt is stored again whole.
	call(t, r, "/v1/completions", completionBody("sim-model", doc+" First question?"))
	if got := rc.take(); len(got) != 1 || got[0].Type != BlockStored || !slices.Equal(got[0].BlockHashes, ha) || got[0].ParentBlockHash != nil {
		t.Fatalf("after the clear: %s", fmtEvents(got))
	}
}

// TestKVEventsEvictions: with a small cache, a prompt's new blocks evict
// the least recently used ones, the tail of the older prompt first; the
// BlockRemoved comes before the BlockStored that caused it.
func TestKVEventsEvictions(t *testing.T) {
	var rc recorder
	o := words
	o.NumBlocks = 48
	o.OnKVEvent = rc.hook
	r := start(t, o)
	pa, pb := routerProse("alpha", 700), routerProse("beta", 700) // about 30 blocks each
	ia := mustTokenize(t, r, fmt.Sprintf(`{"prompt":%q}`, pa)).Tokens
	ib := mustTokenize(t, r, fmt.Sprintf(`{"prompt":%q}`, pb)).Tokens
	ha, hb := chain("sim-model", ia), chain("sim-model", ib)
	if len(ha)+len(hb) <= 48 || len(hb) > 48 {
		t.Fatalf("%d + %d blocks for a cache of 48", len(ha), len(hb))
	}
	call(t, r, "/v1/completions", completionBody("sim-model", pa))
	rc.take()
	call(t, r, "/v1/completions", completionBody("sim-model", pb))
	got := rc.take()
	over := len(ha) + len(hb) - 48
	want := []KVEvent{
		{Type: BlockRemoved, BlockHashes: reversed(ha[len(ha)-over:]), Medium: MediumGPU},
		{Type: BlockStored, BlockHashes: hb, TokenIDs: ib[:len(hb)*16], BlockSize: 16, Medium: MediumGPU},
	}
	if !eventsEqual(got, want) {
		t.Fatalf("events\n got %s\nwant %s", fmtEvents(got), fmtEvents(want))
	}
	// The head of the first prompt is still cached, and the usage says so.
	if _, u, _ := call(t, r, "/v1/completions", completionBody("sim-model", pa)); u.Details.Cached != (len(ha)-over)*16 {
		t.Fatalf("first prompt again: %+v, want %d cached", u, (len(ha)-over)*16)
	}
}

func reversed(s []uint64) []uint64 {
	s = slices.Clone(s)
	slices.Reverse(s)
	return s
}

// TestKVEventsMirrorCache: a consumer that applies the events holds exactly
// the blocks the cache holds, after every request of a random mix of
// shared prefixes, under LRU pressure, with prompts larger than the cache.
func TestKVEventsMirrorCache(t *testing.T) {
	var rc recorder
	o := words
	o.NumBlocks = 40
	o.OnKVEvent = rc.hook
	r := start(t, o)
	mirror := map[uint64]bool{}
	rng := rand.New(rand.NewPCG(1, 2))
	prefixes := []string{routerProse("tenant 1", 200), routerProse("tenant 2", 400), routerProse("tenant 3", 100), routerProse("huge", 1200)}
	for i := range 60 {
		p := prefixes[rng.IntN(len(prefixes))] + routerProse(fmt.Sprintf("q%d", rng.IntN(5)), rng.IntN(200))
		model := "sim-model"
		if rng.IntN(4) == 0 {
			model = "sql-lora"
		}
		if code, _, body := call(t, r, "/v1/completions", completionBody(model, p)); code != 200 {
			t.Fatalf("request %d: %d %s", i, code, body)
		}
		if i == 30 {
			r.DropCache()
		}
		for _, ev := range rc.take() {
			switch ev.Type {
			case BlockStored:
				if len(ev.TokenIDs) != 16*len(ev.BlockHashes) || ev.BlockSize != 16 {
					t.Fatalf("request %d: %s", i, fmtEvents([]KVEvent{ev}))
				}
				for _, h := range ev.BlockHashes {
					if mirror[h] {
						t.Fatalf("request %d: block %x stored twice", i, h)
					}
					mirror[h] = true
				}
			case BlockRemoved:
				for _, h := range ev.BlockHashes {
					if !mirror[h] {
						t.Fatalf("request %d: block %x removed but never stored", i, h)
					}
					delete(mirror, h)
				}
			case AllBlocksCleared:
				clear(mirror)
			}
		}
		r.mu.Lock()
		keys := r.cache.Keys()
		r.mu.Unlock()
		if len(keys) != len(mirror) || r.CachedBlocks() != len(keys) {
			t.Fatalf("request %d: the cache holds %d blocks, the events say %d", i, len(keys), len(mirror))
		}
		for _, k := range keys {
			if !mirror[k] {
				t.Fatalf("request %d: cached block %x never reported", i, k)
			}
		}
	}
}

// TestKVEventsBytesTokenizer: the hooks work with the old tokenizer too,
// over its chunk ids.
func TestKVEventsBytesTokenizer(t *testing.T) {
	var rc recorder
	o := fast
	o.OnKVEvent = rc.hook
	r := start(t, o)
	call(t, r, "/v1/completions", completionBody("sim-model", strings.Repeat("abcd", 100)))
	got := rc.take()
	ids := mustTokenize(t, r, fmt.Sprintf(`{"prompt":%q}`, strings.Repeat("abcd", 100))).Tokens
	// "<|p|>" + 400 bytes: 102 tokens, 6 full blocks.
	if len(ids) != 102 || len(got) != 1 || !slices.Equal(got[0].BlockHashes, chain("sim-model", ids)) || len(got[0].BlockHashes) != 6 {
		t.Fatalf("%d ids, events %s", len(ids), fmtEvents(got))
	}
}

func eventsEqual(a, b []KVEvent) bool {
	return slices.EqualFunc(a, b, func(x, y KVEvent) bool {
		return x.Type == y.Type && slices.Equal(x.BlockHashes, y.BlockHashes) && slices.Equal(x.TokenIDs, y.TokenIDs) &&
			(x.ParentBlockHash == nil) == (y.ParentBlockHash == nil) && (x.ParentBlockHash == nil || *x.ParentBlockHash == *y.ParentBlockHash) &&
			x.BlockSize == y.BlockSize && x.LoRAID == y.LoRAID && x.LoRAName == y.LoRAName && x.Medium == y.Medium
	})
}

func fmtEvents(evs []KVEvent) string {
	var sb strings.Builder
	for _, ev := range evs {
		fmt.Fprintf(&sb, "\n  %s %d blocks", ev.Type, len(ev.BlockHashes))
		if len(ev.BlockHashes) > 0 {
			fmt.Fprintf(&sb, " [%x..%x]", ev.BlockHashes[0], ev.BlockHashes[len(ev.BlockHashes)-1])
		}
		if ev.ParentBlockHash != nil {
			fmt.Fprintf(&sb, " parent %x", *ev.ParentBlockHash)
		}
		fmt.Fprintf(&sb, " %d ids, size %d, lora %d %q, %s", len(ev.TokenIDs), ev.BlockSize, ev.LoRAID, ev.LoRAName, ev.Medium)
	}
	return sb.String()
}
