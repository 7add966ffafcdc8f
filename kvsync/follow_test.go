package kvsync_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/kvsync"
	"github.com/semroute/semroute/simreplica"
	"github.com/semroute/semroute/tokenizer"
)

// chatBody is one request of a small mixed workload: a few system
// prompts with tools, shared documents, multi-turn histories.
func chatBody(i int) []byte {
	sys := fmt.Sprintf("You are assistant %d. Answer briefly and cite the documents you use. ", i%3)
	sys += strings.Repeat(fmt.Sprintf("rule %d of policy %d applies; ", i%3, i%3), 20)
	msgs := []map[string]string{{"role": "system", "content": sys}}
	if i%2 == 0 {
		msgs = append(msgs, map[string]string{"role": "user", "content": "Document: " + strings.Repeat(fmt.Sprintf("fact %d about topic %d. ", i%4, i%4), 30)})
		msgs = append(msgs, map[string]string{"role": "assistant", "content": "Read."})
	}
	for turn := 0; turn < i%4; turn++ {
		msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("question %d of session %d", turn, i%5)},
			map[string]string{"role": "assistant", "content": fmt.Sprintf("answer %d of session %d", turn, i%5)})
	}
	msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("new question number %d", i)})
	body := map[string]any{"model": "sim-model", "max_tokens": 2, "messages": msgs}
	if i%3 == 1 {
		body["tools"] = []any{map[string]any{"type": "function", "function": map[string]any{"name": "search", "description": strings.Repeat("searches the corpus ", 10)}}}
	}
	b, _ := json.Marshal(body)
	return b
}

func send(t *testing.T, url string, body []byte) (prompt, cached int) {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Usage struct {
			Prompt  int `json:"prompt_tokens"`
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out.Usage.Prompt, out.Usage.Details.Cached
}

// TestPictureIsTheEnginesCache: a replica's picture built only from its
// KV events, looked up with the engine's own tokens, predicts exactly the
// cached tokens the engine then reports, request after request, while the
// engine's small cache evicts.
func TestPictureIsTheEnginesCache(t *testing.T) {
	var events atomic.Int64
	sim, err := simreplica.Start(simreplica.Options{
		Overhead: time.Microsecond, PrefillPerToken: time.Nanosecond, InterToken: time.Microsecond, NumBlocks: 96,
		KVEvents:  &kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv-events"},
		OnKVEvent: func(simreplica.KVEvent) { events.Add(1) },
	}, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	model := cachemodel.New(cachemodel.Options{})
	id, _ := model.AddReplica("sim", 96*16)
	pub, replay := sim.KVEventsEndpoints()
	f, err := kvsync.Follow(kvsync.Options{Model: model, ID: id, Name: "sim", Endpoint: pub, ReplayEndpoint: replay, Topic: "kv-events", BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	testwait.Until(t, "subscribed", sim.KVEventsSubscribed)
	tok, err := tokenizer.New(tokenizer.Options{URL: sim.URL, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var predicted, reported, hits int
	for i := range 60 {
		body := chatBody(i)
		ids, err := tok.Body(context.Background(), blockhash.Chat, "sim-model", body)
		if err != nil {
			t.Fatal(err)
		}
		blocks, _ := blockhash.AppendTokenBlocks(nil, blockhash.TokenSeed(""), ids, 16, nil)
		want := model.Match(blocks, nil, nil)[id].Tokens
		prompt, cached := send(t, sim.URL, body)
		if prompt != len(ids) {
			t.Fatalf("request %d: /tokenize gave %d ids, the engine counted %d", i, len(ids), prompt)
		}
		if want != cached {
			t.Errorf("request %d: picture predicted %d cached tokens, engine reported %d", i, want, cached)
		}
		predicted, reported = predicted+want, reported+cached
		if cached > 0 {
			hits++
		}
		testwait.Until(t, "events applied", func() bool { return int64(f.Stats().Subscriber.Applied) == events.Load() })
	}
	st := f.Stats()
	if hits < 20 || st.Removed == 0 || !st.Live {
		t.Fatalf("workload too easy: %d hits, %+v", hits, st)
	}
	if ms, _ := model.Stats(id); ms.Blocks != int64(sim.CachedBlocks()) || st.Tracked != sim.CachedBlocks() {
		t.Fatalf("picture holds %d blocks (%d tracked), engine %d", ms.Blocks, st.Tracked, sim.CachedBlocks())
	}
	t.Logf("predicted %d, reported %d cached tokens over 60 requests; %+v", predicted, reported, st)
}

// chainEvent is a BlockStored of n blocks of ids from base, after parent.
func chainEvent(hashes []uint64, parent *uint64, base int) kvevents.Event {
	e := kvevents.Event{Kind: kvevents.BlockStored, BlockHashes: hashes, BlockSize: 16, Medium: "GPU"}
	for i := range 16 * len(hashes) {
		e.TokenIDs = append(e.TokenIDs, uint32(base+i))
	}
	if parent != nil {
		e.ParentHash, e.HasParent = *parent, true
	}
	return e
}

func blocksOf(base, n int) []blockhash.Block {
	ids := make([]int32, 16*n+1)
	for i := range ids {
		ids[i] = int32(base + i)
	}
	bl, _ := blockhash.AppendTokenBlocks(nil, blockhash.TokenSeed(""), ids, 16, nil)
	return bl
}

// TestEventFaults: a gap is filled from replay; a restart clears the
// picture; malformed payloads are counted and skipped; silence while
// routed blocks go unconfirmed falls back to the approximate picture, and
// the next batch makes it live again.
func TestEventFaults(t *testing.T) {
	p, err := kvevents.NewPublisher(kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	model := cachemodel.New(cachemodel.Options{PendingTTL: 50 * time.Millisecond})
	id, _ := model.AddReplica("r", 0)
	f, err := kvsync.Follow(kvsync.Options{Model: model, ID: id, Name: "r", Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint(),
		BlockSize: 16, Silence: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	testwait.Until(t, "subscribed", p.Subscribed)
	matched := func(bl []blockhash.Block) int { return model.Match(bl, nil, nil)[id].Blocks }
	a := blocksOf(0, 4)
	one := uint64(101)
	p.Publish(kvevents.Batch{Events: []kvevents.Event{chainEvent([]uint64{100, 101}, nil, 0)}})
	p.Drop(kvevents.Batch{Events: []kvevents.Event{chainEvent([]uint64{102, 103}, &one, 32)}}) // lost on the way
	p.PublishRaw([]byte{0xc1, 0x00})                                                           // malformed
	p.Publish(kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.BlockRemoved, BlockHashes: []uint64{999}, Medium: "GPU"}}})
	testwait.Until(t, "the gap filled from replay", func() bool { return matched(a) == 4 })
	// The malformed payload is counted once it is decoded, which may come
	// after the gap it revealed is filled.
	testwait.Until(t, "the malformed payload counted", func() bool { return f.Stats().Subscriber.Malformed > 0 })
	st := f.Stats()
	if st.Subscriber.Gaps == 0 || st.Subscriber.Replayed == 0 || st.Subscriber.Malformed == 0 || st.Subscriber.Resets != 0 {
		t.Fatalf("stats after gap and malformed payload: %+v", st.Subscriber)
	}
	// Restart: the sequence starts over; the picture is cleared.
	p.Restart()
	p.Publish(kvevents.Batch{Events: []kvevents.Event{chainEvent([]uint64{200}, nil, 1000)}})
	// The restart is seen in the batch after it: the picture is cleared,
	// then that batch applied; wait for both, not the first alone.
	testwait.Until(t, "the restart cleared the picture and the batch after it applied", func() bool {
		return matched(a) == 0 && f.Stats().Cleared > 0 && matched(blocksOf(1000, 1)) == 1
	})
	// Silence: routed blocks go unconfirmed and no batch comes.
	model.Record(id, blocksOf(5000, 3), time.Now().UnixNano())
	testwait.Until(t, "fallback to the approximate picture", func() bool { return !f.Stats().Live && !model.EventDriven(id) })
	if f.Stats().Fallbacks != 1 {
		t.Fatalf("fallbacks %d", f.Stats().Fallbacks)
	}
	p.Publish(kvevents.Batch{Events: []kvevents.Event{chainEvent([]uint64{300}, nil, 2000)}})
	testwait.Until(t, "live again", func() bool { return f.Stats().Live && model.EventDriven(id) })
}

// TestTrackedBlocksBounded: an engine that only ever stores is reset at
// MaxBlocks rather than grow without bound.
func TestTrackedBlocksBounded(t *testing.T) {
	model := cachemodel.New(cachemodel.Options{})
	id, _ := model.AddReplica("r", 0)
	a := kvsync.NewApplier(model, id, 16, 100, nil)
	for i := range 300 {
		b := kvevents.Batch{Events: []kvevents.Event{chainEvent([]uint64{uint64(i + 1)}, nil, 16*i)}}
		a.Apply(&b, int64(i))
		if a.Tracked() > 100 {
			t.Fatalf("%d blocks tracked, bound 100", a.Tracked())
		}
	}
	if a.Counts().Cleared == 0 {
		t.Fatal("never reset")
	}
}
