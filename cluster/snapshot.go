package cluster

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/semroute/semroute/blockhash"
)

// A snapshot is streamed as chunks, NATS messages to the asker's inbox:
//
//	chunk = version:1 entry*
//	entry = replica:str n:uvarint block×n
//	block = flags:1 [parent:8 if flags&1] key:8 tokens:uvarint kind:1
//
// flags: 1 the block has a parent, 2 it is in CPU memory. Each replica's
// blocks come parents first. The last chunk is empty, with the header
// Semroute-Last.
const (
	hdrLast    = "Semroute-Last"
	chunkBytes = 256 << 10
	snapParent = 1
	snapCPU    = 2
)

// snapSubject is where a router serves snapshots of its picture.
func (f *Fleet) snapSubject(id string) string {
	return f.snap + "." + strings.Map(func(r rune) rune {
		if r == '.' || r == '*' || r == '>' || r <= ' ' {
			return '_'
		}
		return r
	}, id)
}

// warmStart loads the picture from peer ("": a live peer, heard on the
// records subject within a heartbeat or two, one that has published
// records first; with none the router is alone, and ready at once) and
// makes the router Ready. A client that only answers snapshot requests is
// never asked; the load has a deadline (SnapshotTimeout), and peers'
// records keep being applied while it runs.
func (f *Fleet) warmStart(peer string) {
	defer f.finishLoading()
	wait := time.NewTimer(2*f.o.Heartbeat + f.o.Heartbeat/2)
	defer wait.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !f.publishing(&peer) {
		select {
		case <-wait.C:
			f.o.Logger.Info("fleet: no peer heard; starting with this router's picture", "id", f.o.ID)
			return
		case <-f.stop:
			return
		case <-tick.C:
		}
	}
	n, err := f.load(peer)
	if errors.Is(err, nats.ErrNoResponders) || errors.Is(err, errGone) { // it is starting too, or it left
		f.o.Logger.Info("fleet: the peer serves no snapshot yet; routing on what this router has", "peer", peer)
		return
	}
	if err != nil {
		f.o.Logger.Warn("fleet: warm start from a peer failed; routing on what this router has", "peer", peer, "err", err, "blocks", n)
		return
	}
	f.loaded.Add(1)
	f.o.Logger.Info("fleet: warm start done", "peer", peer, "blocks", n)
}

// publishing reports whether *id is a live peer, heard on the records
// subject; when *id is "", it picks one, if any, one that has published
// records first.
func (f *Fleet) publishing(id *string) bool {
	f.amu.Lock()
	defer f.amu.Unlock()
	now := f.o.Now()
	best, most := "", int64(-1)
	for k, p := range f.peers {
		if now.Sub(p.seen) < f.o.PeerTimeout && (*id == "" || *id == k.id) && p.records > most {
			best, most = k.id, p.records
		}
	}
	*id = cmp.Or(*id, best)
	return best != ""
}

// finishLoading makes the router Ready and serving snapshots itself.
func (f *Fleet) finishLoading() {
	if f.snapSub == nil {
		sub, err := f.nc.Subscribe(f.snapSubject(f.o.ID), f.serve)
		if err != nil {
			f.o.Logger.Warn("fleet: cannot serve snapshots", "err", err)
		}
		f.snapSub = sub
	}
	f.ready.Store(true)
}

var errGone = errors.New("the peer is gone")

// load asks peer for its picture and applies it; it returns the blocks
// stored.
func (f *Fleet) load(peer string) (int, error) {
	inbox := f.nc.NewRespInbox()
	sub, err := f.nc.SubscribeSync(inbox)
	if err != nil {
		return 0, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = sub.SetPendingLimits(-1, 512<<20)
	if err := f.nc.PublishRequest(f.snapSubject(peer), inbox, []byte(f.o.ID)); err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(f.loadCtx, f.o.SnapshotTimeout)
	defer cancel()
	stored := 0
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return stored, err
		}
		if m.Header.Get("Status") == "503" {
			return stored, errGone
		}
		if m.Header.Get(hdrLast) != "" {
			return stored, nil
		}
		n, err := f.applyChunk(m.Data)
		stored += n
		if err != nil {
			return stored, err
		}
	}
}

// applyChunk stores a snapshot chunk's blocks in the picture. Replicas
// whose engine reports KV events here are skipped: their picture is the
// engine's own, and a block stored from a snapshot would have no engine
// hash for its removal to be applied.
func (f *Fleet) applyChunk(b []byte) (int, error) {
	cache, pool := f.eng.Picture(), f.eng.Pool()
	r := &reader{b: b}
	if r.byte() != version {
		return 0, errMalformed
	}
	now := f.o.Now().UnixNano()
	stored := 0
	one := make([]blockhash.Block, 1)
	for len(r.b) > 0 && r.err == nil {
		name := r.str()
		n := r.count(11)
		rep, ok := pool.Get(name)
		skip := !ok || cache.EventDriven(rep.ID)
		for range n {
			flags := r.byte()
			var parent uint64
			if flags&snapParent != 0 {
				parent = r.u64()
			}
			key, tokens, kind := r.u64(), r.uvarint(), blockhash.Kind(r.byte())
			if r.err != nil || kind >= blockhash.NumKinds || tokens > 1<<20 {
				return stored, errMalformed
			}
			if skip {
				continue
			}
			one[0] = blockhash.Block{Hash: key, Tokens: int32(tokens), Kind: kind}
			if ok, _ := cache.Store(rep.ID, parent, flags&snapParent != 0, one, flags&snapCPU != 0, now); ok {
				stored++
			}
		}
	}
	f.snapBlocks.Add(int64(stored))
	return stored, r.err
}

// serve streams this router's picture to the asker of m.
func (f *Fleet) serve(m *nats.Msg) {
	if m.Reply == "" {
		return
	}
	cache := f.eng.Picture()
	var chunks [][]byte
	cur := []byte{version}
	for _, rep := range f.eng.Pool().Replicas() {
		var blocks []byte
		n := 0
		cache.Walk(rep.ID, func(parent uint64, hasParent bool, b blockhash.Block, cpu bool) {
			var flags byte
			if hasParent {
				flags |= snapParent
			}
			if cpu {
				flags |= snapCPU
			}
			blocks = append(blocks, flags)
			if hasParent {
				blocks = binary.BigEndian.AppendUint64(blocks, parent)
			}
			blocks = binary.BigEndian.AppendUint64(blocks, b.Hash)
			blocks = binary.AppendUvarint(blocks, uint64(max(b.Tokens, 1)))
			blocks = append(blocks, byte(b.Kind))
			n++
			if len(blocks) >= chunkBytes {
				cur = appendEntry(cur, rep.Name, n, blocks)
				chunks, cur = append(chunks, cur), []byte{version}
				blocks, n = blocks[:0], 0
			}
		})
		if n > 0 {
			cur = appendEntry(cur, rep.Name, n, blocks)
		}
		if len(cur) >= chunkBytes {
			chunks, cur = append(chunks, cur), []byte{version}
		}
	}
	if len(cur) > 1 {
		chunks = append(chunks, cur)
	}
	for i, c := range chunks {
		if err := f.nc.Publish(m.Reply, c); err != nil {
			f.o.Logger.Warn("fleet: snapshot not sent", "to", string(m.Data), "err", err)
			return
		}
		if i%16 == 15 {
			_ = f.nc.Flush()
		}
	}
	last := &nats.Msg{Subject: m.Reply, Header: nats.Header{}}
	last.Header.Set(hdrLast, "1")
	if err := f.nc.PublishMsg(last); err == nil {
		f.served.Add(1)
		f.o.Logger.Info("fleet: served a snapshot", "to", string(m.Data), "chunks", len(chunks))
	}
}

func appendEntry(b []byte, name string, n int, blocks []byte) []byte {
	b = appendStr(b, name)
	b = binary.AppendUvarint(b, uint64(n))
	return append(b, blocks...)
}
