package kvsync_test

import (
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/kvsync"
)

// restartRig is one engine's publisher and a follower of it.
type restartRig struct {
	pub   *kvevents.Publisher
	f     *kvsync.Follower
	model *cachemodel.Model
	id    int
}

func newRestartRig(t *testing.T) *restartRig {
	t.Helper()
	p, err := kvevents.NewPublisher(kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	model := cachemodel.New(cachemodel.Options{})
	id, _ := model.AddReplica("r", 0)
	f, err := kvsync.Follow(kvsync.Options{Model: model, ID: id, Name: "r", Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint(), BlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	testwait.Until(t, "subscribed", p.Subscribed)
	return &restartRig{p, f, model, id}
}

func (r *restartRig) matched(bl []blockhash.Block) int {
	return r.model.Match(bl, nil, nil)[r.id].Blocks
}

// chain is an engine's chain of n blocks of token ids from base: its
// batches, one block each, and the router's blocks of it.
func chain(hash uint64, base, n int) ([]kvevents.Batch, []blockhash.Block) {
	var out []kvevents.Batch
	for i := range n {
		h := hash + uint64(i)
		var parent *uint64
		if i > 0 {
			p := h - 1
			parent = &p
		}
		e := chainEvent([]uint64{h}, parent, base+16*i)
		out = append(out, kvevents.Batch{Events: []kvevents.Event{e}})
	}
	return out, blocksOf(base, n)
}

// publish sends the batches and waits until the picture holds their blocks.
func (r *restartRig) publish(t *testing.T, bs []kvevents.Batch, bl []blockhash.Block) {
	t.Helper()
	for _, b := range bs {
		if _, err := r.pub.Publish(b); err != nil {
			t.Fatal(err)
		}
	}
	testwait.Until(t, "the blocks applied", func() bool { return r.matched(bl) == len(bl) })
}

// The restart is seen in the engine's metrics first, before its events
// (before any request reaches it): the picture is cleared then, and the
// new engine's first batches, their sequence back at 0, start its new
// picture without clearing it again.
func TestRestartSeenInTheMetricsFirstClearsOnce(t *testing.T) {
	r := newRestartRig(t)
	old, oldBlocks := chain(100, 0, 4)
	r.publish(t, old, oldBlocks)
	r.pub.Restart()
	if !r.f.EngineRestarted(time.Now(), "engine restarted: its counters are gone") {
		t.Fatal("a restart the events did not show was not cleared")
	}
	if r.matched(oldBlocks) != 0 {
		t.Fatal("the old engine's blocks are still in the picture")
	}
	next, nextBlocks := chain(200, 1000, 3)
	r.pub.Drop(next[0]) // lost before the engine's publisher connected: replayed
	r.publish(t, next[1:], nextBlocks)
	st := r.f.Stats()
	if st.Cleared != 1 || st.Subscriber.Resets != 0 || st.Orphans != 0 || st.Restarts != 1 || st.Kept != 0 {
		t.Fatalf("one restart: %d clears, %d resets, %d orphans; %+v", st.Cleared, st.Subscriber.Resets, st.Orphans, st)
	}
}

// The restart is seen in the events first: the picture is cleared and
// rebuilt from the new engine's events, and the metrics' sight of the same
// restart (it happened after their last scrape of the old engine) keeps
// it.
func TestRestartSeenInTheEventsFirstKeepsTheRebuiltPicture(t *testing.T) {
	r := newRestartRig(t)
	old, oldBlocks := chain(100, 0, 4)
	r.publish(t, old, oldBlocks)
	lastScrape := time.Now() // the metrics' last sight of the old engine
	r.pub.Restart()
	next, nextBlocks := chain(200, 1000, 3)
	r.publish(t, next, nextBlocks)
	if r.matched(oldBlocks) != 0 {
		t.Fatal("the old engine's blocks are still in the picture")
	}
	if r.f.EngineRestarted(lastScrape, "engine restarted: its process_start_time_seconds changed") {
		t.Fatal("the restart the events showed was cleared again")
	}
	if got := r.matched(nextBlocks); got != len(nextBlocks) {
		t.Fatalf("the picture rebuilt from the new engine's events holds %d of its %d blocks", got, len(nextBlocks))
	}
	st := r.f.Stats()
	if st.Cleared != 1 || st.Subscriber.Restarts != 1 || st.Kept != 1 {
		t.Fatalf("one restart: %d clears; %+v", st.Cleared, st)
	}
}

// A new engine whose first batches were lost and whose sequence passed the
// old one's: its batches are not a continuation of the old engine's. The
// picture is cleared once, and holds the new engine's blocks, from its
// replay buffer, and none of the old one's.
func TestRestartPastTheOldSequenceClearsThePicture(t *testing.T) {
	r := newRestartRig(t)
	old, oldBlocks := chain(100, 0, 3)
	r.publish(t, old, oldBlocks)
	r.pub.Restart()
	next, nextBlocks := chain(200, 1000, 6)
	for _, b := range next[:5] {
		r.pub.Drop(b) // seqs 0–4: lost
	}
	r.publish(t, next[5:], nextBlocks)
	if r.matched(oldBlocks) != 0 {
		t.Fatal("the old engine's blocks are still in the picture")
	}
	if st := r.f.Stats(); st.Cleared != 1 || st.Subscriber.Restarts != 1 || st.Orphans != 0 {
		t.Fatalf("%+v", st)
	}
}

// Restarts one after another, seen first by either side: each clears the
// picture once, and only the last engine's blocks stay.
func TestRestartsEachClearedOnce(t *testing.T) {
	r := newRestartRig(t)
	gen, genBlocks := chain(100, 0, 2)
	r.publish(t, gen, genBlocks)
	for i, metricsFirst := range []bool{true, false, true, false} {
		prev := genBlocks
		lastScrape := time.Now()
		r.pub.Restart()
		if metricsFirst {
			r.f.EngineRestarted(lastScrape, "engine restarted")
		}
		gen, genBlocks = chain(uint64(1000*(i+2)), 1000*(i+2), 2)
		r.publish(t, gen, genBlocks)
		if !metricsFirst {
			r.f.EngineRestarted(lastScrape, "engine restarted")
		}
		if r.matched(prev) != 0 || r.matched(genBlocks) != len(genBlocks) {
			t.Fatalf("restart %d: %d blocks of the engine before, %d of %d of the new one", i, r.matched(prev), r.matched(genBlocks), len(genBlocks))
		}
		if st := r.f.Stats(); st.Cleared != uint64(i+1) {
			t.Fatalf("after restart %d: %d clears", i, st.Cleared)
		}
	}
}
