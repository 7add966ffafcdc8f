package blockhash

import (
	"errors"
	"strings"
	"testing"
)

// One conversation over the three APIs reads into the same parts: the
// engine renders all three into one chat template, so they share their
// cached prefix, and so do their blocks.
func TestOneConversationOverThreeAPIs(t *testing.T) {
	lim := Limits{MaxMessages: 64}
	chat, err := ParseChat([]byte(`{"model":"m","messages":[
		{"role":"system","content":"You are terse."},
		{"role":"user","content":"First question?"},
		{"role":"assistant","content":"First answer."},
		{"role":"user","content":[{"type":"text","text":"Second "},{"type":"text","text":"question?"}]}]}`), lim)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := ParseResponses([]byte(`{"model":"m","instructions":"You are terse.","max_output_tokens":9,"previous_response_id":"resp_1","input":[
		{"role":"user","content":"First question?"},
		{"type":"message","role":"assistant","content":[{"type":"output_text","text":"First answer."}]},
		{"role":"user","content":[{"type":"input_text","text":"Second "},{"type":"input_text","text":"question?"}]}]}`), lim)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := ParseMessages([]byte(`{"model":"m","max_tokens":9,"system":"You are terse.","messages":[
		{"role":"user","content":"First question?"},
		{"role":"assistant","content":[{"type":"text","text":"First answer."}]},
		{"role":"user","content":[{"type":"text","text":"Second "},{"type":"text","text":"question?"}]}]}`), lim)
	if err != nil {
		t.Fatal(err)
	}
	if resp.PreviousResponseID != "resp_1" || resp.MaxTokens != 9 || msgs.MaxTokens != 9 {
		t.Errorf("previous_response_id %q, max tokens %d and %d", resp.PreviousResponseID, resp.MaxTokens, msgs.MaxTokens)
	}
	for name, r := range map[string]*Request{"responses": resp, "messages": msgs} {
		if len(r.Parts) != len(chat.Parts) {
			t.Fatalf("%s: %d parts, chat %d", name, len(r.Parts), len(chat.Parts))
		}
		for i, p := range r.Parts {
			c := chat.Parts[i]
			if p.Role != c.Role || p.Base != c.Base || string(p.Text) != string(c.Text) || len(p.Segs) != len(c.Segs) {
				t.Errorf("%s part %d: %c %v %q %v; chat's %c %v %q %v", name, i, p.Role, p.Base, p.Text, p.Segs, c.Role, c.Base, c.Text, c.Segs)
			}
		}
	}
}

// Tool calls and their results read as a chat's: the assistant's call as
// name NUL arguments, the result as a tool part; the question is the last
// user message.
func TestAgenticToolTurns(t *testing.T) {
	lim := Limits{}
	resp, err := ParseResponses([]byte(`{"model":"m","tools":[{"type":"function","name":"f","parameters":{}}],"input":[
		{"role":"user","content":"Weather?"},
		{"type":"function_call","call_id":"c1","name":"weather","arguments":"{\"city\":\"Oslo\"}"},
		{"type":"function_call_output","call_id":"c1","output":"rain"},
		{"type":"reasoning","summary":[]}]}`), lim)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		role byte
		base Kind
		text string
	}{
		{RoleTools, KindTools, `[{"type":"function","function":{"name":"f","parameters":{}}}]`},
		{RoleUser, KindUserQuery, "Weather?"},
		{RoleAssistant, KindAssistantHistory, "\x00weather\x00{\"city\":\"Oslo\"}"},
		{RoleTool, KindToolOutput, "rain"},
		{RoleAssistant, KindOther, `{"summary":[],"type":"reasoning"}`},
	}
	check := func(name string, r *Request) {
		t.Helper()
		if len(r.Parts) != len(want) {
			t.Fatalf("%s: %d parts", name, len(r.Parts))
		}
		for i, w := range want {
			if p := r.Parts[i]; p.Role != w.role || p.Base != w.base || string(p.Text) != w.text {
				t.Errorf("%s part %d: %c %v %q, want %c %v %q", name, i, p.Role, p.Base, p.Text, w.role, w.base, w.text)
			}
		}
	}
	check("responses", resp)
	msgs, err := ParseMessages([]byte(`{"model":"m","max_tokens":5,"tools":[{"type":"function","name":"f","parameters":{}}],"messages":[
		{"role":"user","content":"Weather?"},
		{"role":"assistant","content":[{"type":"tool_use","id":"c1","name":"weather","input":{"city":"Oslo"}}]},
		{"role":"user","content":[{"type":"tool_result","tool_use_id":"c1","content":"rain"}]},
		{"role":"assistant","content":[{"type":"thinking","summary":[]}]}]}`), lim)
	if err != nil {
		t.Fatal(err)
	}
	want[4] = struct {
		role byte
		base Kind
		text string
	}{RoleAssistant, KindAssistantHistory, `{"summary":[],"type":"thinking"}`}
	check("messages", msgs)
}

func TestAgenticBadInput(t *testing.T) {
	for _, c := range []struct {
		ep   Endpoint
		body string
		want string
	}{
		{Responses, `{"model":"m"}`, "input: is required"},
		{Responses, `{"model":"m","input":[]}`, "input: must not be empty"},
		{Responses, `{"model":"m","input":5}`, "input: must be a string or an array"},
		{Responses, `{"model":"m","input":"x","store":"no"}`, "store: must be a boolean"},
		{Responses, `{"model":"m","input":[1]}`, "input[0]: must be an object"},
		{Responses, `{"model":"m","input":"x","instructions":3}`, "instructions: must be a string"},
		{Responses, `{"model":"m","input":"x","previous_response_id":3}`, "previous_response_id"},
		{Responses, `{"model":"m","input":[{"role":"user","role":"system","content":"x"}]}`, "input[0].role"},
		{Responses, `{"model":"m","input":[{"type":"function_call","name":1,"arguments":"{}"}]}`, "name and arguments must be strings"},
		{Responses, `{"model":"m","input":"a","input":"b"}`, "input"},
		{Responses, `{"model":"m","input":[{"role":"user","content":"1"},{"role":"user","content":"2"},{"role":"user","content":"3"}]}`, "more than the limit of 2"},
		{Messages, `{"model":"m","max_tokens":1}`, "messages: is required"},
		{Messages, `{"model":"m","messages":[{"role":"tool","content":"x"}]}`, "unknown role"},
		{Messages, `{"model":"m","messages":[{"content":"x"}]}`, "messages[0].role: is required"},
		{Messages, `{"model":"m","system":5,"messages":[{"role":"user","content":"x"}]}`, "system: must be a string or an array"},
		{Messages, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":5}]}]}`, "messages[0].content[0].text: must be a string"},
		{Messages, `{"model":"m","messages":[{"role":"user","content":[7]}]}`, "messages[0].content[0]: must be an object"},
		{Messages, `{"model":"m","tools":{},"messages":[{"role":"user","content":"x"}]}`, "tools: must be an array"},
		{Messages, `{"messages":[{"role":"user","content":"x"}]}`, "model: is required"},
	} {
		_, err := Parse(c.ep, []byte(c.body), Limits{MaxMessages: 2})
		var ie *InputError
		if err == nil || !errors.As(err, &ie) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err %v, want an input error with %q", c.body, err, c.want)
		}
	}
}

// Claude Code's billing header, a system block that changes with every
// request, is left out as vLLM leaves it out: the same system prompt makes
// the same blocks; a system message among the messages is a system part.
func TestMessagesBillingHeaderAndSystemRole(t *testing.T) {
	parse := func(cch string) *Request {
		r, err := ParseMessages([]byte(`{"model":"m","max_tokens":1,"system":[{"type":"text","text":"x-anthropic-billing-header: cch=`+cch+`"},{"type":"text","text":"You are Claude Code."}],
			"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hi"}]}`), Limits{})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	a, b := parse("1"), parse("2")
	if string(a.Parts[0].Text) != "You are Claude Code." || string(a.Parts[0].Text) != string(b.Parts[0].Text) {
		t.Fatalf("system part %q and %q", a.Parts[0].Text, b.Parts[0].Text)
	}
	if a.Parts[1].Role != RoleSystem || string(a.Parts[1].Text) != "Be brief." || a.Parts[2].Base != KindUserQuery {
		t.Fatalf("parts %+v", a.Parts)
	}
}
