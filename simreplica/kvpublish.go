package simreplica

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/semroute/semroute/kvevents"
)

// kvPublisher publishes the prefix cache's events over ZMQ as a vLLM
// engine does (vLLM's --kv-events-config with the zmq publisher): the
// cache's hook queues each change as one batch, in order, and one goroutine
// encodes and sends them, so the cache's lock never waits for the network.
type kvPublisher struct {
	pub  *kvevents.Publisher
	ch   chan kvevents.Batch
	done sync.WaitGroup
	sent atomic.Uint64 // batches published
	rank *int          // the batches' data_parallel_rank; nil: none. Set before the first send.
}

// kvQueue is how many batches may wait to be sent; past it the cache waits
// (vLLM's max_queue_size is 100,000 too).
const kvQueue = 100000

func newKVPublisher(o kvevents.PublisherOptions) (*kvPublisher, error) {
	pub, err := kvevents.NewPublisher(o)
	if err != nil {
		return nil, err
	}
	p := &kvPublisher{pub: pub, ch: make(chan kvevents.Batch, kvQueue)}
	p.done.Add(1)
	go func() {
		defer p.done.Done()
		for b := range p.ch {
			_, _ = p.pub.Publish(b) // a send error loses the batch; replay can still serve it
			p.sent.Add(1)
		}
	}()
	return p, nil
}

// send queues ev as a batch of its own.
func (p *kvPublisher) send(ev KVEvent) {
	p.ch <- kvevents.Batch{TS: float64(time.Now().UnixNano()) / 1e9, Events: []kvevents.Event{wireEvent(ev)}, DPRank: p.rank}
}

// close sends what is queued and closes the sockets.
func (p *kvPublisher) close() error {
	close(p.ch)
	p.done.Wait()
	return p.pub.Close()
}

// wireEvent is ev as vLLM's publisher sends it.
func wireEvent(ev KVEvent) kvevents.Event {
	if ev.Type == AllBlocksCleared {
		return kvevents.Event{Kind: kvevents.AllBlocksCleared}
	}
	out := kvevents.Event{Kind: ev.Type, BlockHashes: ev.BlockHashes, Medium: ev.Medium}
	if ev.Type == BlockStored {
		if ev.ParentBlockHash != nil {
			out.ParentHash, out.HasParent = *ev.ParentBlockHash, true
		}
		out.TokenIDs = make([]uint32, len(ev.TokenIDs))
		for i, id := range ev.TokenIDs {
			out.TokenIDs[i] = uint32(id)
		}
		out.BlockSize = int64(ev.BlockSize)
		out.LoraName = ev.LoRAName
		if ev.LoRAID > 0 {
			out.LoraID, out.HasLoraID = int64(ev.LoRAID), true
		}
	}
	return out
}
