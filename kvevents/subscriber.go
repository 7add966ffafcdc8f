package kvevents

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/go-zeromq/zmq4"
)

// SubscriberOptions configure a Subscriber. OnBatch is required, and one of
// Endpoint and Listener.
type SubscriberOptions struct {
	// Endpoint is the engine's PUB address, e.g. "tcp://10.0.0.5:5557",
	// which the Subscriber dials: the engine binds (vLLM does when its
	// endpoint has a wildcard, "tcp://*:5557").
	Endpoint string
	// Listener, instead of Endpoint, is a SUB socket the router binds and
	// engines dial (vLLM does when its endpoint has no wildcard, as llm-d
	// deploys it): the Subscriber gets the messages whose topic starts with
	// Topic, and the Listener is the caller's to close after it.
	Listener *Listener
	// ReplayEndpoint is the engine's replay ROUTER address; "" when it has
	// none (then every gap is a reset).
	ReplayEndpoint string
	// Topic is the subscription, a prefix of the topic frame as in ZeroMQ;
	// "" receives everything. On a Listener shared by several engines it
	// tells this engine's messages apart (llm-d's engines publish under
	// "kv@<pod-ip>:<port>@<model>").
	Topic string
	// OnBatch receives each batch, in sequence order, from the Subscriber's
	// one goroutine. The Batch is valid only during the call (its memory is
	// reused for the next); copy what you keep. OnBatch must not call Close.
	OnBatch func(seq uint64, b Batch)
	// OnReset is called, from the same goroutine, when the batches delivered
	// so far no longer describe the engine: a gap replay could not fill, or
	// the engine restarted (its sequence went back, or its replay buffer
	// holds another batch under the number of the last one delivered). The
	// consumer should forget what it learned from this engine; delivery goes
	// on from the current batch (after a restart, from what the new engine's
	// replay buffer holds before it). May be nil.
	OnReset func(reason string)
	// ReplayTimeout bounds one replay: connecting, asking and receiving
	// every batch up to the end marker. Default 2s.
	ReplayTimeout time.Duration
	// MaxReplay is the longest gap asked of replay, in batches; a longer one
	// is a reset at once. Default 10000 (vLLM's default buffer_steps).
	MaxReplay uint64
	// ReconnectMin and ReconnectMax bound the wait between two connection
	// attempts, doubling from Min to Max while they fail. Defaults 100ms, 5s.
	ReconnectMin, ReconnectMax time.Duration
	// Limits bound the messages read; the zero Limits are the defaults. A
	// message past one is skipped and counted (Stats.OverLimit). On a
	// Listener, the Listener's MaxMessageBytes (ListenLimits) bounds the
	// messages as they arrive, this one what is decoded.
	Limits Limits
	// Logger receives resets and connection failures (nil: slog.Default()).
	Logger *slog.Logger
}

// Stats are a Subscriber's counters since it started.
type Stats struct {
	// Received counts the messages read from the PUB socket.
	Received uint64
	// Applied counts the batches given to OnBatch, live or replayed.
	Applied uint64
	// Replayed counts the applied batches that came from replay.
	Replayed uint64
	// Gaps counts the times a sequence number jumped forward.
	Gaps uint64
	// Resets counts the calls to OnReset (gaps not filled, restarts).
	Resets uint64
	// Restarts counts the engine restarts the sequence showed (a part of
	// Resets): a number that went back, or a replay buffer that holds
	// another batch under the number of the last one delivered.
	Restarts uint64
	// Malformed counts the messages and payloads that could not be read
	// (wrong frames, a bad sequence frame, a payload Decode refused as
	// ErrMalformed); they are skipped.
	Malformed uint64
	// OverLimit counts the batches, live or replayed, skipped for passing
	// one of the Limits, by the Limit passed. Each was received, so its
	// sequence number is no gap.
	OverLimit [NumLimits]uint64
	// Reconnects counts the connections made after the first.
	Reconnects uint64
	// Dropped counts the messages a Listener had for this Subscriber while
	// its queue was full (a gap, filled from replay like any other).
	Dropped uint64
}

type counters struct {
	received, applied, replayed, gaps, resets, restarts, malformed, reconnects, dropped atomic.Uint64
	overLimit                                                                           [NumLimits]atomic.Uint64
}

// Subscriber follows one engine's KV events: it connects a SUB socket (and
// reconnects by itself when the connection drops), delivers the decoded
// batches in sequence order, fills a gap from the engine's replay socket
// before delivering anything after it, and calls OnReset when it cannot, or
// when the engine restarted. A malformed message, or one past the Limits, is
// counted and skipped. Stats, LastBatch, Silent and Resync are safe for
// concurrent use; Close stops everything and waits for it.
//
// A restart shows in the sequence as a number that goes back (the new
// engine counts from 0 again), unless the new engine's first batches were
// lost and its numbers passed the old one's: then, on a gap, or on the
// first batch after the Subscriber connected again, the replay buffer is
// asked for the batch numbered as the last one delivered, and another
// batch there (its payload's hash differs) is a restart too.
type Subscriber struct {
	opts  SubscriberOptions
	log   *slog.Logger
	start time.Time
	stop  chan struct{}
	done  chan struct{}
	c     counters
	last  atomic.Int64 // unix ns of the last batch applied; 0 before any

	mu      sync.Mutex
	closed  bool
	sock    zmq4.Socket // the current SUB socket
	replayS zmq4.Socket // the replay DEALER while a replay runs

	in chan zmq4.Msg // from the Listener, when there is one

	// fresh asks the run goroutine to start a new sequence (Resync).
	fresh atomic.Bool

	// Owned by the run goroutine.
	dec  Decoder
	have bool
	next uint64
	// lastSum is the hash of the payload of batch next-1, the last delivered;
	// hasLast is false when there is none or it arrived elided.
	lastSum uint64
	hasLast bool
	// verify: the connection is new, so the next batch may be a new
	// engine's even if its number follows on.
	verify bool
}

// NewSubscriber starts following an engine. It does not wait for the
// connection: an engine not up yet is dialled again until Close.
func NewSubscriber(opts SubscriberOptions) (*Subscriber, error) {
	if (opts.Endpoint == "" && opts.Listener == nil) || opts.OnBatch == nil {
		return nil, errors.New("kvevents: subscriber needs an endpoint or a listener, and OnBatch")
	}
	if opts.ReplayTimeout <= 0 {
		opts.ReplayTimeout = 2 * time.Second
	}
	if opts.MaxReplay == 0 {
		opts.MaxReplay = 10000
	}
	if opts.ReconnectMin <= 0 {
		opts.ReconnectMin = 100 * time.Millisecond
	}
	if opts.ReconnectMax < opts.ReconnectMin {
		opts.ReconnectMax = max(5*time.Second, opts.ReconnectMin)
	}
	s := &Subscriber{
		opts:  opts,
		log:   opts.Logger,
		start: time.Now(),
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
		dec:   Decoder{Limits: opts.Limits},
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if l := opts.Listener; l != nil {
		if s.opts.Endpoint == "" {
			s.opts.Endpoint = l.Addr() + " topic " + strconv.Quote(opts.Topic)
		}
		s.in = make(chan zmq4.Msg, listenerQueue)
		if err := l.add(s); err != nil {
			return nil, err
		}
		go s.runListened()
		return s, nil
	}
	go s.run()
	return s, nil
}

// Stats returns the counters.
func (s *Subscriber) Stats() Stats {
	st := Stats{
		Received:   s.c.received.Load(),
		Applied:    s.c.applied.Load(),
		Replayed:   s.c.replayed.Load(),
		Gaps:       s.c.gaps.Load(),
		Resets:     s.c.resets.Load(),
		Restarts:   s.c.restarts.Load(),
		Malformed:  s.c.malformed.Load(),
		Reconnects: s.c.reconnects.Load(),
		Dropped:    s.c.dropped.Load(),
	}
	for l := range st.OverLimit {
		st.OverLimit[l] = s.c.overLimit[l].Load()
	}
	return st
}

// LastBatch is when the last batch was applied; the zero Time before any.
func (s *Subscriber) LastBatch() time.Time {
	if ns := s.last.Load(); ns != 0 {
		return time.Unix(0, ns)
	}
	return time.Time{}
}

// Silent reports whether no batch has been applied for longer than d (since
// the Subscriber started, when none has been). An idle engine is silent too:
// the consumer decides what silence means.
func (s *Subscriber) Silent(d time.Duration) bool {
	t := s.LastBatch()
	if t.IsZero() {
		t = s.start
	}
	return time.Since(t) > d
}

// Resync makes the next batch start a new sequence, as the first one did:
// what the engine's replay buffer holds before it is delivered first, and
// no number it has reads as a restart or a gap. The engine restarted (seen
// elsewhere, as in its metrics) and the consumer already forgot it, so
// that the restart is not seen, and forgotten, twice. Safe for concurrent
// use.
func (s *Subscriber) Resync() { s.fresh.Store(true) }

// Close stops the Subscriber and waits until its goroutine and sockets are
// gone. No callback runs after Close returns. Close is idempotent.
func (s *Subscriber) Close() error {
	if l := s.opts.Listener; l != nil {
		l.remove(s)
	}
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.stop)
		if s.sock != nil {
			s.sock.Close()
		}
		if s.replayS != nil {
			s.replayS.Close()
		}
	}
	s.mu.Unlock()
	<-s.done
	return nil
}

func (s *Subscriber) stopping() bool {
	select {
	case <-s.stop:
		return true
	default:
		return false
	}
}

// setSock records the socket Close must close; false once closed.
func (s *Subscriber) setSock(dst *zmq4.Socket, sock zmq4.Socket) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed && sock != nil {
		return false
	}
	*dst = sock
	return true
}

var quietZMQ = zmq4.WithLogger(log.New(io.Discard, "", 0))

// socketContext is the context of the Subscriber's sockets: it carries
// MaxMessageBytes to the guarded transport.
func (s *Subscriber) socketContext() context.Context {
	return withMessageLimit(context.Background(), s.opts.Limits.orDefaults().MaxMessageBytes)
}

func (s *Subscriber) run() {
	defer close(s.done)
	wait := s.opts.ReconnectMin
	connected := false
	timer := time.NewTimer(0)
	<-timer.C
	for {
		sock := zmq4.NewSub(s.socketContext(), quietZMQ,
			zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(s.opts.ReconnectMax))
		if !s.setSock(&s.sock, sock) {
			closeAndDrain(sock)
			return
		}
		err := sock.SetOption(zmq4.OptionSubscribe, s.opts.Topic)
		if err == nil {
			err = sock.Dial(guarded(s.opts.Endpoint))
		}
		if err == nil {
			if connected {
				s.c.reconnects.Add(1)
				s.verify = true // the engine at the other end may be a new one
			}
			connected = true
			wait = s.opts.ReconnectMin
			err = s.receive(sock)
		}
		s.setSock(&s.sock, nil)
		closeAndDrain(sock)
		if s.stopping() {
			return
		}
		s.log.Debug("kvevents: connection", "endpoint", s.opts.Endpoint, "err", err, "retry_in", wait)
		timer.Reset(wait)
		select {
		case <-s.stop:
			timer.Stop()
			return
		case <-timer.C:
		}
		wait = min(2*wait, s.opts.ReconnectMax)
	}
}

// receive reads the SUB socket until it fails or is closed.
func (s *Subscriber) receive(sock zmq4.Socket) error {
	for {
		msg, err := sock.Recv()
		if err != nil {
			return err
		}
		if s.stopping() {
			return nil
		}
		s.message(msg)
	}
}

// runListened takes the Listener's messages for this engine until Close.
func (s *Subscriber) runListened() {
	defer close(s.done)
	for {
		select {
		case <-s.stop:
			return
		case msg := <-s.in:
			s.message(msg)
		}
	}
}

// offer queues a message from the Listener; a full queue drops it, and the
// gap it leaves is filled from replay.
func (s *Subscriber) offer(msg zmq4.Msg) {
	select {
	case s.in <- msg:
	default:
		s.c.received.Add(1)
		s.c.dropped.Add(1)
	}
}

// message handles one live message, [topic, seq, payload].
func (s *Subscriber) message(msg zmq4.Msg) {
	s.c.received.Add(1)
	if len(msg.Frames) != 3 {
		s.c.malformed.Add(1)
		return
	}
	seq, err := readSeq(msg.Frames[1])
	if err != nil {
		s.c.malformed.Add(1)
		return
	}
	s.handle(seq, msg.Frames[2])
}

// handle orders one live batch against the ones before it.
func (s *Subscriber) handle(seq uint64, payload []byte) {
	if s.fresh.Swap(false) {
		s.have = false
	}
	verify := s.verify
	s.verify = false
	switch {
	case !s.have:
		// What the engine published before this Subscriber heard it (an
		// engine that dials the router publishes into the void until it
		// has connected; vLLM counts from 0, llm-d's simulator from 1):
		// whatever its replay buffer still has.
		if seq > 0 {
			s.fill(0, seq, false)
		}
	case seq < s.next:
		s.restarted(seq, fmt.Sprintf("engine restarted: batch %d after %d", seq, s.next-1))
	case (seq > s.next || verify) && s.otherEngine():
		s.restarted(seq, fmt.Sprintf("engine restarted: its replay buffer holds another batch %d than the one applied", s.next-1))
	case seq > s.next:
		s.c.gaps.Add(1)
		if !s.fill(s.next, seq, true) && !s.stopping() {
			s.reset(fmt.Sprintf("gap: batches %d to %d missed and not replayed", s.next, seq-1))
		}
	}
	if s.stopping() {
		return
	}
	s.have, s.next = true, seq+1
	s.deliver(seq, payload, false)
}

// restarted resets for an engine restart seen at batch seq, and delivers
// what the new engine's replay buffer holds before it, if anything.
func (s *Subscriber) restarted(seq uint64, reason string) {
	s.c.restarts.Add(1)
	s.reset(reason)
	if seq > 0 {
		s.fill(0, seq, false)
	}
}

// otherEngine reports whether the engine's replay buffer holds, under the
// number of the last batch delivered, another batch than that one: the
// engine restarted and its new sequence passed the old one's. False when
// it cannot tell (no replay socket, a buffer that no longer reaches back
// to that batch, a payload that arrived elided).
func (s *Subscriber) otherEngine() bool {
	if s.opts.ReplayEndpoint == "" || !s.hasLast || s.next == 0 {
		return false
	}
	last, other := s.next-1, false
	s.replay(last, func(seq uint64, payload []byte) bool {
		other = seq == last && !isElided(payload) && xxhash.Sum64(payload) != s.lastSum
		return false // the first batch tells
	})
	return other
}

// What became of a batch given to deliver.
type outcome uint8

const (
	applied   outcome = iota // given to OnBatch
	overLimit                // past the Limits: skipped, and counted as received
	unread                   // malformed: skipped
)

func (s *Subscriber) reset(reason string) {
	s.c.resets.Add(1)
	s.log.Warn("kvevents: reset", "endpoint", s.opts.Endpoint, "reason", reason)
	if s.opts.OnReset != nil {
		s.opts.OnReset(reason)
	}
}

// deliver decodes a batch and gives it to OnBatch, or counts why not.
func (s *Subscriber) deliver(seq uint64, payload []byte, replayed bool) outcome {
	if isElided(payload) { // the transport dropped it unread
		s.hasLast = false
		return s.skip(seq, LimitMessageBytes, "payload elided on arrival")
	}
	s.lastSum, s.hasLast = xxhash.Sum64(payload), true
	b, err := s.dec.Decode(payload)
	if le := (*LimitError)(nil); errors.As(err, &le) {
		return s.skip(seq, le.Limit, err)
	}
	if err != nil {
		s.c.malformed.Add(1)
		s.log.Debug("kvevents: malformed batch", "endpoint", s.opts.Endpoint, "seq", seq, "err", err)
		return unread
	}
	s.opts.OnBatch(seq, b)
	s.c.applied.Add(1)
	if replayed {
		s.c.replayed.Add(1)
	}
	s.last.Store(time.Now().UnixNano())
	return applied
}

// skip counts a batch past limit l.
func (s *Subscriber) skip(seq uint64, l Limit, why any) outcome {
	s.c.overLimit[l].Add(1)
	s.log.Debug("kvevents: batch over the limits skipped", "endpoint", s.opts.Endpoint, "seq", seq, "limit", l.String(), "err", why)
	return overLimit
}

// fill asks the replay socket for batches from `from` on and delivers those
// before `to`. It reports whether all of [from, to) were delivered. Unless
// exact, the first batch the buffer has at or after from starts the run
// (an engine's buffer from its start: its first sequence, or the oldest it
// kept).
func (s *Subscriber) fill(from, to uint64, exact bool) bool {
	if s.opts.ReplayEndpoint == "" || to-from > s.opts.MaxReplay {
		return false
	}
	next, ok := from, true
	ended := s.replay(from, func(seq uint64, payload []byte) bool {
		if !exact && next == from && seq > from && seq < to {
			next = seq
		}
		switch {
		case !ok || seq < next || seq >= to:
			// Before the gap, after it (it will come live), or past a hole.
		case seq != next:
			ok = false // the buffer no longer reaches back to next
		case s.deliver(seq, payload, true) != unread:
			next++ // applied, or received and skipped for its size
		default:
			ok = false
		}
		return true
	})
	return ended && ok && next == to
}

// replay asks the replay socket for the batches from `from` on and gives
// each to f, in order, until f returns false. It reports whether the end
// marker came; false too when f stopped it, or when the socket failed,
// timed out (ReplayTimeout bounds it all) or sent a malformed reply.
func (s *Subscriber) replay(from uint64, f func(seq uint64, payload []byte) bool) bool {
	d := zmq4.NewDealer(s.socketContext(), quietZMQ, zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(s.opts.ReplayTimeout), zmq4.WithTimeout(s.opts.ReplayTimeout))
	if !s.setSock(&s.replayS, d) {
		closeAndDrain(d)
		return false
	}
	defer func() {
		s.setSock(&s.replayS, nil)
		closeAndDrain(d)
	}()
	timer := time.AfterFunc(s.opts.ReplayTimeout, func() { d.Close() })
	defer timer.Stop()
	if err := d.Dial(guarded(s.opts.ReplayEndpoint)); err != nil {
		return false
	}
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, seqBytes(from))); err != nil {
		return false
	}
	for {
		msg, err := d.Recv()
		if err != nil || s.stopping() {
			return false // timed out, closed, or the engine went away
		}
		fr, good := replyFrames(msg.Frames)
		if !good {
			s.c.malformed.Add(1)
			return false
		}
		if bytes.Equal(fr[0], endSeq) {
			return true
		}
		seq, err := readSeq(fr[0])
		if err != nil {
			s.c.malformed.Add(1)
			return false
		}
		if !f(seq, fr[1]) {
			return false
		}
	}
}

// replyFrames returns the [seq, payload] of a replay reply as a DEALER
// receives it, in any of the forms engines send: [seq, payload] (a REQ's
// view), ["", seq, payload] (vLLM before PR #45177), [topic, seq, payload]
// and ["", topic, seq, payload] (vLLM since PR #45177, and llm-d's
// simulator, pkg/kv-cache/kv_events_replayer.go, whose end marker is
// ["", "", -1, ""]).
func replyFrames(f [][]byte) ([][]byte, bool) {
	switch len(f) {
	case 2:
		return f, true
	case 3:
		return f[1:], true
	case 4:
		return f[2:], len(f[0]) == 0
	}
	return nil, false
}
