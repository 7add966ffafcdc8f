// OpenAI's official JS SDK, unchanged, against the router: what
// cmd/router/jssdk_test.go runs and checks. Usage: node agent.mjs BASE_URL MODEL
// It prints one JSON object: for each chain, every turn's replica, the
// tokens the router predicted cached (X-Semroute-Matched-Tokens) and the
// engine's usage; and the tool loops' steps.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0 });
const tools = [{ type: "function", name: "read_file", description: "Read a file of the repository.",
  parameters: { type: "object", properties: { path: { type: "string" } }, required: ["path"] } }];
const chatTools = tools.map(({ type, ...fn }) => ({ type, function: fn }));

function turn(response, data) {
  return { replica: response.headers.get("x-semroute-replica"),
    matched: Number(response.headers.get("x-semroute-matched-tokens")),
    input: data.usage.input_tokens, cached: data.usage.input_tokens_details.cached_tokens, id: data.id };
}

// A chain of n turns continued by previous_response_id, whole or streamed.
async function chain(n, stream) {
  const turns = [];
  let prev;
  for (let i = 0; i < n; i++) {
    const params = { model, input: `Turn ${i}: what changed in the build since the last turn, and why?`,
      max_output_tokens: 24, previous_response_id: prev };
    if (!stream) {
      const { data, response } = await client.responses.create(params).withResponse();
      turns.push(turn(response, data));
      prev = data.id;
      continue;
    }
    const { data: events, response } = await client.responses.create({ ...params, stream: true }).withResponse();
    let done;
    for await (const ev of events) {
      if (ev.type === "response.completed") done = ev.response;
    }
    if (!done) throw new Error(`turn ${i}: the stream ended without response.completed`);
    turns.push(turn(response, done));
    prev = done.id;
  }
  return turns;
}

// responses.stream(...).finalResponse(), the SDK's own accumulation,
// continuing a chain.
async function finalResponses(n) {
  const out = [];
  let prev;
  for (let i = 0; i < n; i++) {
    const s = client.responses.stream({ model, input: `Stream turn ${i}.`, max_output_tokens: 8, previous_response_id: prev });
    const r = await s.finalResponse();
    out.push({ id: r.id, text: r.output_text, output: r.output.length, status: r.status });
    prev = r.id;
  }
  return out;
}

// A tool loop of n steps over the Responses API: each answer a
// function_call, whose output goes back with previous_response_id.
async function responsesToolLoop(n) {
  const steps = [];
  let prev, input = "Find where the retry budget is set.";
  for (let i = 0; i < n; i++) {
    const r = await client.responses.create({ model, tools, tool_choice: "required", input, previous_response_id: prev, max_output_tokens: 16 });
    const call = r.output.find((o) => o.type === "function_call");
    if (!call) throw new Error(`responses step ${i}: no function_call in ${JSON.stringify(r.output)}`);
    steps.push({ name: call.name, args: JSON.parse(call.arguments) });
    input = [{ type: "function_call_output", call_id: call.call_id, output: `contents of ${call.name} step ${i}` }];
    prev = r.id;
  }
  return steps;
}

// A tool loop of n steps over chat completions, the history resent.
async function chatToolLoop(n) {
  const steps = [];
  const messages = [{ role: "system", content: "You are a coding agent." }, { role: "user", content: "Find where the retry budget is set." }];
  for (let i = 0; i < n; i++) {
    const c = await client.chat.completions.create({ model, messages, tools: chatTools, tool_choice: "required", max_tokens: 16 });
    const m = c.choices[0].message;
    if (!m.tool_calls?.length) throw new Error(`chat step ${i}: no tool call in ${JSON.stringify(m)}`);
    const call = m.tool_calls[0];
    steps.push({ name: call.function.name, args: JSON.parse(call.function.arguments), finish: c.choices[0].finish_reason });
    messages.push(m, { role: "tool", tool_call_id: call.id, content: `contents step ${i}` });
  }
  return steps;
}

const out = {
  chain: await chain(20, false),
  streamed: await chain(20, true),
  final: await finalResponses(3),
  responsesTools: await responsesToolLoop(5),
  chatTools: await chatToolLoop(5),
};
console.log(JSON.stringify(out));
