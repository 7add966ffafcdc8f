package cluster

import (
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
)

// maxHeld bounds the bytes of peers' batches kept while a warm start
// loads; past it they are dropped (and the gap they leave makes the
// router forget those peers' requests in flight).
const maxHeld = 64 << 20

// onBatch receives a batch on the records subject. NATS calls it for one
// message at a time.
func (f *Fleet) onBatch(m *nats.Msg) {
	f.amu.Lock()
	defer f.amu.Unlock()
	if f.loading {
		if f.heldBytes+len(m.Data) <= maxHeld {
			f.held = append(f.held, m.Data)
			f.heldBytes += len(m.Data)
		}
		return
	}
	f.applyBatch(m.Data, m.Header.Get(hdrFirst))
}

// applyBatch applies one batch to the picture. f.amu must be held.
func (f *Fleet) applyBatch(data []byte, first string) {
	now := f.o.Now()
	var p *peer
	err := decode(data, func(h header) bool {
		if h.sender == f.o.ID && h.epoch == f.epoch {
			if t, err := strconv.ParseInt(first, 10, 64); err == nil && h.count > 0 {
				f.lag.Store(max(now.UnixNano()-t, 0))
			}
			return false // our own, echoed
		}
		k := peerKey{h.sender, h.epoch}
		p = f.peers[k]
		if p == nil {
			p = &peer{id: h.sender, flight: map[uint64]*flight{}}
			f.peers[k] = p
			f.o.Logger.Info("fleet: peer joined", "peer", h.sender)
		}
		p.seen = now
		switch {
		case p.seq != 0 && h.seq <= p.seq:
			return false // a batch seen already
		case p.seq != 0 && h.seq != p.seq+1:
			f.gaps.Add(1)
			f.o.Logger.Warn("fleet: records lost from a peer; forgetting its requests in flight", "peer", h.sender, "missed", h.seq-p.seq-1)
			f.endAll(p, now)
		}
		p.seq = h.seq
		return true
	}, func(r *record) { f.apply(p, r, now) })
	if err != nil {
		f.malformed.Add(1)
		f.o.Logger.Warn("fleet: malformed batch", "err", err)
	}
}

// apply applies one record of peer p. f.amu must be held.
func (f *Fleet) apply(p *peer, r *record, now time.Time) {
	f.applied.Add(1)
	cache, pool := f.eng.Cache(), f.eng.Pool()
	switch r.typ {
	case recRoute, recReply:
		rep, ok := pool.Get(r.replica)
		if !ok {
			f.unresolved.Add(1)
			return
		}
		if old := p.flight[r.req]; old != nil && r.typ == recRoute {
			f.end(p, old, now) // before resolve: both use f.scratch
			delete(p.flight, r.req)
		}
		all, ok := f.resolve(&r.chain)
		if r.typ == recReply {
			if ok && len(all) > 0 {
				cache.Extend(rep.ID, all, r.chain.prefix, now.UnixNano())
			}
			return
		}
		tracked := len(p.flight) < maxFlights // an untracked request would never be unpinned
		fl := &flight{r: rep, work: replica.Work{Prefill: r.prefill, Tokens: r.tokens}}
		if ok && len(all) > 0 {
			if tracked && p.keys+len(all) <= maxPinnedKeys {
				if _, fl.pins = cache.Commit(rep.ID, all, now.UnixNano()); fl.pins.Blocks() > 0 {
					fl.keys = make([]uint64, fl.pins.Blocks())
					for i := range fl.keys {
						fl.keys[i] = all[i].Hash
					}
					p.keys += len(fl.keys)
				}
			} else {
				cache.Record(rep.ID, all, now.UnixNano())
			}
		}
		if !tracked {
			return
		}
		if len(all) > 0 {
			fl.last, fl.has = all[len(all)-1].Hash, true
		}
		rep.Begin(&fl.work)
		p.flight[r.req] = fl
	case recPrefill:
		if fl := p.flight[r.req]; fl != nil {
			fl.r.PrefillDone(&fl.work, now)
		}
	case recDone:
		fl := p.flight[r.req]
		if fl == nil {
			return
		}
		delete(p.flight, r.req)
		f.end(p, fl, now)
	case recEject:
		if rep, ok := pool.Get(r.replica); ok {
			rep.Eject(now.Add(time.Duration(min(r.cool, uint64(time.Hour/time.Millisecond))) * time.Millisecond))
		}
	case recReset: // the peer (re)connected: it may know what this router does not
		f.endAll(p, now)
		if f.ready.Load() {
			f.askResync(p.id)
		}
	}
}

// resolve returns a chain's blocks in full: the prefix the sender named
// by its last key, rebuilt from this picture, then the new blocks. It
// reports false (counted) when this picture does not know the prefix.
// The result is valid until the next call. f.amu must be held.
func (f *Fleet) resolve(c *chain) ([]blockhash.Block, bool) {
	all := f.scratch[:0]
	if c.prefix > 0 {
		var ok bool
		all, ok = f.eng.Cache().Chain(c.prefixKey, all)
		if !ok || len(all) != c.prefix {
			f.unresolved.Add(1)
			f.scratch = all[:0]
			return nil, false
		}
	}
	all = append(all, c.blocks...)
	f.scratch = all[:0]
	return all, true
}
