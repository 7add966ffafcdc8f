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
	// Workload is "mixed" (the default: GenerateOpenAI's mix), "blend",
	// where reuse past the exact prefix matters (see generateBlend), or
	// "agentic", multi-step tool loops over three APIs (see
	// generateAgentic).
	Workload string
	// Blend and agentic workloads. Documents and tool outputs are drawn with
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
	// APIs, agentic workload only, are the APIs its sessions speak, each
	// session one of them drawn uniformly: "chat" (/v1/chat/completions),
	// "responses" (/v1/responses) or "messages" (Anthropic's /v1/messages).
	// Nil or empty: all three. The draw is a stream of its own, so the
	// same seed makes the same sessions whatever the list.
	APIs []string
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
	o, err := o.withDefaults()
	if err != nil {
		return err
	}
	switch o.Workload {
	case "", "mixed":
		return generateMixed(w, o)
	case "blend":
		return generateBlend(w, o)
	case "agentic":
		return generateAgentic(w, o)
	}
	return fmt.Errorf("gen: unknown workload %q (have mixed, blend, agentic)", o.Workload)
}

// withDefaults returns o with its zero fields at their defaults, or an
// error if one is out of range.
func (o GenOptions) withDefaults() (GenOptions, error) {
	o.Sessions = cmp.Or(o.Sessions, 2000)
	o.Rate = cmp.Or(o.Rate, 2)
	o.Tenants = cmp.Or(o.Tenants, 8)
	o.Docs = cmp.Or(o.Docs, 300)
	o.ThinkSeconds = cmp.Or(o.ThinkSeconds, 20)
	if o.Sessions < 0 || o.Rate <= 0 || o.Tenants < 1 || o.Docs < 1 || o.ThinkSeconds < 0 {
		return o, fmt.Errorf("gen: sessions, rate, tenants, docs and think time must be positive")
	}
	return o, nil
}

// mixedGen generates the mixed workload (GenerateOpenAI): what its
// requests draw from, the draws and the requests so far.
type mixedGen struct {
	o       GenOptions
	rng     *rand.Rand
	zipf    *rand.Zipf        // the documents' popularity
	systems []string          // each tenant's system prompt
	tools   []json.RawMessage // each tenant's tool schemas
	docs    [][]string        // each document's sections
	out     []genLine
}

// mixedInstructions start a RAG turn's user message.
var mixedInstructions = []string{
	"Summarise the document below.", "Answer from the document below only.",
	"List the key facts in the document below.", "Translate the document below into plain English.",
	"Find contradictions in the document below.", "Extract every date in the document below.",
}

// generateMixed writes the mixed workload (GenerateOpenAI).
func generateMixed(w io.Writer, o GenOptions) error {
	g := newMixedGen(o)
	t := 0.0
	for s := 0; s < o.Sessions; s++ {
		t += g.rng.ExpFloat64() / o.Rate
		g.session(s, t)
	}
	return writeLines(w, g.out)
}

// fixed returns a generator whose draws depend on seed alone.
func (g *mixedGen) fixed(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 77)) }

// newMixedGen makes the tenants' system prompts and tools and the
// documents.
func newMixedGen(o GenOptions) *mixedGen {
	g := &mixedGen{o: o, rng: rand.New(rand.NewPCG(o.Seed, o.Seed^0x5eed)),
		systems: make([]string, o.Tenants), tools: make([]json.RawMessage, o.Tenants), docs: make([][]string, o.Docs)}
	for t := range g.systems {
		g.systems[t] = fmt.Sprintf("You are the assistant of tenant %d. ", t) + words("s", 150+g.fixed(uint64(t)).IntN(300), g.fixed(uint64(t)))
		g.tools[t] = toolSchemas(6, func(k int) (string, string) {
			return fmt.Sprintf("tool_%d_%d", t, k), words("d", 40, g.fixed(uint64(t*100+k)))
		})
	}
	for d := range g.docs {
		r := g.fixed(uint64(1000 + d))
		for s := 0; s < 3+r.IntN(5); s++ {
			g.docs[d] = append(g.docs[d], fmt.Sprintf("Section %d of document %d. ", s, d)+words("c", 120+r.IntN(300), r))
		}
	}
	g.zipf = rand.NewZipf(g.rng, 1.2, 2, uint64(o.Docs-1))
	return g
}

// session generates session s, arriving at t seconds: a tenant's system
// prompt, then 1–6 turns of a RAG session, a chat or an agent.
func (g *mixedGen) session(s int, t float64) {
	rng := g.rng
	tenant := rng.IntN(g.o.Tenants)
	kind := rng.IntN(10) // 0-4 RAG, 5-7 chat, 8-9 agent
	agent := kind >= 8
	turns := 1 + rng.IntN(6)
	msgs := []map[string]any{{"role": "system", "content": g.systems[tenant]}}
	at := t
	for turn := 0; turn < turns; turn++ {
		msgs = append(msgs, map[string]any{"role": "user", "content": g.userText(kind < 5)})
		body := map[string]any{"model": "sim-model", "messages": append([]map[string]any(nil), msgs...), "stream": true}
		if agent {
			body["tools"] = g.tools[tenant]
		}
		outTokens := 30 + rng.IntN(300)
		g.out = append(g.out, newLine(at, s, tenant, body, outTokens))
		msgs = g.reply(msgs, s, turn, tenant, agent, outTokens)
		at += rng.ExpFloat64()*g.o.ThinkSeconds + float64(outTokens)*0.02
	}
}

// userText returns a user message: for RAG an instruction, a document
// (Zipf-popular, its sections reordered a quarter of the time) and a
// question; else words.
func (g *mixedGen) userText(rag bool) string {
	rng := g.rng
	if !rag {
		return words("u", 15+rng.IntN(60), rng)
	}
	d := g.docs[g.zipf.Uint64()]
	sections := append([]string(nil), d...)
	if rng.IntN(4) == 0 {
		rng.Shuffle(len(sections), func(i, j int) { sections[i], sections[j] = sections[j], sections[i] })
	}
	return mixedInstructions[rng.IntN(len(mixedInstructions))] + "\n<document>\n" + strings.Join(sections, "\n") + "\n</document>\nQuestion: " + words("q", 10+rng.IntN(20), rng)
}

// reply appends the assistant's reply to turn of session s, of outTokens
// tokens, to msgs: text, or an agent's tool call and the tool's output.
func (g *mixedGen) reply(msgs []map[string]any, s, turn, tenant int, agent bool, outTokens int) []map[string]any {
	reply := map[string]any{"role": "assistant", "content": words("a", outTokens*2/3, g.fixed(uint64(s*100+turn)))}
	if !agent {
		return append(msgs, reply)
	}
	call := fmt.Sprintf("call_%d_%d", s, turn)
	reply["content"] = nil
	reply["tool_calls"] = []map[string]any{{"id": call, "type": "function",
		"function": map[string]any{"name": fmt.Sprintf("tool_%d_%d", tenant, turn%6), "arguments": `{"q":"x"}`}}}
	return append(msgs, reply, map[string]any{"role": "tool", "tool_call_id": call, "content": words("o", 80+g.rng.IntN(200), g.rng)})
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
	// API is the API the request is for (ReadOpenAI's "api"); "": told
	// by its body, chat or completions.
	API string `json:"api,omitempty"`
}

// newLine returns the line of a request of session s of tenant,
// arriving at seconds, with outTokens output tokens.
func newLine(at float64, s, tenant int, body map[string]any, outTokens int) genLine {
	return genLine{int64(at * 1000), fmt.Sprintf("s%d", s), fmt.Sprintf("t%d", tenant), body, outTokens, ""}
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
	zs, zv, err := zipfParams(o)
	if err != nil {
		return err
	}
	if o.Topics < 0 {
		return fmt.Errorf("gentrace: topics %d is negative", o.Topics)
	}
	g := newBlendGen(o, zs, zv)
	agents := cmp.Or(o.AgentShare, 0.3)
	t := 0.0
	for s := 0; s < o.Sessions; s++ {
		t += g.rng.ExpFloat64() / o.Rate
		tenant := g.rng.IntN(o.Tenants)
		if g.rng.Float64() < agents {
			g.agentSession(s, tenant, t)
		} else {
			g.ragSession(s, tenant, t)
		}
	}
	return writeLines(w, g.out)
}

// blendGen generates the blend workload (generateBlend): what its
// requests draw from, the draws and the requests so far.
type blendGen struct {
	o                GenOptions
	rng              *rand.Rand
	personas         []string          // o.Tenants × 4 system prompts
	tools            []json.RawMessage // each tenant's tool schemas
	docs, outputs    []string          // what RAG retrieves, what agents' tools answer
	docZipf, outZipf *rand.Zipf        // their popularity
	topics           [][]uint64        // each topic's documents (o.Topics)
	topicZipf        *rand.Zipf        // the topics' popularity; nil without topics
	out              []genLine
}

// blendInstructions start a RAG turn's user message.
var blendInstructions = []string{
	"Answer from the documents only.", "Summarise what the documents say.", "Compare the documents.",
	"List the facts the documents share.", "Which document answers best?", "Quote the relevant lines.",
}

// fixed returns a generator whose draws depend on seed alone.
func (g *blendGen) fixed(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 91)) }

// newBlendGen makes the personas, the tools, the documents, the tool
// outputs and the topics, drawn with Zipf(zs, zv) popularity.
func newBlendGen(o GenOptions, zs, zv float64) *blendGen {
	g := &blendGen{o: o, rng: rand.New(rand.NewPCG(o.Seed, o.Seed^0xb1e4d)), personas: make([]string, o.Tenants*4),
		tools: make([]json.RawMessage, o.Tenants), docs: make([]string, o.Docs), outputs: make([]string, o.Docs)}
	for i := range g.personas {
		g.personas[i] = fmt.Sprintf("You are persona %d of tenant %d. ", i%4, i/4) + words("s", 60+g.fixed(uint64(i)).IntN(120), g.fixed(uint64(i)))
	}
	for t := range g.tools {
		g.tools[t] = toolSchemas(4, func(k int) (string, string) {
			return fmt.Sprintf("lookup_%d", k), words("d", 30, g.fixed(uint64(5000+t*10+k)))
		})
	}
	for d := range g.docs {
		r := g.fixed(uint64(10000 + d))
		g.docs[d] = fmt.Sprintf("Document %d. ", d) + words("c", 200+r.IntN(300), r)
		g.outputs[d] = fmt.Sprintf("Result %d: ", d) + words("o", 150+r.IntN(250), r)
	}
	g.docZipf = rand.NewZipf(g.rng, zs, zv, uint64(o.Docs-1))
	g.outZipf = rand.NewZipf(g.rng, zs, zv, uint64(o.Docs-1))
	if o.Topics > 0 {
		g.topics = make([][]uint64, o.Topics)
		for k := range g.topics {
			r := g.fixed(uint64(20000 + k))
			for n := 2 + r.IntN(3); len(g.topics[k]) < min(n, o.Docs); {
				if d := uint64(r.IntN(o.Docs)); !slices.Contains(g.topics[k], d) {
					g.topics[k] = append(g.topics[k], d)
				}
			}
		}
		g.topicZipf = rand.NewZipf(g.rng, zs, zv, uint64(o.Topics-1))
	}
	return g
}

// ragSession generates RAG session s of tenant, arriving at seconds: one
// of the tenant's personas, then 1–2 turns of an instruction, the
// documents retrieved and a question.
func (g *blendGen) ragSession(s, tenant int, at float64) {
	rng := g.rng
	msgs := []map[string]any{{"role": "system", "content": g.personas[tenant*4+rng.IntN(4)]}}
	for turn := 0; turn < 1+rng.IntN(2); turn++ {
		parts := []map[string]string{{"type": "text", "text": blendInstructions[rng.IntN(len(blendInstructions))]}}
		for _, d := range g.retrieve() {
			parts = append(parts, map[string]string{"type": "text", "text": g.docs[d]})
		}
		parts = append(parts, map[string]string{"type": "text", "text": "Question: " + words("q", 8+rng.IntN(16), rng)})
		msgs = append(msgs, map[string]any{"role": "user", "content": parts})
		outTokens := 30 + rng.IntN(200)
		body := map[string]any{"model": "sim-model", "messages": append([]map[string]any(nil), msgs...), "stream": true}
		g.out = append(g.out, newLine(at, s, tenant, body, outTokens))
		msgs = append(msgs, map[string]any{"role": "assistant", "content": words("a", outTokens*2/3, g.fixed(uint64(s*100+turn)))})
		at += rng.ExpFloat64()*g.o.ThinkSeconds + float64(outTokens)*0.02
	}
}

// retrieve returns the documents of a RAG turn in a random order: a
// topic's, another document ranked in for one of them a quarter of the
// time, or without topics 2–4 drawn on their own.
func (g *blendGen) retrieve() []uint64 {
	rng := g.rng
	picked := map[uint64]bool{}
	if g.topicZipf != nil {
		topic := g.topics[g.topicZipf.Uint64()]
		for _, d := range topic {
			picked[d] = true
		}
		if rng.IntN(4) == 0 { // the retriever ranks another document in
			delete(picked, topic[rng.IntN(len(topic))])
			for len(picked) < len(topic) {
				picked[g.docZipf.Uint64()] = true
			}
		}
	} else {
		for n := 2 + rng.IntN(3); len(picked) < n; {
			picked[g.docZipf.Uint64()] = true
		}
	}
	order := make([]uint64, 0, len(picked))
	for d := range picked {
		order = append(order, d)
	}
	slices.Sort(order)
	rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	return order
}

// agentSession generates agent session s of tenant, arriving at seconds:
// the tenant's first persona, a user message, then 2–4 turns each ending
// in a tool call whose output is drawn from the shared pool.
func (g *blendGen) agentSession(s, tenant int, at float64) {
	rng := g.rng
	msgs := []map[string]any{{"role": "system", "content": g.personas[tenant*4]}, {"role": "user", "content": words("u", 20+rng.IntN(30), rng)}}
	for turn := 0; turn < 2+rng.IntN(3); turn++ {
		outTokens := 20 + rng.IntN(60)
		body := map[string]any{"model": "sim-model", "messages": append([]map[string]any(nil), msgs...), "stream": true, "tools": g.tools[tenant]}
		g.out = append(g.out, newLine(at, s, tenant, body, outTokens))
		call := fmt.Sprintf("call_%d_%d", s, turn)
		msgs = append(msgs, map[string]any{"role": "assistant", "content": nil, "tool_calls": []map[string]any{{"id": call, "type": "function",
			"function": map[string]any{"name": fmt.Sprintf("lookup_%d", turn%4), "arguments": `{"q":"x"}`}}}},
			map[string]any{"role": "tool", "tool_call_id": call, "content": g.outputs[g.outZipf.Uint64()]})
		at += rng.ExpFloat64()*g.o.ThinkSeconds/4 + float64(outTokens)*0.02
	}
}

// toolSchemas returns the JSON of n function tools in chat's shape, tool
// k named and described by def(k), each taking one string argument q.
func toolSchemas(n int, def func(k int) (name, description string)) json.RawMessage {
	tools := make([]toolDef, n)
	for k := range tools {
		tools[k].name, tools[k].description = def(k)
		tools[k].parameters = map[string]any{"type": "object", "properties": map[string]any{"q": map[string]string{"type": "string"}}}
	}
	return toolsJSON(apiChat, tools)
}

// toolDef is a function tool: its name, its description and the JSON
// schema of its arguments.
type toolDef struct {
	name, description string
	parameters        map[string]any
}

// The APIs a generated request may be for (genLine.API, GenOptions.APIs).
const (
	apiChat      = "chat"
	apiResponses = "responses"
	apiMessages  = "messages"
)

// toolsJSON returns the JSON of tools in api's shape: chat's {type:
// function, function: {name, description, parameters}}, the Responses
// API's {type: function, name, description, parameters}, or Anthropic's
// {name, description, input_schema}. Keys come in sorted order.
func toolsJSON(api string, tools []toolDef) json.RawMessage {
	out := make([]map[string]any, len(tools))
	for i, t := range tools {
		switch api {
		case apiResponses:
			out[i] = map[string]any{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
		case apiMessages:
			out[i] = map[string]any{"name": t.name, "description": t.description, "input_schema": t.parameters}
		default:
			out[i] = map[string]any{"type": "function", "function": map[string]any{"name": t.name, "description": t.description, "parameters": t.parameters}}
		}
	}
	b, _ := json.Marshal(out)
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
