package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// guardedTCP is the zmq4 transport the kvevents sockets use for tcp://
// endpoints: plain TCP whose bytes are followed frame by frame before zmq4
// reads them, because zmq4 v0.17.0 allocates whatever length a frame
// header announces. A data frame that would take its message past the
// socket's MaxMessageBytes (Limits) is dropped as it arrives, never
// buffered whole, and zmq4 gets in its place a frame of one byte
// (elided): the message keeps its other frames, so that the Subscriber
// counts it and its sequence number, and the connection lives on. A
// command frame past the limit, or a message of more than maxFrames
// frames, cuts the connection.
const guardedTCP = "kvevents-tcp"

const (
	// maxFrames bounds the frames of one message (vLLM sends 3, a replay
	// reply 3 with the delimiter, 4 with the topic).
	maxFrames = 16
	// zmtpGreeting is the length of the ZMTP 3 greeting that precedes the
	// frames.
	zmtpGreeting = 64
	// guardBuffer is how many bytes a guarded connection reads at once.
	guardBuffer = 16 << 10
)

func init() {
	if err := zmq4.RegisterTransport(guardedTCP, guardTransport{transport.New("tcp")}); err != nil {
		panic(err)
	}
}

// guarded rewrites a tcp:// endpoint to the guarded transport.
func guarded(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return guardedTCP + "://" + rest
	}
	return ep
}

type guardTransport struct{ tcp transport.Transport }

// Dial and Listen take the limit from the socket's context
// (withMessageLimit), which zmq4 passes them.
func (g guardTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := g.tcp.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newGuardConn(c, messageLimit(ctx)), nil
}

func (g guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := g.tcp.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return guardListener{l, messageLimit(ctx)}, nil
}

// handshakeTimeout bounds how long an accepted connection may take to send
// its greeting and first frame: zmq4 v0.17.0 opens accepted connections one
// at a time, so a peer that connects and says nothing would stall every
// engine dialling after it.
var handshakeTimeout = 5 * time.Second

// guardListener guards the connections a bound socket accepts.
type guardListener struct {
	net.Listener
	limit uint64
}

func (l guardListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	_ = c.SetReadDeadline(time.Now().Add(handshakeTimeout))
	g := newGuardConn(c, l.limit)
	g.accepted = true
	return g, nil
}

func (g guardTransport) Addr(ep string) (string, error) { return g.tcp.Addr(ep) }

var errFrameTooLong = errors.New("kvevents: ZMTP command frame or message over the limit")

// guardConn hands zmq4 the bytes of its connection through a frameFilter.
type guardConn struct {
	net.Conn
	f   frameFilter
	in  []byte // read from Conn
	out []byte // filtered, handed on from off
	off int
	err error // Conn's, handed on once out is drained
	// accepted: the read deadline set at Accept is lifted after the first
	// whole frame header (the handshake's READY).
	accepted bool
}

func newGuardConn(c net.Conn, limit uint64) *guardConn {
	return &guardConn{Conn: c, f: frameFilter{limit: limit, need: zmtpGreeting}}
}

func (c *guardConn) Read(p []byte) (int, error) {
	for c.off == len(c.out) {
		if c.err != nil {
			return 0, c.err
		}
		if c.in == nil {
			c.in = make([]byte, guardBuffer)
			c.out = make([]byte, 0, guardBuffer+16)
		}
		n, err := c.Conn.Read(c.in)
		var ok bool
		c.out, ok = c.f.filter(c.out[:0], c.in[:n])
		c.off, c.err = 0, err
		if !ok {
			c.Conn.Close()
			c.out, c.err = c.out[:0], errFrameTooLong
		}
		if c.accepted && c.f.headers > 0 {
			c.accepted = false
			_ = c.Conn.SetReadDeadline(time.Time{})
		}
	}
	n := copy(p, c.out[c.off:])
	c.off += n
	return n, nil
}

// The states of a frameFilter.
const (
	fsPass  uint8 = iota // hand on need bytes (the greeting, a frame's body)
	fsDrop               // drop need bytes (an elided frame's body)
	fsFlags              // next: a frame's flags
	fsSize               // next: need more bytes of a frame's size
)

// frameFilter follows a ZMTP 3 stream: the greeting, then frames of a
// flags byte, a 1- or 8-byte size and a body. It holds a frame's header
// back until it has the whole size, then hands it on, or the header of a
// one-byte frame and elided in its place when the frame would take its
// message past limit. The zero frameFilter is not ready: see newGuardConn.
type frameFilter struct {
	limit   uint64 // bytes of one message's frames
	state   uint8
	need    uint64
	hdr     [9]byte // the header read so far
	nhdr    int
	size    uint64
	msg     uint64 // bytes of the current message's frames handed on so far
	frames  int    // frames of the current message so far
	headers int    // frame headers read, for the accept deadline
}

// filter appends to dst what zmq4 may read of in, and reports false when
// the connection must be cut.
func (f *frameFilter) filter(dst, in []byte) ([]byte, bool) {
	for len(in) > 0 {
		switch f.state {
		case fsPass, fsDrop:
			k := min(f.need, uint64(len(in)))
			if f.state == fsPass {
				dst = append(dst, in[:k]...)
			}
			f.need -= k
			in = in[k:]
			if f.need == 0 {
				f.state = fsFlags
			}
		case fsFlags:
			f.hdr[0], f.nhdr, f.size = in[0], 1, 0
			in = in[1:]
			f.need = 1
			if f.hdr[0]&0x02 != 0 { // a long frame: 8 bytes of size
				f.need = 8
			}
			f.state = fsSize
		case fsSize:
			f.hdr[f.nhdr] = in[0]
			f.nhdr++
			f.size = f.size<<8 | uint64(in[0])
			in = in[1:]
			if f.need--; f.need > 0 {
				continue
			}
			var ok bool
			if dst, ok = f.frame(dst); !ok {
				return dst, false
			}
		}
	}
	return dst, true
}

// frame decides on a frame whose header is whole: its header is handed on
// and its body will be, or it is elided, or the connection is cut.
func (f *frameFilter) frame(dst []byte) ([]byte, bool) {
	fl := f.hdr[0]
	more, command := fl&0x01 != 0, fl&0x04 != 0
	f.headers++
	if f.frames++; f.frames > maxFrames {
		return dst, false
	}
	if f.size <= f.limit-f.msg {
		dst = append(dst, f.hdr[:f.nhdr]...)
		f.msg += f.size
		f.state, f.need = fsPass, f.size
	} else if command {
		return dst, false
	} else {
		dst = append(dst, fl&^0x02, 1, elided)
		f.state, f.need = fsDrop, f.size
	}
	if !more {
		f.msg, f.frames = 0, 0
	}
	if f.need == 0 {
		f.state = fsFlags
	}
	return dst, true
}

// closeAndDrain closes s and empties its receive queue. zmq4 v0.17.0 hands
// each received message to a channel of 10 from one goroutine per
// connection, which blocks for ever when the channel is full and nobody
// reads: after Close, Recv returns either a queued message or the closed
// error at random, so reading until the error has come many times in a row
// leaves no message queued and no goroutine blocked.
func closeAndDrain(s zmq4.Socket) {
	_ = s.Close()
	for misses := 0; misses < 64; {
		if _, err := s.Recv(); err != nil {
			misses++
		} else {
			misses = 0
		}
	}
}

// seqBytes is seq as 8 bytes big-endian.
func seqBytes(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}

// endSeq is the replay end marker, -1 as 8 bytes.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

func readSeq(b []byte) (uint64, error) {
	if len(b) != 8 {
		return 0, fmt.Errorf("sequence frame of %d bytes, want 8", len(b))
	}
	return binary.BigEndian.Uint64(b), nil
}
