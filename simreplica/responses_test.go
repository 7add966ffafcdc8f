package simreplica

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
)

// openaiClient is the official Go SDK's client for r.
func openaiClient(r *Running) openai.Client {
	return openai.NewClient(option.WithBaseURL(r.URL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
}

// missingRequired returns the fields of v, an openai-go SDK struct
// decoded from JSON, that the SDK marks required and the JSON did not
// give (or gave as null).
func missingRequired(v any) []string {
	rv := reflect.ValueOf(v)
	meta := rv.FieldByName("JSON")
	var missing []string
	for i := range rv.NumField() {
		f := rv.Type().Field(i)
		if !strings.Contains(f.Tag.Get("api"), "required") {
			continue
		}
		if m := meta.FieldByName(f.Name); m.IsValid() && !m.Interface().(interface{ Valid() bool }).Valid() {
			missing = append(missing, f.Tag.Get("json"))
		}
	}
	return missing
}

// sdkVariant returns an event's variant as the SDK decodes it, with its
// item's and part's variants where it has them.
func sdkVariants(ev responses.ResponseStreamEventUnion) []any {
	out := []any{ev.AsAny()}
	switch e := ev.AsAny().(type) {
	case responses.ResponseOutputItemAddedEvent:
		out = append(out, e.Item.AsAny())
	case responses.ResponseOutputItemDoneEvent:
		out = append(out, e.Item.AsAny())
	case responses.ResponseContentPartAddedEvent:
		out = append(out, e.Part.AsAny())
	case responses.ResponseContentPartDoneEvent:
		out = append(out, e.Part.AsAny())
	}
	return out
}

// accumulate follows a Responses stream's events as the official JS SDK's
// ResponseStream does for finalResponse(): the snapshot from
// response.created, each item added, each content part added, each text
// or arguments delta appended where its indices say; it fails on an event
// that names an item or part not added, and returns the snapshot's output
// and the completed response's.
func accumulate(t *testing.T, evs []map[string]any) (snapshot, completed []any) {
	t.Helper()
	var snap map[string]any
	item := func(e map[string]any) map[string]any {
		out := snap["output"].([]any)
		i := int(e["output_index"].(float64))
		if i >= len(out) {
			t.Fatalf("%s names output %d of %d", e["type"], i, len(out))
		}
		return out[i].(map[string]any)
	}
	for _, e := range evs {
		if snap == nil && e["type"] != "response.created" {
			t.Fatalf("the first event is %s, not response.created", e["type"])
		}
		switch e["type"] {
		case "response.created":
			snap = e["response"].(map[string]any)
		case "response.output_item.added":
			snap["output"] = append(snap["output"].([]any), e["item"])
		case "response.content_part.added":
			it := item(e)
			it["content"] = append(it["content"].([]any), e["part"])
		case "response.output_text.delta":
			content := item(e)["content"].([]any)
			ci := int(e["content_index"].(float64))
			if ci >= len(content) || content[ci].(map[string]any)["type"] != "output_text" {
				t.Fatalf("a text delta for content %d of %v", ci, content)
			}
			part := content[ci].(map[string]any)
			part["text"] = part["text"].(string) + e["delta"].(string)
		case "response.function_call_arguments.delta":
			it := item(e)
			it["arguments"] = it["arguments"].(string) + e["delta"].(string)
		case "response.completed":
			completed = e["response"].(map[string]any)["output"].([]any)
		}
	}
	return snap["output"].([]any), completed
}

// sameItems reports whether two lists of output items agree but for their
// status (the JS SDK's snapshot keeps the added item's).
func sameItems(a, b []any) bool {
	strip := func(items []any) string {
		var out []any
		for _, it := range items {
			m := map[string]any{}
			for k, v := range it.(map[string]any) {
				if k != "status" {
					m[k] = v
				}
			}
			out = append(out, m)
		}
		s, _ := json.Marshal(out)
		return string(s)
	}
	return strip(a) == strip(b)
}

// A streamed response has every event OpenAI's specification lists, in
// order, each with the fields the official SDK requires and a
// sequence_number from 0; the item's id is the same throughout and in
// GET; the deltas make the completed text, which is the whole answer's.
func TestResponsesStreamEvents(t *testing.T) {
	r := start(t, agentic)
	ctx := context.Background()
	oa := openaiClient(r)
	params := responses.ResponseNewParams{Model: "sim-model", Instructions: openai.String("Answer briefly."),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("What is the capital of Peru?")}, MaxOutputTokens: openai.Int(5)}
	whole, err := oa.Responses.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	st := oa.Responses.NewStreaming(ctx, params)
	var types []string
	var raw []map[string]any
	var deltas strings.Builder
	itemIDs := map[string]bool{}
	var completed responses.Response
	for st.Next() {
		ev := st.Current()
		if int(ev.SequenceNumber) != len(types) || !ev.JSON.SequenceNumber.Valid() {
			t.Fatalf("event %d (%s) has sequence_number %d", len(types), ev.Type, ev.SequenceNumber)
		}
		types = append(types, ev.Type)
		for _, v := range sdkVariants(ev) {
			if m := missingRequired(v); len(m) > 0 {
				t.Fatalf("%s: %T lacks the required %v: %s", ev.Type, v, m, ev.RawJSON())
			}
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(ev.RawJSON()), &m); err != nil {
			t.Fatal(err)
		}
		raw = append(raw, m)
		switch ev.Type {
		case "response.output_text.delta":
			deltas.WriteString(ev.Delta)
			itemIDs[ev.ItemID] = true
		case "response.output_item.added":
			if ev.Item.Status != "in_progress" || len(ev.Item.Content) != 0 {
				t.Fatalf("the item added: %s", ev.RawJSON())
			}
			itemIDs[ev.Item.ID] = true
		case "response.content_part.added", "response.output_text.done", "response.content_part.done":
			itemIDs[ev.ItemID] = true
		case "response.output_item.done":
			itemIDs[ev.Item.ID] = true
		case "response.completed":
			completed = ev.Response
		}
	}
	if st.Err() != nil {
		t.Fatal(st.Err())
	}
	want := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
	for range 5 {
		want = append(want, "response.output_text.delta")
	}
	want = append(want, "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed")
	if !reflect.DeepEqual(types, want) {
		t.Fatalf("events %v, want %v", types, want)
	}
	if len(completed.Output) != 1 || len(itemIDs) != 1 || !itemIDs[completed.Output[0].ID] {
		t.Fatalf("item ids %v, completed %+v", itemIDs, completed.Output)
	}
	if text := completed.OutputText(); text != deltas.String() || text != whole.OutputText() || text == "" {
		t.Fatalf("completed %q, deltas %q, whole answer %q", text, deltas.String(), whole.OutputText())
	}
	u := completed.Usage
	if u.OutputTokens != 5 || u.InputTokens != whole.Usage.InputTokens || u.TotalTokens != u.InputTokens+5 || completed.Status != "completed" {
		t.Fatalf("completed usage %+v, status %s (whole %+v)", u, completed.Status, whole.Usage)
	}
	if done := raw[len(raw)-4]; done["text"] != deltas.String() {
		t.Fatalf("output_text.done %v", done)
	}
	snap, final := accumulate(t, raw)
	if !sameItems(snap, final) {
		t.Fatalf("the JS SDK's snapshot %v, the completed output %v", snap, final)
	}
	// GET gives the same output items.
	resp, err := http.Get(r.URL + "/v1/responses/" + completed.ID)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var got struct {
		Output []any `json:"output"`
	}
	if err := json.Unmarshal(b, &got); err != nil || !reflect.DeepEqual(got.Output, final) {
		t.Fatalf("GET %s: %s, want output %v", completed.ID, b, final)
	}
}
