package kvevents

import (
	"net"
	"strconv"
	"strings"
)

// RankEndpoint is the address at which data-parallel rank k of an engine
// publishes (or replays, or dials) what its rank 0 does at addr, as vLLM
// offsets it (ZmqEventPublisher.offset_endpoint_port,
// vllm/distributed/kv_events.py): a tcp:// port k higher, an ipc:// or
// inproc:// path with "_dp<k>" appended. "" and rank 0 are left alone, and
// so is port 0 (a free port: each rank takes its own) or an address whose
// port does not parse (the socket refuses it).
func RankEndpoint(addr string, k int) string {
	if addr == "" || k == 0 {
		return addr
	}
	if !strings.HasPrefix(addr, "tcp://") {
		return addr + "_dp" + strconv.Itoa(k)
	}
	host, p, ok := TCPPort(addr)
	if !ok || p == 0 {
		return addr
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+k))
}

// TCPPort splits a tcp:// ZeroMQ address into its host and port; ok is
// false for another transport or a port that does not parse.
func TCPPort(addr string) (host string, port int, ok bool) {
	rest, isTCP := strings.CutPrefix(addr, "tcp://")
	if !isTCP {
		return "", 0, false
	}
	host, ps, err := net.SplitHostPort(rest)
	if err != nil {
		return "", 0, false
	}
	port, err = strconv.Atoi(ps)
	return host, port, err == nil
}
