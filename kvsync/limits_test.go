package kvsync_test

import (
	"testing"

	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/kvsync"
)

// A Follower's Limits reach the socket: a batch past them is counted and
// leaves the picture as it was, with no gap and no reset, and the batch
// after it is applied.
func TestFollowerSkipsBatchesOverLimits(t *testing.T) {
	p, err := kvevents.NewPublisher(kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	model := cachemodel.New(cachemodel.Options{})
	id, _ := model.AddReplica("r", 0)
	f, err := kvsync.Follow(kvsync.Options{Model: model, ID: id, Name: "r", Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint(),
		BlockSize: 16, Limits: kvevents.Limits{MaxTokensPerEvent: 1024}})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	testwait.Until(t, "subscribed", p.Subscribed)
	matched := func(base, n int) int { return model.Match(blocksOf(base, n), nil, nil)[id].Blocks }
	hashes := make([]uint64, 65) // 1040 token ids
	for i := range hashes {
		hashes[i] = uint64(i + 1)
	}
	for _, b := range []kvevents.Batch{
		{Events: []kvevents.Event{chainEvent(hashes, nil, 0)}},
		{Events: []kvevents.Event{chainEvent([]uint64{1000}, nil, 1<<20)}},
	} {
		if _, err := p.Publish(b); err != nil {
			t.Fatal(err)
		}
	}
	// The picture holds a batch's blocks before its counts are added:
	// both are awaited.
	testwait.Until(t, "the batch after", func() bool { return matched(1<<20, 1) == 1 && f.Stats().Stored == 1 })
	st := f.Stats()
	if matched(0, 65) != 0 || st.Subscriber.OverLimit[kvevents.LimitTokens] != 1 || st.Subscriber.Gaps != 0 ||
		st.Subscriber.Resets != 0 || st.Cleared != 0 || st.Stored != 1 {
		t.Fatalf("%d blocks of the batch over the limit in the picture; stats %+v", matched(0, 65), st)
	}
}
