package router

import (
	"errors"
	"io"
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
}

// newBody returns a body of n bytes with one reference, the caller's.
func newBody(n int) *body {
	if v, ok := bodyBufs.Get().(*body); ok && cap(v.b) >= n {
		v.b = v.b[:n]
		v.refs.Store(1)
		return v
	}
	b := &body{b: make([]byte, n)}
	b.refs.Store(1)
	return b
}

// release drops one reference.
func (b *body) release() {
	if b.refs.Add(-1) == 0 && cap(b.b) <= maxPooledBody {
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
// holds it); the mutex keeps a read from running after Close gave the
// buffer back.
type bodyReader struct {
	mu  sync.Mutex
	buf *body // nil once closed
	off int
}

func (r *bodyReader) Read(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.buf == nil {
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
	defer r.mu.Unlock()
	if r.buf == nil {
		return 0, errBodyClosed
	}
	n, err := w.Write(r.buf.b[r.off:])
	r.off += n
	return int64(n), err
}

func (r *bodyReader) Close() error {
	r.mu.Lock()
	b := r.buf
	r.buf = nil
	r.mu.Unlock()
	if b != nil {
		b.release()
	}
	return nil
}
