package decisionlog

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestPrefixOmittedAndOldLogsRead: a record's prefix outcomes are written
// as "prefix": {...} without the outcomes at 0, left out when not
// classified, and a line written before the field existed still reads.
func TestPrefixOmittedAndOldLogsRead(t *testing.T) {
	for _, tc := range []struct {
		name string
		rec  Record
		want string // in the line, or "" for no "prefix" at all
	}{
		{"classified", Record{ID: "a", Prefix: &Prefix{Hit: 64, Cold: 36}}, `"prefix":{"hit":64,"cold":36}`},
		{"routed away", Record{ID: "b", Prefix: &Prefix{RoutedAwayLoad: 70, Evicted: 2, Waited: 3, RoutedAway: 1}},
			`"prefix":{"routed_away":1,"routed_away_load":70,"evicted":2,"waited":3}`},
		{"not classified", Record{ID: "c"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := json.Marshal(&tc.rec)
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case tc.want == "" && strings.Contains(string(b), `"prefix"`):
				t.Fatalf("%s has a prefix", b)
			case tc.want != "" && !strings.Contains(string(b), tc.want):
				t.Fatalf("%s lacks %s", b, tc.want)
			}
			var back Record
			if err := json.Unmarshal(b, &back); err != nil {
				t.Fatal(err)
			}
			if (back.Prefix == nil) != (tc.rec.Prefix == nil) || (back.Prefix != nil && *back.Prefix != *tc.rec.Prefix) {
				t.Fatalf("read back %+v, wrote %+v", back.Prefix, tc.rec.Prefix)
			}
		})
	}
	// A line as the router wrote it before prefix outcomes were logged.
	old := `{"time_ns":1,"id":"x","arm":"default","policy":"semantic","key":"00000000000000ff","prompt_tokens_estimated":40,"blocks":[],"candidates":[{"replica":"a","score":1,"matched_tokens":0,"in_flight":0,"pending_tokens":0,"recent_tokens":0,"reason":"miss"}],"replicas":["a"],"budgets":[0],"chosen":"a","outcome":{"status":200,"ttft_ns":1,"duration_ns":2,"prompt_tokens":40,"output_tokens":4,"cached_tokens":0,"replica":"a"}}`
	n := 0
	skipped, err := ReadWith(strings.NewReader(old+"\n"), ReadOptions{Warn: func(line int, err error) { t.Errorf("line %d: %v", line, err) }}, func(r *Record) error {
		n++
		if r.Prefix != nil || r.Outcome == nil || r.Outcome.PromptTokens != 40 {
			t.Errorf("old record read as %+v", r)
		}
		return nil
	})
	if err != nil || skipped != 0 || n != 1 {
		t.Fatalf("read %d, skipped %d: %v", n, skipped, err)
	}
}
