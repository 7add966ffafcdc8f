package simreplica

import (
	"fmt"
	"strings"
	"testing"
)

// TestDonorReusesSimilarPrompt: a donor replica reuses what its prefix
// cache holds of a similar earlier prompt (the same document after another
// system prompt, with another question) and reports it; a replica without
// Donor reuses nothing there; an unrelated prompt takes nothing; a donor
// whose blocks are gone gives nothing.
func TestDonorReusesSimilarPrompt(t *testing.T) {
	doc := prose("alpha", 800)
	first := ragBody(prose("sys", 40), "Why is it so?", doc)
	second := ragBody(prose("other", 40), "How does it work?", doc)

	reusesNothingPlain(t, first, second)

	o := blendFast
	o.Donor = &Donor{}
	r := start(t, o)
	_, u1, _ := call(t, r, "/v1/chat/completions", first)
	if u1.Details.Cached != 0 {
		t.Fatalf("first request: %d cached", u1.Details.Cached)
	}
	_, u, body := call(t, r, "/v1/chat/completions", second)
	// The donor is held whole: its full blocks, up to the second prompt's
	// last token.
	bs := r.o.BlockSize
	want := min(u1.Prompt/bs*bs, (u.Prompt-1)/bs*bs)
	if u.Details.Cached != want || want == 0 {
		t.Fatalf("second request: cached %d, want %d (the donor's full blocks): %s", u.Details.Cached, want, body)
	}
	if st := r.Stats(); st.ReusedTokens != int64(want) || st.CachedTokens != int64(want) {
		t.Fatalf("stats %+v, want %d reused", st, want)
	}
	if m := metricValues(t, r); m["vllm:external_prefix_cache_hits_total"] != fmt.Sprint(want) || m["vllm:prefix_cache_hits_total"] != "0" {
		t.Fatalf("external hits %s, prefix hits %s; want %d and 0", m["vllm:external_prefix_cache_hits_total"], m["vllm:prefix_cache_hits_total"], want)
	}

	if _, u, _ := call(t, r, "/v1/chat/completions", ragBody(prose("third", 40), "What?", prose("gamma", 800))); u.Details.Cached != 0 {
		t.Fatalf("an unrelated prompt reused %d tokens", u.Details.Cached)
	}

	r.DropCache()
	if _, u, _ := call(t, r, "/v1/chat/completions", ragBody(prose("fourth", 40), "When?", doc)); u.Details.Cached != 0 {
		t.Fatalf("after the cache was dropped, a donor gave %d tokens", u.Details.Cached)
	}
}

// TestDonorThreshold: a prompt that shares less than MinSimilarity with
// every earlier one reuses nothing; lowering the threshold lets it.
func TestDonorThreshold(t *testing.T) {
	doc := prose("alpha", 600)
	half := prose("beta", 600) // another half as long as doc: Jaccard about 1/3
	for _, c := range []struct {
		sim    float64
		reused bool
	}{{0.5, false}, {0.2, true}} {
		o := blendFast
		o.Donor = &Donor{MinSimilarity: c.sim}
		r := start(t, o)
		call(t, r, "/v1/chat/completions", ragBody(prose("sys", 20), "Why?", doc))
		_, u, _ := call(t, r, "/v1/chat/completions", ragBody(prose("other", 20), "How?", doc[:len(doc)/2], half[:len(half)/2]))
		if got := u.Details.Cached > 0; got != c.reused {
			t.Fatalf("MinSimilarity %v: cached %d, want reuse %v", c.sim, u.Details.Cached, c.reused)
		}
	}
	if _, err := New(Options{Donor: &Donor{MinSimilarity: 1.5}}); err == nil {
		t.Fatal("MinSimilarity 1.5 accepted")
	}
	if _, err := New(Options{Donor: &Donor{}, Blend: &Blend{}, Tokenizer: TokenizerWords}); err == nil {
		t.Fatal("Donor with Blend accepted")
	}
}

// TestDonorKeepsToItsModel: a prompt served under an adapter is no donor
// for the base model's prompts, whose KV differs.
func TestDonorKeepsToItsModel(t *testing.T) {
	o := blendFast
	o.Donor = &Donor{}
	o.LoRAs = []string{"sql-lora"}
	r := start(t, o)
	doc := prose("alpha", 800)
	call(t, r, "/v1/chat/completions", strings.Replace(ragBody(prose("sys", 40), "Why?", doc), `"sim-model"`, `"sql-lora"`, 1))
	if _, u, _ := call(t, r, "/v1/chat/completions", ragBody(prose("other", 40), "How?", doc)); u.Details.Cached != 0 {
		t.Fatalf("the base model took %d tokens from an adapter's donor", u.Details.Cached)
	}
	_, u, _ := call(t, r, "/v1/chat/completions", strings.Replace(ragBody(prose("third", 40), "When?", doc), `"sim-model"`, `"sql-lora"`, 1))
	if u.Details.Cached == 0 {
		t.Fatal("the adapter took nothing from its own donor")
	}
}
