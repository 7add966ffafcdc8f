package router

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/internal/testwait"
)

// parts renders parts as role:text, one each.
func partsString(ps []blockhash.Part) string {
	var sb strings.Builder
	for _, p := range ps {
		fmt.Fprintf(&sb, "%c:%s|", p.Role, p.Text)
	}
	return sb.String()
}

func parseResponses(t *testing.T, body string) *blockhash.Request {
	t.Helper()
	r, err := blockhash.ParseResponses([]byte(body), blockhash.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Recycle)
	return r
}

// A continuation's parts are vLLM's: its instructions, the stored
// conversation (the earlier instructions in it), the earlier output, its
// input; its tools first, the earlier tools not at all. What is stored
// for its answer is all of that but the tools, and the earlier question
// is history.
func TestContinuedAsVLLMRendersIt(t *testing.T) {
	first := parseResponses(t, `{"model":"m","instructions":"Be terse.","tools":[{"type":"function","name":"f","parameters":{}}],"input":"Hi"}`)
	parts, d := continued(first, nil)
	stored := d.stored
	if got, want := partsString(parts), `T:[{"type":"function","function":{"name":"f","parameters":{}}}]|s:Be terse.|u:Hi|`; got != want {
		t.Fatalf("first: %s, want %s", got, want)
	}
	if got, want := partsString(stored), "s:Be terse.|u:Hi|"; got != want {
		t.Fatalf("first stored: %s, want %s", got, want)
	}
	c := newChains(0)
	c.put("resp_1", stored, [][]byte{[]byte("Hello.")})
	prev, ok := c.get("resp_1")
	if !ok {
		t.Fatal("the chain stored is not found")
	}
	second := parseResponses(t, `{"model":"m","instructions":"Be terse.","tools":[{"type":"function","name":"g","parameters":{}}],"previous_response_id":"resp_1","input":[{"role":"user","content":"Weather?"}]}`)
	parts, d = continued(second, prev)
	stored = d.stored
	want := `T:[{"type":"function","function":{"name":"g","parameters":{}}}]|s:Be terse.|s:Be terse.|u:Hi|a:Hello.|u:Weather?|`
	if got := partsString(parts); got != want {
		t.Fatalf("second: %s\nwant %s", got, want)
	}
	if got, want := partsString(stored), "s:Be terse.|s:Be terse.|u:Hi|a:Hello.|u:Weather?|"; got != want {
		t.Fatalf("second stored: %s, want %s", got, want)
	}
	if parts[3].Base != blockhash.KindUserHistory || parts[5].Base != blockhash.KindUserQuery {
		t.Fatalf("kinds: earlier question %v, new %v", parts[3].Base, parts[5].Base)
	}
	if prev.msgs[1].Base != blockhash.KindUserQuery {
		t.Fatal("continuing a chain changed the chain stored")
	}
}

// Chains are kept within their budget of bytes, the least recently used
// dropped first; one over the budget alone is not kept; none are kept
// with a negative budget.
func TestChainsBudget(t *testing.T) {
	msg := func(n int) []blockhash.Part {
		return []blockhash.Part{{Role: blockhash.RoleUser, Text: []byte(strings.Repeat("x", n))}}
	}
	c := newChains(3 * (1000 + 2*partOverhead))
	for i := range 4 {
		c.put(fmt.Sprint(i), msg(1000), [][]byte{nil})
		if i == 1 {
			c.get("0") // used: the older one goes first
		}
	}
	if _, ok := c.get("1"); ok {
		t.Error("the least recently used chain was kept past the budget")
	}
	for _, id := range []string{"0", "2", "3"} {
		if _, ok := c.get(id); !ok {
			t.Errorf("chain %s was dropped", id)
		}
	}
	if n, size := c.held(); n != 3 || size > c.max {
		t.Errorf("held %d chains of %d bytes, budget %d", n, size, c.max)
	}
	c.put("big", msg(10000), nil)
	if _, ok := c.get("big"); ok {
		t.Error("a chain over the whole budget was kept")
	}
	off := newChains(-1)
	off.put("a", msg(1), nil)
	if _, ok := off.get("a"); ok {
		t.Error("a chain was kept with chains off")
	}
}

// A peer's record makes the same chain the router that saw the answer
// keeps: the first turn's, then the second's from it; a record continuing
// an unknown response, or malformed, is dropped.
func TestChainRecordsMakeTheSameChain(t *testing.T) {
	here, peer := &Core{chains: newChains(0)}, &Core{chains: newChains(0)}
	var prev *responseChain
	for i, body := range []string{
		`{"model":"m","instructions":"Be terse.","input":"Hi"}`,
		`{"model":"m","instructions":"Be terse.","previous_response_id":"resp_0","tools":[{"type":"function","name":"f","parameters":{}}],"input":[{"role":"user","content":"More?"}]}`,
	} {
		_, d := continued(parseResponses(t, body), prev)
		id, out := fmt.Sprint("resp_", i), [][]byte{[]byte(fmt.Sprint("answer ", i))}
		here.chains.put(id, d.stored, out)
		peer.AddChain(d.record(id, out))
		prev, _ = here.chains.get(id)
		got, ok := peer.chains.get(id)
		if !ok {
			t.Fatalf("turn %d: the peer kept no chain", i)
		}
		if a, b := partsString(prev.msgs), partsString(got.msgs); a != b || string(got.out[0]) != string(out[0]) {
			t.Fatalf("turn %d: peer's chain %s, want %s", i, b, a)
		}
	}
	_, d := continued(parseResponses(t, `{"model":"m","previous_response_id":"resp_unknown","input":"x"}`), nil)
	peer.AddChain(d.record("resp_x", nil))
	peer.AddChain([]byte(`{"id":"resp_y","instr":5,"parts":[]}`))
	peer.AddChain([]byte(`not json`))
	for _, id := range []string{"resp_x", "resp_y"} {
		if _, ok := peer.chains.get(id); ok {
			t.Errorf("%s was kept", id)
		}
	}
}

// A continuation waiting for its chain gets it as soon as it is put, and
// gives up after its wait otherwise, leaving nothing behind.
func TestChainWait(t *testing.T) {
	c := newChains(0)
	got := make(chan bool)
	go func() {
		_, ok := c.wait(context.Background(), "resp_1", time.Hour)
		got <- ok
	}()
	testwait.Until(t, "the waiter registered", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.waiting["resp_1"] != nil
	})
	c.put("resp_1", []blockhash.Part{{Role: blockhash.RoleUser, Text: []byte("x")}}, nil)
	if !<-got {
		t.Fatal("the waiter did not get the chain put")
	}
	if _, ok := c.wait(context.Background(), "resp_2", time.Millisecond); ok {
		t.Fatal("a chain never put was found")
	}
	if len(c.waiting) != 0 {
		t.Fatalf("waiters left behind: %v", c.waiting)
	}
}

// A request with store: false drafts no chain (its engine keeps nothing);
// a continuation of an unknown response is marked Unknown and routed on
// its own parts.
func TestContinueChainStoreAndUnknown(t *testing.T) {
	c := &Core{chains: newChains(0)}
	var cr CoreRequest
	c.continueChain(context.Background(), parseResponses(t, `{"model":"m","input":"x","store":false}`), &cr)
	if cr.chain != nil || cr.Unknown {
		t.Fatalf("store false: chain %v, unknown %v", cr.chain, cr.Unknown)
	}
	req := parseResponses(t, `{"model":"m","input":"x","previous_response_id":"resp_gone"}`)
	cr = CoreRequest{}
	c.continueChain(context.Background(), req, &cr)
	if cr.chain != nil || !cr.Unknown || len(req.Parts) != 1 {
		t.Fatalf("unknown chain: chain %v, unknown %v, %d parts", cr.chain, cr.Unknown, len(req.Parts))
	}
}
