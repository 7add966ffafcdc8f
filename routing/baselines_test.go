package routing

import (
	"fmt"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/replica"
)

func mustPolicy(t *testing.T, name string) Policy {
	t.Helper()
	p, err := NewSeededPolicy(PolicySpec{Type: name}, 7)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// winner scores cands with p and returns the winner's name.
func winner(p Policy, in *View, cands []Candidate) string {
	p.Score(in, cands)
	return rank(cands, in.Key, 1)[0].Replica.Name
}

func TestPowerOfTwoPicksTheLighterOfTwo(t *testing.T) {
	p := mustPolicy(t, "power_of_two")
	for i := 0; i < 50; i++ {
		cs := cands(2)
		cs[0].Load.InFlight, cs[1].Load.InFlight = 5, 1
		if w := winner(p, &View{}, cs); w != "r1" {
			t.Fatalf("picked %s", w)
		}
	}
	// With many replicas the heaviest is never picked: it can only lose.
	for i := 0; i < 200; i++ {
		cs := cands(6)
		for j := range cs {
			cs[j].Load.InFlight = int64(j)
		}
		if w := winner(p, &View{}, cs); w == "r5" {
			t.Fatal("picked the most loaded replica")
		}
	}
}

func TestConsistentHashStableAndMinimalMoves(t *testing.T) {
	p := mustPolicy(t, "consistent_hash")
	before := map[uint64]string{}
	counts := map[string]int{}
	for k := uint64(0); k < 1000; k++ {
		w := winner(p, &View{Key: k}, cands(4))
		if again := winner(p, &View{Key: k}, cands(4)); again != w {
			t.Fatalf("key %d: %s then %s", k, w, again)
		}
		before[k] = w
		counts[w]++
	}
	for name, n := range counts {
		if n < 150 {
			t.Errorf("%s owns %d of 1000 keys: %v", name, n, counts)
		}
	}
	// Drop r3: only r3's keys move.
	for k, w := range before {
		now := winner(p, &View{Key: k}, cands(3))
		if w != "r3" && now != w {
			t.Fatalf("key %d moved from %s to %s though %s stayed", k, w, now, w)
		}
	}
}

func TestSGLangBranches(t *testing.T) {
	p := mustPolicy(t, "sglang")
	in := &View{Tokens: 1000}
	cs := cands(3)
	cs[0].Match.Tokens, cs[0].Load.InFlight = 800, 100 // imbalanced: 100 − 0 > 64
	cs[1].Load.InFlight, cs[2].Load.InFlight = 0, 10
	if w := winner(p, in, cs); w != "r1" {
		t.Fatalf("imbalanced: %s, want the shortest queue r1", w)
	}
	cs[0].Load.InFlight = 20 // balanced; match rate 0.8 > 0.3
	if w := winner(p, in, cs); w != "r0" {
		t.Fatalf("balanced with a good match: %s, want r0", w)
	}
	cs[0].Match.Tokens = 200 // 0.2 ≤ 0.3: smallest tree
	cs[0].CacheTokens, cs[1].CacheTokens, cs[2].CacheTokens = 500, 900, 100
	if w := winner(p, in, cs); w != "r2" {
		t.Fatalf("weak match: %s, want the smallest tree r2", w)
	}
}

func TestDynamoDocumentedExample(t *testing.T) {
	// Dynamo's docs: worker costs 1×8+10, 1×5+5, 1×2+9; worker 2 wins.
	p := mustPolicy(t, "dynamo")
	in := &View{Tokens: 8, BlockTokens: 1}
	cs := cands(3)
	cs[0].Load.ActiveTokens = 2
	cs[1].Match.Tokens = 3
	cs[2].Match.Tokens, cs[2].Load.ActiveTokens = 6, 7
	p.Score(in, cs)
	for i, want := range []float64{18, 10, 11} {
		if cs[i].Score != want {
			t.Errorf("worker %d cost %v, want %v", i+1, cs[i].Score, want)
		}
	}
	if w := winner(p, in, cs); w != "r1" {
		t.Fatalf("winner %s", w)
	}
}

func TestDynamoTemperatureSamples(t *testing.T) {
	p, _ := NewSeededPolicy(PolicySpec{Type: "dynamo", Params: Params{"temperature": 1}}, 3)
	wins := map[string]int{}
	for i := 0; i < 300; i++ {
		cs := cands(3)
		cs[1].Match.Tokens = 4
		wins[winner(p, &View{Tokens: 8, BlockTokens: 1}, cs)]++
	}
	if wins["r1"] < 100 || wins["r0"] == 0 {
		t.Fatalf("softmax wins %v: want the cheapest most often, others sometimes", wins)
	}
}

func TestLLMDWeightedScorers(t *testing.T) {
	p := mustPolicy(t, "llmd")
	in := &View{Blocks: make([]blockhash.Block, 10)}
	cs := cands(3)
	cs[0].Match.Blocks, cs[0].Load.Waiting, cs[0].Load.KVUsage = 10, 4, 0.9 // 3·1 + 2·0 + 2·0.1 = 3.2
	cs[1].Match.Blocks, cs[1].Load.Waiting, cs[1].Load.KVUsage = 5, 0, 0.5  // 1.5 + 2 + 1 = 4.5
	cs[2].Match.Blocks, cs[2].Load.Waiting, cs[2].Load.KVUsage = 0, 2, 0    // 0 + 1 + 2 = 3
	p.Score(in, cs)
	for i, want := range []float64{-3.2, -4.5, -3} {
		if d := cs[i].Score - want; d > 1e-9 || d < -1e-9 {
			t.Errorf("replica %d score %v, want %v", i, cs[i].Score, want)
		}
	}
}

func TestAIBrixBranches(t *testing.T) {
	p := mustPolicy(t, "aibrix")
	in := &View{}
	cs := cands(4)
	for i := range cs {
		cs[i].Load.Running = 4
	}
	cs[0].Match.Blocks, cs[1].Match.Blocks = 8, 6
	if w := winner(p, in, cs); w != "r0" {
		t.Fatalf("best match within mean+2σ: %s, want r0", w)
	}
	cs[0].Load.Running = 14 // mean 6.5, σ 4.33: limit 15.2, still within
	if w := winner(p, in, cs); w != "r0" {
		t.Fatalf("%s, want r0", w)
	}
	cs = cands(8)
	for i := range cs {
		cs[i].Load.Running = 2
	}
	cs[0].Match.Blocks, cs[0].Load.Running = 8, 12 // mean 3.25, σ 3.3: limit 9.9
	cs[1].Match.Blocks = 2
	if w := winner(p, in, cs); w != "r1" {
		t.Fatalf("hot match above mean+2σ: %s, want the next match r1", w)
	}
	cs[2].Load.Running = 30 // imbalance 28 > 16: least running
	cs[3].Load.Running = 0
	if w := winner(p, in, cs); w != "r3" {
		t.Fatalf("imbalanced: %s, want r3", w)
	}
}

func TestSemanticKVSessionBonus(t *testing.T) {
	p := mustPolicy(t, "semantickv")
	in := &View{Key: 42}
	cs := cands(3)
	cs[2].Match = cachemodel.Match{Weighted: 300}
	if w := winner(p, in, cs); w != "r2" {
		t.Fatalf("%s, want the best match", w)
	}
	p.(Observer).Chosen(in, &Candidate{Replica: &replica.Replica{Name: "r0"}})
	if w := winner(p, in, cs); w != "r0" { // 512 bonus beats 300 matched
		t.Fatalf("%s, want the session's replica", w)
	}
	cs[0].Load.PendingTokens = 1000
	if w := winner(p, in, cs); w != "r2" {
		t.Fatalf("%s, want load to outweigh the bonus", w)
	}
}

func TestEveryPolicyPicksAvailableCandidate(t *testing.T) {
	for _, name := range PolicyNames() {
		p := mustPolicy(t, name)
		for n := 1; n <= 5; n++ {
			cs := cands(n)
			w := winner(p, &View{Key: uint64(n), Tokens: 10, BlockTokens: 4}, cs)
			if w == "" || w > fmt.Sprint("r", n-1) {
				t.Errorf("%s with %d candidates picked %q", name, n, w)
			}
		}
	}
}
