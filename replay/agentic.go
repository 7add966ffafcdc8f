package replay

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"strings"
)

// generateAgentic writes the "agentic" workload: sessions that are the
// multi-step tool loops of coding and operations agents, each speaking
// one of o.APIs.
//
//   - Each of o.Tenants tenants has a long system prompt (1,000–3,000
//     tokens) and its own 12–30 function tools, whose schemas (names from
//     one catalogue, arguments and descriptions the tenant's own) come to
//     2,000–5,000 tokens.
//   - A session is a task of 3–12 steps. Each step is a request of the
//     whole history so far: the tenant's tools and system prompt, the task,
//     then each earlier step's tool call (name and JSON arguments) and the
//     tool's output. Every step's reply is a tool call but the last one's,
//     which is text. Tool outputs are 20–3,000 tokens, lognormal (median
//     150); a read-type tool's output (a file, a listing, a page) is a
//     third of the time one of o.Docs outputs that recur across sessions
//     and tenants, drawn Zipf(o.ZipfS, o.ZipfV), as a popular file is read
//     again and again.
//   - The next step arrives when the reply has been decoded (its output
//     tokens × 20 ms) and the tool has run: lognormal, median 0.5 s, at
//     most 10 s. Sessions arrive Poisson at o.Rate a second; o.ThinkSeconds
//     is not used.
//   - A session speaks one API: chat completions (tool_calls and tool
//     messages), the Responses API (instructions, input items of
//     function_call and function_call_output, store false and the whole
//     history every step, as Codex-style clients send it) or Anthropic's
//     Messages API (system, tool_use and tool_result blocks, max_tokens).
//     The same session renders the same prompt in each (blockhash reads
//     all three as the chat the engine renders), so a tenant's sessions
//     share its prefix whichever API each speaks.
//
// Each line's "api" names its API. The output depends only on o.
func generateAgentic(w io.Writer, o GenOptions) error {
	apis, err := agenticAPIs(o.APIs)
	if err != nil {
		return err
	}
	zs, zv, err := zipfParams(o)
	if err != nil {
		return err
	}
	g := newAgenticGen(o, zs, zv)
	t := 0.0
	for s := 0; s < o.Sessions; s++ {
		t += g.rng.ExpFloat64() / o.Rate
		g.session(s, t, apis[g.apiRNG.IntN(len(apis))])
	}
	return writeLines(w, g.out)
}

// agenticAPIs checks GenOptions.APIs; empty means all three.
func agenticAPIs(apis []string) ([]string, error) {
	if len(apis) == 0 {
		return []string{apiChat, apiResponses, apiMessages}, nil
	}
	for _, a := range apis {
		if a != apiChat && a != apiResponses && a != apiMessages {
			return nil, fmt.Errorf("gentrace: unknown API %q (have chat, responses, messages)", a)
		}
	}
	return apis, nil
}

// zipfParams returns o's Zipf exponent and offset (defaults 1.1 and 2),
// or an error if they are out of range.
func zipfParams(o GenOptions) (zs, zv float64, err error) {
	zs, zv = cmp.Or(o.ZipfS, 1.1), cmp.Or(o.ZipfV, 2)
	if zs <= 1 || zv < 1 {
		return 0, 0, fmt.Errorf("gentrace: Zipf exponent %v must be > 1 and offset %v ≥ 1", zs, zv)
	}
	return zs, zv, nil
}

// agenticGen generates the agentic workload (generateAgentic): what its
// requests draw from, the draws and the requests so far.
type agenticGen struct {
	o       GenOptions
	rng     *rand.Rand                   // the sessions' draws
	apiRNG  *rand.Rand                   // each session's API, apart from the rest
	systems []string                     // each tenant's system prompt
	tools   [][]agentTool                // each tenant's tools
	schemas []map[string]json.RawMessage // each tenant's tools' JSON, by API
	outputs []string                     // tool outputs that recur across sessions
	outZipf *rand.Zipf                   // their popularity
	out     []genLine
}

// agentTool is a tenant's tool and the arguments its calls give.
type agentTool struct {
	toolDef
	args []agentArg
	read bool // it reads something (a file, a page): its output may recur
}

// agentArg is a tool's argument: its name, its JSON type, and whether a
// call's value is long (a file's content, a patch: the call's reply is
// then long).
type agentArg struct {
	name, typ string
	long      bool
}

// agentArgs are the arguments the tools draw from; long ones go only to
// the tools that write.
var agentArgs = []agentArg{
	{"path", "string", false}, {"pattern", "string", false}, {"command", "string", false},
	{"query", "string", false}, {"limit", "integer", false}, {"offset", "integer", false},
	{"namespace", "string", false}, {"name", "string", false}, {"url", "string", false},
	{"id", "string", false}, {"message", "string", false}, {"timeout_seconds", "integer", false},
}

// agentToolNames is the catalogue of tool names; a tenant takes 12–30 of
// them. Those starting with read, list, get, search, grep, fetch, describe
// or open read; write, edit and apply take a long argument.
var agentToolNames = []string{
	"read_file", "write_file", "edit_file", "apply_patch", "list_directory", "search_code", "grep",
	"run_shell", "run_tests", "git_status", "git_diff", "git_log", "git_commit", "fetch_url", "web_search",
	"query_database", "describe_table", "get_pods", "get_logs", "describe_deployment", "get_metrics",
	"search_logs", "create_ticket", "update_ticket", "send_message", "restart_service", "scale_deployment",
	"read_config", "write_config", "list_alerts", "open_issue", "get_issue", "build_project", "lint",
	"find_references", "get_definition",
}

// fixed returns a generator whose draws depend on seed alone.
func (g *agenticGen) fixed(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0xa6e)) }

// newAgenticGen makes the tenants' system prompts and tools and the
// recurring tool outputs, drawn with Zipf(zs, zv) popularity.
func newAgenticGen(o GenOptions, zs, zv float64) *agenticGen {
	g := &agenticGen{o: o, rng: rand.New(rand.NewPCG(o.Seed, o.Seed^0xa6e47)), apiRNG: rand.New(rand.NewPCG(o.Seed, 0xa915)),
		systems: make([]string, o.Tenants), tools: make([][]agentTool, o.Tenants), schemas: make([]map[string]json.RawMessage, o.Tenants),
		outputs: make([]string, o.Docs)}
	for t := range o.Tenants {
		r := g.fixed(uint64(t))
		g.systems[t] = fmt.Sprintf("You are the coding and operations agent of tenant %d. ", t) + words("s", (1000+r.IntN(2001))*2/3, r)
		g.tools[t] = tenantTools(t, r)
		defs := make([]toolDef, len(g.tools[t]))
		for k := range defs {
			defs[k] = g.tools[t][k].toolDef
		}
		g.schemas[t] = map[string]json.RawMessage{}
		for _, api := range []string{apiChat, apiResponses, apiMessages} {
			g.schemas[t][api] = toolsJSON(api, defs)
		}
	}
	for d := range g.outputs {
		r := g.fixed(uint64(50000 + d))
		g.outputs[d] = fmt.Sprintf("File %d:\n", d) + words("f", outputTokens(r)*2/3, r)
	}
	g.outZipf = rand.NewZipf(g.rng, zs, zv, uint64(o.Docs-1))
	return g
}

// tenantTools returns tenant t's tools, drawn from r: 12–30 of the
// catalogue, their schemas 2,000–5,000 tokens in all.
func tenantTools(t int, r *rand.Rand) []agentTool {
	names := append([]string(nil), agentToolNames...)
	r.Shuffle(len(names), func(i, j int) { names[i], names[j] = names[j], names[i] })
	names = names[:12+r.IntN(19)]
	perTool := (2000 + r.IntN(3001)) * 4 / len(names) // bytes of schema each, at 4 bytes a token
	tools := make([]agentTool, len(names))
	for k, name := range names {
		tools[k] = newAgentTool(t, name, perTool, r)
	}
	return tools
}

// newAgentTool returns tenant t's tool name: 1–4 arguments, and a
// description long enough that its schema is about size bytes.
func newAgentTool(t int, name string, size int, r *rand.Rand) agentTool {
	tool := agentTool{toolDef: toolDef{name: name}, read: hasAnyPrefix(name, "read", "list", "get", "search", "grep", "fetch", "describe", "open")}
	for _, k := range r.Perm(len(agentArgs))[:1+r.IntN(4)] {
		tool.args = append(tool.args, agentArgs[k])
	}
	if hasAnyPrefix(name, "write", "edit", "apply") {
		tool.args = append(tool.args, agentArg{"content", "string", true})
	}
	props := map[string]any{}
	required := []string{}
	for i, a := range tool.args {
		props[a.name] = map[string]any{"type": a.typ, "description": words("p", 5+r.IntN(16), r)}
		if i == 0 || a.long {
			required = append(required, a.name)
		}
	}
	tool.parameters = map[string]any{"type": "object", "properties": props, "required": required, "additionalProperties": false}
	bare := toolsJSON(apiChat, []toolDef{tool.toolDef})
	tool.description = fmt.Sprintf("Tenant %d's %s. ", t, strings.ReplaceAll(name, "_", " ")) +
		words("d", max(8, (size-len(bare))/6), r) // a pseudo-word is about 6 bytes
	return tool
}

// hasAnyPrefix reports whether s starts with one of prefixes.
func hasAnyPrefix(s string, prefixes ...string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// lognormal returns a draw of exp(N(ln median, sigma²)) from r, clamped to
// [lo, hi]: a heavy tail, bounded.
func lognormal(r *rand.Rand, median, sigma, lo, hi float64) float64 {
	return min(max(median*math.Exp(sigma*r.NormFloat64()), lo), hi)
}

// outputTokens draws a tool output's length in tokens: 20–3,000,
// lognormal with median 150.
func outputTokens(r *rand.Rand) int { return int(lognormal(r, 150, 1.3, 20, 3000)) }

// toolSeconds draws the time a tool takes to run, in seconds: lognormal
// with median 0.5 s, at most 10 s.
func toolSeconds(r *rand.Rand) float64 { return lognormal(r, 0.5, 1, 0.01, 10) }

// agentStep is one step of a session's history: the assistant's tool call
// (its id, the tool's name, the arguments' JSON) and the tool's output.
type agentStep struct {
	id, name, args, output string
	tokens                 int // the call's output tokens
}

// session generates session s, arriving at seconds and speaking api: a
// tenant's task of 3–12 steps.
func (g *agenticGen) session(s int, at float64, api string) {
	rng := g.rng
	tenant := rng.IntN(g.o.Tenants)
	steps := 3 + rng.IntN(10)
	task := fmt.Sprintf("Task %d: ", s) + words("u", 15+rng.IntN(120), rng)
	var hist []agentStep
	for k := 0; k < steps; k++ {
		body := g.body(api, tenant, task, hist)
		outTokens := 40 + rng.IntN(400) // the last step's answer
		var step agentStep
		if k < steps-1 {
			step = g.call(s, k, tenant)
			outTokens = step.tokens
		}
		line := newLine(at, s, tenant, body, outTokens)
		line.API = api
		g.out = append(g.out, line)
		at += float64(outTokens)*0.02 + toolSeconds(rng)
		hist = append(hist, step)
	}
}

// call draws step k of session s of tenant: a call of one of its tools
// and the tool's output.
func (g *agenticGen) call(s, k, tenant int) agentStep {
	rng := g.rng
	tools := g.tools[tenant]
	tool := tools[rng.IntN(len(tools))]
	if rng.IntN(2) == 0 { // the first few tools are the ones most used
		tool = tools[rng.IntN(3)]
	}
	args := map[string]any{}
	for _, a := range tool.args {
		switch {
		case a.long:
			args[a.name] = strings.ReplaceAll(words("w", 30+rng.IntN(400), rng), "\n", " ")
		case a.typ == "integer":
			args[a.name] = rng.IntN(500)
		default:
			args[a.name] = fmt.Sprintf("%s/%s%d", tool.name, a.name, rng.IntN(200))
		}
	}
	b, _ := json.Marshal(args)
	st := agentStep{id: fmt.Sprintf("call_%d_%d", s, k), name: tool.name, args: string(b), tokens: (len(tool.name)+len(b))/4 + 8}
	if tool.read && rng.IntN(3) == 0 {
		st.output = g.outputs[g.outZipf.Uint64()]
	} else {
		st.output = words("o", outputTokens(rng)*2/3, rng)
	}
	return st
}

// body returns the request body of a step of tenant's task in api, after
// the steps hist.
func (g *agenticGen) body(api string, tenant int, task string, hist []agentStep) map[string]any {
	system, tools := g.systems[tenant], g.schemas[tenant][api]
	switch api {
	case apiResponses:
		return responsesBody(system, tools, task, hist)
	case apiMessages:
		return messagesBody(system, tools, task, hist)
	}
	return chatBody(system, tools, task, hist)
}

// chatBody is a step's /v1/chat/completions body: the system message, the
// task, then each step's assistant tool call and tool message.
func chatBody(system string, tools json.RawMessage, task string, hist []agentStep) map[string]any {
	msgs := []map[string]any{{"role": "system", "content": system}, {"role": "user", "content": task}}
	for _, st := range hist {
		msgs = append(msgs, map[string]any{"role": "assistant", "content": nil, "tool_calls": []map[string]any{{"id": st.id, "type": "function",
			"function": map[string]any{"name": st.name, "arguments": st.args}}}},
			map[string]any{"role": "tool", "tool_call_id": st.id, "content": st.output})
	}
	return map[string]any{"model": "sim-model", "messages": msgs, "tools": tools, "stream": true}
}

// responsesBody is a step's /v1/responses body: instructions, the task as
// a user message item, then each step's function_call and
// function_call_output items; the whole history, nothing stored.
func responsesBody(system string, tools json.RawMessage, task string, hist []agentStep) map[string]any {
	input := []map[string]any{{"type": "message", "role": "user", "content": []map[string]any{{"type": "input_text", "text": task}}}}
	for _, st := range hist {
		input = append(input, map[string]any{"type": "function_call", "call_id": st.id, "name": st.name, "arguments": st.args},
			map[string]any{"type": "function_call_output", "call_id": st.id, "output": st.output})
	}
	return map[string]any{"model": "sim-model", "instructions": system, "tools": tools, "input": input, "store": false, "stream": true}
}

// messagesBody is a step's Anthropic /v1/messages body: system, the task,
// then each step's assistant tool_use block and user tool_result block.
func messagesBody(system string, tools json.RawMessage, task string, hist []agentStep) map[string]any {
	msgs := []map[string]any{{"role": "user", "content": []map[string]any{{"type": "text", "text": task}}}}
	for _, st := range hist {
		msgs = append(msgs, map[string]any{"role": "assistant", "content": []map[string]any{{"type": "tool_use", "id": st.id, "name": st.name, "input": json.RawMessage(st.args)}}},
			map[string]any{"role": "user", "content": []map[string]any{{"type": "tool_result", "tool_use_id": st.id, "content": st.output}}})
	}
	return map[string]any{"model": "sim-model", "system": system, "tools": tools, "messages": msgs, "max_tokens": 4096, "stream": true}
}
