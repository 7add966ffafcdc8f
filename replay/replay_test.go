package replay

import (
	"container/list"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
)

func mooncake(t testing.TB, blockTokens int, lines ...string) []Request {
	t.Helper()
	reqs, err := ReadMooncake(strings.NewReader(strings.Join(lines, "\n")), blockTokens)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

func TestReadMooncake(t *testing.T) {
	reqs := mooncake(t, 4,
		`{"timestamp": 5, "input_length": 10, "output_length": 3, "hash_ids": [1, 2, 3]}`,
		`{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 5, "input_length": 5, "output_length": 1, "hash_ids": [1, 9]}`)
	if len(reqs) != 3 || reqs[0].Tokens != 4 || reqs[1].Tokens != 10 || reqs[2].Tokens != 5 {
		t.Fatalf("order or tokens wrong: %+v", reqs)
	}
	if b := reqs[1].Blocks; len(b) != 3 || b[0].Tokens != 4 || b[2].Tokens != 2 {
		t.Fatalf("blocks %+v: the last holds what is left", b)
	}
	if reqs[0].Blocks[0].Hash != reqs[1].Blocks[0].Hash || reqs[1].Blocks[1].Hash == reqs[2].Blocks[1].Hash {
		t.Fatal("equal id prefixes must be equal block prefixes, and only those")
	}
	if reqs[1].Arrival >= reqs[2].Arrival || reqs[1].Arrival/1e6 != 5 {
		t.Fatalf("equal timestamps keep line order: %d, %d", reqs[1].Arrival, reqs[2].Arrival)
	}
	for _, bad := range []string{
		`{"input_length": 4, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]}`,
		`{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, 2]}`,
		`{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": []}`,
		`not json`,
	} {
		if _, err := ReadMooncake(strings.NewReader(bad), 4); err == nil || !strings.Contains(err.Error(), "line 1") {
			t.Errorf("%s: err = %v", bad, err)
		}
	}
}

// plainLRU is the reference: one LRU list of blocks per replica under a
// token budget, each request's blocks touched tail first so its head is the
// most recent, and a request's cached tokens are its leading blocks present.
type plainLRU struct {
	budget int64
	used   int64
	order  *list.List // front: most recent
	index  map[uint64]*list.Element
}

type lruEntry struct {
	key    uint64
	tokens int64
}

func newPlainLRU(budget int64) *plainLRU {
	return &plainLRU{budget: budget, order: list.New(), index: map[uint64]*list.Element{}}
}

func (c *plainLRU) serve(blocks []blockhash.Block) (cached int) {
	for _, b := range blocks {
		if _, ok := c.index[b.Hash]; !ok {
			break
		}
		cached += int(b.Tokens)
	}
	for i := len(blocks) - 1; i >= 0; i-- {
		b := blocks[i]
		if e, ok := c.index[b.Hash]; ok {
			c.order.MoveToFront(e)
			continue
		}
		c.index[b.Hash] = c.order.PushFront(lruEntry{b.Hash, int64(b.Tokens)})
		c.used += int64(b.Tokens)
		for c.used > c.budget {
			e := c.order.Back()
			c.order.Remove(e)
			delete(c.index, e.Value.(lruEntry).key)
			c.used -= e.Value.(lruEntry).tokens
		}
	}
	return cached
}

// lruReference serves reqs round robin on plain LRU caches, each request
// whole before the next: its prompt, then at its end the full blocks of
// its output (outputBlocks, as vLLM caches what it generated), every block
// of blockTokens tokens (0: no output cached).
func lruReference(reqs []Request, replicas int, budget int64, blockTokens int) (cached []int, total int64) {
	caches := make([]*plainLRU, replicas)
	for i := range caches {
		caches[i] = newPlainLRU(budget)
	}
	for i := range reqs {
		c := caches[i%replicas].serve(reqs[i].Blocks)
		if out := outputBlocks(&reqs[i], i, blockTokens); blockTokens > 0 && len(out) > 0 {
			caches[i%replicas].serve(append(slices.Clone(reqs[i].Blocks), out...))
		}
		cached = append(cached, c)
		total += int64(c)
	}
	return cached, total
}

// TestRunningPromptPinned: a running request's blocks are not evicted,
// as vLLM keeps them off its free queue. On one replica of 3 blocks, a
// prompt of 2 blocks runs for seconds (100 output tokens); a short request
// of one block runs and finishes beside it, and a third one-block request
// then needs room: the engine evicts the finished request's block, not the
// running prompt's, although they were used last; a fourth request asking
// for the first prompt while it still runs finds it whole. Without pins
// the running prompt's leaf went (least recently used) and the fourth found
// half of it.
func TestRunningPromptPinned(t *testing.T) {
	reqs := mooncake(t, 2,
		`{"timestamp": 0, "input_length": 4, "output_length": 100, "hash_ids": [1, 2]}`,
		`{"timestamp": 10, "input_length": 2, "output_length": 1, "hash_ids": [3]}`,
		`{"timestamp": 100, "input_length": 2, "output_length": 1, "hash_ids": [5]}`,
		`{"timestamp": 200, "input_length": 4, "output_length": 1, "hash_ids": [1, 2]}`)
	sum, err := Replay(reqs, Config{Replicas: 1, BudgetTokens: 6, BlockTokens: 2, Eviction: "lru"}, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	var got []int
	for _, r := range sum.Policies[0].rows {
		got = append(got, r.cachedTokens)
	}
	if fmt.Sprint(got) != "[0 0 0 4]" {
		t.Fatalf("cached %v, want [0 0 0 4]: the running prompt kept whole", got)
	}
}

// TestAdmissionWaitsForRoom: a replica's engine never holds more than its
// budget for the prompts it runs: a request whose blocks do not fit beside
// the running ones waits, however many running slots are free, and its
// wait counts in its TTFT; one that fits runs at once.
func TestAdmissionWaitsForRoom(t *testing.T) {
	reqs := mooncake(t, 2,
		`{"timestamp": 0, "input_length": 4, "output_length": 100, "hash_ids": [1, 2]}`,
		`{"timestamp": 10, "input_length": 4, "output_length": 1, "hash_ids": [1, 2]}`,
		`{"timestamp": 20, "input_length": 4, "output_length": 1, "hash_ids": [3, 4]}`)
	m := Config{Replicas: 1, BudgetTokens: 6, BlockTokens: 2, Eviction: "lru"}
	sum, err := Replay(reqs, m, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	rows := sum.Policies[0].rows
	if rows[1].ttftMS > 100 || rows[1].cachedTokens != 4 {
		t.Errorf("request 1 (the running prompt again: nothing new to hold) waited %.0f ms and found %d tokens", rows[1].ttftMS, rows[1].cachedTokens)
	}
	decode := float64(100*DefaultInterToken) / 1e6 // ms the first request runs after its prefill
	if rows[2].ttftMS < decode-20 {
		t.Errorf("request 2 (4 new tokens beside 4 running, budget 6) started after %.0f ms, before the first ended (%.0f ms)", rows[2].ttftMS, decode)
	}
}

// TestAdmissionAsVLLM: an engine admits as vLLM's scheduler does. A
// request fits if its blocks fit in the room the running requests leave,
// idle cached blocks counting as room (they are evicted for it); the
// queue is first come first served, so a request that would fit waits
// behind one that does not; and the wait is counted (Result.KVWaits).
func TestAdmissionAsVLLM(t *testing.T) {
	reqs := mooncake(t, 2,
		`{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, 2]}`,           // ends at once: 1, 2 idle
		`{"timestamp": 500, "input_length": 2, "output_length": 100, "hash_ids": [3]}`,          // runs 2 s holding 2 tokens
		`{"timestamp": 1000, "input_length": 6, "output_length": 1, "hash_ids": [4, 5, 6]}`,     // 2 + 6 = 8: fits, 1 and 2 evicted
		`{"timestamp": 1100, "input_length": 8, "output_length": 1, "hash_ids": [7, 8, 9, 10]}`, // 2 + 8 > 8: waits for 3
		`{"timestamp": 1200, "input_length": 2, "output_length": 1, "hash_ids": [11]}`)          // would fit, waits behind it
	m := Config{Replicas: 1, BudgetTokens: 8, BlockTokens: 2, Eviction: "lru"}
	sum, err := Replay(reqs, m, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	rr := sum.Policies[0]
	rows := rr.rows
	running := float64(500) + float64(DefaultPrefillOverhead+2*DefaultPrefillPerToken)/1e6 + float64(100*DefaultInterToken)/1e6 // ms: when request 1 ends
	if rows[2].ttftMS > 50 {
		t.Errorf("request 2 (fits beside the running one once the idle blocks go) waited: TTFT %.0f ms", rows[2].ttftMS)
	}
	if end := 1100 + rows[3].ttftMS; end < running {
		t.Errorf("request 3 (does not fit beside the running one) had its first token at %.0f ms, before the running request ended at %.0f ms", end, running)
	}
	if end := 1200 + rows[4].ttftMS; end < running {
		t.Errorf("request 4 overtook request 3 (first come first served): first token at %.0f ms, before %.0f ms", end, running)
	}
	if rr.KVWaits != 2 || rr.Prediction.EngineEvictions < 2 {
		t.Errorf("%d requests waited for KV room (want 2: request 3, then 4 beside 3), %d blocks evicted (want 1 and 2 at least)", rr.KVWaits, rr.Prediction.EngineEvictions)
	}
}

// TestPredictionLostWhileWaiting: a request routed to a replica whose
// engine holds its prefix, idle, waits there for KV room; the running
// request ends, its output's blocks take the room, and the prefix is gone
// when the waiting request is admitted. The picture predicted the prefix;
// the report counts its tokens as lost while the request waited.
func TestPredictionLostWhileWaiting(t *testing.T) {
	reqs := mooncake(t, 2,
		`{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, 2]}`,        // ends at once: 1, 2 idle
		`{"timestamp": 100, "input_length": 6, "output_length": 100, "hash_ids": [3, 4, 5]}`, // runs 2 s holding 6 tokens
		`{"timestamp": 200, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 6]}`)   // 6 + 6 > 10: waits
	m := Config{Replicas: 1, BudgetTokens: 10, BlockTokens: 2, Eviction: "lru"}
	sum, err := Replay(reqs, m, []Run{{Policy: "round_robin", Picture: PictureApproximate}})
	if err != nil {
		t.Fatal(err)
	}
	rr := sum.Policies[0]
	p := rr.Prediction
	if x := rr.rows[2]; x.predicted != 4 || x.cachedTokens != 0 || p.LostWaitingTokens != 4 || p.NotHeldTokens != 0 || rr.KVWaits != 1 {
		t.Fatalf("request 2: predicted %d cached tokens, found %d (want 4, 0); lost while waiting %d, not held when routed %d (want 4, 0); %d waited for room (want 1)",
			x.predicted, x.cachedTokens, p.LostWaitingTokens, p.NotHeldTokens, rr.KVWaits)
	}
}

func TestRoundRobinIsPlainLRUByHand(t *testing.T) {
	// Two replicas of 3 blocks (6 tokens), blocks of 2 tokens. Worked by
	// hand (replica: cache after the request, cached tokens):
	//  0 r0 [1 2 3]   miss            {1 2 3}          0
	//  1 r1 [1 2 4]   miss            {1 2 4}          0
	//  2 r0 [1 2 5]   hits 1 2        evict 3: {1 2 5}  4
	//  3 r1 [1 2 4 6] hits 1 2 4      evict 6 itself    6
	//  4 r0 [1 2 3]   hits 1 2        evict 5           4
	//  5 r1 [7 8]     miss            evict 4, 2        0
	//  6 r0 [1 2 4]   hits 1 2        evict 3           4
	//  7 r1 [1 2 4]   hits 1          evict 8, 7        2
	// A second apart, so that each request has finished before the next
	// (a running request's blocks are pinned: see TestRunningPromptPinned).
	reqs := mooncake(t, 2,
		`{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 3]}`,
		`{"timestamp": 1000, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 4]}`,
		`{"timestamp": 2000, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 5]}`,
		`{"timestamp": 3000, "input_length": 8, "output_length": 1, "hash_ids": [1, 2, 4, 6]}`,
		`{"timestamp": 4000, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 3]}`,
		`{"timestamp": 5000, "input_length": 4, "output_length": 1, "hash_ids": [7, 8]}`,
		`{"timestamp": 6000, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 4]}`,
		`{"timestamp": 7000, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 4]}`)
	want := []int{0, 0, 4, 6, 4, 0, 4, 2}
	sum, err := Replay(reqs, Config{Replicas: 2, BudgetTokens: 6, BlockTokens: 2, Eviction: "lru"}, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	rr := sum.Policies[0]
	var got []int
	for _, r := range rr.rows {
		got = append(got, r.cachedTokens)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) || rr.CachedTokens != 20 || rr.PromptTokens != 48 {
		t.Fatalf("cached %v (total %d of %d), want %v (20 of 48)", got, rr.CachedTokens, rr.PromptTokens, want)
	}
	if ref, _ := lruReference(reqs, 2, 6, 2); fmt.Sprint(ref) != fmt.Sprint(want) {
		t.Fatalf("the reference itself gives %v", ref)
	}
}

func traceFile(t testing.TB, name string) *os.File {
	t.Helper()
	f, err := os.Open("../testdata/traces/" + name)
	if err != nil {
		t.Fatalf("the public traces are in testdata/traces at the repository's top: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func TestRoundRobinIsPlainLRUOnConversationTrace(t *testing.T) {
	reqs, err := ReadMooncake(traceFile(t, "conversation_trace.jsonl"), 512)
	if err != nil {
		t.Fatal(err)
	}
	const replicas, budget = 8, 1_000_000
	// One request running per replica at a time: none of its blocks is
	// pinned when the next is served, as none is in a plain LRU cache.
	sum, err := Replay(reqs, Config{Replicas: replicas, BudgetTokens: budget, BlockTokens: 512, Eviction: "lru", MaxRunning: 1}, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	_, want := lruReference(reqs, replicas, budget, 512)
	got := sum.Policies[0].CachedTokens
	t.Logf("round_robin cached %d tokens (hit rate %.4f); plain per-replica LRU: %d", got, sum.Policies[0].TokenHitRate, want)
	if got != want {
		t.Fatalf("round_robin cached %d tokens, a plain LRU per replica %d", got, want)
	}
}

func TestReplayIsDeterministic(t *testing.T) {
	reqs, err := ReadMooncake(traceFile(t, "synthetic_trace.jsonl"), 512)
	if err != nil {
		t.Fatal(err)
	}
	reqs = reqs[:1500] // enough for every policy's state and the queues to build (a third of the trace: CI's time)
	var runs []Run
	for _, p := range []string{"semantic", "random", "power_of_two", "dynamo", "semantickv"} {
		runs = append(runs, Run{Policy: p})
	}
	m := Config{BlockTokens: 512}
	m.Seed = 9
	a, err := Replay(reqs, m, runs)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Replay(reqs, m, runs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range a.Policies {
		x, y := a.Policies[i], b.Policies[i]
		if x.CachedTokens != y.CachedTokens || x.TTFTP99MS != y.TTFTP99MS || x.LoadImbalance != y.LoadImbalance {
			t.Errorf("%s differs between two runs: %+v vs %+v", x.Name, x, y)
		}
	}
}
