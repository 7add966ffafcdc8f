package replay

import (
	"bytes"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// On the blend workload, blending engines reuse documents past the
// prefix (more tokens than prefix engines under any policy), and the
// semantic policy that credits what they reuse saves more than the same
// policy crediting the prefix alone. Virtual time and fixed seeds: the
// figures are exact.
func TestBlendEnginesAndEngineAwareCredit(t *testing.T) {
	var buf bytes.Buffer
	if err := GenerateOpenAI(&buf, GenOptions{Seed: 7, Sessions: 300, Docs: 60, Workload: "blend"}); err != nil {
		t.Fatal(err)
	}
	split, _ := blockhash.NewSplitter(blockhash.Options{Segments: true})
	reqs, err := ReadOpenAI(bytes.NewReader(buf.Bytes()), split)
	if err != nil {
		t.Fatal(err)
	}
	prefixOnly := routing.PolicyConfig{PrefixOnly: true}
	runs := []Run{{Policy: "semantic"}, {Label: "semantic-prefix-credit", Policy: "semantic", Config: &prefixOnly}}
	cached := func(reuse string) (aware, prefix int64) {
		m := Model{Replicas: 4, BudgetTokens: 20000, Reuse: replica.Reuse{Mode: reuse}}
		sum, err := Replay(reqs, m, runs)
		if err != nil {
			t.Fatal(err)
		}
		return sum.Policies[0].CachedTokens, sum.Policies[1].CachedTokens
	}
	aware, prefix := cached(replica.ReuseBlend)
	plainAware, plainPrefix := cached(replica.ReusePrefix)
	t.Logf("blend engines: aware %d, prefix credit %d; prefix engines: %d, %d", aware, prefix, plainAware, plainPrefix)
	if plainAware != plainPrefix {
		t.Fatalf("on prefix engines the credit changed the run: %d against %d", plainAware, plainPrefix)
	}
	if prefix <= plainPrefix {
		t.Fatalf("blending engines reused %d tokens, prefix engines %d", prefix, plainPrefix)
	}
	if aware <= prefix {
		t.Fatalf("engine-aware credit saved %d tokens, prefix credit %d", aware, prefix)
	}
}
