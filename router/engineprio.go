package router

import (
	"bytes"
	"strconv"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
)

// A replica whose engine schedules by priority (replicas[].scheduling:
// priority, vLLM's --scheduling-policy priority) is sent each request's
// priority in its body's top-level "priority": the engine serves its
// waiting requests by it, lower first, and preempts the highest when its
// KV cache runs out (vllm/v1/core/sched/scheduler.py). The router's
// priority is the request's in its own queue (the objective's, capped by
// its API key's max_priority), higher first: the engine's is its negation,
// so that the two orders agree (objective priority 10 is vLLM's -10; the
// default 0 is vLLM's default 0, sent as no field at all; a sheddable -1 is
// 1). A client's own priority never reaches an engine (scrubbed): it
// would let a client pass its key's ceiling on a priority engine, and an
// fcfs engine ignores it (vLLM V1) or refuses it (vLLM V0, and the
// refusal its OpenAI protocol documents). vLLM's Messages API has no
// priority (AnthropicMessagesRequest): none is sent there.

// vllmPriority returns vLLM's priority for router priority p.
func vllmPriority(p int) int { return -p }

// prioritizes reports whether a request of API api and router priority p
// carries a priority to a priority engine: p is not vLLM's default, and
// the API has a priority.
func prioritizes(api blockhash.Endpoint, p int) bool { return p != 0 && api != blockhash.Messages }

// enginePriority returns the priority to send replica rep for a request
// of API api and router priority p: vLLM's on a priority engine
// (vllmPriority), 0 (none) on any other, or when not prioritizes.
func enginePriority(rep *replica.Replica, api blockhash.Endpoint, p int) int {
	if !prioritizes(api, p) || !rep.Scheduling.Prioritized() {
		return 0
	}
	return vllmPriority(p)
}

// anyPrioritized reports whether some of reps schedules by priority.
func anyPrioritized(reps []*replica.Replica) bool {
	for _, r := range reps {
		if r.Scheduling.Prioritized() {
			return true
		}
	}
	return false
}

// priorityBytes is what withPriority adds to a body at most: a comma,
// the key, and an int's digits and sign.
const priorityBytes = len(`,"priority":`) + 20

// appendPriority appends to dst body b, a JSON object without a priority
// key (the parser accepted it, and scrubbed took a client's out), with
// "priority":p as its last key, and returns it.
func appendPriority(dst, b []byte, p int) []byte {
	end := bytes.LastIndexByte(b, '}') // the parser accepted an object: its last byte that is not space
	inner := bytes.TrimRight(b[:end], " \t\r\n")
	dst = append(dst, inner...)
	if inner[len(inner)-1] != '{' {
		dst = append(dst, ',')
	}
	dst = append(dst, `"priority":`...)
	dst = strconv.AppendInt(dst, int64(p), 10)
	return append(dst, b[end:]...)
}

// withPriority returns a new body of b with "priority":p (appendPriority).
func withPriority(b []byte, p int) *body {
	out := newBody(len(b) + priorityBytes)
	out.b = appendPriority(out.b[:0], b, p)
	return out
}

// perReplica returns flight.retag for a request cr whose forwarded body is
// b: the body for each replica an attempt goes to. A Responses request's
// carries the response id the router issues, which names the replica
// (issueID); a priority engine's, the request's engine priority
// (enginePriority). nil when every replica gets b itself. The copies'
// bytes were counted with b's (upstreamBody).
func (s *Server) perReplica(b *body, cr CoreRequest) func(*replica.Replica) *body {
	ids := cr.API == blockhash.Responses
	if !ids && !prioritizes(cr.API, cr.Priority) {
		return nil
	}
	return func(rep *replica.Replica) *body {
		out := b
		if ids {
			out = withRequestID(b.b, s.core.ids.issue(rep.Name, cr.Tenant))
		}
		if p := enginePriority(rep, cr.API, cr.Priority); p != 0 {
			with := withPriority(out.b, p)
			if out != b {
				out.release()
			}
			out = with
		}
		if out == b {
			b.refs.Add(1) // the flight releases what this returns, the handler b
		}
		return out
	}
}
