package replay

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
)

// GenOptions shape a synthetic openai-format trace. Zero fields take the
// defaults.
type GenOptions struct {
	Seed     uint64
	Sessions int     // default 2,000
	Rate     float64 // new sessions per second; default 2
	Tenants  int     // default 8
	Docs     int     // documents in the retrieval corpus; default 300
	// ThinkSeconds is the mean time between a session's turns. Default 20.
	ThinkSeconds float64
	// Workload is "mixed" (the default: GenerateOpenAI's mix) or "blend",
	// where reuse past the exact prefix matters (see generateBlend).
	Workload string
	// Blend workload only. Documents and tool outputs are drawn with
	// Zipf popularity, P(k) ∝ (ZipfV + k)^−ZipfS over k = 0 … Docs−1:
	// ZipfS > 1 (default 1.1), ZipfV ≥ 1 (default 2); a larger ZipfV
	// flattens the head, so that fewer documents are popular enough for
	// every replica to hold. AgentShare is the share of sessions that are
	// agents rather than RAG: default 0.3; negative means none.
	ZipfS, ZipfV float64
	AgentShare   float64
	// Topics, when positive, makes a RAG turn retrieve by topic, as
	// similar questions retrieve the same documents: a topic drawn with the
	// same Zipf popularity from Topics, each a fixed set of 2–4 documents
	// of the pool, of which one is swapped for another document a quarter
	// of the time. Zero: every turn draws its documents on its own.
	Topics int
}

// GenerateOpenAI writes a synthetic trace in the openai format: a mix of
// retrieval (RAG) sessions, multi-turn chats and tool-using agents over
// tenants with their own system prompts (and tool schemas for agents).
//
//   - RAG: one user message holding an instruction, then a retrieved
//     document (Zipf-popular over the corpus, sometimes with its sections
//     reordered), then a question; instructions vary, so the same document
//     often follows a different prefix.
//   - Chat: the history grows by the assistant's reply and a new question.
//   - Agent: tool schemas, then tool calls and tool outputs in the history.
//
// Arrivals are Poisson; a session's turns are separated by exponential think
// times. Replies are deterministic text of output_tokens words, repeated in
// the next turn's history, so replies can be linked. The output depends only
// on o.
func GenerateOpenAI(w io.Writer, o GenOptions) error {
	if o.Sessions == 0 {
		o.Sessions = 2000
	}
	if o.Rate == 0 {
		o.Rate = 2
	}
	if o.Tenants == 0 {
		o.Tenants = 8
	}
	if o.Docs == 0 {
		o.Docs = 300
	}
	if o.ThinkSeconds == 0 {
		o.ThinkSeconds = 20
	}
	if o.Sessions < 0 || o.Rate <= 0 || o.Tenants < 1 || o.Docs < 1 || o.ThinkSeconds < 0 {
		return fmt.Errorf("gen: sessions, rate, tenants, docs and think time must be positive")
	}
	switch o.Workload {
	case "", "mixed":
	case "blend":
		return generateBlend(w, o)
	default:
		return fmt.Errorf("gen: unknown workload %q (have mixed, blend)", o.Workload)
	}
	rng := rand.New(rand.NewPCG(o.Seed, o.Seed^0x5eed))
	fixed := func(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 77)) }
	systems := make([]string, o.Tenants)
	tools := make([]json.RawMessage, o.Tenants)
	for t := range systems {
		systems[t] = fmt.Sprintf("You are the assistant of tenant %d. ", t) + words("s", 150+fixed(uint64(t)).IntN(300), fixed(uint64(t)))
		tools[t] = toolSchemas(6, func(k int) (string, string) {
			return fmt.Sprintf("tool_%d_%d", t, k), words("d", 40, fixed(uint64(t*100+k)))
		})
	}
	docs := make([][]string, o.Docs) // sections
	for d := range docs {
		r := fixed(uint64(1000 + d))
		for s := 0; s < 3+r.IntN(5); s++ {
			docs[d] = append(docs[d], fmt.Sprintf("Section %d of document %d. ", s, d)+words("c", 120+r.IntN(300), r))
		}
	}
	instructions := []string{
		"Summarise the document below.", "Answer from the document below only.",
		"List the key facts in the document below.", "Translate the document below into plain English.",
		"Find contradictions in the document below.", "Extract every date in the document below.",
	}
	zipf := rand.NewZipf(rng, 1.2, 2, uint64(o.Docs-1))
	var out []genLine
	t := 0.0
	for s := 0; s < o.Sessions; s++ {
		t += rng.ExpFloat64() / o.Rate
		tenant := rng.IntN(o.Tenants)
		kind := rng.IntN(10) // 0-4 RAG, 5-7 chat, 8-9 agent
		turns := 1 + rng.IntN(6)
		msgs := []map[string]any{{"role": "system", "content": systems[tenant]}}
		at := t
		for turn := 0; turn < turns; turn++ {
			var user string
			switch {
			case kind < 5:
				d := docs[zipf.Uint64()]
				sections := append([]string(nil), d...)
				if rng.IntN(4) == 0 {
					rng.Shuffle(len(sections), func(i, j int) { sections[i], sections[j] = sections[j], sections[i] })
				}
				user = instructions[rng.IntN(len(instructions))] + "\n<document>\n" + strings.Join(sections, "\n") + "\n</document>\nQuestion: " + words("q", 10+rng.IntN(20), rng)
			default:
				user = words("u", 15+rng.IntN(60), rng)
			}
			msgs = append(msgs, map[string]any{"role": "user", "content": user})
			body := map[string]any{"model": "sim-model", "messages": append([]map[string]any(nil), msgs...), "stream": true}
			if kind >= 8 {
				body["tools"] = tools[tenant]
			}
			outTokens := 30 + rng.IntN(300)
			out = append(out, genLine{int64(at * 1000), fmt.Sprintf("s%d", s), fmt.Sprintf("t%d", tenant), body, outTokens})
			reply := map[string]any{"role": "assistant", "content": words("a", outTokens*2/3, fixed(uint64(s*100+turn)))}
			if kind >= 8 {
				call := fmt.Sprintf("call_%d_%d", s, turn)
				reply["content"] = nil
				reply["tool_calls"] = []map[string]any{{"id": call, "type": "function",
					"function": map[string]any{"name": fmt.Sprintf("tool_%d_%d", tenant, turn%6), "arguments": `{"q":"x"}`}}}
				msgs = append(msgs, reply, map[string]any{"role": "tool", "tool_call_id": call, "content": words("o", 80+rng.IntN(200), rng)})
			} else {
				msgs = append(msgs, reply)
			}
			at += rng.ExpFloat64()*o.ThinkSeconds + float64(outTokens)*0.02
		}
	}
	return writeLines(w, out)
}

// words returns n pseudo-words tagged tag drawn from r, with a line break
// every 17.
func words(tag string, n int, r *rand.Rand) string {
	var sb strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&sb, "%s%d ", tag, r.IntN(4000))
		if i%17 == 16 {
			sb.WriteString(".\n")
		}
	}
	return sb.String()
}

// genLine is one request of a generated trace.
type genLine struct {
	TimestampMS  int64          `json:"timestamp_ms"`
	SessionID    string         `json:"session_id"`
	TenantID     string         `json:"tenant_id"`
	Request      map[string]any `json:"request"`
	OutputTokens int            `json:"output_tokens"`
}

// generateBlend writes the "blend" workload: requests whose reusable
// parts recur after different prefixes and in different orders, where an
// engine that blends segments (CacheBlend) gains and one that reuses the
// exact prefix alone does not.
//
//   - RAG (1 − o.AgentShare of sessions, 1–2 turns): a system prompt drawn from
//     o.Tenants × 4 personas, then one user message whose content parts
//     are an instruction (one of 6), 2–4 documents drawn Zipf(o.ZipfS,
//     o.ZipfV) from a pool of o.Docs (each 200–500 words), or those of a
//     topic (o.Topics), each its own content part, in a random order, and
//     a paraphrased question.
//   - Agents (o.AgentShare of sessions, 2–4 turns): the tenant's system
//     prompt and tool schemas, then tool calls whose outputs (150–400
//     words) are drawn the same way from a pool of o.Docs shared by every
//     session: the same lookups recur across sessions, after different
//     histories.
//
// Arrivals are Poisson at o.Rate sessions per second, turns o.ThinkSeconds
// apart on average. The output depends only on o.
func generateBlend(w io.Writer, o GenOptions) error {
	rng := rand.New(rand.NewPCG(o.Seed, o.Seed^0xb1e4d))
	fixed := func(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 91)) }
	personas := make([]string, o.Tenants*4)
	for i := range personas {
		personas[i] = fmt.Sprintf("You are persona %d of tenant %d. ", i%4, i/4) + words("s", 60+fixed(uint64(i)).IntN(120), fixed(uint64(i)))
	}
	tools := make([]json.RawMessage, o.Tenants)
	for t := range tools {
		tools[t] = toolSchemas(4, func(k int) (string, string) {
			return fmt.Sprintf("lookup_%d", k), words("d", 30, fixed(uint64(5000+t*10+k)))
		})
	}
	docs := make([]string, o.Docs)
	outputs := make([]string, o.Docs)
	for d := range docs {
		r := fixed(uint64(10000 + d))
		docs[d] = fmt.Sprintf("Document %d. ", d) + words("c", 200+r.IntN(300), r)
		outputs[d] = fmt.Sprintf("Result %d: ", d) + words("o", 150+r.IntN(250), r)
	}
	instructions := []string{
		"Answer from the documents only.", "Summarise what the documents say.", "Compare the documents.",
		"List the facts the documents share.", "Which document answers best?", "Quote the relevant lines.",
	}
	zs, zv := cmp.Or(o.ZipfS, 1.1), cmp.Or(o.ZipfV, 2)
	if zs <= 1 || zv < 1 {
		return fmt.Errorf("gentrace: Zipf exponent %v must be > 1 and offset %v ≥ 1", zs, zv)
	}
	if o.Topics < 0 {
		return fmt.Errorf("gentrace: topics %d is negative", o.Topics)
	}
	agents := cmp.Or(o.AgentShare, 0.3)
	docZipf := rand.NewZipf(rng, zs, zv, uint64(o.Docs-1))
	outZipf := rand.NewZipf(rng, zs, zv, uint64(o.Docs-1))
	var topics [][]uint64
	var topicZipf *rand.Zipf
	if o.Topics > 0 {
		topics = make([][]uint64, o.Topics)
		for k := range topics {
			r := fixed(uint64(20000 + k))
			for n := 2 + r.IntN(3); len(topics[k]) < min(n, o.Docs); {
				if d := uint64(r.IntN(o.Docs)); !slices.Contains(topics[k], d) {
					topics[k] = append(topics[k], d)
				}
			}
		}
		topicZipf = rand.NewZipf(rng, zs, zv, uint64(o.Topics-1))
	}
	var out []genLine
	t := 0.0
	for s := 0; s < o.Sessions; s++ {
		t += rng.ExpFloat64() / o.Rate
		tenant := rng.IntN(o.Tenants)
		agent := rng.Float64() < agents
		at := t
		if !agent {
			msgs := []map[string]any{{"role": "system", "content": personas[tenant*4+rng.IntN(4)]}}
			for turn := 0; turn < 1+rng.IntN(2); turn++ {
				parts := []map[string]string{{"type": "text", "text": instructions[rng.IntN(len(instructions))]}}
				picked := map[uint64]bool{}
				if topicZipf != nil {
					topic := topics[topicZipf.Uint64()]
					for _, d := range topic {
						picked[d] = true
					}
					if rng.IntN(4) == 0 { // the retriever ranks another document in
						delete(picked, topic[rng.IntN(len(topic))])
						for len(picked) < len(topic) {
							picked[docZipf.Uint64()] = true
						}
					}
				} else {
					for n := 2 + rng.IntN(3); len(picked) < n; {
						picked[docZipf.Uint64()] = true
					}
				}
				order := make([]uint64, 0, len(picked))
				for d := range picked {
					order = append(order, d)
				}
				slices.Sort(order)
				rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
				for _, d := range order {
					parts = append(parts, map[string]string{"type": "text", "text": docs[d]})
				}
				parts = append(parts, map[string]string{"type": "text", "text": "Question: " + words("q", 8+rng.IntN(16), rng)})
				msgs = append(msgs, map[string]any{"role": "user", "content": parts})
				outTokens := 30 + rng.IntN(200)
				body := map[string]any{"model": "sim-model", "messages": append([]map[string]any(nil), msgs...), "stream": true}
				out = append(out, genLine{int64(at * 1000), fmt.Sprintf("s%d", s), fmt.Sprintf("t%d", tenant), body, outTokens})
				msgs = append(msgs, map[string]any{"role": "assistant", "content": words("a", outTokens*2/3, fixed(uint64(s*100+turn)))})
				at += rng.ExpFloat64()*o.ThinkSeconds + float64(outTokens)*0.02
			}
			continue
		}
		msgs := []map[string]any{{"role": "system", "content": personas[tenant*4]}, {"role": "user", "content": words("u", 20+rng.IntN(30), rng)}}
		for turn := 0; turn < 2+rng.IntN(3); turn++ {
			outTokens := 20 + rng.IntN(60)
			body := map[string]any{"model": "sim-model", "messages": append([]map[string]any(nil), msgs...), "stream": true, "tools": tools[tenant]}
			out = append(out, genLine{int64(at * 1000), fmt.Sprintf("s%d", s), fmt.Sprintf("t%d", tenant), body, outTokens})
			call := fmt.Sprintf("call_%d_%d", s, turn)
			msgs = append(msgs, map[string]any{"role": "assistant", "content": nil, "tool_calls": []map[string]any{{"id": call, "type": "function",
				"function": map[string]any{"name": fmt.Sprintf("lookup_%d", turn%4), "arguments": `{"q":"x"}`}}}},
				map[string]any{"role": "tool", "tool_call_id": call, "content": outputs[outZipf.Uint64()]})
			at += rng.ExpFloat64()*o.ThinkSeconds/4 + float64(outTokens)*0.02
		}
	}
	return writeLines(w, out)
}

// toolSchemas returns the JSON of n function tools, tool k named and
// described by def(k), each taking one string argument q.
func toolSchemas(n int, def func(k int) (name, description string)) json.RawMessage {
	var schema []map[string]any
	for k := range n {
		name, desc := def(k)
		schema = append(schema, map[string]any{"type": "function", "function": map[string]any{
			"name": name, "description": desc,
			"parameters": map[string]any{"type": "object", "properties": map[string]any{"q": map[string]string{"type": "string"}}},
		}})
	}
	b, _ := json.Marshal(schema)
	return b
}

// writeLines writes a generated trace's requests in arrival order.
func writeLines(w io.Writer, out []genLine) error {
	sort.SliceStable(out, func(i, j int) bool { return out[i].TimestampMS < out[j].TimestampMS })
	enc := json.NewEncoder(w)
	for i := range out {
		if err := enc.Encode(&out[i]); err != nil {
			return err
		}
	}
	return nil
}
