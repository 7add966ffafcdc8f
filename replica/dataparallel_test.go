package replica

import (
	"strings"
	"testing"
)

// A replica of 3 data-parallel ranks is 3 routing targets, each with its
// rank and its own KV events: vLLM's rank k binds (or dials) at ports k
// higher, and its batches carry data_parallel_rank k.
func TestRanksSplitsADataParallelReplica(t *testing.T) {
	specs := Ranks([]Spec{
		{Name: "solo", URL: "http://10.0.0.4:8000", KVEvents: KVEvents{Endpoint: "tcp://{host}:5557"}},
		{Name: "dp", URL: "http://10.0.0.5:8000", BudgetTokens: 1000, DataParallel: DataParallel{Size: 3},
			KVEvents: KVEvents{Endpoint: "tcp://{host}:5557", ReplayEndpoint: "tcp://{host}:5600", Topic: "kv"}},
		{Name: "v6", URL: "http://[fd00::7]:8000", DataParallel: DataParallel{Size: 2}, KVEvents: KVEvents{Listen: "tcp://0.0.0.0:7000", ReplayEndpoint: "ipc:///tmp/replay"}},
	})
	var got []string
	for _, s := range specs {
		got = append(got, strings.Join([]string{s.Name, s.URL, s.KVEvents.Endpoint, s.KVEvents.ReplayEndpoint, s.KVEvents.Listen}, " "))
		if s.DataParallel.On() && (s.KVEvents.DataParallelRank != s.DataParallel.Rank || s.BudgetTokens != map[bool]int64{true: 1000, false: 0}[strings.HasPrefix(s.Name, "dp")]) {
			t.Errorf("%s: events of rank %d, budget %d", s.Name, s.KVEvents.DataParallelRank, s.BudgetTokens)
		}
		if _, err := s.Validate(); err != nil {
			t.Errorf("%s: %v", s.Name, err)
		}
	}
	want := []string{
		"solo http://10.0.0.4:8000 tcp://10.0.0.4:5557  ",
		"dp-dp0 http://10.0.0.5:8000 tcp://10.0.0.5:5557 tcp://10.0.0.5:5600 ",
		"dp-dp1 http://10.0.0.5:8000 tcp://10.0.0.5:5558 tcp://10.0.0.5:5601 ",
		"dp-dp2 http://10.0.0.5:8000 tcp://10.0.0.5:5559 tcp://10.0.0.5:5602 ",
		"v6-dp0 http://[fd00::7]:8000  ipc:///tmp/replay tcp://0.0.0.0:7000",
		"v6-dp1 http://[fd00::7]:8000  ipc:///tmp/replay_dp1 tcp://0.0.0.0:7001",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("ranks:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if specs[0].DataParallel.On() || specs[0].KVEvents.DataParallelRank != 0 {
		t.Errorf("a replica of one rank: %+v", specs[0])
	}
	if specs[3].KVEvents.Topic != "kv" {
		t.Errorf("rank 1's topic %q", specs[3].KVEvents.Topic)
	}
}

func TestDataParallelChecked(t *testing.T) {
	for _, s := range []Spec{
		{Name: "a", URL: "http://h:1", DataParallel: DataParallel{Size: MaxDataParallelSize + 1}},
		{Name: "a", URL: "http://h:1", DataParallel: DataParallel{Size: -1}},
		{Name: "a", URL: "http://h:1", DataParallel: DataParallel{Size: 2, Rank: 2}},
		{Name: "a", URL: "http://h:1", DataParallel: DataParallel{Rank: -1}},
	} {
		if _, err := s.Validate(); err == nil {
			t.Errorf("%+v was accepted", s.DataParallel)
		}
	}
}
