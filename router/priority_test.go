package router

import (
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	"github.com/semroute/semroute/apikey"
)

// loadKeys writes yaml as a keys file and loads it.
func loadKeys(t *testing.T, yaml string) *apikey.Set {
	t.Helper()
	path := filepath.Join(t.TempDir(), "keys.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	keys, err := apikey.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

// TestKeyMaxPriorityIsTheCeiling: over sockets, a key's max_priority is
// the ceiling of whatever priority its request ends with (issue 43): a
// best-effort key (−1) that sends no objective is sheddable, as one that
// sends any, and is answered 429 at once rather than queued at the
// default 0; a key capped at 1 that asks for 10 waits at 1. A client's
// own X-Semroute-Priority is not taken, key or not. The queue dispatches
// by the priorities it holds, the capped one first.
func TestKeyMaxPriorityIsTheCeiling(t *testing.T) {
	yaml := "keys:\n" +
		"  - {tenant: batch, max_priority: -1, sha256: " + apikey.Hash("sk-batch") + "}\n" +
		"  - {tenant: mid, max_priority: 1, sha256: " + apikey.Hash("sk-mid") + "}\n" +
		"  - {tenant: open, sha256: " + apikey.Hash("sk-open") + "}\n"
	h := newHeldRouter(t, loadKeys(t, yaml), map[string]int{"critical": 10, "normal": 1})
	bearer := func(key string, more ...string) map[string]string {
		m := map[string]string{"Authorization": "Bearer " + key}
		for i := 0; i+1 < len(more); i += 2 {
			m[more[i]] = more[i+1]
		}
		return m
	}
	first := h.post("first", bearer("sk-open"))
	if got := <-h.arrived; got != "first" { // the replica's one slot: saturated from now
		t.Fatalf("the replica received %q", got)
	}
	for _, c := range []struct {
		name    string
		headers map[string]string
	}{
		{"no objective", bearer("sk-batch")},
		{"an objective above the key's", bearer("sk-batch", "X-Gateway-Inference-Objective", "critical")},
		{"a forged priority", bearer("sk-batch", "X-Semroute-Priority", "5", "X-Llm-D-Inference-Objective", "normal")},
	} {
		if code, ok := h.answeredUnqueued(h.post("batch", c.headers), 0); !ok || code != http.StatusTooManyRequests {
			t.Fatalf("a best-effort key's request, %s: answered %d, queued %v; want 429 (sheddable, never queued)", c.name, code, !ok)
		}
	}
	mid := h.post("mid", bearer("sk-mid", "X-Gateway-Inference-Objective", "critical"))
	waitQueued(t, h.core, 1)
	forged := h.post("forged", bearer("sk-open", "X-Semroute-Priority", "7"))
	waitQueued(t, h.core, 2)
	if got, _ := h.core.q.Bands(); !maps.Equal(got, map[int]int{1: 1, 0: 1}) {
		t.Fatalf("waiting by priority: %v, want the capped key's at 1, the forged one's at 0", got)
	}
	if got := h.next(); got != "mid" {
		t.Fatalf("the slot went to %q, want the capped key's request, at 1", got)
	}
	if got := h.next(); got != "forged" {
		t.Fatalf("the slot went to %q", got)
	}
	h.release <- struct{}{}
	for _, code := range []<-chan int{first, mid, forged} {
		if c := <-code; c != http.StatusOK {
			t.Fatalf("a request answered %d", c)
		}
	}
}

// TestForgedPriorityWithoutKeys: without API keys, a client's
// X-Semroute-Priority is not taken either: its objective decides.
func TestForgedPriorityWithoutKeys(t *testing.T) {
	h := newHeldRouter(t, nil, map[string]int{"best-effort": -1})
	first := h.post("first", nil)
	<-h.arrived
	forged := map[string]string{"X-Semroute-Priority": "9", "X-Gateway-Inference-Objective": "best-effort"}
	if code, ok := h.answeredUnqueued(h.post("forged", forged), 0); !ok || code != http.StatusTooManyRequests {
		t.Fatalf("a best-effort request with a forged priority: answered %d, queued %v; want 429", code, !ok)
	}
	h.release <- struct{}{}
	if c := <-first; c != http.StatusOK {
		t.Fatalf("the first: %d", c)
	}
}
