package simreplica

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/kvevents"
)

// TestKVEventsOverZMQ: a replica with KV events on publishes them over ZMQ
// as vLLM does; a subscriber that applies them (stored adds, removed
// deletes, cleared empties) holds exactly the replica's cached blocks, and
// a restart reaches it as AllBlocksCleared.
func TestKVEventsOverZMQ(t *testing.T) {
	o := fast
	o.NumBlocks = 64 // small, so that later prompts evict earlier ones
	o.KVEvents = &kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv-events"}
	r := start(t, o)
	pub, replay := r.KVEventsEndpoints()
	if !strings.HasPrefix(pub, "tcp://127.0.0.1:") || !strings.HasPrefix(replay, "tcp://127.0.0.1:") {
		t.Fatalf("endpoints %q %q", pub, replay)
	}
	var mu sync.Mutex
	held := map[uint64]bool{}
	var stored, removed, cleared int
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberOptions{Endpoint: pub, ReplayEndpoint: replay, Topic: "kv-events",
		OnBatch: func(_ uint64, b kvevents.Batch) {
			mu.Lock()
			defer mu.Unlock()
			for _, ev := range b.Events {
				switch ev.Kind {
				case kvevents.BlockStored:
					stored++
					if ev.BlockSize != 16 || len(ev.TokenIDs) != 16*len(ev.BlockHashes) || ev.Medium != "GPU" {
						t.Errorf("stored event %+v", ev)
					}
					for _, h := range ev.BlockHashes {
						held[h] = true
					}
				case kvevents.BlockRemoved:
					removed++
					for _, h := range ev.BlockHashes {
						delete(held, h)
					}
				case kvevents.AllBlocksCleared:
					cleared++
					clear(held)
				}
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	testwait.Until(t, "the subscription", r.kv.pub.Subscribed)
	for i := range 12 { // 12 × ~28 blocks: more than 64, so some are evicted
		call(t, r, "/v1/completions", fmt.Sprintf(`{"model":"sim-model","max_tokens":1,"prompt":%q}`, strings.Repeat(fmt.Sprint("prompt ", i, " "), 200)))
	}
	wait := func(what string, ok func() bool) {
		t.Helper()
		testwait.Until(t, what, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return ok()
		})
	}
	wait("the subscriber holds what the cache holds", func() bool { return removed > 0 && len(held) == r.CachedBlocks() })
	mu.Lock()
	t.Logf("%d stored and %d removed events; %d blocks held, as the cache", stored, removed, len(held))
	mu.Unlock()
	r.Restart()
	wait("the restart cleared the subscriber's picture", func() bool { return cleared == 1 && len(held) == 0 })
}
