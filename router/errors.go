package router

import (
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"unicode/utf8"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/routing"
)

// apiError is an error turned into an OpenAI-style error body.
type apiError struct {
	status int
	typ    string
	code   string
	msg    string
}

// Error returns e's message: an *apiError is an error Admit may return,
// which classify answers as it is.
func (e *apiError) Error() string { return e.msg }

// maxErrorMessage bounds an error body's message, in bytes, whatever the
// input or upstream error behind it.
const maxErrorMessage = 512

// writeError is the one place that turns errors into HTTP statuses and
// bodies: OpenAI's shape, or Anthropic's on the Messages API's path
// (anthropicWriter). The message is cut to maxErrorMessage bytes.
func writeError(w http.ResponseWriter, e apiError) {
	body := errorJSON(e)
	if anthropicShape(w) {
		e.status, body = anthropicError(e)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	_, _ = w.Write(body)
}

// anthropicWriter is the ResponseWriter of a request on the Messages API's
// path: the router's own errors are answered in Anthropic's shape.
type anthropicWriter struct{ http.ResponseWriter }

// anthropicShape reports whether w, or a writer it wraps, is an
// anthropicWriter.
func anthropicShape(w http.ResponseWriter) bool {
	for {
		switch x := w.(type) {
		case anthropicWriter:
			return true
		case interface{ Unwrap() http.ResponseWriter }:
			w = x.Unwrap()
		default:
			return false
		}
	}
}

// Unwrap gives http.ResponseController the writer underneath (Flush).
func (a anthropicWriter) Unwrap() http.ResponseWriter { return a.ResponseWriter }

// Flush flushes the writer underneath, for the stream's proxy.
func (a anthropicWriter) Flush() { _ = http.NewResponseController(a.ResponseWriter).Flush() }

// anthropicError returns e's status and body in Anthropic's error shape,
// {"type":"error","error":{"type":…,"message":…}}, with the error type
// Anthropic gives each status. The router's shedding and saturation (429
// from its queue, 503 when no replica or memory is free) is Anthropic's
// 529 overloaded_error, which its SDKs retry.
func anthropicError(e apiError) (int, []byte) {
	status, typ := e.status, "api_error"
	switch {
	case e.code == "saturated" || e.status == http.StatusServiceUnavailable:
		status, typ = 529, "overloaded_error"
	case e.status == http.StatusBadRequest || e.status == http.StatusMethodNotAllowed || e.status == http.StatusRequestHeaderFieldsTooLarge:
		typ = "invalid_request_error"
	case e.status == http.StatusUnauthorized:
		typ = "authentication_error"
	case e.status == http.StatusForbidden:
		typ = "permission_error"
	case e.status == http.StatusNotFound:
		typ = "not_found_error"
	case e.status == http.StatusRequestEntityTooLarge:
		typ = "request_too_large"
	case e.status == http.StatusTooManyRequests:
		typ = "rate_limit_error"
	}
	b, _ := json.Marshal(map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": truncate(e.msg, maxErrorMessage)}})
	return status, append(b, '\n')
}

// errorJSON is e's body in OpenAI's error shape, its message truncated to
// maxErrorMessage bytes, ending with a newline.
func errorJSON(e apiError) []byte {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": truncate(e.msg, maxErrorMessage), "type": e.typ, "code": e.code}})
	return append(b, '\n')
}

// truncate cuts s to at most n bytes on a UTF-8 boundary, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n - len("…")
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + "…"
}

// methodNotAllowed answers a routed path called with a method other than
// POST.
func methodNotAllowed(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Allow", http.MethodPost)
	writeError(w, apiError{http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed",
		r.Method + " is not allowed on " + r.URL.Path + "; use POST"})
}

// notRouted answers a path under a routed one (/v1/chat/completions/…):
// there is no such route.
func notRouted(w http.ResponseWriter, r *http.Request) { writeError(w, unknownRoute(r.URL.Path)) }

// unknownRoute is the error for a path under a routed one.
func unknownRoute(path string) apiError {
	return apiError{http.StatusNotFound, "invalid_request_error", "unknown_route",
		"no route " + path + "; use /v1/chat/completions or /v1/completions"}
}

// maxTokensError is the error for a request asking more output tokens than
// the limits allow, or nil.
func maxTokensError(asked int, lim *limits.Request) *apiError {
	if asked <= lim.MaxOutputTokens {
		return nil
	}
	return &apiError{http.StatusBadRequest, "invalid_request_error", "invalid_request",
		"max_tokens: " + strconv.Itoa(asked) + " is more than the limit of " + strconv.Itoa(lim.MaxOutputTokens)}
}

// classify turns an error of reading, parsing, routing or forwarding a
// request into the status and OpenAI-shaped error the client gets.
func classify(err error) apiError {
	var ie *blockhash.InputError
	var tooBig *http.MaxBytesError
	var um *routing.UnknownModelError
	var busy *bodiesInFlightError
	var ae *apiError
	switch {
	case errors.As(err, &ae):
		return *ae
	case errors.As(err, &tooBig):
		return apiError{http.StatusRequestEntityTooLarge, "invalid_request_error", "body_too_large",
			"request body is larger than the limit of " + strconv.FormatInt(tooBig.Limit, 10) + " bytes"}
	case errors.As(err, &ie):
		return apiError{http.StatusBadRequest, "invalid_request_error", "invalid_request", ie.Error()}
	case errors.As(err, &busy):
		return apiError{http.StatusServiceUnavailable, "server_busy", "body_bytes_in_flight", busy.Error()}
	case errors.Is(err, blockhash.ErrBusy):
		return apiError{http.StatusServiceUnavailable, "server_busy", "parse_budget", err.Error()}
	case errors.As(err, new(*QueueError)):
		return apiError{http.StatusTooManyRequests, "rate_limit_error", "saturated",
			"the replicas for this request are saturated and the router's queue " + queueVerdicts[queueReason(err)] + "; retry after the Retry-After seconds"}
	case errors.Is(err, routing.ErrNoReplica):
		return apiError{http.StatusServiceUnavailable, "service_unavailable", "no_replica", "no replica is available to serve the request"}
	case errors.As(err, &um):
		// OpenAI's answer for a model that does not exist.
		return apiError{http.StatusNotFound, "invalid_request_error", "model_not_found",
			"The model `" + um.Model + "` does not exist or you do not have access to it."}
	}
	// The cause is logged, not told: it names the router's and the
	// replica's addresses.
	msg := "the replica closed the connection or sent an invalid answer"
	switch errorKind(err) {
	case "connect":
		msg = "could not connect to the replica"
	case "timeout":
		msg = "the replica did not answer in time"
	}
	return apiError{http.StatusBadGateway, "upstream_error", "upstream_unreachable", msg}
}

// queueReason names why the router's queue refused or let go of a
// request: a key of queueVerdicts, and the shed metric's reason label.
func queueReason(err error) string {
	switch {
	case errors.Is(err, flow.ErrSheddable):
		return "sheddable"
	case errors.Is(err, flow.ErrShed):
		return "shed"
	case errors.Is(err, flow.ErrExpired):
		return "expired"
	case errors.Is(err, ErrTooLate):
		return "late"
	}
	return "full"
}

// queueVerdicts says each queueReason in words.
var queueVerdicts = map[string]string{
	"sheddable": "does not hold a sheddable request",
	"shed":      "gave its place to a request of a higher priority",
	"expired":   "held it as long as it holds any",
	"late":      "predicts no slot frees for it within its deadline",
	"full":      "is full",
}

func (s *Server) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	f := flightOf(r.Context())
	if r.Context().Err() != nil { // the client left; nobody to answer
		if f != nil {
			f.status = 499
		}
		return
	}
	e := classify(err)
	if f != nil {
		f.status = e.status
		w.Header().Set(HeaderReplica, f.current().Replica.Name)
	}
	s.o.Logger.Warn("upstream error", "err", err)
	writeError(w, e)
}
