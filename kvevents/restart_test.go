package kvevents

import (
	"strings"
	"testing"

	"github.com/semroute/semroute/internal/testwait"
)

// An engine that restarted and whose first batches were lost, so that the
// first one heard is numbered past the old engine's last: the gap reads
// as a restart (the replay buffer holds another batch under the number of
// the last one delivered), not as a continuation to fill, and what the new
// engine's buffer holds is delivered from its start.
// waitDelivered waits until the batch of block hash id is delivered.
func (r *rig) waitDelivered(t *testing.T, id uint64) {
	t.Helper()
	testwait.Until(t, "the batch", func() bool { _, first, _ := r.col.snapshot(); return len(first) > 0 && first[len(first)-1] == id })
}

func TestRestartPastTheOldSequence(t *testing.T) {
	r := newRig(t, PublisherOptions{ReplayEndpoint: "tcp://127.0.0.1:0"}, SubscriberOptions{})
	r.publish(t, 1, 2, 3) // seqs 0–2
	r.waitApplied(t, 3)
	r.pub.Restart()
	for id := uint64(10); id < 15; id++ {
		r.pub.Drop(batchFor(id)) // seqs 0–4 of the new engine, lost on the wire
	}
	r.publish(t, 15) // seq 5
	r.waitDelivered(t, 15)
	seqs, first, resets := r.col.snapshot()
	if !equal(seqs, []uint64{0, 1, 2, 0, 1, 2, 3, 4, 5}) || !equal(first, []uint64{1, 2, 3, 10, 11, 12, 13, 14, 15}) {
		t.Fatalf("seqs %v first %v: the new engine's batches were not delivered from its start", seqs, first)
	}
	st := r.sub.Stats()
	if len(resets) != 1 || !strings.HasPrefix(resets[0], "engine restarted") || st.Restarts != 1 || st.Resets != 1 || st.Gaps != 0 {
		t.Fatalf("resets %q stats %+v", resets, st)
	}
	// The same engine's gap is still a gap filled from replay.
	r.pub.Drop(batchFor(16))
	r.publish(t, 17)
	r.waitDelivered(t, 17)
	if _, first, resets = r.col.snapshot(); first[9] != 16 || first[10] != 17 || len(resets) != 1 || r.sub.Stats().Gaps != 1 {
		t.Fatalf("first %v resets %q stats %+v", first, resets, r.sub.Stats())
	}
}

// An engine that comes back on the same port after the subscriber's
// connection dropped, whose first batch heard carries exactly the number
// the old engine's next would have: the new connection has it checked
// against the replay buffer, and it is a restart.
func TestReconnectToANewEngineWhoseSequenceFollowsOn(t *testing.T) {
	r := newRig(t, PublisherOptions{ReplayEndpoint: "tcp://127.0.0.1:0"}, SubscriberOptions{})
	r.publish(t, 1, 2, 3) // seqs 0–2
	r.waitApplied(t, 3)
	ep, replay := r.pub.Endpoint(), r.pub.ReplayEndpoint()
	r.pub.Close()
	var pub *Publisher
	testwait.Until(t, "the ports again", func() bool {
		var err error
		pub, err = NewPublisher(PublisherOptions{Endpoint: ep, ReplayEndpoint: replay})
		return err == nil
	})
	defer pub.Close()
	testwait.Until(t, "the new subscription", pub.Subscribed)
	for id := uint64(10); id < 13; id++ {
		pub.Drop(batchFor(id)) // seqs 0–2, published before anyone listened
	}
	if _, err := pub.Publish(batchFor(13)); err != nil { // seq 3: the old engine's next
		t.Fatal(err)
	}
	r.waitDelivered(t, 13)
	_, first, resets := r.col.snapshot()
	if !equal(first, []uint64{1, 2, 3, 10, 11, 12, 13}) || len(resets) != 1 || r.sub.Stats().Restarts != 1 {
		t.Fatalf("first %v resets %q stats %+v", first, resets, r.sub.Stats())
	}
}

// Resync, after a restart seen elsewhere: the new engine's batches start a
// new sequence, from what its replay buffer holds, with no reset.
func TestResync(t *testing.T) {
	r := newRig(t, PublisherOptions{ReplayEndpoint: "tcp://127.0.0.1:0"}, SubscriberOptions{})
	r.publish(t, 1, 2, 3)
	r.waitApplied(t, 3)
	r.pub.Restart()
	r.sub.Resync()
	r.pub.Drop(batchFor(10)) // seq 0, lost
	r.publish(t, 11)         // seq 1
	r.waitDelivered(t, 11)
	r.pub.Restart()
	r.sub.Resync()
	for id := uint64(20); id < 25; id++ {
		r.pub.Drop(batchFor(id)) // seqs 0–4: past the sequence before
	}
	r.publish(t, 25) // seq 5
	r.waitDelivered(t, 25)
	seqs, first, resets := r.col.snapshot()
	if !equal(seqs, []uint64{0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5}) || !equal(first, []uint64{1, 2, 3, 10, 11, 20, 21, 22, 23, 24, 25}) {
		t.Fatalf("seqs %v first %v", seqs, first)
	}
	if st := r.sub.Stats(); len(resets) != 0 || st.Resets != 0 || st.Restarts != 0 || st.Gaps != 0 {
		t.Fatalf("resets %q stats %+v", resets, st)
	}
}
