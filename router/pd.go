package router

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

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

// Fallback reasons (semroute_pd_fallbacks_total).
const (
	pdPrefillFailed = "prefill_failed"     // every prefill replica failed before answering: aggregated
	pdRefused       = "prefill_refused"    // a prefill replica answered 4xx: aggregated, the decode replica answers
	pdNoParams      = "no_transfer_params" // a prefill answer without kv_transfer_params: the decode replica computes
)

// disaggregated reports whether requests for model go through a prefill
// replica: some available replica of role prefill may serve it.
func (c *Core) disaggregated(model string) bool {
	now := time.Now()
	for _, r := range c.e.Pool().Replicas() {
		if r.Role.Prefills() && r.Available(now) && servesModel(r, model) {
			return true
		}
	}
	return false
}

// needsPrefill reports whether decode decision rt's request goes through
// a prefill replica: its decode replica would compute at least
// MinPrefillTokens of its prompt. A request that does not is counted
// short.
func (c *Core) needsPrefill(rt *Routed) bool {
	min := cmp.Or(c.o.PD.MinPrefillTokens, DefaultMinPrefillTokens)
	if min > 0 && rt.Uncached(rt.Served.Replica.ID) < float64(min) {
		c.o.Metrics.disaggregated("short")
		return false
	}
	return true
}

// servesModel reports whether r may serve model: its models are not known
// yet, or include it, or no model was named.
func servesModel(r *replica.Replica, model string) bool {
	m := r.Models()
	return model == "" || m == nil || m.Served == nil || m.Serves(model)
}

func decodes(r *replica.Replica) bool  { return r.Role.Decodes() }
func prefills(r *replica.Replica) bool { return r.Role.Prefills() }

// rewriteJSON applies edit to the top-level object of JSON body b and
// returns the object encoded again.
func rewriteJSON(b []byte, edit func(map[string]json.RawMessage)) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	edit(m)
	return json.Marshal(m)
}

// prefillParams is what a prefill request asks of vLLM: compute the
// prompt and keep its KV for a remote decode.
var prefillParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// prefillBody rewrites a client's request for its prefill replica, as
// vLLM's reference proxy does: kv_transfer_params asking for a remote
// decode, no stream, one token (max_tokens, and max_completion_tokens if
// given), and without what a prefill does not take (stream_options,
// min_tokens, min_completion_tokens).
func prefillBody(b []byte) ([]byte, error) {
	return rewriteJSON(b, func(m map[string]json.RawMessage) {
		m["kv_transfer_params"] = prefillParams
		m["stream"] = json.RawMessage("false")
		m["max_tokens"] = json.RawMessage("1")
		if _, ok := m["max_completion_tokens"]; ok {
			m["max_completion_tokens"] = json.RawMessage("1")
		}
		delete(m, "stream_options")
		delete(m, "min_tokens")
		delete(m, "min_completion_tokens")
	})
}

// decodeBody sets the kv_transfer_params a prefill replica returned on the
// client's request for its decode replica; nil params takes any the client
// sent out (the decode replica then computes the prompt itself).
func decodeBody(b []byte, params json.RawMessage) ([]byte, error) {
	return rewriteJSON(b, func(m map[string]json.RawMessage) {
		if params == nil {
			delete(m, "kv_transfer_params")
			return
		}
		m["kv_transfer_params"] = params
	})
}

// prefillAnswer is what the router reads of a prefill replica's answer.
type prefillAnswer struct {
	Params json.RawMessage `json:"kv_transfer_params"`
	Usage  *struct {
		PromptTokens        int64 `json:"prompt_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int64 `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

// errPrefillRefused is a prefill replica's 4xx: the request's own fault,
// which another prefill replica would answer alike.
var errPrefillRefused = errors.New("router: the prefill replica refused the request")

// prefill sends the prefill request body to rt's replica, failing over
// down its ranking when one fails before answering (as the proxy does),
// and ends rt. It returns the kv_transfer_params of the answer (nil when
// it had none), errPrefillRefused on a 4xx, or the last failure.
func (s *Server) prefill(ctx context.Context, r *http.Request, rt *Routed, body []byte, requestID string) (json.RawMessage, error) {
	start := time.Now()
	next := 1
	for {
		c := rt.Served
		ans, status, err := s.prefillOnce(ctx, r, c.Replica, body, requestID)
		now := time.Now()
		o := Outcome{Status: status}
		switch {
		case err == nil && status < 300:
			c.Replica.Succeeded(now, s.o.Ejection)
			if ans.Usage != nil {
				o.PromptTokens = ans.Usage.PromptTokens
				if d := ans.Usage.PromptTokensDetails; d != nil {
					o.CachedTokens, o.CachedReported = d.CachedTokens, true
				}
			}
			s.core.FirstByte(rt)
			s.core.Finish(rt, o, nil)
			s.core.o.Metrics.prefilled(now.Sub(start))
			if p := bytes.TrimSpace(ans.Params); len(p) == 0 || bytes.Equal(p, []byte("null")) || bytes.Equal(p, []byte("{}")) {
				return nil, nil
			}
			return ans.Params, nil
		case err == nil && status < 500:
			s.core.Finish(rt, o, nil)
			return nil, fmt.Errorf("%w: status %d", errPrefillRefused, status)
		case ctx.Err() != nil:
			o.Status = 499
			s.core.Finish(rt, o, nil)
			return nil, ctx.Err()
		case err == nil:
			s.core.o.Metrics.UpstreamError(c.Replica.Name, "status_5xx")
			s.core.e.Strike(c.Replica, now, s.o.Ejection, clientSource(r.RemoteAddr))
			err = fmt.Errorf("prefill replica %s answered %d", c.Replica.Name, status)
		case status != 0: // an answer that is not one
			s.core.o.Metrics.UpstreamError(c.Replica.Name, "status_5xx")
			s.core.e.Strike(c.Replica, now, s.o.Ejection, clientSource(r.RemoteAddr))
		default:
			s.core.o.Metrics.UpstreamError(c.Replica.Name, errorKind(err))
			s.core.e.Fail(c.Replica, now, s.o.Ejection)
		}
		s.o.Logger.Warn("prefill replica failed before answering", "replica", c.Replica.Name, "err", err)
		if !s.core.Failover(rt, next) {
			o.Status, o.Error = 502, err.Error()
			s.core.Finish(rt, o, nil)
			return nil, err
		}
		next++
	}
}

// prefillOnce sends the prefill request to rep and reads its answer: the
// status, and for a 2xx the answer's transfer parameters and usage.
func (s *Server) prefillOnce(ctx context.Context, in *http.Request, rep *replica.Replica, body []byte, requestID string) (*prefillAnswer, int, error) {
	out, err := http.NewRequestWithContext(ctx, http.MethodPost, in.URL.String(), bytes.NewReader(body))
	if err != nil {
		return nil, 0, err
	}
	aim(out, in.URL, in.Header.Values("Authorization"), rep.URL)
	out.Header.Set("Content-Type", "application/json")
	out.Header.Set("X-Request-Id", requestID)
	resp, err := s.o.Transport.RoundTrip(out)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxPrefillAnswer))
	if err != nil {
		return nil, resp.StatusCode, err
	}
	if resp.StatusCode >= 300 {
		return nil, resp.StatusCode, nil
	}
	var ans prefillAnswer
	if err := json.Unmarshal(b, &ans); err != nil {
		return nil, resp.StatusCode, fmt.Errorf("prefill answer: %w", err)
	}
	return &ans, resp.StatusCode, nil
}

// routeDisaggregated routes a request of a model a prefill replica serves
// (cr, whose forwarded body is fwd): a decode replica first, by the
// policy among the replicas that decode (its load and the prefix it
// holds, which shortens the transfer); then, unless that replica would
// compute less than MinPrefillTokens of the prompt, a prefill replica by
// the policy among the prefill replicas (its cache), which computes the
// prompt (prefill). It returns the decode decision, the body to send it
// (with the prefill's kv_transfer_params) and the prefill replica's name
// ("" when the request went aggregated). A prefill that fails falls back
// to the decode replica alone, counted; the caller releases the body.
func (s *Server) routeDisaggregated(r *http.Request, cr CoreRequest, fwd *body) (*Routed, *body, string, error) {
	in := cr.Input.Copy() // for the prefill decision, before the decode one owns cr's blocks
	rt, err := s.core.Route(cr)
	if err != nil {
		return nil, nil, "", err
	}
	fwd.refs.Add(1) // the caller releases what this returns, and its own
	if !s.core.needsPrefill(rt) {
		return rt, fwd, "", nil
	}
	aggregated := func(reason string, err error) (*Routed, *body, string, error) {
		s.core.o.Metrics.pdFallback(reason)
		s.o.Logger.Warn("disaggregated request served by its decode replica alone", "reason", reason, "err", err, "decode", rt.Served.Replica.Name)
		b, e := decodeBody(fwd.b, nil)
		if e != nil {
			return rt, fwd, "", nil
		}
		fwd.release()
		return rt, bodyOf(b), "", nil
	}
	pcr := cr
	pcr.Input, pcr.Prefill = in, true
	prt, err := s.core.Route(pcr)
	if err != nil {
		return aggregated(pdPrefillFailed, err)
	}
	pairPD(prt, rt)
	pb, err := prefillBody(fwd.b)
	if err != nil {
		s.core.Finish(prt, Outcome{Status: 400, Error: err.Error()}, nil)
		return aggregated(pdPrefillFailed, err)
	}
	params, err := s.prefill(r.Context(), r, prt, pb, rt.ID)
	name := prt.Served.Replica.Name
	switch {
	case r.Context().Err() != nil:
		return rt, fwd, name, nil // the client left: the proxy ends rt
	case errors.Is(err, errPrefillRefused):
		return aggregated(pdRefused, err)
	case err != nil:
		return aggregated(pdPrefillFailed, err)
	case params == nil:
		s.core.o.Metrics.pdFallback(pdNoParams)
		s.o.Logger.Warn("prefill answer without kv_transfer_params: the decode replica computes the prompt", "prefill", name, "decode", rt.Served.Replica.Name)
		b, e := decodeBody(fwd.b, nil)
		if e != nil {
			return rt, fwd, name, nil
		}
		fwd.release()
		return rt, bodyOf(b), name, nil
	}
	b, err := decodeBody(fwd.b, params)
	if err != nil {
		return aggregated(pdPrefillFailed, err)
	}
	s.core.o.Metrics.disaggregated("disaggregated")
	fwd.release()
	return rt, bodyOf(b), name, nil
}

// allowBoth returns a filter of the replicas a and b both allow (a nil: all).
func allowBoth(a, b func(*replica.Replica) bool) func(*replica.Replica) bool {
	if a == nil {
		return b
	}
	return func(r *replica.Replica) bool { return a(r) && b(r) }
}
