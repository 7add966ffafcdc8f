package numbered

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestBodies(t *testing.T) {
	for _, stream := range []bool{false, true} {
		g := New(1024, stream)
		if g.Len() > 1024 || g.Len() < 1000 {
			t.Fatalf("a body of %d bytes for 1024", g.Len())
		}
		for _, prefix := range []string{"000000000001 lorem", "000000000002 lorem"} {
			var req struct {
				Model    string `json:"model"`
				Stream   bool   `json:"stream"`
				Messages []struct{ Content string }
			}
			b := g.Next()
			if err := json.Unmarshal(b, &req); err != nil {
				t.Fatal(err)
			}
			if req.Model != "sim-model" || req.Stream != stream || len(b) != g.Len() || !strings.HasPrefix(req.Messages[0].Content, prefix) {
				t.Fatalf("want a body whose prompt starts %q: %s", prefix, b)
			}
		}
	}
}
