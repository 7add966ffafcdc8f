package tokenizer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/semroute/semroute/internal/connpool"
)

// conns is the Client's own way to a replica's /tokenize over plain HTTP:
// HTTP/1.1 on pooled keep-alive connections, the exchange — write the
// query, read the answer's headers, read its ids — in the calling
// goroutine, as the router's own transport to replicas does
// (router/upstream.go). http.Transport runs a reader and a writer
// goroutine on each connection and hands each request and response
// between them over channels; for a 1 KB prompt that machinery, with the
// answer's 16 KiB read buffer, was most of what precise mode added to the
// router's CPU per request (BenchmarkPreciseCPU in router).
//
// Answers come from http.ReadResponse, so framing (Content-Length,
// chunked, close-delimited) is net/http's. The call's deadline is the
// connection's; a cancelled context moves it to the past, which ends a
// blocked write or read, and the connection is closed rather than pooled.
// Nothing reads an idle connection, so connections are pooled in a
// connpool.Pool: only when nothing is left to read on one, checked with a
// non-blocking peek before its reuse once it idled peekAfter (bytes the
// replica sent unasked are not read as the next answer; servers send
// them, a 408, after seconds of idling), and idle ones swept every
// sweepEvery. /tokenize has no
// effect but its answer: a call on a reused connection that got no byte of
// answer (the replica closed it as the call went out) is sent again, once,
// on a new one.
//
// Safe for concurrent use.
type conns struct {
	// pool keeps the idle connections by host:port: maxIdlePerHost per
	// replica, maxIdleTotal over all, for idleTimeout each, swept every
	// sweepEvery, peeked at before reuse after peekAfter.
	pool     connpool.Pool[*conn]
	mu       sync.Mutex
	targets  sync.Map // base URL → *target
	nTargets int      // entries in targets, under mu
}

// The bounds of conns: idle connections kept over all replicas, how long
// one may idle (http.DefaultTransport's IdleConnTimeout), how often idle
// ones are looked at (vLLM's server, uvicorn, closes a connection idle for
// 5 s), the bytes of an answer's headers, the base URLs remembered, and
// the idling after which a connection is peeked at before reuse.
const (
	maxIdleTotal   = 1024
	idleTimeout    = 90 * time.Second
	sweepEvery     = 5 * time.Second
	maxHeaderBytes = 64 << 10
	maxTargets     = 1024
	peekAfter      = time.Second
)

func newConns() *conns {
	return &conns{pool: connpool.Pool[*conn]{
		MaxPerKey:   maxIdlePerHost,
		MaxTotal:    maxIdleTotal,
		IdleTimeout: idleTimeout,
		SweepEvery:  sweepEvery,
		PeekAfter:   peekAfter,
	}}
}

// proxied reports whether the environment names an HTTP proxy: calls then
// go through net/http, which honours it.
var proxied = os.Getenv("HTTP_PROXY") != "" || os.Getenv("http_proxy") != ""

// target is where a base URL's /tokenize is: the address to dial, the
// Host header and the path.
type target struct {
	addr, host, path string
}

// target returns base's target; nil if base is not a plain http URL.
func (p *conns) target(base string) *target {
	if t, ok := p.targets.Load(base); ok {
		return t.(*target)
	}
	u, err := url.Parse(strings.TrimSuffix(base, "/") + "/tokenize")
	if err != nil || u.Scheme != "http" || u.Host == "" || u.User != nil {
		return nil
	}
	t := &target{addr: u.Host, host: u.Host, path: u.RequestURI()}
	if u.Port() == "" { // http://replica, as http.Transport reads it
		t.addr = net.JoinHostPort(u.Hostname(), "80")
	}
	p.mu.Lock()
	if p.nTargets >= maxTargets { // replicas come and go: forget them all, now and then
		p.targets.Clear()
		p.nTargets = 0
	}
	if _, loaded := p.targets.LoadOrStore(base, t); !loaded {
		p.nTargets++
	}
	p.mu.Unlock()
	return t
}

// conn is one connection to a replica. Its reads pass through lim, which
// bounds the answer's headers.
type conn struct {
	c      net.Conn
	lim    capReader
	br     *bufio.Reader
	bw     *bufio.Writer
	addr   string
	reused bool // it served a call before (it came from the pool)
}

// NetConn and Buffered make a conn a connpool.Conn.
func (pc *conn) NetConn() net.Conn { return pc.c }
func (pc *conn) Buffered() int     { return pc.br.Buffered() }

// capReader reads from c, at most n bytes while n >= 0.
type capReader struct {
	c net.Conn
	n int
	// read counts the bytes read since the call began: none means the
	// replica answered nothing.
	read int
}

var errHeaders = errors.New("tokenizer: /tokenize answer's headers too large")

func (r *capReader) Read(p []byte) (int, error) {
	if r.n == 0 {
		return 0, errHeaders
	}
	if r.n > 0 && len(p) > r.n {
		p = p[:r.n]
	}
	n, err := r.c.Read(p)
	if r.n > 0 {
		r.n -= n
	}
	r.read += n
	return n, err
}

// pastDeadline ends any blocked read or write on a connection at once.
var pastDeadline = time.Unix(1, 0)

// post sends q to t and reads the ids answered, at most limit, by
// deadline; ctx cancels the call.
func (p *conns) post(ctx context.Context, deadline time.Time, t *target, q *query, limit int) ([]int32, error) {
	for retried := false; ; retried = true {
		pc, err := p.get(ctx, deadline, t.addr)
		if err != nil {
			return nil, fmt.Errorf("tokenizer: %w", err)
		}
		ids, keep, err := p.exchange(ctx, deadline, pc, t, q, limit)
		if err == nil {
			if keep {
				p.pool.Put(pc.addr, pc)
			} else {
				pc.c.Close()
			}
			return ids, nil
		}
		pc.c.Close()
		if retried || !pc.reused || pc.lim.read > 0 || ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, err
		}
		// A pooled connection the replica closed as the call went out
		// (after the peek in get), no byte of answer read: again, on a
		// new connection.
	}
}

// errAnswered is a /tokenize that answered with a status other than 200.
type errAnswered struct{ status int }

func (e *errAnswered) Error() string {
	return fmt.Sprintf("tokenizer: /tokenize answered %d", e.status)
}

// exchange writes q on pc and reads the answer's ids; keep says pc may be
// pooled.
func (p *conns) exchange(ctx context.Context, deadline time.Time, pc *conn, t *target, q *query, limit int) (ids []int32, keep bool, err error) {
	_ = pc.c.SetDeadline(deadline)
	if ctx.Done() != nil {
		stop := context.AfterFunc(ctx, func() { _ = pc.c.SetDeadline(pastDeadline) })
		defer func() {
			if !stop() { // the context fired: the deadline is in the past
				keep = false
				if err != nil {
					err = fmt.Errorf("tokenizer: %w", ctx.Err())
				}
			}
		}()
	}
	pc.lim.n, pc.lim.read = maxHeaderBytes, 0
	if err := writeQuery(pc, t, q); err != nil {
		return nil, false, fmt.Errorf("tokenizer: %w", err)
	}
	resp, err := readHeaders(pc.br)
	if err != nil {
		return nil, false, fmt.Errorf("tokenizer: %w", err)
	}
	pc.lim.n = -1
	keep = !resp.Close
	if resp.StatusCode != http.StatusOK {
		return nil, false, &errAnswered{resp.StatusCode}
	}
	// Token ids are at most 11 bytes each in JSON.
	ids, count, err := readAnswer(io.LimitReader(resp.Body, int64(limit)*12+4096), limit)
	if err != nil {
		return nil, false, fmt.Errorf("tokenizer: /tokenize answer: %w", err)
	}
	if count >= 0 && count != len(ids) {
		return nil, false, fmt.Errorf("tokenizer: /tokenize answered %d tokens (count %d)", len(ids), count)
	}
	// The rest of the answer (a new line, a chunked answer's last chunk),
	// a few KiB at most, so that the connection can serve the next call.
	if n, _ := io.Copy(io.Discard, io.LimitReader(resp.Body, maxAnswerTail+1)); n > maxAnswerTail {
		keep = false
	}
	if keep {
		_ = pc.c.SetDeadline(time.Time{})
	}
	return ids, keep, nil
}

// writeQuery writes q as a POST to t's /tokenize on pc: through its
// buffer when q fits, else the head and q's parts in one vectored write
// (through the buffer, a large body went in three writes).
func writeQuery(pc *conn, t *target, q *query) error {
	var b [256]byte
	head := append(b[:0], "POST "...)
	head = append(head, t.path...)
	head = append(head, " HTTP/1.1\r\nHost: "...)
	head = append(head, t.host...)
	head = append(head, "\r\nContent-Type: application/json\r\nContent-Length: "...)
	head = strconv.AppendInt(head, int64(q.n), 10)
	head = append(head, "\r\n\r\n"...)
	if len(head)+q.n <= pc.bw.Available() {
		pc.bw.Write(head)
		for _, part := range q.parts {
			pc.bw.Write(part)
		}
		return pc.bw.Flush()
	}
	bufs := make(net.Buffers, 0, 1+len(q.parts))
	bufs = append(bufs, head)
	bufs = append(bufs, q.parts...)
	_, err := bufs.WriteTo(pc.c)
	return err
}

// readHeaders reads the answer's headers, past interim answers (100
// Continue, 103 Early Hints).
func readHeaders(br *bufio.Reader) (*http.Response, error) {
	for {
		resp, err := http.ReadResponse(br, nil)
		switch {
		case err != nil:
			return nil, err
		case resp.StatusCode == http.StatusSwitchingProtocols:
			return nil, errors.New("tokenizer: /tokenize switched protocols unasked")
		case resp.StatusCode >= 200 || resp.StatusCode < 100:
			return resp, nil
		}
	}
}

// get returns a pooled connection to addr that is still open, or dials
// one by deadline.
func (p *conns) get(ctx context.Context, deadline time.Time, addr string) (*conn, error) {
	// A connection that idled a while is looked at: the replica may have
	// closed it, or sent bytes nobody asked for, which must never be read
	// as this call's answer. One just back from a call is trusted (a peek
	// is a system call a call): if the replica closed it meanwhile, the
	// call, sent again, goes on a new one (post).
	if pc, ok := p.pool.Get(addr); ok {
		pc.reused = true
		return pc, nil
	}
	d := net.Dialer{Deadline: deadline}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	pc := &conn{c: c, addr: addr, lim: capReader{c: c, n: -1}}
	pc.br = bufio.NewReader(&pc.lim)
	pc.bw = bufio.NewWriter(c)
	return pc, nil
}

// closeIdle closes every pooled connection.
func (p *conns) closeIdle() { p.pool.CloseIdle() }
