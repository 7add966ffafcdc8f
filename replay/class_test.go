package replay

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
)

func TestParseClass(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want ReplicaClass
		err  string // a part of the error; "" for none
	}{
		{in: "count=4", want: ReplicaClass{Count: 4}},
		{in: "name=slow,count=2,prefill_overhead=10ms,prefill_per_token=300us,inter_token=60ms,max_running=64,budget_tokens=200000",
			want: ReplicaClass{Name: "slow", Count: 2, PrefillOverhead: 10 * time.Millisecond, PrefillPerToken: 300 * time.Microsecond,
				InterToken: 60 * time.Millisecond, MaxRunning: 64, BudgetTokens: 200_000}},
		{in: " count=1 , prefill_per_token=200µs", want: ReplicaClass{Count: 1, PrefillPerToken: 200 * time.Microsecond}},
		{in: "prefill_per_token=1ms", err: "no count"},
		{in: "count=0", err: "count 0"},
		{in: "count=4,speed=2", err: `unknown key "speed" (keys: name, count,`},
		{in: "count=4,count=5", err: "count given twice"},
		{in: "count=4,inter_token=fast", err: "inter_token"},
		{in: "count=4,budget_tokens=-1", err: "must not be negative"},
		{in: "count=4,prefill_per_token=-1us", err: "must not be negative"},
		{in: "count=4,name=a b", err: "letters, digits"},
		{in: "count", err: "not key=value"},
		{in: "", err: "not key=value"},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseClass(tc.in)
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("error %v", err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("error %v, want one saying %q", err, tc.err)
			case tc.err == "" && got != tc.want:
				t.Fatalf("got %+v, want %+v", got, tc.want)
			}
			if err == nil {
				back, err := ParseClass(got.String())
				if err != nil || back != got {
					t.Fatalf("%q read back as %+v, %v", got.String(), back, err)
				}
			}
		})
	}
}

// FuzzParseClass: a class ParseClass accepts is written by String in a
// form it reads back as the same class.
func FuzzParseClass(f *testing.F) {
	for _, s := range []string{"count=4", "name=slow,count=2,prefill_overhead=10ms,prefill_per_token=300us,inter_token=60ms,max_running=64,budget_tokens=200000",
		"count=1,prefill_per_token=1.5µs", "count=4,speed=2", "count=3,name=x.y-z_1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		c, err := ParseClass(s)
		if err != nil {
			return
		}
		back, err := ParseClass(c.String())
		if err != nil || back != c {
			t.Fatalf("%q → %+v → %q → %+v, %v", s, c, c.String(), back, err)
		}
	})
}

func TestClassesChecked(t *testing.T) {
	reqs := mooncake(t, 2, `{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, 2]}`)
	for _, tc := range []struct {
		name string
		m    Config
		err  string
	}{
		{"count against replicas", Config{Replicas: 3, Classes: []ReplicaClass{{Count: 2}}}, "classes count 2 replicas, the fleet has 3"},
		{"count against names", Config{ReplicaNames: []string{"a"}, Classes: []ReplicaClass{{Count: 2}}}, "classes count 2 replicas, the fleet has 1"},
		{"budgets too", Config{ReplicaNames: []string{"a"}, Budgets: []int64{10}, Classes: []ReplicaClass{{Count: 1}}}, "both given"},
		{"names twice", Config{Classes: []ReplicaClass{{Name: "a", Count: 1}, {Name: "a", Count: 1}}}, `"a" given twice`},
		{"default name twice", Config{Classes: []ReplicaClass{{Count: 1}, {Name: "class-0", Count: 1}}}, `"class-0" given twice`},
		{"zero count", Config{Classes: []ReplicaClass{{Count: 0}}}, "count 0"},
		{"too many", Config{Classes: []ReplicaClass{{Count: 4096}, {Count: 1}}}, "replicas 4097"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.m.BlockTokens = 2
			_, err := Replay(reqs, tc.m, []Run{{Policy: "round_robin"}})
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("error %v, want one saying %q", err, tc.err)
			}
		})
	}
}

// TestMixedFleetPrefillTimes: requests far apart, none cached, sent round
// robin to a fast and a slow replica (half the prefill speed, its own
// overhead): each first token comes exactly its replica's prefill time
// after it arrives, and the report gives each class its own TTFT.
func TestMixedFleetPrefillTimes(t *testing.T) {
	var lines []string
	for i := range 6 {
		lines = append(lines, fmt.Sprintf(`{"timestamp": %d, "input_length": %d, "output_length": 10, "hash_ids": [%d, %d]}`, i*10_000, 600+i*80, 2*i, 2*i+1))
	}
	reqs := mooncake(t, 512, lines...)
	m := Config{BlockTokens: 512, Classes: []ReplicaClass{
		{Name: "fast", Count: 1},
		{Name: "slow", Count: 1, PrefillOverhead: 8 * time.Millisecond, PrefillPerToken: 2 * DefaultPrefillPerToken},
	}}
	sum, err := Replay(reqs, m, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	rr := sum.Policies[0]
	perToken := []float64{float64(DefaultPrefillPerToken) / 1e6, 2 * float64(DefaultPrefillPerToken) / 1e6} // ms, by replica
	overhead := []float64{float64(DefaultPrefillOverhead) / 1e6, 8}
	on := [2]int{}
	for i, x := range rr.rows {
		want := overhead[x.replica] + float64(x.promptTokens)*perToken[x.replica]
		if x.cachedTokens != 0 || math.Abs(x.ttftMS-want) > 1e-6 {
			t.Errorf("request %d on replica %d: TTFT %.3f ms with %d cached, want %.3f ms with none", i, x.replica, x.ttftMS, x.cachedTokens, want)
		}
		on[x.replica]++
	}
	if on != [2]int{3, 3} {
		t.Fatalf("round robin sent %v requests to the two replicas, want 3 each", on)
	}
	fast, slow := rr.Classes[0], rr.Classes[1]
	if fast.Name != "fast" || slow.Name != "slow" || fast.Requests != 3 || slow.Requests != 3 {
		t.Fatalf("classes %+v", rr.Classes)
	}
	if slow.TTFTP50MS < 1.9*fast.TTFTP50MS {
		t.Errorf("TTFT p50 %.1f ms on the slow class, %.1f ms on the fast one: want about twice", slow.TTFTP50MS, fast.TTFTP50MS)
	}
	if got := sum.Model.Fleet; len(got) != 2 || got[1].String() != "slow ×1 (replicas 1–1): prefill 8.0 ms + 200 µs/token, 20 ms/output token, 256 running max, 1000000 tokens" {
		t.Errorf("fleet summary %v", got)
	}
}

// TestMixedFleetGenerated: a generated workload (chats, RAG and agents)
// sent round robin to two fast replicas and two of half their prefill
// speed, which decode a third slower: the slow class takes longer TTFTs,
// and no first token comes before its replica could have computed the
// prompt's uncached tokens.
func TestMixedFleetGenerated(t *testing.T) {
	reqs := generated(t, 60)
	m := Config{BlockTokens: 16, Seed: 1, PrefillPerToken: 200 * time.Microsecond, Classes: []ReplicaClass{
		{Name: "fast", Count: 2},
		{Name: "slow", Count: 2, PrefillPerToken: 400 * time.Microsecond, InterToken: 30 * time.Millisecond},
	}}
	sum, err := Replay(reqs, m, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	rr := sum.Policies[0]
	for i, x := range rr.rows {
		perToken := 0.2 // ms
		if x.replica >= 2 {
			perToken = 0.4
		}
		if least := 5 + float64(x.promptTokens-x.cachedTokens)*perToken; x.ttftMS < least-1e-6 {
			t.Errorf("request %d on replica %d: TTFT %.3f ms, less than its prefill %.3f ms", i, x.replica, x.ttftMS, least)
		}
	}
	fast, slow := rr.Classes[0], rr.Classes[1]
	t.Logf("fast %+v\nslow %+v", fast, slow)
	if fast.Requests+slow.Requests != len(reqs) || fast.Requests < len(reqs)/2-1 || slow.Requests < len(reqs)/2-1 {
		t.Fatalf("round robin split %d requests %d / %d", len(reqs), fast.Requests, slow.Requests)
	}
	if slow.TTFTP50MS <= fast.TTFTP50MS || slow.TTFTP99MS <= fast.TTFTP99MS {
		t.Errorf("TTFT p50 / p99: slow class %.0f / %.0f ms, fast %.0f / %.0f ms: want the slow class slower",
			slow.TTFTP50MS, slow.TTFTP99MS, fast.TTFTP50MS, fast.TTFTP99MS)
	}
}

// TestKVBoundClasses: a fleet whose second class has a quarter of the
// first's KV cache, on a generated workload that fills it: no engine ever
// holds more than its class's budget for the prompts it runs, requests
// wait for room on the small class (and are counted), and waiting costs
// them TTFT.
func TestKVBoundClasses(t *testing.T) {
	reqs := generated(t, 60)
	m := Config{BlockTokens: 16, Seed: 1, Classes: []ReplicaClass{
		{Name: "big", Count: 2, BudgetTokens: 40_000},
		{Name: "small", Count: 2, BudgetTokens: 10_000},
	}}
	sum, err := Replay(reqs, m, []Run{{Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	rr := sum.Policies[0]
	largest := 0
	for _, r := range reqs {
		largest = max(largest, r.Tokens)
	}
	for r, peak := range rr.PeakKV {
		budget := int64(40_000)
		if r >= 2 {
			budget = 10_000
		}
		if peak > max(budget, int64(largest)) {
			t.Errorf("replica %d held %d KV tokens, over its budget %d", r, peak, budget)
		}
	}
	big, small := rr.Classes[0], rr.Classes[1]
	t.Logf("big %+v\nsmall %+v", big, small)
	if small.KVWaits == 0 || small.KVWaits <= big.KVWaits || rr.KVWaits != big.KVWaits+small.KVWaits {
		t.Errorf("requests that waited for KV room: %d on the small class, %d on the big one, %d in all: want the small class to wait, more",
			small.KVWaits, big.KVWaits, rr.KVWaits)
	}
	if small.TTFTP99MS <= big.TTFTP99MS {
		t.Errorf("TTFT p99 %.0f ms on the small class, %.0f ms on the big one: waiting for room costs time", small.TTFTP99MS, big.TTFTP99MS)
	}
	if want := int64(2*40_000 + 2*10_000); sumBudget(t, m) != want {
		t.Errorf("the pooled reference's one cache is %d tokens, want the fleet's %d", sumBudget(t, m), want)
	}
}

// sumBudget returns the fleet's KV cache in tokens, as the pooled
// reference has it.
func sumBudget(t *testing.T, m Config) int64 {
	t.Helper()
	if err := m.defaults(); err != nil {
		t.Fatal(err)
	}
	return m.totalBudget()
}
