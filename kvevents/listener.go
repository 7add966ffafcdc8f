package kvevents

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/go-zeromq/zmq4"
)

// listenerQueue is how many messages a Listener holds for one Subscriber
// that is busy (filling a gap from replay); past it messages are dropped,
// and the gap they leave is filled from replay in turn.
const listenerQueue = 4096

// Listener is a SUB socket the router binds and engines dial: the shape
// llm-d deploys (every vLLM engine's publisher dials one indexer that
// binds; vLLM's ZmqEventPublisher binds only when its endpoint has a
// wildcard, `*` or `::`, and dials otherwise, see
// vllm/distributed/kv_events.py), and the only one llm-d's simulator
// speaks (its PUB always dials, pkg/common/publisher.go). Each message goes
// to the Subscriber whose Topic is the longest prefix of the message's
// topic; one with none is counted and dropped. One engine a port needs no
// topics: a Listener with a single Subscriber of Topic "" takes everything.
//
// A Listener is safe for concurrent use. Close it after its Subscribers.
type Listener struct {
	sock zmq4.Socket
	addr string
	done chan struct{}

	mu   sync.Mutex
	subs []*Subscriber

	unmatched atomic.Uint64
	closed    atomic.Bool
}

// Listen binds a SUB socket at endpoint, e.g. "tcp://0.0.0.0:5557"
// ("tcp://127.0.0.1:0" picks a free port; see Addr), and starts receiving.
// Messages are bounded by the default MaxMessageBytes (see ListenLimits).
func Listen(endpoint string) (*Listener, error) { return ListenLimits(endpoint, Limits{}) }

// ListenLimits is Listen with messages bounded by lim.MaxMessageBytes as
// they arrive (a larger message reaches its Subscriber with the payload
// elided, to be counted and skipped); the Subscribers' own Limits bound
// what they decode.
func ListenLimits(endpoint string, lim Limits) (*Listener, error) {
	if !strings.HasPrefix(endpoint, "tcp://") {
		return nil, fmt.Errorf("kvevents: listen on %q: only tcp:// endpoints", endpoint)
	}
	ctx := withMessageLimit(context.Background(), lim.orDefaults().MaxMessageBytes)
	sock := zmq4.NewSub(ctx, quietZMQ)
	if err := sock.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		sock.Close()
		return nil, err
	}
	if err := sock.Listen(guarded(endpoint)); err != nil {
		sock.Close()
		return nil, fmt.Errorf("kvevents: listen on %q: %w", endpoint, err)
	}
	l := &Listener{sock: sock, addr: "tcp://" + sock.Addr().String(), done: make(chan struct{})}
	go l.run()
	return l, nil
}

// Addr is the bound address, with the port it got.
func (l *Listener) Addr() string { return l.addr }

// Unmatched counts the messages no Subscriber's topic matched.
func (l *Listener) Unmatched() uint64 { return l.unmatched.Load() }

// Close stops receiving and waits for it. Close is idempotent.
func (l *Listener) Close() error {
	l.closed.Store(true)
	closeAndDrain(l.sock)
	<-l.done
	return nil
}

func (l *Listener) add(s *Subscriber) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, o := range l.subs {
		if o.opts.Topic == s.opts.Topic {
			return fmt.Errorf("kvevents: two subscribers of topic %q on %s", s.opts.Topic, l.addr)
		}
	}
	l.subs = append(l.subs, s)
	return nil
}

func (l *Listener) remove(s *Subscriber) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, o := range l.subs {
		if o == s {
			l.subs = append(l.subs[:i], l.subs[i+1:]...)
			return
		}
	}
}

// match is the Subscriber of the longest topic that prefixes topic.
func (l *Listener) match(topic []byte) *Subscriber {
	l.mu.Lock()
	defer l.mu.Unlock()
	var best *Subscriber
	for _, s := range l.subs {
		t := s.opts.Topic
		if strings.HasPrefix(string(topic), t) && (best == nil || len(t) > len(best.opts.Topic)) {
			best = s
		}
	}
	return best
}

func (l *Listener) run() {
	defer close(l.done)
	for {
		msg, err := l.sock.Recv()
		if err != nil {
			if l.closed.Load() {
				return
			}
			continue // one engine's connection dropped; it dials again
		}
		if len(msg.Frames) == 0 {
			l.unmatched.Add(1)
			continue
		}
		if s := l.match(msg.Frames[0]); s != nil {
			s.offer(msg)
		} else {
			l.unmatched.Add(1)
		}
	}
}
