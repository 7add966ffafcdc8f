package kvevents

import (
	"net"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
)

// Two engines dial one bound Listener, as llm-d deploys vLLM; each
// Subscriber gets only its engine's batches, by topic, and fills its own
// gaps from its engine's replay socket, whose replies carry the topic frame
// (vLLM PR #45177, llm-d's simulator).
func TestListenerTellsEnginesApartByTopic(t *testing.T) {
	l, err := Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	topics := []string{"kv@10.0.0.1:8000@m", "kv@10.0.0.1:8001@m"}
	var rigs []*rig
	for _, topic := range topics {
		pub, err := NewPublisher(PublisherOptions{Connect: l.Addr(), Topic: topic, ReplayEndpoint: "tcp://127.0.0.1:0", ReplayTopic: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pub.Close() })
		col := &collector{}
		sub, err := NewSubscriber(SubscriberOptions{Listener: l, Topic: topic, ReplayEndpoint: pub.ReplayEndpoint(),
			OnBatch: col.onBatch, OnReset: col.onReset, ReplayTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sub.Close() })
		rigs = append(rigs, &rig{pub, sub, col})
	}
	if _, err := NewSubscriber(SubscriberOptions{Listener: l, Topic: topics[0], OnBatch: func(uint64, Batch) {}}); err == nil {
		t.Fatal("a second subscriber of one topic on one listener was accepted")
	}
	for _, r := range rigs {
		testwait.Until(t, "the subscription", r.pub.Subscribed)
	}
	a, b := rigs[0], rigs[1]
	a.publish(t, 100, 101)
	b.publish(t, 200)
	a.pub.Drop(batchFor(102)) // lost on the wire: replayed with its topic frame
	a.publish(t, 103)
	b.publish(t, 201)
	a.waitApplied(t, 4)
	b.waitApplied(t, 2)
	seqs, first, resets := a.col.snapshot()
	if !equal(seqs, []uint64{0, 1, 2, 3}) || !equal(first, []uint64{100, 101, 102, 103}) || len(resets) != 0 {
		t.Fatalf("engine a: seqs %v first %v resets %v", seqs, first, resets)
	}
	if st := a.sub.Stats(); st.Replayed != 1 || st.Malformed != 0 {
		t.Fatalf("engine a: %+v", st)
	}
	seqs, first, _ = b.col.snapshot()
	if !equal(seqs, []uint64{0, 1}) || !equal(first, []uint64{200, 201}) {
		t.Fatalf("engine b: seqs %v first %v", seqs, first)
	}

	// An engine of no configured topic is counted, and harms nobody.
	other, err := NewPublisher(PublisherOptions{Connect: l.Addr(), Topic: "kv@10.0.0.9:8000@m"})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	testwait.Until(t, "the subscription", other.Subscribed)
	if _, err := other.Publish(batchFor(900)); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the unmatched message", func() bool { return l.Unmatched() == 1 })
}

// A peer that connects to the Listener and sends nothing is cut after the
// handshake deadline; engines that dial after it are not held up.
func TestListenerSilentPeer(t *testing.T) {
	defer func(d time.Duration) { handshakeTimeout = d }(handshakeTimeout)
	handshakeTimeout = 300 * time.Millisecond
	l, err := Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp", l.Addr()[len("tcp://"):])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	col := &collector{}
	sub, err := NewSubscriber(SubscriberOptions{Listener: l, OnBatch: col.onBatch})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	pub, err := NewPublisher(PublisherOptions{Connect: l.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	testwait.Until(t, "the subscription of an engine dialling after a silent peer", pub.Subscribed)
	if _, err := pub.Publish(batchFor(1)); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the batch", func() bool { s, _, _ := col.snapshot(); return len(s) == 1 })
}

func TestReplyFrames(t *testing.T) {
	seq, p := []byte("12345678"), []byte("payload")
	for _, c := range []struct {
		frames [][]byte
		ok     bool
	}{
		{[][]byte{seq, p}, true},
		{[][]byte{{}, seq, p}, true},
		{[][]byte{[]byte("kv@t"), seq, p}, true},
		{[][]byte{{}, []byte("kv@t"), seq, p}, true},
		{[][]byte{[]byte("x"), []byte("kv@t"), seq, p}, false},
		{[][]byte{seq}, false},
		{[][]byte{{}, {}, {}, seq, p}, false},
	} {
		f, ok := replyFrames(c.frames)
		if ok != c.ok || (ok && (string(f[0]) != string(seq) || string(f[1]) != string(p))) {
			t.Errorf("%q: got %q %v", c.frames, f, ok)
		}
	}
}

// An engine that published before the router heard it (it dials the
// router, or the router started after it): the first batch heard fetches
// what the engine's replay buffer still has from its start, whatever
// number the engine starts counting at.
func TestFirstBatchCatchesUpFromReplay(t *testing.T) {
	l, err := Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	pub, err := NewPublisher(PublisherOptions{Connect: l.Addr(), ReplayEndpoint: "tcp://127.0.0.1:0", ReplayTopic: true})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	pub.SkipSeq(1)          // counts from 1, as llm-d's simulator does
	pub.Drop(batchFor(500)) // published before anyone listened
	pub.Drop(batchFor(501))
	col := &collector{}
	sub, err := NewSubscriber(SubscriberOptions{Listener: l, ReplayEndpoint: pub.ReplayEndpoint(), OnBatch: col.onBatch, OnReset: col.onReset, ReplayTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	testwait.Until(t, "the subscription", pub.Subscribed)
	if _, err := pub.Publish(batchFor(502)); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, "the batches", func() bool { s, _, _ := col.snapshot(); return len(s) == 3 })
	seqs, first, resets := col.snapshot()
	if !equal(seqs, []uint64{1, 2, 3}) || !equal(first, []uint64{500, 501, 502}) || len(resets) != 0 {
		t.Fatalf("seqs %v first %v resets %v", seqs, first, resets)
	}
}
