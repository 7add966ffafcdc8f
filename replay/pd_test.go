package replay

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/replica"
)

// docWorkload is a prefill-heavy trace of mooncake lines (512-token
// blocks): n requests, one every gap ms, each a shared system block, one
// of docs documents of 8 blocks (Zipf-drawn), and a question block of its
// own, answered in 16 tokens.
func docWorkload(t testing.TB, n, docs int, gap float64) []Request {
	rng := rand.New(rand.NewPCG(7, 7))
	zipf := rand.NewZipf(rng, 1.1, 1, uint64(docs-1))
	lines := make([]string, n)
	for i := range lines {
		d := int(zipf.Uint64())
		ids := []string{"1"}
		for k := range 8 {
			ids = append(ids, fmt.Sprint(1000+d*10+k))
		}
		ids = append(ids, fmt.Sprint(1_000_000+i))
		lines[i] = fmt.Sprintf(`{"timestamp": %d, "input_length": %d, "output_length": 16, "hash_ids": [%s]}`,
			int(float64(i)*gap), 512*len(ids), strings.Join(ids, ", "))
	}
	return mooncake(t, 512, lines...)
}

func pdConfig(p, d int) Config {
	roles := make([]replica.Role, 0, p+d)
	for range p {
		roles = append(roles, replica.RolePrefill)
	}
	for range d {
		roles = append(roles, replica.RoleDecode)
	}
	return Config{Replicas: p + d, Roles: roles, BlockTokens: 512, BudgetTokens: 40_000, Seed: 1}
}

// TestReplayDisaggregated replays a prefill-heavy trace on 2 prefill and 2
// decode replicas: every prompt of a disaggregated request is computed on
// a prefill replica, decode replicas compute only what conditional
// disaggregation keeps from them, and the cache-aware policy's prefill
// pool finds more of the prompts cached than round robin's.
func TestReplayDisaggregated(t *testing.T) {
	reqs := docWorkload(t, 600, 24, 60)
	sum, err := Replay(reqs, pdConfig(2, 2), []Run{{Policy: "semantic"}, {Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	if pd := sum.Model.Disaggregation; pd == nil || pd.PrefillReplicas != 2 || pd.DecodeReplicas != 2 || pd.MinPrefillTokens != DefaultMinPrefillTokens {
		t.Fatalf("summary's disaggregation %+v", pd)
	}
	sem, rr := sum.Policies[0], sum.Policies[1]
	for _, r := range append(sum.Policies, sum.Pooled) {
		if r.Requests != len(reqs) || r.Disaggregated == 0 || r.TransferTokens == 0 {
			t.Fatalf("%s: %d of %d requests routed, %d disaggregated, %d tokens moved", r.Name, r.Requests, len(reqs), r.Disaggregated, r.TransferTokens)
		}
		// Every request's question block is new to every replica, but a
		// decode replica holding the rest computes 512 tokens: at least
		// MinPrefillTokens, so every request of this trace goes through a
		// prefill replica unless its decode replica is predicted to give
		// its first token sooner computing it (router.Core's localSooner).
		if r.Disaggregated < len(reqs)/4 {
			t.Errorf("%s: %d of %d disaggregated; decode replicas computed %v", r.Name, r.Disaggregated, len(reqs), r.PrefillComputed[2:])
		}
	}
	t.Logf("semantic: hit %.3f, TTFT p50 %.1f p99 %.1f ms, %d tokens moved; round robin: hit %.3f, TTFT p50 %.1f p99 %.1f ms, %d moved",
		sem.TokenHitRate, sem.TTFTP50MS, sem.TTFTP99MS, sem.TransferTokens, rr.TokenHitRate, rr.TTFTP50MS, rr.TTFTP99MS, rr.TransferTokens)
	if sem.TokenHitRate < 1.2*rr.TokenHitRate || sem.TTFTP50MS >= rr.TTFTP50MS {
		t.Errorf("prefill pool hit: semantic %.3f, round robin %.3f; TTFT p50 %.1f, %.1f ms", sem.TokenHitRate, rr.TokenHitRate, sem.TTFTP50MS, rr.TTFTP50MS)
	}
	// Decode replicas that hold a prompt's prefix pull less of it.
	if sem.TransferTokens >= rr.TransferTokens {
		t.Errorf("tokens moved: semantic %d, round robin %d", sem.TransferTokens, rr.TransferTokens)
	}
}

// TestReplayTransferTime replays requests one at a time: a disaggregated
// request's TTFT is its prefill plus the transfer of the blocks its decode
// replica does not hold, and a request whose decode replica holds all
// but MinPrefillTokens of its prompt is not disaggregated.
func TestReplayTransferTime(t *testing.T) {
	m := pdConfig(1, 1)
	m.TransferLatency, m.TransferPerToken = 3*time.Millisecond, 20*time.Microsecond
	m.MinPrefillTokens = 1024
	reqs := mooncake(t, 512,
		`{"timestamp": 0, "input_length": 2048, "output_length": 4, "hash_ids": [1, 2, 3, 4]}`,
		`{"timestamp": 10000, "input_length": 2048, "output_length": 4, "hash_ids": [1, 2, 3, 5]}`,
		`{"timestamp": 20000, "input_length": 3072, "output_length": 4, "hash_ids": [1, 2, 6, 7, 8, 9]}`)
	sum, err := Replay(reqs, m, []Run{{Policy: "semantic"}})
	if err != nil {
		t.Fatal(err)
	}
	r := sum.Policies[0]
	prefill := func(uncached int) float64 {
		return float64(DefaultPrefillOverhead+time.Duration(uncached)*DefaultPrefillPerToken) / 1e6
	}
	move := func(tokens int) float64 {
		return float64(m.TransferLatency+time.Duration(tokens)*m.TransferPerToken) / 1e6
	}
	want := []struct {
		ttft    float64
		replica int
	}{
		{prefill(2048) + move(2048), 1},
		{prefill(512), 1},               // 512 uncached on the decode replica: computed there
		{prefill(2048) + move(2048), 1}, // 2,048 uncached there: through the prefill replica, which holds 1,024
	}
	for i, w := range want {
		if got := r.rows[i]; math.Abs(got.ttftMS-w.ttft) > 1e-6 || got.replica != w.replica {
			t.Errorf("request %d: TTFT %.4f ms on replica %d, want %.4f on %d", i, got.ttftMS, got.replica, w.ttft, w.replica)
		}
	}
	if r.Disaggregated != 2 || r.TransferTokens != 2048+2048 {
		t.Errorf("%d disaggregated, %d tokens moved; want 2 and 4,096", r.Disaggregated, r.TransferTokens)
	}
	if r.PrefillComputed[0] != 2048+2048 || r.PrefillComputed[1] != 512 {
		t.Errorf("computed per replica %v, want [4096 512]", r.PrefillComputed)
	}
}

// TestReplayMinPrefillTokens: conditional disaggregation's threshold
// decides, and a negative one disaggregates every request.
func TestReplayMinPrefillTokens(t *testing.T) {
	reqs := docWorkload(t, 80, 6, 200)
	for _, c := range []struct {
		min  int
		want func(n int) bool
	}{
		{1 << 20, func(n int) bool { return n == 0 }},
		{-1, func(n int) bool { return n == len(reqs) }},
	} {
		m := pdConfig(1, 2)
		m.MinPrefillTokens = c.min
		sum, err := Replay(reqs, m, []Run{{Policy: "semantic"}})
		if err != nil {
			t.Fatal(err)
		}
		if r := sum.Policies[0]; !c.want(r.Disaggregated) {
			t.Errorf("min %d: %d of %d disaggregated", c.min, r.Disaggregated, len(reqs))
		}
	}
}

func TestReplayRolesChecked(t *testing.T) {
	reqs := docWorkload(t, 4, 2, 100)
	for _, c := range []struct {
		m    Config
		runs []Run
		want string
	}{
		{Config{Replicas: 3, Roles: []replica.Role{replica.RolePrefill, replica.RoleDecode}}, nil, "2 roles for 3 replicas"},
		{Config{Replicas: 2, Roles: []replica.Role{replica.RolePrefill, replica.RolePrefill}}, nil, "no replica decodes"},
		{Config{Replicas: 2, Roles: []replica.Role{replica.RolePrefill, "encode"}}, nil, "encode"},
		{pdConfig(1, 1), []Run{{Policy: "semantic", FlowControl: true}}, "one router and no flow control"},
		{pdConfig(1, 1), []Run{{Policy: "semantic", Routers: 2, Sync: SyncNone}}, "one router and no flow control"},
	} {
		if _, err := Replay(reqs, c.m, c.runs); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err %v, want %q", c.m.Roles, err, c.want)
		}
	}
}

// A prefill replica keeps a prompt's KV until its decode replica has it,
// and admits no more than its cache holds meanwhile, however slow the
// decode replica is to take them.
func TestReplayPrefillReplicaHoldsItsBudget(t *testing.T) {
	m := pdConfig(1, 1)
	m.BudgetTokens, m.MaxRunning = 16_384, 1
	m.MinPrefillTokens = -1 // every request through the prefill replica, however long its queue
	lines := make([]string, 40)
	for i := range lines {
		lines[i] = fmt.Sprintf(`{"timestamp": %d, "input_length": 4096, "output_length": 500, "hash_ids": [%d, %d, %d, %d]}`, i, 4*i+1, 4*i+2, 4*i+3, 4*i+4)
	}
	reqs := mooncake(t, 1024, lines...)
	m.BlockTokens = 1024
	sum, err := Replay(reqs, m, []Run{{Policy: "semantic"}, {Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range append(sum.Policies, sum.Pooled) {
		if r.Requests != len(reqs) || r.Disaggregated != len(reqs) {
			t.Fatalf("%s: %d routed, %d disaggregated", r.Name, r.Requests, r.Disaggregated)
		}
		for k, p := range r.PeakKV {
			if p > m.BudgetTokens {
				t.Errorf("%s: replica %d held %d KV tokens, past its %d", r.Name, k, p, m.BudgetTokens)
			}
		}
	}
}

// Round robin goes round each pool: both prefill replicas compute.
func TestReplayRoundRobinUsesEveryPrefillReplica(t *testing.T) {
	reqs := docWorkload(t, 200, 12, 50)
	m := pdConfig(2, 2)
	m.MinPrefillTokens = -1
	sum, err := Replay(reqs, m, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	c := sum.Policies[0].PrefillComputed
	if c[0] == 0 || c[1] == 0 || sum.Policies[0].LoadImbalance > 1.2 {
		t.Fatalf("prefill computed per replica %v (imbalance %.2f): round robin must use both", c, sum.Policies[0].LoadImbalance)
	}
}
