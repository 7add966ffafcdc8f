// Package connpool keeps idle keep-alive connections for the HTTP/1.1
// clients that read their answers in the calling goroutine: the router's
// transport to replicas (router/upstream.go) and the tokenizer's client
// of /tokenize (tokenizer/conn.go).
//
// Without a reader goroutine on each connection, as http.Transport has,
// nothing sees an idle connection close or receive bytes nobody asked
// for. So a connection is pooled only when nothing is left to read on it,
// it is checked with a non-blocking peek before reuse (Alive), and idle
// ones are swept now and then: those the peer closed, or that idled too
// long, are closed, so that they hold no file descriptors.
package connpool

import (
	"net"
	"sync"
	"time"
)

// Conn is what a Pool keeps: a connection, and what its reader buffered
// from it. Implementations are pointers to the caller's own connection
// type, so that Get hands back the caller's type.
type Conn interface {
	// NetConn is the connection: the pool peeks at it and closes it.
	NetConn() net.Conn
	// Buffered is the number of bytes read from the connection and not
	// yet consumed (bufio.Reader.Buffered): any means the connection
	// holds bytes past the last answer, and is neither idle nor reusable.
	Buffered() int
}

// Alive reports whether c, an idle connection, is still open and idle:
// nothing buffered from it and nothing to read on it. The end of the
// stream, an error, or bytes nobody asked for mean it is not. It does not
// wait, and may be called concurrently for different connections.
func Alive(c Conn) bool {
	return c.Buffered() == 0 && PeekIdle(c.NetConn())
}

// Pool keeps idle connections by key (the host:port dialled), the most
// recently used last, and hands them out again most recently used first.
//
// The configuration fields are set before the pool is used from more than
// one goroutine (Put starts sweeps, which read them) and not changed
// after. The zero Pool is ready to use and keeps nothing (its caps are 0).
//
// Safe for concurrent use.
type Pool[T Conn] struct {
	// MaxPerKey bounds the idle connections kept under one key; 0 keeps
	// none.
	MaxPerKey int
	// MaxTotal bounds the idle connections kept under all keys; 0 keeps
	// none.
	MaxTotal int
	// IdleTimeout is how long a connection may stay idle before a sweep
	// closes it; 0 or less: no limit (a sweep closes only dead ones).
	IdleTimeout time.Duration
	// SweepEvery is how often idle connections are swept while any are
	// pooled (a timer, started by Put, that stops once the pool is
	// empty); 0 or less: never (dead connections are then found by Get
	// alone, and closed by CloseIdle).
	SweepEvery time.Duration
	// PeekAfter is how long a connection must have idled before Get
	// peeks at it (Alive); one idle for less is handed out unchecked, and
	// a close that raced it is the caller's to handle. 0 or less: every
	// connection is peeked at.
	PeekAfter time.Duration

	mu       sync.Mutex
	idle     map[string][]idleConn[T] // nil until the first Put
	n        int                      // idle connections under all keys
	sweeping bool                     // a sweep is scheduled
}

// idleConn is a pooled connection and when it went idle.
type idleConn[T Conn] struct {
	c     T
	since time.Time
}

// Get takes the most recently pooled connection under key that is still
// open (connections found dead are closed), or reports false when there
// is none. It does not wait, and allocates nothing but PeekIdle's.
func (p *Pool[T]) Get(key string) (T, bool) {
	for {
		p.mu.Lock()
		l := p.idle[key]
		if len(l) == 0 {
			p.mu.Unlock()
			var zero T
			return zero, false
		}
		e := l[len(l)-1]
		l[len(l)-1] = idleConn[T]{}
		p.idle[key] = l[:len(l)-1]
		p.n--
		p.mu.Unlock()
		// Bytes from the peer on an idle connection (a close, or an answer
		// nobody asked for) must never be read as the next answer. One
		// just back from a call may be trusted (PeekAfter): a peek is a
		// system call.
		if (p.PeekAfter > 0 && time.Since(e.since) < p.PeekAfter) || Alive(e.c) {
			return e.c, true
		}
		e.c.NetConn().Close()
	}
}

// Put pools c under key for reuse, or closes it when bytes are buffered
// from it (Conn.Buffered) or the pool for key, or the whole pool, is full.
// The caller gives c up either way.
func (p *Pool[T]) Put(key string, c T) {
	if c.Buffered() != 0 {
		c.NetConn().Close()
		return
	}
	now := time.Now()
	p.mu.Lock()
	l := p.idle[key]
	full := len(l) >= p.MaxPerKey || p.n >= p.MaxTotal
	if !full {
		if p.idle == nil {
			p.idle = make(map[string][]idleConn[T])
		}
		p.idle[key] = append(l, idleConn[T]{c, now})
		p.n++
		if !p.sweeping && p.SweepEvery > 0 {
			p.sweeping = true
			time.AfterFunc(p.SweepEvery, p.sweep)
		}
	}
	p.mu.Unlock()
	if full {
		c.NetConn().Close()
	}
}

// sweep closes the idle connections the peer closed or that idled past
// IdleTimeout, forgets keys left without any, and comes back in
// SweepEvery while any are left.
func (p *Pool[T]) sweep() {
	now := time.Now()
	var dead []T
	p.mu.Lock()
	for key, l := range p.idle {
		keep := l[:0]
		for _, e := range l {
			if (p.IdleTimeout <= 0 || now.Sub(e.since) < p.IdleTimeout) && Alive(e.c) {
				keep = append(keep, e)
			} else {
				dead = append(dead, e.c)
			}
		}
		clear(l[len(keep):])
		p.n -= len(l) - len(keep)
		if len(keep) == 0 {
			delete(p.idle, key)
		} else {
			p.idle[key] = keep
		}
	}
	if p.sweeping = len(p.idle) > 0; p.sweeping {
		time.AfterFunc(p.SweepEvery, p.sweep)
	}
	p.mu.Unlock()
	for _, c := range dead {
		c.NetConn().Close()
	}
}

// CloseIdle closes every pooled connection. Connections in use are not
// the pool's: Put after CloseIdle pools again.
func (p *Pool[T]) CloseIdle() {
	p.mu.Lock()
	idle := p.idle
	p.idle, p.n = nil, 0
	p.mu.Unlock()
	for _, l := range idle {
		for _, e := range l {
			e.c.NetConn().Close()
		}
	}
}

// Len returns the number of idle connections pooled under all keys.
func (p *Pool[T]) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

// Live returns the number of pooled connections that are Alive now,
// peeking at each (whatever PeekAfter says) under the pool's lock.
func (p *Pool[T]) Live() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	live := 0
	for _, l := range p.idle {
		for _, e := range l {
			if Alive(e.c) {
				live++
			}
		}
	}
	return live
}
