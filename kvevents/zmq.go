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

// guardedTCP is the zmq4 transport the Subscriber dials tcp:// endpoints
// with: plain TCP whose reads are checked frame by frame, so that a publisher
// announcing a frame longer than maxFrameBytes, or a message of more than
// maxFrames frames, has its connection cut before zmq4 allocates for it
// (zmq4 v0.17.0 allocates whatever length a frame header announces).
const guardedTCP = "kvevents-tcp"

const (
	// maxFrameBytes bounds one ZMTP frame on a subscriber's connections:
	// the payload limit and room for the frame header.
	maxFrameBytes = MaxPayloadBytes + 1024
	// maxFrames bounds the frames of one message (vLLM sends 3, a replay
	// reply 3 with the delimiter).
	maxFrames = 16
	// zmtpGreeting is the length of the ZMTP 3 greeting that precedes the
	// frames.
	zmtpGreeting = 64
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

func (g guardTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := g.tcp.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return &guardConn{Conn: c, need: zmtpGreeting}, nil
}

func (g guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := g.tcp.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return guardListener{l}, nil
}

// handshakeTimeout bounds how long an accepted connection may take to send
// its greeting and first frame: zmq4 v0.17.0 opens accepted connections one
// at a time, so a peer that connects and says nothing would stall every
// engine dialling after it.
var handshakeTimeout = 5 * time.Second

// guardListener guards the connections a bound socket accepts.
type guardListener struct{ net.Listener }

func (l guardListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	_ = c.SetReadDeadline(time.Now().Add(handshakeTimeout))
	return &guardConn{Conn: c, need: zmtpGreeting, accepted: true}, nil
}

func (g guardTransport) Addr(ep string) (string, error) { return g.tcp.Addr(ep) }

var errFrameTooLong = errors.New("kvevents: ZMTP frame or message over the limit")

// guardConn follows the ZMTP stream it reads: the greeting, then frames of
// a flags byte, a 1- or 8-byte length and a body.
type guardConn struct {
	net.Conn
	state  uint8  // 0 greeting/body (skip need bytes), 1 flags, 2 length
	need   uint64 // bytes left to skip, or length bytes left to read
	long   bool
	length uint64
	more   bool
	frames int
	failed bool
	// accepted: the read deadline set at Accept is lifted after the first
	// whole frame (the handshake's READY).
	accepted bool
}

func (c *guardConn) Read(p []byte) (int, error) {
	if c.failed {
		return 0, errFrameTooLong
	}
	n, err := c.Conn.Read(p)
	if !c.check(p[:n]) {
		c.failed = true
		c.Conn.Close()
		return 0, errFrameTooLong
	}
	return n, err
}

func (c *guardConn) check(b []byte) bool {
	for len(b) > 0 {
		switch c.state {
		case 0:
			k := min(c.need, uint64(len(b)))
			c.need -= k
			b = b[k:]
			if c.need == 0 {
				c.state = 1
			}
		case 1:
			fl := b[0]
			b = b[1:]
			c.more = fl&0x01 != 0
			c.long = fl&0x02 != 0
			c.length = 0
			c.need = 1
			if c.long {
				c.need = 8
			}
			c.state = 2
		case 2:
			c.length = c.length<<8 | uint64(b[0])
			b = b[1:]
			if c.need--; c.need > 0 {
				continue
			}
			if c.length > maxFrameBytes {
				return false
			}
			if c.frames++; c.frames > maxFrames {
				return false
			}
			if !c.more {
				c.frames = 0
			}
			if c.accepted {
				c.accepted = false
				_ = c.Conn.SetReadDeadline(time.Time{})
			}
			c.need, c.state = c.length, 0
			if c.need == 0 {
				c.state = 1
			}
		}
	}
	return true
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
