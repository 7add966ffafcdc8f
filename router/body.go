package router

import (
	"errors"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
)

// maxPooledBody is the largest body buffer kept for reuse; larger ones are
// left to the garbage collector.
const maxPooledBody = 1 << 20

var bodyBufs sync.Pool // *body

// body is a request body read into a pooled buffer. The handler holds one
// reference and every upstream attempt's reader (see reader) another until
// the reader is closed; the buffer returns to the pool when the last is
// dropped. httputil.ReverseProxy never passes Close on to the body it is
// given, so the handler closes its readers itself once the proxy returns;
// a transport may also close one, and a read racing either close fails
// rather than reading a buffer already lent to another request.
type body struct {
	b    []byte
	refs atomic.Int32

	// g, if set, counts held bytes (at least len(b)) against limit while
	// the body is referenced; see hold.
	g     *bodyGauge
	limit int64
	held  int
}

// bodyGauge counts the bytes of the request bodies held at once, against
// a limit (limits.Request.MaxBodyBytesInFlight). The zero value holds
// nothing. Safe for concurrent use.
type bodyGauge struct{ n atomic.Int64 }

// Load returns the bytes held now.
func (g *bodyGauge) Load() int64 { return g.n.Load() }

// take adds n bytes if the total stays within limit, and reports whether
// it did.
func (g *bodyGauge) take(n, limit int64) bool {
	for {
		cur := g.n.Load()
		if cur+n > limit {
			return false
		}
		if g.n.CompareAndSwap(cur, cur+n) {
			return true
		}
	}
}

// bodiesInFlightError is a body refused because the bodies held would pass
// their limit.
type bodiesInFlightError struct{ limit int64 }

func (e *bodiesInFlightError) Error() string {
	return "the router is holding its limit of " + strconv.FormatInt(e.limit, 10) + " bytes of request bodies; retry shortly"
}

// count makes b's bytes count against g, up to limit in all, until its
// last reference is dropped. It is called once, before b is read into.
func (b *body) count(g *bodyGauge, limit int64) { b.g, b.limit = g, limit }

// hold makes b hold n bytes, taking what it held not yet from its gauge,
// and reports whether they fitted.
func (b *body) hold(n int) bool {
	if n <= b.held {
		return true
	}
	if b.g != nil && !b.g.take(int64(n-b.held), b.limit) {
		return false
	}
	b.held = n
	return true
}

// newBody returns a body of n bytes with one reference, the caller's.
func newBody(n int) *body {
	if v, ok := bodyBufs.Get().(*body); ok && cap(v.b) >= n {
		v.b = v.b[:n]
		v.refs.Store(1)
		return v
	}
	return bodyOf(make([]byte, n))
}

// bodyPrealloc is the most readBody allocates before bytes arrive: 64 KiB.
const bodyPrealloc = 64 << 10

// readAll reads r into b, growing what b holds (doubling, from
// bodyPrealloc) as bytes arrive, and its buffer with it. n is the declared
// length, or -1: a body that ends before n bytes is an
// io.ErrUnexpectedEOF, and nothing past n is read. A body whose growth
// its gauge cannot hold is an *bodiesInFlightError.
func (b *body) readAll(r io.Reader, n int64) error {
	if n >= 0 {
		r = io.LimitReader(r, n)
	}
	buf := b.b[:0]
	for n < 0 || int64(len(buf)) < n {
		if len(buf) == b.held { // double, but not past the declared length
			size := max(2*b.held, bodyPrealloc)
			if n >= 0 {
				size = int(min(int64(size), n))
			}
			if !b.hold(size) {
				b.b = buf
				return &bodiesInFlightError{b.limit}
			}
			if cap(buf) < size {
				grown := make([]byte, len(buf), size)
				copy(grown, buf)
				buf = grown
			}
		}
		k, err := r.Read(buf[len(buf):b.held])
		buf = buf[:len(buf)+k]
		if err == io.EOF {
			break
		}
		if err != nil {
			b.b = buf
			return err
		}
	}
	b.b = buf
	if n >= 0 && int64(len(buf)) < n {
		return io.ErrUnexpectedEOF
	}
	return nil
}

// bodyOf returns a body holding b, with one reference, the caller's.
func bodyOf(b []byte) *body {
	v := &body{b: b}
	v.refs.Store(1)
	return v
}

// release drops one reference. The last gives back the bytes held to
// the gauge, and the buffer to the pool.
func (b *body) release() {
	if b.refs.Add(-1) != 0 {
		return
	}
	if b.g != nil {
		b.g.n.Add(-int64(b.held))
	}
	b.g, b.limit, b.held = nil, 0, 0
	if cap(b.b) <= maxPooledBody {
		b.b = b.b[:0]
		bodyBufs.Put(b)
	}
}

// reader returns a new reader of the body holding a reference until Close.
func (b *body) reader() *bodyReader {
	b.refs.Add(1)
	return &bodyReader{buf: b}
}

var errBodyClosed = errors.New("router: read of a closed request body")

// bodyReader reads a body. Read, WriteTo and Close may be called from
// different goroutines (a transport may close a body while its writer still
// holds it). A read after Close fails, and the reader's reference is dropped
// only once no read is in progress, so a buffer is never read after it went
// back to the pool; Close does not wait for a write to the network.
type bodyReader struct {
	mu      sync.Mutex
	buf     *body // nil once the reference is dropped
	off     int
	closed  bool
	writing bool // a WriteTo is using buf outside the lock
}

func (r *bodyReader) Read(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return 0, errBodyClosed
	}
	if r.off >= len(r.buf.b) {
		return 0, io.EOF
	}
	n := copy(p, r.buf.b[r.off:])
	r.off += n
	return n, nil
}

// WriteTo writes the rest of the body in one call, as bytes.Reader does.
func (r *bodyReader) WriteTo(w io.Writer) (int64, error) {
	r.mu.Lock()
	if r.closed || r.writing {
		r.mu.Unlock()
		return 0, errBodyClosed
	}
	rest := r.buf.b[r.off:]
	r.writing = true
	r.mu.Unlock()

	n, err := w.Write(rest)

	r.mu.Lock()
	r.writing = false
	r.off += n
	var drop *body
	if r.closed && r.buf != nil { // closed while writing: the reference is ours to drop
		drop, r.buf = r.buf, nil
	}
	r.mu.Unlock()
	if drop != nil {
		drop.release()
	}
	return int64(n), err
}

func (r *bodyReader) Close() error {
	r.mu.Lock()
	var drop *body
	if !r.closed {
		r.closed = true
		if !r.writing {
			drop, r.buf = r.buf, nil
		}
	}
	r.mu.Unlock()
	if drop != nil {
		drop.release()
	}
	return nil
}
