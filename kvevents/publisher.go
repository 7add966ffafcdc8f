package kvevents

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// PublisherOptions configure a Publisher. Endpoint is required.
type PublisherOptions struct {
	// Endpoint is where the PUB socket binds, e.g. "tcp://127.0.0.1:5557"
	// ("tcp://127.0.0.1:0" picks a free port; see Publisher.Endpoint).
	Endpoint string
	// Connect, if set instead of Endpoint, is a bound SUB (a router's
	// Listener) the PUB socket dials, as vLLM's does when its endpoint has
	// no wildcard; it dials again while the address does not answer.
	Connect string
	// ReplayEndpoint is where the replay ROUTER binds; "" for none.
	ReplayEndpoint string
	// Topic is the first frame of every message. Default "" (vLLM's).
	Topic string
	// BufferSteps is how many of the last batches are kept for replay.
	// Default 10000 (vLLM's buffer_steps).
	BufferSteps int
	// Shape is the payload layout Publish encodes. Default ShapeArray.
	Shape Shape
	// ReplayTopic puts the topic frame in replay replies, as vLLM does
	// since PR #45177: [identity, "", topic, seq, payload].
	ReplayTopic bool
}

type buffered struct {
	seq     uint64
	payload []byte
}

// Publisher is what a vLLM engine does with its KV events: it binds a PUB
// socket and optionally a replay ROUTER, numbers batches from 0, sends each
// as [topic, seq, payload] and keeps the last BufferSteps for replay. It is
// for the simulated replica and the tests; the fault methods (Drop, SkipSeq,
// Restart) make the gaps and restarts a subscriber must survive. Its methods
// are safe for concurrent use.
//
// zmq4 v0.17.0 leaks one goroutine per closed PUB socket
// ((*pubMWriter).run waits for ever on a condition Close never signals);
// Close cannot reach it.
type Publisher struct {
	opts     PublisherOptions
	pub      zmq4.Socket
	replay   zmq4.Socket
	endpoint string
	replayEP string

	mu   sync.Mutex
	seq  uint64
	ring []buffered // oldest first; the last BufferSteps are kept
	done chan struct{}
}

// NewPublisher binds the sockets and starts serving replay requests.
func NewPublisher(opts PublisherOptions) (*Publisher, error) {
	if (opts.Endpoint == "") == (opts.Connect == "") {
		return nil, errors.New("kvevents: publisher needs an endpoint to bind or one to connect to")
	}
	if opts.BufferSteps <= 0 {
		opts.BufferSteps = 10000
	}
	quiet := zmq4.WithLogger(log.New(io.Discard, "", 0))
	p := &Publisher{opts: opts, done: make(chan struct{})}
	if opts.Connect != "" {
		p.pub = zmq4.NewPub(context.Background(), quiet, zmq4.WithDialerMaxRetries(-1),
			zmq4.WithAutomaticReconnect(true), zmq4.WithDialerRetry(50*time.Millisecond))
		p.endpoint = opts.Connect
		go func() { _ = p.pub.Dial(opts.Connect) }() // retries until it answers or Close
	} else {
		p.pub = zmq4.NewPub(context.Background(), quiet)
		if err := p.pub.Listen(opts.Endpoint); err != nil {
			p.pub.Close()
			return nil, fmt.Errorf("kvevents: publisher: %w", err)
		}
		p.endpoint = "tcp://" + p.pub.Addr().String()
	}
	if opts.ReplayEndpoint == "" {
		close(p.done)
		return p, nil
	}
	p.replay = zmq4.NewRouter(context.Background(), quiet)
	if err := p.replay.Listen(opts.ReplayEndpoint); err != nil {
		p.pub.Close()
		p.replay.Close()
		return nil, fmt.Errorf("kvevents: publisher replay: %w", err)
	}
	p.replayEP = "tcp://" + p.replay.Addr().String()
	go p.serveReplay()
	return p, nil
}

// Endpoint is the PUB socket's bound address, with the port it got.
func (p *Publisher) Endpoint() string { return p.endpoint }

// ReplayEndpoint is the replay socket's bound address; "" without one.
func (p *Publisher) ReplayEndpoint() string { return p.replayEP }

// Subscribed reports whether a subscriber's subscription has reached the
// PUB socket (messages published before that are lost, as in ZeroMQ).
func (p *Publisher) Subscribed() bool {
	t, ok := p.pub.(zmq4.Topics)
	return ok && len(t.Topics()) > 0
}

// Publish encodes b, sends it with the next sequence number, keeps it for
// replay and returns the number.
func (p *Publisher) Publish(b Batch) (uint64, error) {
	return p.PublishRaw(EncodeShape(nil, b, p.opts.Shape))
}

// PublishRaw is Publish with a payload already encoded (or deliberately
// malformed).
func (p *Publisher) PublishRaw(payload []byte) (uint64, error) {
	return p.publish(payload, true)
}

// Drop numbers and buffers b like Publish but does not send it: a message
// lost on the way, which a subscriber can get back from replay.
func (p *Publisher) Drop(b Batch) uint64 {
	seq, _ := p.publish(EncodeShape(nil, b, p.opts.Shape), false)
	return seq
}

// SkipSeq makes n sequence numbers go unused: a gap nothing can fill.
func (p *Publisher) SkipSeq(n uint64) {
	p.mu.Lock()
	p.seq += n
	p.mu.Unlock()
}

// Restart is an engine restart: the sequence starts again from 0 and the
// replay buffer is emptied.
func (p *Publisher) Restart() {
	p.mu.Lock()
	p.seq = 0
	p.ring = nil
	p.mu.Unlock()
}

func (p *Publisher) publish(payload []byte, send bool) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.seq
	p.seq++
	if send {
		msg := zmq4.NewMsgFrom([]byte(p.opts.Topic), seqBytes(seq), payload)
		if err := p.pub.SendMulti(msg); err != nil {
			return seq, fmt.Errorf("kvevents: publish: %w", err)
		}
	}
	p.ring = append(p.ring, buffered{seq, payload})
	if n := p.opts.BufferSteps; len(p.ring) >= 2*n {
		p.ring = append([]buffered(nil), p.ring[len(p.ring)-n:]...)
	}
	return seq, nil
}

// serveReplay answers replay requests as vLLM's _service_replay does.
func (p *Publisher) serveReplay() {
	defer close(p.done)
	for {
		msg, err := p.replay.Recv()
		if err != nil {
			return
		}
		f := msg.Frames
		// vLLM takes exactly [identity, "", start]; a DEALER that does not
		// send the delimiter gets an answer without it.
		var delim [][]byte
		switch {
		case len(f) == 3 && len(f[1]) == 0:
			delim = [][]byte{{}}
			f = [][]byte{f[0], f[2]}
		case len(f) == 2:
		default:
			continue
		}
		start, err := readSeq(f[1])
		if err != nil {
			continue
		}
		p.mu.Lock()
		var out []buffered
		for _, b := range p.ring[max(0, len(p.ring)-p.opts.BufferSteps):] {
			if b.seq >= start {
				out = append(out, b)
			}
		}
		p.mu.Unlock()
		id := f[0]
		send := func(topic string, frames ...[]byte) error {
			all := append([][]byte{id}, delim...)
			if p.opts.ReplayTopic {
				all = append(all, []byte(topic))
			}
			return p.replay.SendMulti(zmq4.NewMsgFrom(append(all, frames...)...))
		}
		for _, b := range out {
			if send(p.opts.Topic, seqBytes(b.seq), b.payload) != nil {
				break
			}
		}
		_ = send("", endSeq, []byte{})
	}
}

// Close closes the sockets and waits for the replay server to stop. A
// connection zmq4 already closed (its subscriber hung up and a send failed)
// is not an error of Close.
func (p *Publisher) Close() error {
	err := p.pub.Close()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	if p.replay != nil {
		closeAndDrain(p.replay)
	}
	<-p.done
	return err
}
