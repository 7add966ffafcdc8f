package replica

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/semroute/semroute/kvevents"
)

// HeaderDataParallelRank is the header vLLM's OpenAI server reads to send
// a request to one of its data-parallel ranks
// (vllm/entrypoints/openai/serving_engine.py, _get_data_parallel_rank).
const HeaderDataParallelRank = "X-data-parallel-rank"

// MaxDataParallelSize bounds Spec.DataParallelSize.
const MaxDataParallelSize = 256

// HostPlaceholder in a KV events address (Endpoint, ReplayEndpoint) is
// replaced by the host of the replica's URL, so one address template
// serves every replica discovery finds: "tcp://{host}:5557".
const HostPlaceholder = "{host}"

// DataParallel is a routing target's place among its engine's
// data-parallel ranks. The zero value: the engine has one rank, and the
// request carries no rank.
type DataParallel struct {
	Rank int // this target's rank, in [0, Size)
	Size int // the engine's ranks behind its URL; 0 or 1: one
}

// On reports whether requests name the rank they go to.
func (d DataParallel) On() bool { return d.Size > 1 }

// CheckDataParallelSize checks a data_parallel_size: 0 (one rank) to
// MaxDataParallelSize.
func CheckDataParallelSize(n int) error {
	if n < 0 || n > MaxDataParallelSize {
		return fmt.Errorf("%d is not in [0, %d] (0 or 1: one rank)", n, MaxDataParallelSize)
	}
	return nil
}

// RankName is the name of rank k of the replica named name.
func RankName(name string, k int) string { return name + "-dp" + strconv.Itoa(k) }

// Ranks returns the routing targets of specs: each spec as it is, except
// that one whose DataParallel.Size is over 1 becomes one spec for each
// rank, named RankName(name, k), with the same URL and budget (a rank's
// own KV cache), and its KV events on the rank's addresses: vLLM offsets
// the port of a rank's endpoints by its rank (ZmqEventPublisher.
// offset_endpoint_port, vllm/distributed/kv_events.py), and its batches
// carry data_parallel_rank. Every spec's HostPlaceholder is resolved from
// its URL. Ranks takes specs as a Source lists them: call it once.
func Ranks(specs []Spec) []Spec {
	out := make([]Spec, 0, len(specs))
	for _, s := range specs {
		s.KVEvents = s.KVEvents.resolve(s.URL)
		if !s.DataParallel.On() {
			out = append(out, s)
			continue
		}
		for k := range s.DataParallel.Size {
			r := s
			r.Name = RankName(s.Name, k)
			r.DataParallel.Rank = k
			r.KVEvents = s.KVEvents.ofRank(k)
			out = append(out, r)
		}
	}
	return out
}

// resolve replaces HostPlaceholder in the addresses with rawURL's host.
func (k KVEvents) resolve(rawURL string) KVEvents {
	if !strings.Contains(k.Endpoint+k.ReplayEndpoint, HostPlaceholder) {
		return k
	}
	host := rawURL
	if u, err := ParseURL(rawURL); err == nil {
		host = u.Hostname()
	}
	if strings.Contains(host, ":") { // IPv6
		host = "[" + host + "]"
	}
	k.Endpoint = strings.ReplaceAll(k.Endpoint, HostPlaceholder, host)
	k.ReplayEndpoint = strings.ReplaceAll(k.ReplayEndpoint, HostPlaceholder, host)
	return k
}

// ofRank is the events of rank k of an engine whose rank 0 publishes at
// k's addresses: each port offset by k, only rank k's batches followed.
func (k KVEvents) ofRank(rank int) KVEvents {
	k.Endpoint = kvevents.RankEndpoint(k.Endpoint, rank)
	k.ReplayEndpoint = kvevents.RankEndpoint(k.ReplayEndpoint, rank)
	k.Listen = kvevents.RankEndpoint(k.Listen, rank)
	k.DataParallelRank = rank
	return k
}
