package router

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
)

// Prefill/decode disaggregation over vLLM's own protocol (its NIXL
// connector's; vLLM's tests/v1/kv_connector/nixl_integration/
// toy_proxy_server.py is the reference): the request goes first to a
// prefill replica, rewritten to compute the prompt and stop
// (prefillBody), whose answer carries kv_transfer_params (where its KV
// waits: remote_engine_id, remote_block_ids, remote_host, remote_port);
// then the client's own request goes to a decode replica with those
// kv_transfer_params, and its answer, streamed or not, is the client's.
// Both requests carry one X-Request-Id, as the reference proxy sends.

// PDOptions tune disaggregation. The zero value: every request of a model
// that a prefill replica serves is disaggregated when its uncached prompt
// reaches DefaultMinPrefillTokens.
type PDOptions struct {
	// MinPrefillTokens: a request whose prompt its decode replica would
	// compute less of than this (a short prompt, or one whose prefix that
	// replica holds) goes to the decode replica alone, aggregated, as
	// Dynamo's and llm-d's conditional disaggregation. 0: the default;
	// negative: always disaggregated.
	MinPrefillTokens int
}

// DefaultMinPrefillTokens is PDOptions.MinPrefillTokens's default.
const DefaultMinPrefillTokens = 256

// HeaderPrefillReplica names the replica that computed the prompt of a
// disaggregated request (X-Semroute-Replica names the decode replica).
const HeaderPrefillReplica = "X-Semroute-Prefill-Replica"

// maxPrefillAnswer bounds the prefill replica's answer the router reads:
// one token, its usage and the transfer parameters.
const maxPrefillAnswer = 1 << 20

// Fallback reasons (semroute_pd_fallbacks_total): why a request that
// would have been disaggregated was computed by its decode replica alone.
const (
	pdNoPrefill      = "no_prefill_replica" // no prefill replica available for it (every one ejected, down or draining): aggregated at once
	pdPrefillFailed  = "prefill_failed"     // every prefill replica tried failed before answering: aggregated
	pdPrefillTimeout = "prefill_timeout"    // its prefill replica did not answer within the prefill's bound (limits.Timeouts.Prefill): aggregated
	pdRefused        = "prefill_refused"    // a prefill replica answered 4xx: aggregated, the decode replica answers
	pdNoParams       = "no_transfer_params" // a prefill answer without kv_transfer_params: the decode replica computes
)

// pdFallbackReasons are every fallback reason, each counted from 0.
var pdFallbackReasons = []string{pdNoPrefill, pdPrefillFailed, pdPrefillTimeout, pdRefused, pdNoParams}

// pdFallbackError is why a request's prefill could not be placed
// (Placement.Fallback), with its fallback reason.
type pdFallbackError struct {
	reason string // pdNoPrefill or pdPrefillFailed
	err    error
}

func (e *pdFallbackError) Error() string { return e.reason + ": " + e.err.Error() }
func (e *pdFallbackError) Unwrap() error { return e.err }

// reasonOf returns the fallback reason of Placement.Fallback.
func reasonOf(perr error) string {
	if fe, ok := perr.(*pdFallbackError); ok {
		return fe.reason
	}
	return pdPrefillFailed
}

// disaggregated reports whether requests for model in pool are
// disaggregated (CoreRequest.Disaggregate):
// some replica of role prefill may serve it, available or not. A request
// whose prefill replicas are all out (ejected, down, draining) is routed
// there too, to be served by its decode replica alone and counted
// (no_prefill_replica), not aggregated unseen.
func disaggregated(pool *replica.Pool, model string) bool {
	if !pool.HasPrefill() {
		return false // no scan on the way of every request
	}
	for _, r := range pool.Replicas() {
		if r.Role.Prefills() && servesModel(r, model) {
			return true
		}
	}
	return false
}

// servesModel reports whether r may serve model: its models are not known
// yet, or include it, or no model was named.
func servesModel(r *replica.Replica, model string) bool {
	m := r.Models()
	return model == "" || m == nil || m.Served == nil || m.Serves(model)
}

func decodes(r *replica.Replica) bool  { return r.Role.Decodes() }
func prefills(r *replica.Replica) bool { return r.Role.Prefills() }

// fields is a request body's top-level object, decoded once for every
// body disaggregation makes of it (the prefill's, the decode's) and for
// splittable; its values are the body's own bytes.
type fields map[string]json.RawMessage

// fieldsOf decodes body b's top-level object.
func fieldsOf(b []byte) (fields, error) {
	var m fields
	err := json.Unmarshal(b, &m)
	return m, err
}

// rewrite returns the body with edit applied to a copy of its fields
// (size: the body's, to grow the buffer once).
func (m fields) rewrite(size int, edit func(fields)) ([]byte, error) {
	c := maps.Clone(m)
	edit(c)
	var out bytes.Buffer
	out.Grow(size + 256)
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false) // as given: no \u003c for every < of a prompt
	if err := enc.Encode(c); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

// prefillParams is what a prefill request asks of vLLM: compute the
// prompt and keep its KV for a remote decode.
var prefillParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// prefillBody rewrites a client's request for its prefill replica, as
// vLLM's reference proxy does: kv_transfer_params asking for a remote
// decode, no stream, one token (max_tokens, and max_completion_tokens if
// given), and without what a prefill does not take (stream_options,
// min_tokens, min_completion_tokens).
func prefillBody(m fields, size int) ([]byte, error) {
	return m.rewrite(size, func(m fields) {
		m["kv_transfer_params"] = prefillParams
		m["stream"] = json.RawMessage("false")
		m["max_tokens"] = json.RawMessage("1")
		if _, ok := m["max_completion_tokens"]; ok {
			m["max_completion_tokens"] = json.RawMessage("1")
		}
		delete(m, "stream_options")
		delete(m, "min_tokens")
		delete(m, "min_completion_tokens")
		// The prefill's answer is not the client's: what would only
		// make it large (the prompt's logprobs, the prompt echoed) is
		// not asked for.
		delete(m, "prompt_logprobs")
		delete(m, "echo")
	})
}

// decodeBody sets the kv_transfer_params a prefill replica returned on the
// client's request for its decode replica; nil params takes any the client
// sent out (the decode replica then computes the prompt itself).
func decodeBody(m fields, size int, params json.RawMessage) ([]byte, error) {
	return m.rewrite(size, func(m fields) {
		if params == nil {
			delete(m, "kv_transfer_params")
			return
		}
		m["kv_transfer_params"] = params
	})
}

// prefillAnswer is what the router reads of a prefill replica's answer:
// its kv_transfer_params (nil: none, null or empty) and its usage.
type prefillAnswer struct {
	params json.RawMessage
	usage  usageJSON
}

// readPrefillAnswer reads a prefill replica's answer b (at most
// maxPrefillAnswer bytes): checked within lim's nesting and values as a
// client body is (blockhash.Admit), then read with no tree of it: the
// kv_transfer_params' bytes are kept as they are (a long prompt's has
// thousands of block ids), and only the small usage object is parsed. So
// an answer costs about its size, and takes nothing from the parse budget
// of client bodies, under which a prefill would fail for the load of
// others.
func readPrefillAnswer(b []byte, lim blockhash.Limits) (*prefillAnswer, error) {
	lim.Budget = nil
	release, err := blockhash.Admit(b, lim)
	defer release()
	if err != nil {
		return nil, fmt.Errorf("prefill answer: %w", err)
	}
	var top struct {
		KV    json.RawMessage `json:"kv_transfer_params"`
		Usage json.RawMessage `json:"usage"`
	}
	if err := json.Unmarshal(b, &top); err != nil {
		return nil, fmt.Errorf("prefill answer: %w", err)
	}
	ans := &prefillAnswer{}
	if len(top.Usage) > 0 {
		p := replyParsers.Get()
		defer replyParsers.Put(p)
		v, err := p.ParseBytes(top.Usage)
		if err != nil {
			return nil, fmt.Errorf("prefill answer's usage: %w", err)
		}
		if ans.usage, _, err = parseUsage(v); err != nil {
			return nil, fmt.Errorf("prefill answer's usage: %w", err)
		}
	}
	if kv := bytes.TrimSpace(top.KV); len(kv) > 0 && kv[0] == '{' && len(bytes.TrimSpace(kv[1:len(kv)-1])) > 0 {
		ans.params = kv // an object with members: Unmarshal copied it
	}
	return ans, nil
}

// errPrefillRefused is a prefill replica's 4xx: the request's own fault,
// which another prefill replica would answer alike.
var errPrefillRefused = errors.New("router: the prefill replica refused the request")

// errPrefillTimeout is a prefill replica's silence past the prefill's
// bound (limits.Timeouts.Prefill).
var errPrefillTimeout = errors.New("router: the prefill replica did not answer in time")

// prefillTry is one prefill request's result.
type prefillTry struct {
	ans    *prefillAnswer // a 2xx's, read; nil otherwise
	status int            // the answer's status; 0: none came
	idle   bool           // it went silent past timeouts.idle mid-answer (cut off)
	late   bool           // no whole answer within bound (cancelled)
	bound  time.Duration  // the prefill's bound (limits.Timeouts.Prefill)
	err    error          // the transport's, or for a 2xx an unreadable answer's
}

// answered reports whether t is a whole 2xx answer, in time.
func (t *prefillTry) answered() bool {
	return t.status >= 200 && t.status < 300 && !t.idle && !t.late
}

// refused reports whether t is a 4xx other than 408 and 429: the
// request's own fault.
func (t *prefillTry) refused() bool {
	return !t.late && t.status >= 400 && t.status < 500 && t.status != http.StatusRequestTimeout && t.status != http.StatusTooManyRequests
}

// prefill sends the prefill request body to rt's replica and ends rt.
// Each try is bounded by limits.Timeouts.Prefill of the tokens of the
// prompt that replica does not hold (rt's estimate): past it the try is
// cancelled, counted against the replica (replica.Replica.TimedOut,
// which ejects it after a few in a row, at any traffic) and the prefill
// given up, so that a hung prefill pool costs a request one bound, not
// one for each replica. A replica that fails before answering (refused
// or reset, 502 or 503, 408 or 429, silent past timeouts.idle) is passed
// for the next in rt's ranking, as the proxy fails over; a 500 or 504 may
// be the request's own, as the proxy takes it, and ends the tries. It
// returns the answer's kv_transfer_params (nil when it had none, or could
// not be read), errPrefillRefused on another 4xx, errPrefillTimeout past
// the bound, or the last failure. A priority engine is sent prio, the body
// with the request's engine priority, when not nil (enginePriority).
func (s *Server) prefill(ctx context.Context, r *http.Request, rt *Routed, body, prio []byte, requestID string) (json.RawMessage, error) {
	start := time.Now()
	for next := 1; ; next++ {
		rep := rt.Served.Replica
		send := body
		if prio != nil && rep.Scheduling.Prioritized() {
			send = prio
		}
		t := s.prefillOnce(ctx, r, rep, send, requestID, s.o.Timeouts.Prefill(rt.Uncached(rep.ID)))
		if ctx.Err() != nil || t.answered() || t.refused() {
			return s.prefillEnded(ctx, rt, t, start)
		}
		moveOn, err := s.prefillFailed(rep, t, clientSource(r.RemoteAddr), time.Now())
		s.o.Logger.Warn("prefill replica failed", "replica", rep.Name, "err", err)
		if !moveOn || !s.core.Failover(rt, next) {
			status := cmp.Or(t.status, http.StatusBadGateway)
			if t.late {
				status = http.StatusGatewayTimeout
			}
			s.core.Finish(rt, Outcome{Status: status, Error: err.Error()}, nil)
			return nil, err
		}
	}
}

// prefillEnded ends rt, the prefill decision, after try t, which is the
// last: the client left, or its replica answered (2xx) or refused the
// request (4xx). It returns what prefill returns.
func (s *Server) prefillEnded(ctx context.Context, rt *Routed, t *prefillTry, start time.Time) (json.RawMessage, error) {
	o := Outcome{Status: t.status}
	switch {
	case ctx.Err() != nil:
		o.Status = 499
		s.core.Finish(rt, o, nil)
		return nil, ctx.Err()
	case t.refused():
		s.core.Finish(rt, o, nil)
		return nil, fmt.Errorf("%w: status %d", errPrefillRefused, t.status)
	}
	now := time.Now()
	rt.Served.Replica.Succeeded(now, s.o.Ejection)
	ans := t.ans
	if t.err != nil || ans == nil { // answered, but not readably: counted as without parameters
		s.o.Logger.Warn("prefill answer unreadable", "replica", rt.Served.Replica.Name, "err", t.err)
		ans = &prefillAnswer{}
	}
	o.PromptTokens, o.CachedTokens, o.CachedReported = ans.usage.PromptTokens, ans.usage.CachedTokens, ans.usage.CachedReported
	s.core.FirstByte(rt)
	s.core.Finish(rt, o, nil)
	s.core.o.Metrics.prefilled(now.Sub(start))
	return ans.params, nil
}

// prefillFailed counts a prefill replica's failed try t as the proxy
// counts a replica's: 502, 503 and refused or reset connections eject
// it; a 500 or 504 (maybe the request's own), 408, 429 or silence strike
// it; a try past its bound (late, or a timeout of the transport's)
// strikes it as timed out (replica.Replica.TimedOut: a few in a row
// eject it, at any traffic). It returns whether another prefill replica
// should be tried (not after a 500 or 504, which it would answer alike,
// nor past the bound) and the failure.
func (s *Server) prefillFailed(rep *replica.Replica, t *prefillTry, source uint64, now time.Time) (moveOn bool, _ error) {
	status := t.status
	switch {
	case t.late:
		s.core.o.Metrics.UpstreamError(rep.Name, "timeout")
		rep.TimedOut()
		s.core.e.Strike(rep, now, s.o.Ejection, source)
		return false, fmt.Errorf("%w: %s, within %v", errPrefillTimeout, rep.Name, t.bound)
	case status == http.StatusBadGateway || status == http.StatusServiceUnavailable:
		s.core.o.Metrics.UpstreamError(rep.Name, "status_5xx")
		s.core.e.Fail(rep, now, s.o.Ejection)
		return true, fmt.Errorf("prefill replica %s answered %d", rep.Name, status)
	case status >= 500:
		s.core.o.Metrics.UpstreamError(rep.Name, "status_5xx")
		s.core.e.Strike(rep, now, s.o.Ejection, source)
		return false, fmt.Errorf("prefill replica %s answered %d", rep.Name, status)
	case status != 0 || t.idle: // 408, 429, or silent mid-answer
		kind := "status_4xx"
		if t.idle {
			kind = "idle"
		}
		s.core.o.Metrics.UpstreamError(rep.Name, kind)
		s.core.e.Strike(rep, now, s.o.Ejection, source)
		return true, fmt.Errorf("prefill replica %s: %s (status %d)", rep.Name, kind, status)
	}
	s.core.o.Metrics.UpstreamError(rep.Name, errorKind(t.err)) // connect or reset: timeouts are late
	s.core.e.Fail(rep, now, s.o.Ejection)
	return true, t.err
}

// prefillOnce sends the prefill request to rep and reads its answer,
// whole within bound (after it the request is cancelled: late; bound is
// positive, limits.Timeouts.Prefill's).
func (s *Server) prefillOnce(ctx context.Context, in *http.Request, rep *replica.Replica, body []byte, requestID string, bound time.Duration) *prefillTry {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	t := &prefillTry{bound: bound}
	var late atomic.Bool
	timer := time.AfterFunc(bound, func() { late.Store(true); cancel() })
	defer timer.Stop()
	out, err := http.NewRequestWithContext(ctx, http.MethodPost, in.URL.String(), bytes.NewReader(body))
	if err != nil {
		t.err = err
		return t
	}
	aim(out, in.URL, in.Header.Values("Authorization"), rep)
	out.Header.Set("Content-Type", "application/json")
	out.Header.Set("X-Request-Id", requestID)
	if tp := in.Header.Get("traceparent"); tp != "" {
		out.Header.Set("traceparent", tp)
	}
	// A timeout of the transport's own (timeouts.first_byte, which the
	// bound is at most) is the bound's as well.
	lateBy := func(err error) bool { return late.Load() || errorKind(err) == "timeout" }
	resp, err := s.o.Transport.RoundTrip(out)
	if err != nil {
		t.late, t.err = lateBy(err), err
		return t
	}
	var silent atomic.Bool
	rb := newIdleBody(resp.Body, s.o.Timeouts.Idle, s.o.Timeouts.Idle, func() { silent.Store(true); cancel() })
	defer rb.Close()
	b, err := io.ReadAll(io.LimitReader(rb, maxPrefillAnswer))
	t.status, t.err = resp.StatusCode, err
	switch {
	case silent.Load():
		t.idle = true
	case err != nil: // broken off: no answer
		t.status, t.late = 0, lateBy(err)
	case resp.StatusCode < 300:
		t.ans, t.err = readPrefillAnswer(b, s.limits.Load().Parse)
	}
	return t
}

// routeDisaggregated places a request of a model a prefill replica serves
// (cr, whose forwarded body is *fwd; Core.Place): a decode replica, and
// unless it would compute too little of the prompt a prefill replica,
// which computes the prompt (prefill) before the decode replica is sent
// the request with the prefill's kv_transfer_params. It returns the decode
// decision and sets *fwd to the body to send it, which the caller
// releases, and names the prefill replica in w's headers. A request with
// no prefill replica available, or whose prefill fails or outlasts its
// bound, falls back to the decode replica alone, counted by reason.
func (s *Server) routeDisaggregated(w http.ResponseWriter, r *http.Request, cr CoreRequest, fwd **body) (*Routed, error) {
	m, ferr := fieldsOf((*fwd).b) // once, for every body made below; it parsed before
	cr.Whole = ferr != nil || !m.splittable()
	p, err := s.core.Place(cr)
	if err != nil {
		return nil, err
	}
	d := &decodeSide{s: s, rt: p.Routed, fwd: *fwd, m: m, ferr: ferr}
	var prefill string
	switch {
	case p.Fallback != nil: // counted by Place
		d.warn(reasonOf(p.Fallback), p.Fallback)
		*fwd, err = d.whole()
	case p.Prefill == nil:
		*fwd, err = d.whole()
	default:
		var named bool
		*fwd, named, err = d.afterPrefill(r, p.Prefill)
		if named {
			prefill = p.Prefill.Served.Replica.Name
		}
	}
	if err != nil {
		return nil, err
	}
	if prefill != "" {
		w.Header().Set(HeaderPrefillReplica, prefill)
		r.Header.Set("X-Request-Id", p.ID) // the prefill's: vLLM pairs the two by it
	}
	return p.Routed, nil
}

// afterPrefill sends prt's replica the prefill and returns the body to
// send the decode replica: with the prefill's kv_transfer_params, or
// without (it computes the prompt) when the prefill failed, counted by
// reason. named says the prefill replica answered (or the client left
// meanwhile), and is named to the client.
func (d *decodeSide) afterPrefill(r *http.Request, prt *Routed) (b *body, named bool, err error) {
	params, err := d.prefill(r, prt)
	switch {
	case r.Context().Err() != nil:
		d.fwd.refs.Add(1)
		return d.fwd, true, nil // the client left: the proxy ends rt
	case errors.Is(err, errPrefillRefused):
		b, err = d.aggregated(pdRefused, err)
	case errors.Is(err, errPrefillTimeout):
		b, err = d.aggregated(pdPrefillTimeout, err)
	case err != nil:
		b, err = d.aggregated(pdPrefillFailed, err)
	case params == nil:
		d.s.core.o.Metrics.pdFallback(pdNoParams)
		d.s.o.Logger.Warn("prefill answer without kv_transfer_params: the decode replica computes the prompt", "prefill", prt.Served.Replica.Name, "decode", d.rt.Served.Replica.Name)
		b, err = d.whole()
		return b, true, err
	default:
		b, err = d.remote(params)
		return b, true, err
	}
	return b, false, err
}

// decodeSide is a disaggregated request's decode decision rt and the
// bodies it may be sent: fwd, the client's as forwarded, whose fields are
// m (ferr: why they could not be read).
type decodeSide struct {
	s    *Server
	rt   *Routed
	fwd  *body
	m    fields
	ferr error
}

// refuse ends rt, which cannot be sent (a body that does not fit), and
// returns why.
func (d *decodeSide) refuse(err error) (*body, error) {
	d.s.core.Finish(d.rt, Outcome{Status: http.StatusServiceUnavailable, Error: err.Error()}, nil)
	return nil, err
}

// whole sends the decode replica the client's request without any
// kv_transfer_params of the client's own (they would point its connector
// anywhere): it computes the prompt.
func (d *decodeSide) whole() (*body, error) {
	if !bytes.Contains(d.fwd.b, []byte("kv_transfer_params")) {
		d.fwd.refs.Add(1) // the caller releases what this returns, and its own
		return d.fwd, nil
	}
	if d.ferr != nil {
		return d.refuse(d.ferr)
	}
	b, err := decodeBody(d.m, len(d.fwd.b), nil)
	if err != nil {
		return d.refuse(err)
	}
	nb, err := d.s.heldBody(b)
	if err != nil {
		return d.refuse(err)
	}
	return nb, nil
}

// warn logs a fallback for reason (a no_prefill_replica, which every
// request has while the prefill pool is out, at debug level).
func (d *decodeSide) warn(reason string, err error) {
	level := slog.LevelWarn
	if reason == pdNoPrefill {
		level = slog.LevelDebug
	}
	d.s.o.Logger.Log(context.Background(), level, "disaggregated request served by its decode replica alone", "reason", reason, "err", err, "decode", d.rt.Served.Replica.Name)
}

// aggregated counts a fallback for reason and sends the request whole.
func (d *decodeSide) aggregated(reason string, err error) (*body, error) {
	d.s.core.o.Metrics.pdFallback(reason)
	d.warn(reason, err)
	return d.whole()
}

// prefill makes the prefill's body, and its copy with the request's
// priority when a prefill replica of its ranking schedules by priority,
// and sends it to prt's replica (Server.prefill), which ends prt.
func (d *decodeSide) prefill(r *http.Request, prt *Routed) (json.RawMessage, error) {
	err := d.ferr
	var pb []byte
	if err == nil {
		pb, err = prefillBody(d.m, len(d.fwd.b))
	}
	var held, heldPrio *body
	if err == nil {
		held, err = d.s.heldBody(pb)
	}
	if p := prt.req.Priority; err == nil && prioritizes(prt.req.API, p) && anyPrioritized(rankedReplicas(prt)) {
		if heldPrio, err = d.s.heldBody(appendPriority(make([]byte, 0, len(pb)+priorityBytes), pb, vllmPriority(p))); err != nil {
			held.release()
		}
	}
	if err != nil {
		d.s.core.Finish(prt, Outcome{Status: 503, Error: err.Error()}, nil)
		return nil, err
	}
	defer held.release()
	var prio []byte
	if heldPrio != nil {
		defer heldPrio.release()
		prio = heldPrio.b
	}
	return d.s.prefill(r.Context(), r, prt, held.b, prio, d.rt.ID)
}

// rankedReplicas returns the replicas of rt's ranking.
func rankedReplicas(rt *Routed) []*replica.Replica {
	reps := make([]*replica.Replica, len(rt.Ranked))
	for i := range rt.Ranked {
		reps[i] = rt.Ranked[i].Replica
	}
	return reps
}

// remote sends the decode replica the client's request with the
// kv_transfer_params its prefill replica returned: it pulls the KV.
func (d *decodeSide) remote(params json.RawMessage) (*body, error) {
	b, err := decodeBody(d.m, len(d.fwd.b), params)
	if err != nil {
		return d.aggregated(pdPrefillFailed, err)
	}
	nb, err := d.s.heldBody(b)
	if err != nil {
		return d.refuse(err)
	}
	d.s.core.o.Metrics.disaggregated("disaggregated")
	d.rt.SetRemote()
	d.rt.remoteAt = d.s.core.e.Now() // sent next (semroute_pd_decode_first_byte_seconds)
	return nb, nil
}

// heldBody returns b as a body counted against the bytes of request
// bodies the router holds (limits.Request.MaxBodyBytesInFlight), or the
// error that they would pass it.
func (s *Server) heldBody(b []byte) (*body, error) {
	lim := s.limits.Load().MaxBodyBytesInFlight
	nb := bodyOf(b)
	nb.count(&s.bodies, lim)
	if !nb.hold(len(b)) {
		nb.release()
		return nil, &bodiesInFlightError{lim}
	}
	return nb, nil
}

// splittable reports whether a request can be disaggregated: one prompt
// and one answer. vLLM returns one set of kv_transfer_params for a whole
// answer, so a batch of prompts (a completions prompt that is a list of
// prompts) or several answers (n or best_of above 1) is served whole.
func splittable(b []byte) bool {
	m, err := fieldsOf(b)
	return err == nil && m.splittable()
}

// splittable is splittable of the body whose fields are m.
func (m fields) splittable() bool {
	for _, k := range []string{"n", "best_of"} {
		var n *int
		if v, ok := m[k]; ok && (json.Unmarshal(v, &n) != nil || n != nil && *n > 1) {
			return false
		}
	}
	p := bytes.TrimSpace(m["prompt"])
	if len(p) == 0 || p[0] != '[' {
		return true // a chat, or one prompt
	}
	var list []json.RawMessage
	if json.Unmarshal(p, &list) != nil || len(list) <= 1 {
		return true
	}
	first := bytes.TrimSpace(list[0])
	return len(first) > 0 && first[0] != '"' && first[0] != '[' // token ids: one prompt
}

// allowBoth returns a filter of the replicas a and b both allow (a nil: all).
func allowBoth(a, b func(*replica.Replica) bool) func(*replica.Replica) bool {
	if a == nil {
		return b
	}
	return func(r *replica.Replica) bool { return a(r) && b(r) }
}
