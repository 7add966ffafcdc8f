package replay

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/semroute/semroute/decisionlog"
)

// A logged prompt shorter than one block (precise mode keys whole blocks
// only, so its record has none) replays as a request with nothing to
// match, routed on load, instead of aborting the replay.
func TestDecisionsWithAShortPromptReplay(t *testing.T) {
	replicas := []string{"r0", "r1"}
	rec := func(id string, at int64, blocks []decisionlog.Block, prompt int64) decisionlog.Record {
		return decisionlog.Record{TimeNs: at, ID: id, Arm: "default", Policy: "semantic", Key: "00000000000000aa",
			Blocks: blocks, Replicas: replicas, Budgets: []int64{10000, 10000}, Chosen: "r0",
			Outcome: &decisionlog.Outcome{Status: 200, TTFTNs: 1e6, DurationNs: 2e6, PromptTokens: prompt, OutputTokens: 4, Replica: "r0"}}
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	for _, r := range []decisionlog.Record{
		rec("a", 1e9, []decisionlog.Block{{Hash: "0000000000000001", Kind: "system", Tokens: 16}}, 20),
		rec("b", 2e9, nil, 7),
	} {
		if err := enc.Encode(&r); err != nil {
			t.Fatal(err)
		}
	}
	tr, err := ReadDecisions(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != 2 || len(tr.Requests[1].Blocks) != 0 || tr.Requests[1].Tokens != 7 {
		t.Fatalf("read %+v", tr.Requests)
	}
	sum, err := Replay(tr.Requests, Config{ReplicaNames: tr.Replicas, Budgets: tr.Budgets}, []Run{{Policy: "semantic"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := sum.Policies[0].Requests; got != 2 {
		t.Fatalf("replayed %d requests, want 2", got)
	}
}

// A record naming no replicas is refused, naming the decision.
func TestDecisionsWithoutReplicasRefused(t *testing.T) {
	b, _ := json.Marshal(decisionlog.Record{ID: "x", Key: "01", Outcome: &decisionlog.Outcome{Status: 200}})
	if _, err := ReadDecisions(bytes.NewReader(append(b, '\n'))); err == nil || !bytes.Contains([]byte(err.Error()), []byte("decision x")) {
		t.Fatalf("err %v", err)
	}
}
