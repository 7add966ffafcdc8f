package blockhash

import "testing"

// The same tool schemas make the same tools part in each API's shape:
// chat's, the Responses API's (strict left out) and Anthropic's
// (input_schema as parameters, cache_control left out), with each
// schema's own key order kept; a built-in tool is kept whole.
func TestToolsOneFormAcrossAPIs(t *testing.T) {
	const want = `[{"type":"function","function":{"name":"weather","description":"Forecast.","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}},{"type":"web_search"}]`
	bodies := map[Endpoint]string{
		Chat: `{"model":"m","messages":[{"role":"user","content":"q"}],"tools":[
			{"type":"function","function":{"name":"weather","description":"Forecast.","parameters":{"type":"object","properties":{"city":{"type":"string"}}},"strict":true}},
			{"type":"web_search"}]}`,
		Responses: `{"model":"m","input":"q","tools":[
			{"type":"function","name":"weather","description":"Forecast.","strict":true,"parameters":{"type":"object", "properties":{"city":{"type":"string"}}}},
			{"type":"web_search"}]}`,
		Messages: `{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"q"}],"tools":[
			{"name":"weather","description":"Forecast.","input_schema":{"type":"object","properties":{"city":{"type":"string"}}},"cache_control":{"type":"ephemeral"}},
			{"type":"web_search"}]}`,
	}
	for ep, b := range bodies {
		r, err := Parse(ep, []byte(b), Limits{})
		if err != nil {
			t.Fatalf("%v: %v", ep, err)
		}
		if got := string(r.Parts[0].Text); r.Parts[0].Role != RoleTools || got != want {
			t.Errorf("%v: tools part %c %s\nwant %s", ep, r.Parts[0].Role, got, want)
		}
		r.Recycle()
	}
}
