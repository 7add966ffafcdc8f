package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/simreplica"
)

// startRanks starts a simulated engine of size data-parallel ranks whose
// rank k publishes its KV events at port base+k and replays them at
// base+size+k, as vLLM offsets them; base is tried again elsewhere while
// one of its ports is taken.
func startRanks(t *testing.T, o simreplica.Options, size int) (r *simreplica.RunningDataParallel, pub, replay string) {
	t.Helper()
	var err error
	for range 10 {
		base := freePort(t)
		pub, replay = fmt.Sprintf("tcp://127.0.0.1:%d", base), fmt.Sprintf("tcp://127.0.0.1:%d", base+size)
		o.KVEvents = &kvevents.PublisherOptions{Endpoint: pub, ReplayEndpoint: replay}
		if r, err = simreplica.StartDataParallel(o, size, "127.0.0.1:0"); err == nil {
			t.Cleanup(func() { r.Close() })
			return r, pub, replay
		}
	}
	t.Fatalf("no free ports for %d ranks: %v", size, err)
	return nil, "", ""
}

// A replica of 4 data-parallel ranks behind one URL is 4 routing
// targets, each with its own picture from its rank's KV events: every
// turn of a conversation lands on the rank of its first turn and hits
// there, the conversations spread over the ranks, and the router's
// predictions agree with the hits the ranks report. A client's own rank
// header does not steer the engine.
func TestDataParallelReplicaRoutesToRanks(t *testing.T) {
	const ranks, convs, turns = 4, 16, 5
	// A prefill costs what a prefix saves: 50 µs a token.
	sim := simreplica.Options{Overhead: time.Millisecond, PrefillPerToken: 50 * time.Microsecond, InterToken: 100 * time.Microsecond, OutputTokens: 4}
	eng, pub, replay := startRanks(t, sim, ranks)
	r := startRouterYAML(t, fmt.Sprintf(`log: {level: warn}
replicas:
  - name: dp
    url: %s
    data_parallel_size: %d
    kv_events: {endpoint: %q, replay_endpoint: %q}
`, eng.URL, ranks, pub, replay))
	for k := range ranks {
		testwait.Until(t, fmt.Sprint("rank ", k, "'s events followed"), eng.Rank(k).KVEventsSubscribed)
	}
	waitBudgets(t, r, ranks, 16384*16)

	type answer struct {
		rank           string
		cached, prompt int
		predicted      int
	}
	send := func(msgs []map[string]any, hdr string) answer {
		body, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": 4, "messages": msgs})
		req, _ := http.NewRequest(http.MethodPost, r.url+chatPath, strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		if hdr != "" {
			req.Header.Set("X-Data-Parallel-Rank", hdr)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			return answer{}
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var out struct {
			Usage struct {
				Prompt  int `json:"prompt_tokens"`
				Details struct {
					Cached int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if resp.StatusCode != 200 || json.Unmarshal(b, &out) != nil {
			t.Errorf("%d: %s", resp.StatusCode, b)
		}
		var pred int
		fmt.Sscan(resp.Header.Get("X-Semroute-Matched-Tokens"), &pred)
		return answer{resp.Header.Get("X-Semroute-Replica"), out.Usage.Details.Cached, out.Usage.Prompt, pred}
	}

	// The conversations take turns, one request at a time: with no load
	// to weigh against a prefix, where each turn goes is the pictures'
	// doing alone.
	landed := make([][]answer, convs)
	history := make([][]map[string]any, convs)
	for turn := range turns {
		for c := range convs {
			if turn == 0 {
				history[c] = []map[string]any{{"role": "system", "content": fmt.Sprintf("You are agent %d. ", c) + text(fmt.Sprint("conv", c), 300)}}
			}
			history[c] = append(history[c], map[string]any{"role": "user", "content": fmt.Sprintf("turn %d: ", turn) + text(fmt.Sprint("q", c, turn), 20)})
			landed[c] = append(landed[c], send(history[c], ""))
			history[c] = append(history[c], map[string]any{"role": "assistant", "content": "answer " + text(fmt.Sprint("a", c, turn), 8)})
		}
	}
	used := map[string]int{}
	var cached, prompt, predicted int
	for c, as := range landed {
		for i, a := range as {
			if a.rank != as[0].rank {
				t.Errorf("conversation %d: turn %d on %s, its first on %s", c, i, a.rank, as[0].rank)
			}
			if i > 0 && a.cached == 0 {
				t.Errorf("conversation %d: turn %d on %s hit nothing", c, i, a.rank)
			}
			if i > 0 {
				cached, prompt, predicted = cached+a.cached, prompt+a.prompt, predicted+a.predicted
			}
		}
		used[as[0].rank]++
	}
	ratio := float64(predicted) / float64(max(cached, 1))
	t.Logf("conversations by rank %v; later turns' hit ratio %.3f, predicted ÷ reported %.3f", used, float64(cached)/float64(max(prompt, 1)), ratio)
	if len(used) != ranks {
		t.Errorf("the conversations used the ranks %v, not all %d", used, ranks)
	}
	if ratio < 0.97 || ratio > 1.03 {
		t.Errorf("predicted ÷ reported cached tokens %.3f: the ranks' pictures are not their events'", ratio)
	}
	for k := range ranks {
		if st := eng.Rank(k).Stats(); st.CachedTokens == 0 {
			t.Errorf("rank %d reports no hits: %+v", k, st)
		}
	}
	// A client naming a rank is routed as any other: its conversation's rank.
	first := landed[0][0].rank
	other := "0"
	if first == "dp-dp0" {
		other = "1"
	}
	msgs := []map[string]any{{"role": "system", "content": "You are agent 0. " + text("conv0", 300)}, {"role": "user", "content": "turn 0: " + text("q00", 20)}}
	if a := send(msgs, other); a.rank != first || a.cached == 0 {
		t.Errorf("a client's rank header %s moved its request: it went to %s (cached %d), its conversation's rank is %s", other, a.rank, a.cached, first)
	}
}

// Engines found in DNS take discovery.kv_events and
// discovery.data_parallel_size: two engines of two ranks, each engine on
// an address of its own as pods are, publishing its rank k's KV events on
// port P+k of its address, are four replicas, each following its own
// rank's events from the one "{host}" template: every rank a request went
// to hears its blocks stored, and the requests hit.
func TestDiscoveredDataParallelEngines(t *testing.T) {
	sim := simreplica.Options{Overhead: time.Millisecond, PrefillPerToken: 50 * time.Microsecond, InterToken: 100 * time.Microsecond, OutputTokens: 4}
	var (
		engines []*simreplica.RunningDataParallel
		targets []string
		port    int
	)
	for attempt := 0; len(engines) < 2 && attempt < 10; attempt++ {
		if len(engines) == 0 {
			port = freePort(t)
		}
		host := fmt.Sprintf("127.0.0.%d", 20+len(engines))
		o := sim
		o.KVEvents = &kvevents.PublisherOptions{Endpoint: fmt.Sprintf("tcp://%s:%d", host, port)}
		e, err := simreplica.StartDataParallel(o, 2, host+":0")
		if err != nil { // a port taken: all engines start again on another
			for _, e := range engines {
				e.Close()
			}
			engines, targets = nil, nil
			continue
		}
		t.Cleanup(func() { e.Close() })
		engines, targets = append(engines, e), append(targets, strings.TrimPrefix(e.URL, "http://"))
	}
	if len(engines) < 2 {
		t.Fatal("no free ports for the engines' events")
	}
	res := &srvResolver{}
	res.setHosts(targets...)
	r := startRouterResolving(t, fmt.Sprintf(`log: {level: warn}
discovery:
  dns_name: _http._tcp.vllm.test
  srv: true
  interval: 50ms
  data_parallel_size: 2
  kv_events: {endpoint: "tcp://{host}:%d"}
`, port), res)
	for i, e := range engines {
		for k := range 2 {
			testwait.Until(t, fmt.Sprint("engine ", i, " rank ", k, "'s events followed"), e.Rank(k).KVEventsSubscribed)
		}
	}
	waitBudgets(t, r, 4, 16384*16)
	served := map[string]bool{}
	for c := range 8 {
		msgs := []map[string]any{{"role": "system", "content": fmt.Sprintf("You are agent %d. ", c) + text(fmt.Sprint("conv", c), 300)},
			{"role": "user", "content": "hello " + text(fmt.Sprint("q", c), 10)}}
		for range 2 {
			body, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": 4, "messages": msgs})
			resp, err := http.Post(r.url+chatPath, "application/json", strings.NewReader(string(body)))
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("%d from %s", resp.StatusCode, resp.Header.Get("X-Semroute-Replica"))
			}
			served[resp.Header.Get("X-Semroute-Replica")] = true
		}
	}
	ranks := map[string]bool{}
	for _, target := range targets {
		for k := range 2 {
			ranks[fmt.Sprintf("%s-dp%d", target, k)] = true
		}
	}
	if len(served) < 2 {
		t.Errorf("8 conversations all went to %v", served)
	}
	for name := range served {
		if !ranks[name] {
			t.Fatalf("served by %s, not one of the ranks %v", name, ranks)
		}
		testwait.Until(t, name+"'s stored blocks heard from its events", func() bool {
			return metric(t, r.url, "semroute_kv_events_blocks_total", `event="stored",replica="`+name+`"`) > 0
		})
	}
	var cached int64
	for _, e := range engines {
		for k := range 2 {
			cached += e.Rank(k).Stats().CachedTokens
		}
	}
	if cached == 0 {
		t.Error("no rank reported a hit")
	}
}
