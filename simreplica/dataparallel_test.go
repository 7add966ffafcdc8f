package simreplica

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/kvevents"
)

// post sends body to url+path with the rank header (none if rank < 0)
// and returns the status and the cached tokens it reports.
func postRank(t *testing.T, url, path string, rank int, body string) (int, int) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if rank >= 0 {
		req.Header.Set(HeaderDataParallelRank, fmt.Sprint(rank))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var out struct {
		Usage usage `json:"usage"`
	}
	_ = json.Unmarshal(b, &out)
	return resp.StatusCode, out.Usage.Details.Cached
}

// An engine of 3 data-parallel ranks, as vLLM serves one: each rank its
// own cache (a prompt cached on rank 1 is not on rank 2), a request's rank
// from its header (out of range: 400), every rank's gauges on /metrics
// labelled by engine, each rank's KV events with its data_parallel_rank.
func TestDataParallelRanks(t *testing.T) {
	o := fast
	o.KVEvents = &kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0"}
	r, err := StartDataParallel(o, 3, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	var mu sync.Mutex
	ranks := map[int]int{} // rank → stored blocks heard
	for k := range 3 {
		pub, _ := r.Rank(k).KVEventsEndpoints()
		sub, err := kvevents.NewSubscriber(kvevents.SubscriberOptions{Endpoint: pub, OnBatch: func(_ uint64, b kvevents.Batch) {
			mu.Lock()
			defer mu.Unlock()
			if b.DPRank == nil {
				t.Errorf("rank %d's batch has no data_parallel_rank", k)
				return
			}
			for _, ev := range b.Events {
				ranks[*b.DPRank] += len(ev.BlockHashes)
			}
		}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sub.Close() })
		testwait.Until(t, fmt.Sprint("rank ", k, "'s subscription"), r.Rank(k).kv.pub.Subscribed)
	}
	body := `{"model":"sim-model","max_tokens":1,"prompt":"` + strings.Repeat("the same long prompt ", 40) + `"}`
	if code, cached := postRank(t, r.URL, "/v1/completions", 1, body); code != 200 || cached != 0 {
		t.Fatalf("first on rank 1: %d, %d cached", code, cached)
	}
	if code, cached := postRank(t, r.URL, "/v1/completions", 1, body); code != 200 || cached == 0 {
		t.Fatalf("again on rank 1: %d, %d cached", code, cached)
	}
	if code, cached := postRank(t, r.URL, "/v1/completions", 2, body); code != 200 || cached != 0 {
		t.Fatalf("on rank 2: %d, %d cached: the ranks share a cache", code, cached)
	}
	if code, _ := postRank(t, r.URL, "/v1/completions", 3, body); code != http.StatusBadRequest {
		t.Fatalf("rank 3 of 3: %d", code)
	}
	if code, _ := postRank(t, r.URL, "/v1/completions", -1, body); code != 200 {
		t.Fatalf("no rank: %d", code)
	}
	testwait.Until(t, "ranks 1 and 2's events", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return ranks[1] > 0 && ranks[2] == ranks[1]
	})
	resp, err := http.Get(r.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for k := range 3 {
		for _, m := range []string{"vllm:num_requests_running", "vllm:prefix_cache_hits_total", "vllm:cache_config_info"} {
			if !strings.Contains(string(b), m+"{") || !strings.Contains(string(b), fmt.Sprintf(`engine="%d"`, k)) {
				t.Fatalf("/metrics has no %s of engine %d:\n%s", m, k, b)
			}
		}
	}
}
