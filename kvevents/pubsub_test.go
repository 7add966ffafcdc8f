package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"go.uber.org/goleak"

	"github.com/semroute/semroute/internal/testnet"
	"github.com/semroute/semroute/internal/testwait"
)

// zmq4 v0.17.0 never stops a closed PUB socket's writer goroutine (see
// Publisher); that is the one goroutine the tests let outlive its socket.
var pubLeak = goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run")

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, pubLeak) }

// collector records what a Subscriber delivers.
type collector struct {
	mu     sync.Mutex
	seqs   []uint64
	first  []uint64 // the first block hash of each batch
	resets []string
}

func (c *collector) onBatch(seq uint64, b Batch) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seqs = append(c.seqs, seq)
	h := uint64(1 << 63)
	if len(b.Events) > 0 && len(b.Events[0].BlockHashes) > 0 {
		h = b.Events[0].BlockHashes[0]
	}
	c.first = append(c.first, h)
}

func (c *collector) onReset(reason string) {
	c.mu.Lock()
	c.resets = append(c.resets, reason)
	c.mu.Unlock()
}

func (c *collector) snapshot() (seqs, first []uint64, resets []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]uint64(nil), c.seqs...), append([]uint64(nil), c.first...), append([]string(nil), c.resets...)
}

// batchFor is a one-event batch whose block hash tells which batch it is.
func batchFor(id uint64) Batch {
	return Batch{TS: float64(id), DPRank: intp(0), Events: []Event{
		{Kind: BlockStored, BlockHashes: []uint64{id}, TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "GPU"},
	}}
}

type rig struct {
	pub *Publisher
	sub *Subscriber
	col *collector
}

func newRig(t *testing.T, popts PublisherOptions, sopts SubscriberOptions) *rig {
	t.Helper()
	if popts.Endpoint == "" {
		popts.Endpoint = "tcp://127.0.0.1:0"
	}
	pub, err := NewPublisher(popts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	col := &collector{}
	sopts.Endpoint = pub.Endpoint()
	if sopts.ReplayEndpoint == "" {
		sopts.ReplayEndpoint = pub.ReplayEndpoint()
	}
	sopts.OnBatch, sopts.OnReset = col.onBatch, col.onReset
	sopts.ReconnectMin = 10 * time.Millisecond
	if sopts.ReplayTimeout == 0 {
		sopts.ReplayTimeout = time.Second
	}
	sub, err := NewSubscriber(sopts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Close() })
	testwait.Until(t, "the subscription", pub.Subscribed)
	return &rig{pub, sub, col}
}

func (r *rig) publish(t *testing.T, ids ...uint64) {
	t.Helper()
	for _, id := range ids {
		if _, err := r.pub.Publish(batchFor(id)); err != nil {
			t.Fatal(err)
		}
	}
}

func (r *rig) waitApplied(t *testing.T, n int) {
	t.Helper()
	testwait.Until(t, "batches", func() bool { s, _, _ := r.col.snapshot(); return len(s) >= n })
}

func equal(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestSubscriberInOrder(t *testing.T) {
	for _, shape := range []Shape{ShapeArray, ShapeMixed, ShapeMap} {
		r := newRig(t, PublisherOptions{Shape: shape, ReplayEndpoint: "tcp://127.0.0.1:0"}, SubscriberOptions{})
		var want []uint64
		for i := range uint64(50) {
			r.publish(t, 1000+i)
			want = append(want, i)
		}
		r.waitApplied(t, 50)
		seqs, first, resets := r.col.snapshot()
		if !equal(seqs, want) || first[49] != 1049 || len(resets) != 0 {
			t.Fatalf("shape %d: seqs %v first %v resets %v", shape, seqs, first, resets)
		}
		st := r.sub.Stats()
		if st.Received != 50 || st.Applied != 50 || st.Gaps != 0 || st.Resets != 0 || st.Malformed != 0 {
			t.Fatalf("stats %+v", st)
		}
		r.sub.Close()
		r.pub.Close()
	}
}

func TestGapFilledFromReplay(t *testing.T) {
	r := newRig(t, PublisherOptions{ReplayEndpoint: "tcp://127.0.0.1:0"}, SubscriberOptions{})
	r.publish(t, 100, 101, 102)
	r.pub.Drop(batchFor(103)) // lost on the wire, kept for replay
	r.pub.Drop(batchFor(104))
	r.publish(t, 105, 106)
	r.waitApplied(t, 7)
	seqs, first, resets := r.col.snapshot()
	if !equal(seqs, []uint64{0, 1, 2, 3, 4, 5, 6}) || !equal(first, []uint64{100, 101, 102, 103, 104, 105, 106}) {
		t.Fatalf("seqs %v first %v", seqs, first)
	}
	st := r.sub.Stats()
	if len(resets) != 0 || st.Gaps != 1 || st.Replayed != 2 || st.Applied != 7 || st.Received != 5 {
		t.Fatalf("resets %v stats %+v", resets, st)
	}
}

// A gap replay cannot fill resets the consumer and goes on from the batch
// that showed it.
func TestGapNotFilled(t *testing.T) {
	// A ROUTER that takes requests and never answers.
	mute := zmq4.NewRouter(context.Background(), quietZMQ)
	if err := mute.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	defer closeAndDrain(mute)
	// An address nothing listens on.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "tcp://" + l.Addr().String()
	l.Close()

	for _, tc := range []struct {
		name    string
		pub     PublisherOptions
		replay  string
		timeout time.Duration
		gap     func(p *Publisher)
	}{
		{"skipped seq", PublisherOptions{ReplayEndpoint: "tcp://127.0.0.1:0"}, "", 0,
			func(p *Publisher) { p.SkipSeq(2) }},
		{"buffer too short", PublisherOptions{ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 2}, "", 0,
			func(p *Publisher) { p.Drop(batchFor(7)); p.Drop(batchFor(8)); p.Drop(batchFor(9)) }},
		{"no replay endpoint", PublisherOptions{}, "", 0,
			func(p *Publisher) { p.Drop(batchFor(7)) }},
		{"replay down", PublisherOptions{}, dead, 0,
			func(p *Publisher) { p.Drop(batchFor(7)) }},
		{"replay times out", PublisherOptions{}, "tcp://" + mute.Addr().String(), 200 * time.Millisecond,
			func(p *Publisher) { p.Drop(batchFor(7)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, tc.pub, SubscriberOptions{ReplayEndpoint: tc.replay, ReplayTimeout: tc.timeout})
			r.publish(t, 1, 2)
			tc.gap(r.pub)
			r.publish(t, 50, 51)
			r.waitApplied(t, 4)
			_, first, resets := r.col.snapshot()
			st := r.sub.Stats()
			if !equal(first, []uint64{1, 2, 50, 51}) || len(resets) != 1 || !strings.HasPrefix(resets[0], "gap") ||
				st.Gaps != 1 || st.Resets != 1 || st.Replayed != 0 {
				t.Fatalf("first %v resets %q stats %+v", first, resets, st)
			}
		})
	}
}

func TestPublisherRestart(t *testing.T) {
	r := newRig(t, PublisherOptions{ReplayEndpoint: "tcp://127.0.0.1:0"}, SubscriberOptions{})
	r.publish(t, 1, 2, 3)
	r.waitApplied(t, 3)
	r.pub.Restart()
	r.publish(t, 10, 11)
	r.waitApplied(t, 5)
	// A restart whose first batches were lost: what replay has is delivered.
	r.pub.Restart()
	r.pub.Drop(batchFor(20))
	r.publish(t, 21)
	r.waitApplied(t, 7)
	seqs, first, resets := r.col.snapshot()
	if !equal(seqs, []uint64{0, 1, 2, 0, 1, 0, 1}) || !equal(first, []uint64{1, 2, 3, 10, 11, 20, 21}) ||
		len(resets) != 2 || !strings.HasPrefix(resets[0], "engine restarted") {
		t.Fatalf("seqs %v first %v resets %q", seqs, first, resets)
	}
	if st := r.sub.Stats(); st.Resets != 2 || st.Replayed != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestMalformedSkipped(t *testing.T) {
	r := newRig(t, PublisherOptions{}, SubscriberOptions{})
	r.publish(t, 1)
	if _, err := r.pub.PublishRaw([]byte{0x92, 0x00}); err != nil { // truncated
		t.Fatal(err)
	}
	r.publish(t, 3)
	// Messages of the wrong frames, sent by hand on the same PUB socket.
	_ = r.pub.pub.SendMulti(zmq4.NewMsgFrom([]byte(""), []byte{1, 2, 3}, []byte{0x90}))
	_ = r.pub.pub.SendMulti(zmq4.NewMsgFrom([]byte(""), seqBytes(99)))
	r.publish(t, 4) // seq 3: the hand-made messages used none
	r.waitApplied(t, 3)
	testwait.Until(t, "all messages", func() bool { return r.sub.Stats().Received == 6 })
	seqs, first, resets := r.col.snapshot()
	st := r.sub.Stats()
	if !equal(seqs, []uint64{0, 2, 3}) || !equal(first, []uint64{1, 3, 4}) || len(resets) != 0 || st.Malformed != 3 {
		t.Fatalf("seqs %v first %v resets %v stats %+v", seqs, first, resets, st)
	}
}

func TestSilent(t *testing.T) {
	r := newRig(t, PublisherOptions{}, SubscriberOptions{})
	if !r.sub.LastBatch().IsZero() {
		t.Fatal("LastBatch before any batch")
	}
	testwait.Until(t, "silent without batches", func() bool { return r.sub.Silent(50 * time.Millisecond) })
	r.publish(t, 1)
	r.waitApplied(t, 1)
	if r.sub.Silent(time.Second) || r.sub.LastBatch().IsZero() {
		t.Fatal("silent right after a batch")
	}
	testwait.Until(t, "silent after the events stopped", func() bool { return r.sub.Silent(50 * time.Millisecond) })
}

// The engine goes away and comes back on the same port: the subscriber
// reconnects by itself and sees the restart.
func TestReconnect(t *testing.T) {
	r := newRig(t, PublisherOptions{}, SubscriberOptions{})
	r.publish(t, 1, 2, 3)
	r.waitApplied(t, 3)
	ep := r.pub.Endpoint()
	r.pub.Close()
	var pub *Publisher
	testwait.Until(t, "the port again", func() bool {
		var err error
		pub, err = NewPublisher(PublisherOptions{Endpoint: ep})
		return err == nil
	})
	defer pub.Close()
	testwait.Until(t, "the new subscription", pub.Subscribed)
	if _, err := pub.Publish(batchFor(10)); err != nil {
		t.Fatal(err)
	}
	r.waitApplied(t, 4)
	_, first, resets := r.col.snapshot()
	if !equal(first, []uint64{1, 2, 3, 10}) || len(resets) != 1 || r.sub.Stats().Reconnects < 1 {
		t.Fatalf("first %v resets %v stats %+v", first, resets, r.sub.Stats())
	}
}

// A subscriber to nothing, closed, leaves nothing behind; so does one that
// ran against a publisher.
func TestCloseLeavesNoGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(), pubLeak)
	// "Nothing" hangs up on every connection, so that the subscriber is
	// closed in the middle of its redialling.
	nothing, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var dials atomic.Int32
	hungUp := make(chan struct{})
	go func() {
		defer close(hungUp)
		for {
			c, err := nothing.Accept()
			if err != nil {
				return
			}
			dials.Add(1)
			c.Close()
		}
	}()
	s, err := NewSubscriber(SubscriberOptions{Endpoint: "tcp://" + nothing.Addr().String(), OnBatch: func(uint64, Batch) {},
		ReconnectMin: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the subscriber's second dial", func() bool { return dials.Load() >= 2 })
	s.Close()
	s.Close()
	nothing.Close()
	<-hungUp

	pub, err := NewPublisher(PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	var n sync.WaitGroup
	n.Add(1)
	once := sync.Once{}
	s, err = NewSubscriber(SubscriberOptions{Endpoint: pub.Endpoint(), ReplayEndpoint: pub.ReplayEndpoint(),
		OnBatch: func(uint64, Batch) { once.Do(n.Done) }})
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the subscription", pub.Subscribed)
	pub.Drop(batchFor(1))
	for range 30 { // more than zmq4's queues hold, and a replay
		pub.Publish(batchFor(2))
	}
	n.Wait()
	s.Close()
	pub.Close()
}

// zmtpFrame is a ZMTP 3 frame: flags (more, command), a short or long size
// and the body.
func zmtpFrame(more, command bool, body []byte) []byte {
	fl := byte(0)
	if more {
		fl |= 1
	}
	if command {
		fl |= 4
	}
	if len(body) > 255 {
		h := []byte{fl | 2, 0, 0, 0, 0, 0, 0, 0, 0}
		binary.BigEndian.PutUint64(h[1:], uint64(len(body)))
		return append(h, body...)
	}
	return append([]byte{fl, byte(len(body))}, body...)
}

// filterAll runs stream through a fresh frameFilter of limit, in reads of
// split bytes.
func filterAll(stream []byte, limit uint64, split int) ([]byte, bool) {
	f := frameFilter{limit: limit, need: zmtpGreeting}
	var out []byte
	for i := 0; i < len(stream); i += split {
		var ok bool
		if out, ok = f.filter(out, stream[i:min(i+split, len(stream))]); !ok {
			return out, false
		}
	}
	return out, true
}

// The guard hands ordinary messages on unchanged however they are split,
// elides a data frame that would take its message past the limit (and
// nothing else), and cuts a connection for a command frame past it or a
// message of too many frames.
func TestGuardConn(t *testing.T) {
	greeting := make([]byte, zmtpGreeting)
	message := func(topic, payload []byte) []byte {
		m := append(zmtpFrame(true, false, topic), zmtpFrame(true, false, seqBytes(1))...)
		return append(m, zmtpFrame(false, false, payload)...)
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	ready := zmtpFrame(false, true, []byte("\x05READY"))
	ok := cat(greeting, ready, message([]byte("topic"), make([]byte, 1000)), message(nil, make([]byte, 4096-8)))
	// A payload 1 byte too long (a message's bytes are its frames' bodies),
	// then a long topic whose payload does not fit beside it, each elided;
	// the message after them passes whole.
	over := cat(greeting, message(nil, make([]byte, 4096-7)), message(make([]byte, 3000), make([]byte, 1200)), message(nil, []byte{0x90}))
	elidedFrame := []byte{0, 1, elided}
	want := cat(greeting, zmtpFrame(true, false, nil), zmtpFrame(true, false, seqBytes(1)), elidedFrame,
		zmtpFrame(true, false, make([]byte, 3000)), zmtpFrame(true, false, seqBytes(1)), elidedFrame,
		message(nil, []byte{0x90}))
	for _, split := range []int{1, 3, 7, 4096, len(ok)} {
		if out, good := filterAll(ok, 4096, split); !good || !bytes.Equal(out, ok) {
			t.Fatalf("split %d: an ordinary stream was changed (cut %v)", split, !good)
		}
		if out, good := filterAll(over, 4096, split); !good || !bytes.Equal(out, want) {
			t.Fatalf("split %d: frames past the limit not elided (cut %v): %d bytes, want %d", split, !good, len(out), len(want))
		}
	}
	// A data frame of 1 TiB announced: elided, its body dropped as it comes.
	huge := cat(greeting, []byte{2, 0, 0, 1, 0, 0, 0, 0, 0}, make([]byte, 100000))
	if out, good := filterAll(huge, 4096, 1000); !good || !bytes.Equal(out, cat(greeting, elidedFrame)) {
		t.Fatalf("a 1 TiB data frame: cut %v, out %x", !good, out[zmtpGreeting:])
	}
	if _, good := filterAll(cat(greeting, []byte{6, 0, 0, 1, 0, 0, 0, 0, 0}), 4096, 3); good {
		t.Fatal("did not cut a 1 TiB command frame")
	}
	many := append([]byte{}, greeting...)
	for range maxFrames + 1 {
		many = append(many, zmtpFrame(true, false, nil)...)
	}
	if _, good := filterAll(many, 4096, 5); good {
		t.Fatal("did not cut a message of too many frames")
	}
}

// refFilter is what frameFilter does, read off a whole stream: each frame
// whose header is whole handed on, elided, or the end (cut).
func refFilter(stream []byte, limit uint64) (out []byte, cut bool) {
	if len(stream) <= zmtpGreeting {
		return stream, false
	}
	out, p := append(out, stream[:zmtpGreeting]...), stream[zmtpGreeting:]
	var msg uint64
	frames := 0
	for len(p) > 0 {
		fl, hl := p[0], 2
		if fl&2 != 0 {
			hl = 9
		}
		if len(p) < hl {
			return out, false // the header is held back until whole
		}
		size := uint64(p[1])
		if hl == 9 {
			size = binary.BigEndian.Uint64(p[1:9])
		}
		if frames++; frames > maxFrames {
			return out, true
		}
		body := p[hl:]
		k := min(size, uint64(len(body)))
		switch {
		case msg+size <= limit && size <= limit:
			out = append(out, p[:hl]...)
			out = append(out, body[:k]...)
			msg += size
		case fl&4 != 0:
			return out, true
		default:
			out = append(out, fl&^2, 1, elided)
		}
		if fl&1 == 0 {
			msg, frames = 0, 0
		}
		if k < size {
			break
		}
		p = body[k:]
	}
	return out, false
}

// FuzzFrameFilter holds the guard to refFilter for any stream, limit and
// read size.
func FuzzFrameFilter(f *testing.F) {
	greeting := make([]byte, zmtpGreeting)
	f.Add(append(append([]byte{}, greeting...), zmtpFrame(true, false, []byte("topic"))...), uint16(16), uint8(1))
	f.Add(append(append([]byte{}, greeting...), 2, 0, 0, 0, 0, 0, 0, 1, 0, 7, 7, 7), uint16(100), uint8(3))
	f.Add(append(append([]byte{}, greeting...), 6, 0, 0, 0, 0, 0, 0, 1, 0), uint16(100), uint8(2))
	f.Fuzz(func(t *testing.T, stream []byte, limit uint16, split uint8) {
		want, cut := refFilter(stream, uint64(limit))
		out, ok := filterAll(stream, uint64(limit), int(split)+1)
		if ok == cut {
			t.Fatalf("cut %v, want %v", !ok, cut)
		}
		if ok && !bytes.Equal(out, want) {
			t.Fatalf("filtered\n%x\nwant\n%x", out, want)
		}
	})
}

// A hostile publisher announcing a 1 TiB frame right after its greeting
// gets its connection cut; the subscriber lives on and dials again.
func TestGuardAgainstHugeFrame(t *testing.T) {
	accepted := make(chan struct{}, 100)
	addr, _ := testnet.Serve(t, func(c net.Conn) {
		select {
		case accepted <- struct{}{}:
		default:
		}
		g := make([]byte, zmtpGreeting) // ZMTP 3.0, NULL mechanism
		g[0], g[9], g[10] = 0xff, 0x7f, 3
		copy(g[12:], "NULL")
		c.Write(g)
		c.Write([]byte{0x06, 0, 0, 1, 0, 0, 0, 0, 0}) // long command frame of 2^40 bytes
		c.Close()
	})
	s, err := NewSubscriber(SubscriberOptions{Endpoint: "tcp://" + addr,
		OnBatch: func(uint64, Batch) {}, ReconnectMin: time.Millisecond, ReconnectMax: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		select {
		case <-accepted:
		case <-time.After(5 * time.Second):
			t.Fatal("the subscriber stopped dialling")
		}
	}
	s.Close()
}

// BenchmarkSubscriber is the whole path on 127.0.0.1: encode, PUB, SUB,
// Decode, OnBatch, for the realistic batch (256 blocks).
func BenchmarkSubscriber(b *testing.B) {
	pub, err := NewPublisher(PublisherOptions{Endpoint: "tcp://127.0.0.1:0", BufferSteps: 16})
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	var mu sync.Mutex
	var got int
	cond := sync.NewCond(&mu)
	s, err := NewSubscriber(SubscriberOptions{Endpoint: pub.Endpoint(), OnBatch: func(uint64, Batch) {
		mu.Lock()
		got++
		cond.Signal()
		mu.Unlock()
	}})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	testwait.Until(b, "the subscription", pub.Subscribed)
	payload := EncodeShape(nil, realistic(), ShapeMixed)
	b.ResetTimer()
	for i := range b.N {
		if _, err := pub.PublishRaw(payload); err != nil {
			b.Fatal(err)
		}
		if i%64 == 63 { // keep zmq4's unbounded PUB queue short
			mu.Lock()
			for got < i-64 {
				cond.Wait()
			}
			mu.Unlock()
		}
	}
	mu.Lock()
	for got < b.N {
		cond.Wait()
	}
	mu.Unlock()
	b.ReportMetric(float64(256*b.N)/b.Elapsed().Seconds(), "blocks/s")
	if st := s.Stats(); st.Gaps != 0 || st.Malformed != 0 {
		b.Fatalf("stats %+v", st)
	}
}

// A publisher whose subscribers hung up first closes without an error: the
// connections zmq4 already closed are not a failure of Close.
func TestPublisherCloseAfterSubscriberLeft(t *testing.T) {
	for i := range 20 {
		pub, err := NewPublisher(PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
		if err != nil {
			t.Fatal(err)
		}
		s, err := NewSubscriber(SubscriberOptions{Endpoint: pub.Endpoint(), ReplayEndpoint: pub.ReplayEndpoint(),
			OnBatch: func(uint64, Batch) {}})
		if err != nil {
			t.Fatal(err)
		}
		testwait.Until(t, "the subscription", pub.Subscribed)
		s.Close()
		for range i % 4 { // a send to the gone subscriber has zmq4 close its end
			pub.Publish(batchFor(1))
			// Not synchronisation: the rounds vary how far zmq4 got in
			// closing its end when Close comes, which nothing exposes.
			time.Sleep(time.Millisecond)
		}
		if err := pub.Close(); err != nil {
			t.Fatalf("round %d: Close after the subscriber left: %v", i, err)
		}
	}
}
