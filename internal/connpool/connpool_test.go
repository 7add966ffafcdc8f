package connpool

import (
	"bufio"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testnet"
	"github.com/semroute/semroute/internal/testwait"
)

// tconn is a caller's connection: a TCP connection and its reader.
type tconn struct {
	c      *noteClose
	br     *bufio.Reader
	closed *atomic.Bool
}

func (tc *tconn) NetConn() net.Conn { return tc.c }
func (tc *tconn) Buffered() int     { return tc.br.Buffered() }

// noteClose is a TCP connection that notes its Close; it stays a
// syscall.Conn, which PeekIdle peeks at.
type noteClose struct {
	*net.TCPConn
	closed atomic.Bool
}

func (n *noteClose) Close() error {
	n.closed.Store(true)
	return n.TCPConn.Close()
}

// peer is the server side of the connections dialled: each accepted
// connection is sent on accepted, and held open until the test ends.
type peer struct {
	addr     string
	accepted chan net.Conn
}

func newPeer(t *testing.T) *peer {
	p := &peer{accepted: make(chan net.Conn, 64)}
	p.addr, _ = testnet.Serve(t, func(c net.Conn) { p.accepted <- c })
	return p
}

// dial returns a new connection to p and p's side of it.
func (p *peer) dial(t *testing.T) (*tconn, net.Conn) {
	t.Helper()
	c, err := net.Dial("tcp", p.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	nc := &noteClose{TCPConn: c.(*net.TCPConn)}
	return &tconn{c: nc, br: bufio.NewReader(nc), closed: &nc.closed}, <-p.accepted
}

func TestZeroPoolKeepsNothing(t *testing.T) {
	p := newPeer(t)
	var pool Pool[*tconn]
	c, _ := p.dial(t)
	pool.Put("a", c)
	if !c.closed.Load() || pool.Len() != 0 {
		t.Fatalf("zero pool: closed %v, len %d", c.closed.Load(), pool.Len())
	}
	if _, ok := pool.Get("a"); ok {
		t.Fatal("zero pool handed out a connection")
	}
}

func TestCaps(t *testing.T) {
	p := newPeer(t)
	pool := Pool[*tconn]{MaxPerKey: 2, MaxTotal: 3}
	var cs []*tconn
	for _, key := range []string{"a", "a", "a", "b", "b"} {
		c, _ := p.dial(t)
		cs = append(cs, c)
		pool.Put(key, c)
	}
	// a: two kept, the third over MaxPerKey; b: one kept, the second over
	// MaxTotal.
	for i, want := range []bool{false, false, true, false, true} {
		if cs[i].closed.Load() != want {
			t.Errorf("connection %d closed %v, want %v", i, !want, want)
		}
	}
	if n := pool.Len(); n != 3 {
		t.Fatalf("Len %d, want 3", n)
	}
	// Most recently pooled first.
	for _, want := range []*tconn{cs[1], cs[0]} {
		if c, ok := pool.Get("a"); !ok || c != want {
			t.Fatalf("Get(a) = %p %v, want %p", c, ok, want)
		}
	}
	if _, ok := pool.Get("a"); ok {
		t.Fatal("Get(a) on an empty key")
	}
	pool.CloseIdle()
	if !cs[3].closed.Load() || pool.Len() != 0 {
		t.Fatalf("after CloseIdle: closed %v, len %d", cs[3].closed.Load(), pool.Len())
	}
	// Pooled again after CloseIdle.
	pool.Put("a", cs[0])
	if pool.Len() != 1 || cs[0].closed.Load() {
		t.Fatalf("Put after CloseIdle: len %d, closed %v", pool.Len(), cs[0].closed.Load())
	}
}

// TestBufferedIsNotPooled: a connection with bytes past its answer
// buffered is closed, not pooled.
func TestBufferedIsNotPooled(t *testing.T) {
	p := newPeer(t)
	pool := Pool[*tconn]{MaxPerKey: 4, MaxTotal: 4}
	c, srv := p.dial(t)
	io.WriteString(srv, "xy")
	if b, err := c.br.ReadByte(); err != nil || b != 'x' {
		t.Fatal(b, err)
	}
	pool.Put("a", c)
	if !c.closed.Load() || pool.Len() != 0 {
		t.Fatalf("closed %v, len %d", c.closed.Load(), pool.Len())
	}
}

// TestGetPeeks: bytes nobody asked for, or the peer's close, on an idle
// connection keep Get from handing it out, unless it idled less than
// PeekAfter.
func TestGetPeeks(t *testing.T) {
	p := newPeer(t)
	for _, peer := range []string{"sends", "closes"} {
		t.Run(peer, func(t *testing.T) {
			pool := Pool[*tconn]{MaxPerKey: 4, MaxTotal: 4}
			live, _ := p.dial(t)
			dead, srv := p.dial(t)
			pool.Put("a", live)
			pool.Put("a", dead)
			if pool.Live() != 2 {
				t.Fatalf("Live %d before the peer acted", pool.Live())
			}
			if peer == "sends" {
				io.WriteString(srv, "HTTP/1.1 408 Request Timeout\r\n\r\n")
			} else {
				srv.Close()
			}
			testwait.Until(t, "the peer's bytes or close to arrive", func() bool { return pool.Live() == 1 })
			pool.PeekAfter = time.Hour // trusted: just back
			if c, ok := pool.Get("a"); !ok || c != dead {
				t.Fatalf("PeekAfter 1h: Get = %p %v, want the unchecked %p", c, ok, dead)
			}
			pool.Put("a", dead)
			pool.PeekAfter = 0
			if c, ok := pool.Get("a"); !ok || c != live {
				t.Fatalf("Get = %p %v, want %p (past the dead one)", c, ok, live)
			}
			if !dead.closed.Load() || pool.Len() != 0 {
				t.Fatalf("the dead one: closed %v, len %d", dead.closed.Load(), pool.Len())
			}
		})
	}
}

// TestSweep: a sweep closes the connections the peer closed and those
// idle past IdleTimeout, and keeps the others.
func TestSweep(t *testing.T) {
	p := newPeer(t)
	pool := Pool[*tconn]{MaxPerKey: 4, MaxTotal: 8, IdleTimeout: time.Minute}
	live, _ := p.dial(t)
	old, _ := p.dial(t)
	dead, srv := p.dial(t)
	pool.Put("a", live)
	pool.Put("a", old)
	pool.Put("b", dead)
	srv.Close()
	testwait.Until(t, "the peer's close to arrive", func() bool { return pool.Live() == 2 })
	pool.mu.Lock()
	pool.idle["a"][1].since = time.Now().Add(-2 * time.Minute)
	pool.mu.Unlock()
	pool.sweep()
	if live.closed.Load() || !old.closed.Load() || !dead.closed.Load() {
		t.Fatalf("after a sweep: closed live %v old %v dead %v", live.closed.Load(), old.closed.Load(), dead.closed.Load())
	}
	if keys, n, _ := pool.state(); keys != 1 || n != 1 {
		t.Fatalf("after a sweep: %d keys, %d connections; want 1, 1 (b forgotten)", keys, n)
	}
}

// state returns the keys remembered, the connections pooled and whether a
// sweep is scheduled.
func (p *Pool[T]) state() (keys, n int, sweeping bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.idle), p.n, p.sweeping
}

// TestSweepScheduled: Put starts the sweeps, which end once the pool is
// empty.
func TestSweepScheduled(t *testing.T) {
	p := newPeer(t)
	pool := Pool[*tconn]{MaxPerKey: 4, MaxTotal: 4, SweepEvery: time.Millisecond}
	c, srv := p.dial(t)
	pool.Put("a", c)
	srv.Close()
	testwait.Until(t, "a sweep to close the connection the peer closed, and no other sweep scheduled", func() bool {
		keys, n, sweeping := pool.state()
		return keys == 0 && n == 0 && !sweeping
	})
	if !c.closed.Load() {
		t.Fatal("swept, not closed")
	}
}

// TestGetPutAllocatesNothing: the pool's own part of the hot path, a Get
// and a Put of an open connection, allocates nothing (the peek, a system
// call, is PeekIdle's and is left out: PeekAfter).
func TestGetPutAllocatesNothing(t *testing.T) {
	p := newPeer(t)
	pool := Pool[*tconn]{MaxPerKey: 4, MaxTotal: 4, PeekAfter: time.Hour}
	c, _ := p.dial(t)
	pool.Put("a", c)
	allocs := testing.AllocsPerRun(100, func() {
		pc, ok := pool.Get("a")
		if !ok {
			t.Fatal("the open connection was not handed out")
		}
		pool.Put("a", pc)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per Get and Put", allocs)
	}
}
