// Package tokenizer gets a request's exact token ids from the engine
// itself: vLLM's POST /tokenize, with the chat messages (so the model's
// chat template applies) or the prompt. Answers are cached, so a request
// seen again is not tokenized again, and a call is bounded in time: a slow
// or failing tokenizer makes the caller route on its estimate rather than
// wait.
//
// A Client is safe for concurrent use.
package tokenizer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/semroute/semroute/blockhash"
)

// Options configure a Client. URL is required.
type Options struct {
	// URL is the base URL of a replica serving /tokenize (vLLM's OpenAI
	// server), e.g. http://10.0.0.5:8000.
	URL string
	// Pick, if set instead of URL, chooses the replica to ask for each
	// call, given the request's model (e.g. any healthy one serving it);
	// "" means none is available.
	Pick func(model string) string
	// Timeout bounds one call; past it the caller gets ErrSlow and routes
	// on its estimate. Default 50ms.
	Timeout time.Duration
	// CacheTokens bounds the token ids kept in the cache, in tokens (4
	// bytes each). Default 4 Mi tokens (16 MiB).
	CacheTokens int
	// MaxTokens refuses an answer longer than this many tokens (a broken
	// or hostile replica). Default 1 Mi.
	MaxTokens int
	// Client sends the calls. Nil means the Client's own: HTTP/1.1 on
	// kept-alive connections, up to maxIdlePerHost idle ones to each
	// replica, in the calling goroutine (conns); https replicas, and every
	// replica when HTTP_PROXY is set, through net/http (newTransport).
	Client *http.Client
	// OnCall, if set, hears the outcome of every call: the base URL asked
	// and nil, ErrSlow or the failure.
	OnCall func(base string, err error)
}

// Defaults of Options.
const (
	DefaultTimeout     = 50 * time.Millisecond
	DefaultCacheTokens = 4 << 20
)

// maxIdlePerHost bounds the idle keep-alive connections the Client's own
// transport keeps to one replica: as many as the calls that may be in
// flight at once, so that each call finds one made. net/http's default
// transport keeps 2: under 8 concurrent requests, a third of the calls
// opened a connection (a TCP handshake and a goroutine pair at each end),
// and the router spent about as much CPU again per request as without
// /tokenize (BenchmarkPreciseCPU in router).
const maxIdlePerHost = 256

// newTransport is the Client's own transport: net/http's default, keeping
// maxIdlePerHost idle connections per replica and no bound on their sum
// (Pick may ask several replicas).
func newTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = maxIdlePerHost
	t.MaxIdleConns = 0
	return t
}

// maxAnswerTail bounds the bytes read after an answer's object so that
// its connection is kept.
const maxAnswerTail = 4 << 10

// ErrNoReplica is returned when Pick finds no replica to ask.
var ErrNoReplica = errors.New("tokenizer: no replica to ask")

// ErrSlow is returned when the tokenizer did not answer within Timeout.
var ErrSlow = errors.New("tokenizer: no answer in time")

// Stats count a Client's calls.
type Stats struct {
	Hits, Calls, Failures, Slow int64
}

// Client tokenizes requests through a replica's /tokenize.
type Client struct {
	o     Options
	cache *lru.Cache[uint64, []int32]
	held  atomic.Int64 // tokens in the cache, approximately (evictions subtract)
	conns *conns       // the calls' own connections; nil: all go through o.Client

	hits, calls, failures, slow atomic.Int64
}

// New returns a Client.
func New(o Options) (*Client, error) {
	if o.URL == "" && o.Pick == nil {
		return nil, errors.New("tokenizer: URL or Pick is required")
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.CacheTokens <= 0 {
		o.CacheTokens = DefaultCacheTokens
	}
	if o.MaxTokens <= 0 {
		o.MaxTokens = 1 << 20
	}
	c := &Client{o: o}
	if o.Client == nil {
		c.o.Client = &http.Client{Transport: newTransport()}
		if !proxied {
			c.conns = newConns()
		}
	}
	// The LRU is bounded by entries; the token bound is kept by evicting
	// the oldest entries while the cache holds more tokens than allowed.
	cache, err := lru.NewWithEvict[uint64, []int32](1<<16, func(_ uint64, v []int32) { c.held.Add(-int64(len(v))) })
	if err != nil {
		return nil, err
	}
	c.cache = cache
	return c, nil
}

// Stats returns the calls counted so far.
func (c *Client) Stats() Stats {
	return Stats{Hits: c.hits.Load(), Calls: c.calls.Load(), Failures: c.failures.Load(), Slow: c.slow.Load()}
}

// Chat returns the token ids of a chat request's prompt: messages is the
// request's "messages" JSON, rendered with the model's chat template and
// the generation prompt, as the engine renders it to serve the request.
func (c *Client) Chat(ctx context.Context, model string, messages []byte) ([]int32, error) {
	q := newQuery(model)
	q.field("messages", messages)
	q.field("add_generation_prompt", jsonTrue)
	q.end()
	return c.tokenize(ctx, q)
}

// Body returns the token ids of the prompt of an OpenAI request body of
// endpoint ep, as the engine renders it to serve the body: a chat body's
// messages, tools and template options (add_generation_prompt,
// continue_final_message, chat_template, chat_template_kwargs,
// add_special_tokens), or a completions body's prompt, which must be one
// string, and add_special_tokens. model is the body's "model" as the
// router's parse read it. The fields' values are sent as the body gives
// them, found by the engine's rules for keys (exact, case-sensitive; see
// bodyQuery), never decoded again nor copied: the body must be the valid
// JSON the router parsed, and is read only until Body returns.
func (c *Client) Body(ctx context.Context, ep blockhash.Endpoint, model string, body []byte) ([]int32, error) {
	q, err := bodyQuery(ep, model, body)
	if err != nil {
		return nil, err
	}
	return c.tokenize(ctx, q)
}

// Prompt returns the token ids of a completions request's prompt (a JSON
// string).
func (c *Client) Prompt(ctx context.Context, model string, prompt []byte) ([]int32, error) {
	q := newQuery(model)
	q.field("prompt", prompt)
	q.end()
	return c.tokenize(ctx, q)
}

func (c *Client) tokenize(ctx context.Context, q *query) ([]int32, error) {
	key := q.key()
	if ids, ok := c.cache.Get(key); ok {
		c.hits.Add(1)
		return ids, nil
	}
	c.calls.Add(1)
	ids, err := c.call(ctx, q)
	if err != nil {
		if errors.Is(err, ErrSlow) {
			c.slow.Add(1)
		} else {
			c.failures.Add(1)
		}
		return nil, err
	}
	n := int64(len(ids))
	c.held.Add(n)
	if found, _ := c.cache.ContainsOrAdd(key, ids); found { // another call added it meanwhile
		c.held.Add(-n)
	}
	for c.held.Load() > int64(c.o.CacheTokens) && c.cache.Len() > 1 {
		c.cache.RemoveOldest()
	}
	return ids, nil
}

func (c *Client) call(ctx context.Context, q *query) ([]int32, error) {
	base := c.o.URL
	if c.o.Pick != nil {
		if base = c.o.Pick(q.model); base == "" {
			return nil, ErrNoReplica
		}
	}
	ids, err := c.post(ctx, base, q)
	if c.o.OnCall != nil {
		c.o.OnCall(base, err)
	}
	return ids, err
}

// CloseIdleConnections closes the connections to replicas kept for later
// calls.
func (c *Client) CloseIdleConnections() {
	if c.conns != nil {
		c.conns.closeIdle()
	}
	c.o.Client.CloseIdleConnections()
}

// post sends q to base's /tokenize, within Timeout: on the Client's own
// connections when it has them and base is plain http, else through its
// http.Client.
func (c *Client) post(ctx context.Context, base string, q *query) ([]int32, error) {
	deadline := time.Now().Add(c.o.Timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if c.conns != nil {
		if t := c.conns.target(base); t != nil {
			ids, err := c.conns.post(ctx, deadline, t, q, c.o.MaxTokens)
			if err != nil && ctx.Err() != context.Canceled &&
				(!time.Now().Before(deadline) || errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded)) {
				return nil, ErrSlow
			}
			return ids, err
		}
	}
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	return c.postHTTP(ctx, base, q)
}

// postHTTP sends q to base's /tokenize through the http.Client. q's pieces
// are read only until postHTTP returns: the request's readers fail after
// it (see lease).
func (c *Client) postHTTP(ctx context.Context, base string, q *query) ([]int32, error) {
	l := &lease{}
	defer l.end()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(base, "/")+"/tokenize", q.reader(l))
	if err != nil {
		return nil, err
	}
	req.ContentLength = int64(q.n)
	// A request on a kept-alive connection that the server had closed is
	// sent again, from the start.
	req.GetBody = func() (io.ReadCloser, error) { return q.reader(l), nil }
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.o.Client.Do(req)
	if err != nil {
		if ctx.Err() == context.DeadlineExceeded {
			return nil, ErrSlow
		}
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return nil, fmt.Errorf("tokenizer: /tokenize answered %d", resp.StatusCode)
	}
	// Token ids are at most 11 bytes each in JSON.
	ids, count, err := readAnswer(io.LimitReader(resp.Body, int64(c.o.MaxTokens)*12+4096), c.o.MaxTokens)
	if err != nil {
		if ctx.Err() == context.DeadlineExceeded {
			return nil, ErrSlow
		}
		return nil, fmt.Errorf("tokenizer: /tokenize answer: %w", err)
	}
	if count >= 0 && count != len(ids) {
		return nil, fmt.Errorf("tokenizer: /tokenize answered %d tokens (count %d)", len(ids), count)
	}
	// The answer is read to its end (a new line after the object, a
	// chunked answer's last chunk), a few KiB at most: net/http keeps a
	// connection for the next call only if its answer was.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxAnswerTail))
	return ids, nil
}
