package simreplica

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// prose returns n distinct words seeded by tag.
func prose(tag string, n int) string {
	r := rand.New(rand.NewPCG(uint64(len(tag)), uint64(tag[0])))
	var b strings.Builder
	fmt.Fprintf(&b, "%s.", tag)
	for range n {
		fmt.Fprintf(&b, " %s%d", tag, r.IntN(100000))
	}
	return b.String()
}

// ragBody is a chat request whose user message holds an instruction, the
// documents as content parts, and a question.
func ragBody(system, question string, docs ...string) string {
	parts := []map[string]string{{"type": "text", "text": "Answer from the documents."}}
	for _, d := range docs {
		parts = append(parts, map[string]string{"type": "text", "text": d})
	}
	parts = append(parts, map[string]string{"type": "text", "text": question})
	b, _ := json.Marshal(map[string]any{"model": "sim-model", "messages": []map[string]any{
		{"role": "system", "content": system}, {"role": "user", "content": parts}}})
	return string(b)
}

// tokens returns the word tokenizer's count for text alone.
func tokens(t *testing.T, r *Running, text string) int {
	return len(r.Tokenizer().Encode(nil, []byte(text), false))
}

var blendFast = Options{Overhead: time.Microsecond, PrefillPerToken: time.Nanosecond, InterToken: time.Microsecond, OutputTokens: 2}

// reusesNothingPlain checks that a replica reusing the exact prefix alone
// (neither Blend nor Donor) reuses nothing of first in second, whose
// system prompt differs.
func reusesNothingPlain(t *testing.T, first, second string) {
	t.Helper()
	plain := start(t, blendFast)
	call(t, plain, "/v1/chat/completions", first)
	if _, u, _ := call(t, plain, "/v1/chat/completions", second); u.Details.Cached != 0 {
		t.Fatalf("an exact-prefix replica, after another system prompt, reused %d tokens", u.Details.Cached)
	}
}

// TestBlendReusesDocumentsAnywhere: a blending replica reuses a document
// after another system prompt and in another order, computing the
// recompute share again; a replica without Blend reuses nothing there;
// the question is never reused; usage, Stats and the external prefix
// cache counters agree.
func TestBlendReusesDocumentsAnywhere(t *testing.T) {
	a, b := prose("alpha", 400), prose("beta", 300)
	first := ragBody(prose("sys", 50), "Why?", a, b)
	second := ragBody(prose("other", 60), "How?", b, a)

	reusesNothingPlain(t, first, second)

	o := blendFast
	o.Blend = &Blend{}
	r := start(t, o)
	if _, u, _ := call(t, r, "/v1/chat/completions", first); u.Details.Cached != 0 {
		t.Fatalf("first request: %d cached", u.Details.Cached)
	}
	_, u, body := call(t, r, "/v1/chat/completions", second)
	// Each document is found by its tokens but the first and last; 85% of
	// those are not computed.
	want := 0
	for _, d := range []string{a, b} {
		n := tokens(t, r, d) - 2
		want += n - (n*15+99)/100
	}
	if u.Details.Cached != want {
		t.Fatalf("second request: cached %d, want %d (documents reused at 85%%): %s", u.Details.Cached, want, body)
	}
	st := r.Stats()
	if st.ReusedTokens != int64(want) || st.CachedTokens != int64(want) {
		t.Fatalf("stats %+v, want %d reused", st, want)
	}
	m := metricValues(t, r)
	if m["vllm:external_prefix_cache_hits_total"] != fmt.Sprint(want) || m["vllm:prefix_cache_hits_total"] != "0" {
		t.Fatalf("external hits %s, prefix hits %s; want %d and 0", m["vllm:external_prefix_cache_hits_total"], m["vllm:prefix_cache_hits_total"], want)
	}

	// The same question sent as a document's place is not a document.
	if _, u, _ := call(t, r, "/v1/chat/completions", ragBody(prose("third", 40), a)); u.Details.Cached != 0 {
		t.Fatalf("a question reused %d tokens", u.Details.Cached)
	}

	// The exact prefix comes first: the same request again is a prefix hit,
	// and nothing of it is counted twice.
	_, u, _ = call(t, r, "/v1/chat/completions", second)
	if p := u.Prompt; u.Details.Cached < p-r.Options().BlockSize-1 || u.Details.Cached >= p {
		t.Fatalf("repeat: cached %d of %d", u.Details.Cached, p)
	}

	r.Restart()
	if _, u, _ := call(t, r, "/v1/chat/completions", ragBody(prose("fourth", 50), "When?", a)); u.Details.Cached != 0 {
		t.Fatalf("after a restart, %d tokens reused", u.Details.Cached)
	}
}

// TestBlendStoreBudget: segments past the store's budget are evicted, least
// recently used first.
func TestBlendStoreBudget(t *testing.T) {
	a, b, c := prose("alpha", 300), prose("beta", 300), prose("gamma", 300)
	o := blendFast
	r0 := start(t, o)
	o.Blend = &Blend{BudgetTokens: 2*tokens(t, r0, a) + 10} // two documents
	r := start(t, o)
	call(t, r, "/v1/chat/completions", ragBody(prose("s1", 40), "q1", a, b))
	call(t, r, "/v1/chat/completions", ragBody(prose("s2", 40), "q2", c)) // evicts a
	_, u, _ := call(t, r, "/v1/chat/completions", ragBody(prose("s3", 40), "q3", a))
	if u.Details.Cached != 0 {
		t.Fatalf("evicted document reused: %d", u.Details.Cached)
	}
	_, u, _ = call(t, r, "/v1/chat/completions", ragBody(prose("s4", 40), "q4", c))
	if u.Details.Cached == 0 {
		t.Fatal("a stored document was not reused")
	}
	if n, held := r.blend.held(); n != 2 || held > o.Blend.BudgetTokens {
		t.Fatalf("store holds %d segments, %d tokens; budget %d", n, held, o.Blend.BudgetTokens)
	}
}

// TestBlendComputesWhatItDoesNotReuse: what the engine computed (and so
// the time to first token) is only what a reused document left: the
// prompt tokens (vllm:prompt_tokens_total, every prompt token as vLLM
// counts them) less the prefix cache's and the external cache's hits.
func TestBlendComputesWhatItDoesNotReuse(t *testing.T) {
	o := blendFast
	o.Blend = &Blend{}
	r := start(t, o)
	doc := prose("delta", 1500)
	_, u1, _ := call(t, r, "/v1/chat/completions", ragBody(prose("s1", 20), "q", doc))
	_, u2, _ := call(t, r, "/v1/chat/completions", ragBody(prose("s2", 20), "q", doc))
	if u2.Details.Cached < u2.Prompt/2 {
		t.Fatalf("reused %d of %d", u2.Details.Cached, u2.Prompt)
	}
	m := metricValues(t, r)
	num := func(name string) int64 {
		v, err := strconv.ParseInt(m[name], 10, 64)
		if err != nil {
			t.Fatalf("%s: %q", name, m[name])
		}
		return v
	}
	if got := num("vllm:prompt_tokens_total"); got != int64(u1.Prompt+u2.Prompt) {
		t.Fatalf("vllm:prompt_tokens_total %d, want every prompt token, %d", got, u1.Prompt+u2.Prompt)
	}
	computed := num("vllm:prompt_tokens_total") - num("vllm:prefix_cache_hits_total") - num("vllm:external_prefix_cache_hits_total")
	if want := int64(u1.Prompt + u2.Prompt - u2.Details.Cached); computed != want {
		t.Fatalf("prompt tokens computed %d, want %d", computed, want)
	}
}

func TestBlendOptionsChecked(t *testing.T) {
	for _, o := range []Options{
		{Blend: &Blend{Recompute: 1}},
		{Blend: &Blend{Recompute: -0.1}},
		{Blend: &Blend{}, Tokenizer: TokenizerBytes},
	} {
		if _, err := New(o); err == nil {
			t.Errorf("%+v: no error", *o.Blend)
		}
	}
}

func TestIndexIDs(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		hay := make([]int32, r.IntN(60))
		for i := range hay {
			hay[i] = int32(r.IntN(3))
		}
		needle := make([]int32, 1+r.IntN(4))
		for i := range needle {
			needle[i] = int32(r.IntN(3))
		}
		want := -1
		for i := 0; i+len(needle) <= len(hay); i++ {
			if slices.Equal(hay[i:i+len(needle)], needle) {
				want = i
				break
			}
		}
		if got := indexIDs(hay, needle); got != want {
			t.Fatalf("indexIDs(%v, %v) = %d, want %d", hay, needle, got, want)
		}
	}
}

// A document that starts with whitespace is found all the same: the
// template's newline before it joins that whitespace into one token.
func TestBlendDocumentStartingWithWhitespace(t *testing.T) {
	o := blendFast
	o.Blend = &Blend{}
	r := start(t, o)
	doc := "\n\n  " + prose("epsilon", 300)
	call(t, r, "/v1/chat/completions", ragBody(prose("s1", 30), "q", doc))
	if _, u, _ := call(t, r, "/v1/chat/completions", ragBody(prose("s2", 40), "q", doc)); u.Details.Cached < 200 {
		t.Fatalf("reused %d tokens of a 300-word document", u.Details.Cached)
	}
}

// held returns the segments and tokens stored.
func (s *blendStore) held() (segments, tokens int) { return s.store.Held() }
