package main

import (
	"context"
	"encoding/json"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/openai/openai-go/v3/shared"

	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/simreplica"
)

// agentSim is fastSim with a prefill whose cost shows: 50 µs a token, so
// that computing a loop's prompt again costs more than the wait a peer's
// request may seem to impose before its end reaches this router.
var agentSim = simreplica.Options{Overhead: time.Millisecond, PrefillPerToken: 50 * time.Microsecond, InterToken: 100 * time.Microsecond, OutputTokens: 4}

// toolLoopSteps is the steps of each tool loop.
const toolLoopSteps = 5

// readFile is the loops' one tool's parameters.
var readFileParams = map[string]any{"type": "object", "properties": map[string]any{"path": map[string]any{"type": "string"}}, "required": []string{"path"}}

// turnOf reads the router's prediction and replica from an answer's headers.
func turnOf(api string, hr *http.Response, prompt, cached int64) chainTurn {
	matched, _ := strconv.Atoi(hr.Header.Get("X-Semroute-Matched-Tokens"))
	return chainTurn{api: api, replica: hr.Header.Get("X-Semroute-Replica"), matched: matched, prompt: prompt, cached: cached}
}

// chatToolLoop runs a tool loop over chat completions, the history resent.
func chatToolLoop(t *testing.T, oa openai.Client, model, system string, tool func()) []chainTurn {
	t.Helper()
	tools := []openai.ChatCompletionToolUnionParam{openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
		Name: "read_file", Description: openai.String("Read a file of the repository."), Parameters: readFileParams})}
	msgs := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(system), openai.UserMessage("Find where the retry budget is set.")}
	var turns []chainTurn
	for i := range toolLoopSteps {
		var hr *http.Response
		c, err := oa.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: model, Messages: msgs, Tools: tools,
			ToolChoice: openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")}, MaxTokens: openai.Int(16)}, option.WithResponseInto(&hr))
		if err != nil {
			t.Fatalf("chat step %d: %v", i, err)
		}
		m := c.Choices[0].Message
		if len(m.ToolCalls) == 0 || c.Choices[0].FinishReason != "tool_calls" {
			t.Fatalf("chat step %d: no tool call: %+v", i, c.Choices[0])
		}
		turns = append(turns, turnOf("chat", hr, c.Usage.PromptTokens, c.Usage.PromptTokensDetails.CachedTokens))
		tool()
		msgs = append(msgs, m.ToParam(), openai.ToolMessage("contents of step "+strconv.Itoa(i), m.ToolCalls[0].ID))
	}
	return turns
}

// responsesToolLoop runs a tool loop over the Responses API, each call's
// output sent back with previous_response_id.
func responsesToolLoop(t *testing.T, oa openai.Client, model string, tool func()) []chainTurn {
	t.Helper()
	tools := []responses.ToolUnionParam{responses.ToolParamOfFunction("read_file", readFileParams, false)}
	input := responses.ResponseNewParamsInputUnion{OfString: openai.String("Find where the retry budget is set.")}
	var turns []chainTurn
	prev := ""
	for i := range toolLoopSteps {
		p := responses.ResponseNewParams{Model: model, Tools: tools, Input: input, MaxOutputTokens: openai.Int(16),
			ToolChoice: responses.ResponseNewParamsToolChoiceUnion{OfToolChoiceMode: openai.Opt(responses.ToolChoiceOptionsRequired)}}
		if prev != "" {
			p.PreviousResponseID = openai.String(prev)
		}
		var hr *http.Response
		r, err := oa.Responses.New(context.Background(), p, option.WithResponseInto(&hr))
		if err != nil {
			t.Fatalf("responses step %d: %v", i, err)
		}
		var call *responses.ResponseFunctionToolCall
		for _, o := range r.Output {
			if o.Type == "function_call" {
				fc := o.AsFunctionCall()
				call = &fc
			}
		}
		if call == nil || !json.Valid([]byte(call.Arguments)) {
			t.Fatalf("responses step %d: no function call: %+v", i, r.Output)
		}
		turns = append(turns, turnOf("responses", hr, r.Usage.InputTokens, r.Usage.InputTokensDetails.CachedTokens))
		tool()
		out := responses.ResponseInputItemParamOfFunctionCallOutput("contents of step " + strconv.Itoa(i))
		out.OfFunctionCallOutput.CallID = openai.String(call.CallID)
		input, prev = responses.ResponseNewParamsInputUnion{OfInputItemList: responses.ResponseInputParam{out}}, r.ID
	}
	return turns
}

// messagesToolLoop runs a tool loop over Anthropic's Messages API, the
// conversation resent with each tool use and its result.
func messagesToolLoop(t *testing.T, an anthropic.Client, model, system string, tool func()) []chainTurn {
	t.Helper()
	tools := []anthropic.ToolUnionParam{anthropic.ToolUnionParamOfTool(anthropic.ToolInputSchemaParam{
		Properties: readFileParams["properties"], Required: []string{"path"}}, "read_file")}
	msgs := []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Find where the retry budget is set."))}
	var turns []chainTurn
	for i := range toolLoopSteps {
		var hr *http.Response
		m, err := an.Messages.New(context.Background(), anthropic.MessageNewParams{Model: anthropic.Model(model), MaxTokens: 16, Tools: tools,
			System: []anthropic.TextBlockParam{{Text: system}}, Messages: msgs,
			ToolChoice: anthropic.ToolChoiceUnionParam{OfAny: &anthropic.ToolChoiceAnyParam{}}}, aoption.WithResponseInto(&hr))
		if err != nil {
			t.Fatalf("messages step %d: %v", i, err)
		}
		var use *anthropic.ToolUseBlock
		for _, b := range m.Content {
			if b.Type == "tool_use" {
				u := b.AsToolUse()
				use = &u
			}
		}
		if use == nil || m.StopReason != "tool_use" {
			t.Fatalf("messages step %d: no tool use: %+v", i, m)
		}
		turns = append(turns, turnOf("messages", hr, m.Usage.InputTokens+m.Usage.CacheReadInputTokens, m.Usage.CacheReadInputTokens))
		tool()
		msgs = append(msgs, m.ToParam(), anthropic.NewUserMessage(anthropic.NewToolResultBlock(use.ID, "contents of step "+strconv.Itoa(i), false)))
	}
	return turns
}

// idle waits until every router of d counts no request in flight on any
// replica and has applied every KV event batch the replicas published: a
// step's end has reached every router, as it has when a tool runs between
// two steps (the tests' engines answer in a millisecond, before a fleet's
// records and the engines' events of it arrive).
func idle(t *testing.T, d *demo) {
	t.Helper()
	apps := d.apps
	if len(apps) == 0 {
		apps = []*app{d.app}
	}
	testwait.Until(t, "every router to see no request in flight and every event", func() bool {
		var published uint64
		for _, s := range d.sims {
			published += s.KVEventsPublished()
		}
		for _, a := range apps {
			applied := uint64(0)
			a.events.mu.Lock()
			for _, f := range a.events.by {
				applied += f.Stats().Subscriber.Applied
			}
			a.events.mu.Unlock()
			if applied < published {
				return false
			}
		}
		for _, u := range routerURLs(d) {
			for _, l := range strings.Split(scrapeURL(t, u), "\n") {
				if strings.HasPrefix(l, "semroute_replica_in_flight{") && !strings.HasSuffix(l, " 0") {
					return false
				}
			}
		}
		return true
	})
}

// patientTokenizer returns a config giving /tokenize 10 s, not 50 ms: a
// request whose tokens come late is routed on the estimate, whose blocks
// are not the engine's, and the tests that compare predictions with the
// engine's cached tokens run beside the race detector on two cores.
func patientTokenizer(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tokenizer.yaml")
	writeConfig(t, path, "tokenizer:\n  timeout: 10s\n")
	return path
}

// forAgentSetups runs fn against the demo in precise mode (agentSim's
// replicas publishing KV events) and against two such routers behind a
// round-robin front, each a subtest.
func forAgentSetups(t *testing.T, fn func(t *testing.T, d *demo)) {
	for _, c := range []struct {
		name string
		o    demoOptions
	}{
		{"demo", demoOptions{sim: agentSim, picture: "events"}},
		{"two routers", demoOptions{sim: agentSim, picture: "events", routers: 2}},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.o.config = patientTokenizer(t)
			d := startTestDemo(t, c.o)
			waitSubscribed(t, d)
			fn(t, d)
		})
	}
}

// Tool loops of five steps over each API, through the official Go SDKs
// unchanged, against the demo in precise mode and two routers behind a
// round-robin front: every step is a tool call the next step answers,
// each loop stays on one replica, and from the third step the tokens the
// router predicts cached are within 10% of the engine's.
func TestToolLoopsThroughTheGoSDKs(t *testing.T) {
	forAgentSetups(t, func(t *testing.T, d *demo) {
		model := d.sims[0].Options().Model
		// Each loop its own agent's system prompt: one shared by every
		// request would be hot (routing.EngineOptions.HotUses), credited to
		// every replica, and a loop's short history would not hold it home.
		system := func(api string) string {
			return text("You are a "+api+" coding agent in a monorepo; use the tools.", 300)
		}
		oa := openai.NewClient(option.WithBaseURL(d.router.URL()+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
		an := anthropic.NewClient(aoption.WithBaseURL(d.router.URL()), aoption.WithAPIKey("unused"), aoption.WithMaxRetries(0))
		tool := func() { idle(t, d) }
		for name, turns := range map[string][]chainTurn{
			"chat":      chatToolLoop(t, oa, model, system("chat"), tool),
			"responses": responsesToolLoop(t, oa, model, tool),
			"messages":  messagesToolLoop(t, an, model, system("messages"), tool),
		} {
			for i, s := range turns[1:] {
				if s.replica != turns[0].replica {
					t.Errorf("%s step %d went to %s, the loop began on %s", name, i+1, s.replica, turns[0].replica)
				}
			}
			checkPredicted(t, name, 0.1, turns)
		}
	})
}
