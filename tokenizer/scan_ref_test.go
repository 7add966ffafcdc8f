package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"testing"

	"github.com/semroute/semroute/blockhash"
)

// topLevelRef is topLevel the slow, obviously right way: encoding/json's
// tokenizer reads the object's keys (unescaped, matched exactly) and each
// value as raw JSON.
func topLevelRef(data []byte, names []string) ([][]byte, error) {
	raw := make([][]byte, len(names))
	d := json.NewDecoder(bytes.NewReader(data))
	if tok, err := d.Token(); err != nil || tok != json.Delim('{') {
		return nil, errNotJSONObject
	}
	for d.More() {
		tok, err := d.Token()
		if err != nil {
			return nil, err
		}
		var v json.RawMessage
		if err := d.Decode(&v); err != nil {
			return nil, err
		}
		for i, n := range names {
			if tok.(string) == n {
				if raw[i] != nil {
					return nil, &dupError{Field: n}
				}
				raw[i] = v
			}
		}
	}
	return raw, nil
}

// FuzzTopLevel holds topLevel to topLevelRef on every JSON object: the
// same values, byte for byte, and the same field refused as given twice.
// On anything else it must only not panic.
func FuzzTopLevel(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"A"}],"MESSAGES":[]}`,
		`{"m\u0065ssages":[1],"tools":{"a":"}\"]"},"tools" : null}`,
		`{ "add_generation_prompt" : false , "chat_template_kwargs" : { "x" : [ 1 , 2 ] } }`,
		`{"prompt":"a\\","add_special_tokens":true}`,
		`{}`, ` { } `, `{"a":1}`, `[1]`, `"x"`, `{"a":`, `{"messages":[1,2}`, `{"prompt":"unterminated}`,
		`{"prompt":12.5e3,"x":true,"y":null,"z":-0}`,
	} {
		f.Add([]byte(s))
	}
	names := append(append([]string{}, chatFields...), completionFields[0])
	f.Fuzz(func(t *testing.T, data []byte) {
		raw := make([][]byte, len(names))
		err := topLevel(data, names, raw)
		if !json.Valid(data) || bytes.TrimSpace(data)[0] != '{' {
			return
		}
		want, wantErr := topLevelRef(data, names)
		var dup, wantDup *dupError
		if errors.As(wantErr, &wantDup) {
			if !errors.As(err, &dup) || dup.Field != wantDup.Field {
				t.Fatalf("%q: %v, want %s given twice", data, err, wantDup.Field)
			}
			return
		}
		if wantErr != nil {
			t.Fatalf("reference: %v", wantErr)
		}
		if err != nil {
			t.Fatalf("%q: %v", data, err)
		}
		for i := range names {
			if !bytes.Equal(raw[i], want[i]) || (raw[i] == nil) != (want[i] == nil) {
				t.Fatalf("%q: %s = %q, want %q", data, names[i], raw[i], want[i])
			}
		}
	})
}

// TestTopLevelAgreesWithTheParser: where the router's parser accepts a
// chat body, the model it read is the body's "model" as topLevel finds it,
// and the messages topLevel finds are the array it read (as many).
func TestTopLevelAgreesWithTheParser(t *testing.T) {
	for _, body := range []string{
		`{"model":"m","messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}],"MESSAGES":[{"role":"user","content":"x"}],"Model":"evil"}`,
		`{"m\u006fdel":"m","m\u0065ssages":[{"role":"user","content":"a"}]}`,
		`{"MODEL":"evil","model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"a"}]}`,
	} {
		req, err := blockhash.ParseChat([]byte(body), blockhash.Limits{})
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		raw := make([][]byte, 2)
		if err := topLevel([]byte(body), []string{"model", "messages"}, raw); err != nil {
			t.Fatal(err)
		}
		var model string
		var msgs []json.RawMessage
		if json.Unmarshal(raw[0], &model) != nil || json.Unmarshal(raw[1], &msgs) != nil {
			t.Fatalf("%s: model %s, messages %s", body, raw[0], raw[1])
		}
		if model != req.Model || len(msgs) != len(req.Parts) {
			t.Fatalf("%s: model %q and %d messages, the parser read %q and %d", body, model, len(msgs), req.Model, len(req.Parts))
		}
		req.Recycle()
	}
}
