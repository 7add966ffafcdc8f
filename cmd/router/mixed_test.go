package main

import (
	"os"
	"strconv"
	"testing"
)

// tpMixedFleet is 4 third-party replicas of two speeds: two fast ones
// (prefill 10 ms + 0.5 ms a token, 5 ms an output token, 8 sequences at
// once, 1,024 blocks of KV) and two 3× slower in prefill and decode with
// half the sequences and half the KV (30 ms + 1.5 ms a token, 15 ms an
// output token, 4 sequences, 512 blocks): a fleet of two GPU generations.
func tpMixedFleet() tpOptions {
	return tpOptions{n: 4,
		argsFor: func(i int) []string {
			if i < 2 {
				return []string{"--prefill-overhead", "10ms", "--prefill-time-per-token", "500us",
					"--inter-token-latency", "5ms", "--max-num-seqs", "8"}
			}
			return []string{"--prefill-overhead", "30ms", "--prefill-time-per-token", "1500us",
				"--inter-token-latency", "15ms", "--max-num-seqs", "4"}
		},
		blocksFor: func(i int) int { return 1024 >> (i / 2) },
	}
}

// tpUniformFleet is 4 alike third-party replicas prefilling perToken a
// prompt token (a Go duration), the rest as startThirdParty's.
func tpUniformFleet(perToken string) tpOptions {
	return tpOptions{n: 4, args: []string{"--prefill-time-per-token", perToken}}
}

// tpPortRows are the table's rows of every port and the default, in
// estimate mode (the ports read no engine tokens) and as shipped.
func tpPortRows() []tpRow {
	estimate := "tokenizer:\n  mode: estimate\n"
	return []tpRow{
		{"round robin", "round_robin", estimate, false},
		{"llm-d port", "llmd", estimate, false},
		{"SGLang port", "sglang", estimate, false},
		{"Dynamo port", "dynamo", estimate, false},
		{"AIBrix port", "aibrix", estimate, false},
		{"default (tokenizer.mode: estimate)", "", estimate, false},
		{"default: auto + KV events", "", "", true},
	}
}

// BenchmarkThirdPartyMixed measures every port and the default through
// 4 third-party replicas of two speeds (tpMixedFleet) on this project's
// mixed chat workload, and through 4 alike replicas at 0.5 ms and at 4 ms
// a prompt token, each row a sub-benchmark reporting the engines' hit
// ratio, TTFT p50, p90 and p99 at the client. It logs the tables. It takes
// minutes: run it with
//
//	SEMROUTE_THIRDPARTY_SIM=/path/to/llm-d-inference-sim SEMROUTE_THIRDPARTY_MIXED=600 \
//	  go test -run '^$' -bench BenchmarkThirdPartyMixed -benchtime 1x -v -timeout 60m ./cmd/router
//
// SEMROUTE_THIRDPARTY_ROWS keeps the rows whose names hold one of its
// comma-separated words, SEMROUTE_THIRDPARTY_FLEETS the fleets (mixed,
// 0.5ms, 4ms); SEMROUTE_THIRDPARTY_WORKERS sets the clients (default
// 24: the mixed fleet's sequences).
func BenchmarkThirdPartyMixed(b *testing.B) {
	n, _ := strconv.Atoi(os.Getenv("SEMROUTE_THIRDPARTY_MIXED"))
	if n == 0 {
		b.Skip("set SEMROUTE_THIRDPARTY_MIXED=<requests> to measure")
	}
	workers := 24
	if w, _ := strconv.Atoi(os.Getenv("SEMROUTE_THIRDPARTY_WORKERS")); w > 0 {
		workers = w
	}
	fleets := []struct {
		name  string
		fleet tpOptions
	}{
		{"mixed", tpMixedFleet()},
		{"0.5ms", tpUniformFleet("500us")},
		{"4ms", tpUniformFleet("4ms")},
	}
	want := os.Getenv("SEMROUTE_THIRDPARTY_FLEETS")
	for _, f := range fleets {
		if want != "" && !wordIn(want, f.name) {
			continue
		}
		b.Run(f.name, func(b *testing.B) {
			b.Log(tpFleetTable(b, "fleet "+f.name+", the mixed chat workload, 40 sessions open",
				truthSessions(n, 31, 40), tpPortRows(), workers, f.fleet))
		})
	}
}
