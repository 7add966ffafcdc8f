package cluster

import (
	"strconv"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/semroute/semroute/blockhash"

	"github.com/semroute/semroute/replica"
)

// onBatch receives a batch on the records subject. NATS calls it for one
// message at a time. Peers' batches are applied as they come, a warm start
// under way or not: a snapshot adds to the picture, it never holds the
// fleet's live records back.
func (f *Fleet) onBatch(m *nats.Msg) {
	f.amu.Lock()
	defer f.amu.Unlock()
	f.applyBatch(m.Data, m.Header.Get(hdrFirst))
}

// applyBatch applies one batch to the picture. f.amu must be held.
//
// A peer is known by its id and epoch. A batch whose sequence is not the
// next one, whether it jumps or goes back, is a gap: the peer's requests
// in flight are forgotten (they may have ended in what was lost) and the
// batch is applied from its sequence on, so that a forged sequence can
// never make the peer's own batches look old.
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
			if len(f.peers) >= f.o.MaxPeers {
				f.refused.Add(1)
				return false
			}
			p = &peer{id: h.sender, flight: map[uint64]*flight{}}
			f.peers[k] = p
			f.o.Logger.Info("fleet: peer joined", "peer", h.sender)
		}
		p.seen = now
		if p.seq != 0 && h.seq != p.seq+1 {
			f.gaps.Add(1)
			f.o.Logger.Warn("fleet: a peer's batches are out of sequence; forgetting its requests in flight", "peer", h.sender, "expected", p.seq+1, "got", h.seq)
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
	p.records++
	switch r.typ {
	case recRoute, recReply:
		f.applyRoute(p, r, now)
	case recPrefill:
		if fl := p.flight[r.req]; fl != nil {
			fl.l.FirstToken(now)
		}
	case recDone:
		if fl := p.flight[r.req]; fl != nil {
			delete(p.flight, r.req)
			f.end(p, fl, now)
		}
	case recEject:
		f.applyEject(r, now)
	case recHome:
		// Older routers' word of where a response is stored: ignored. A
		// response's id carries its home and its tenant under the fleet's
		// response key (router/respid.go), so a peer's claim is neither
		// needed nor taken, whatever it says.
		f.ignoredHomes.Add(1)
	case recReset: // the peer (re)connected: it may know what this router does not
		f.endAll(p, now)
		if f.ready.Load() {
			f.askResync(p.id)
		}
	}
}

// applyRoute applies a route record (a request p sent to a replica, which
// ends the one it had in flight under the same id) or a reply record (the
// blocks of a reply p learned). f.amu must be held.
func (f *Fleet) applyRoute(p *peer, r *record, now time.Time) {
	rep, ok := f.eng.Pool().Get(r.replica)
	if !ok {
		f.unresolved.Add(1)
		return
	}
	if old := p.flight[r.req]; old != nil && r.typ == recRoute {
		f.end(p, old, now)
		delete(p.flight, r.req)
	}
	all, ok := f.resolve(&r.chain)
	if !ok {
		all = nil
	}
	if r.typ == recReply {
		f.eng.Picture().Replied(rep.ID, all, r.chain.prefix, now)
		return
	}
	f.bound(r, all, ok)
	if f.flights >= maxFlights { // an untracked request would never be unpinned
		f.eng.Picture().Routed(rep.ID, all, now)
		return
	}
	f.track(p, r, rep, all, now)
}

// track leases rep for p's routed request r, whose blocks are all, and
// keeps it in flight until its done record. Its blocks are pinned while
// the fleet's pinned keys and rep's share of pinned tokens allow. f.amu
// must be held.
func (f *Fleet) track(p *peer, r *record, rep *replica.Replica, all []blockhash.Block, now time.Time) {
	st, _ := f.eng.Picture().Stats(rep.ID)
	pin := f.keys+len(all) <= maxPinnedKeys && (st.Budget == 0 || f.pinned[rep.ID]+chainTokens(all) <= st.Budget/pinShare)
	fl := &flight{start: now}
	fl.l = f.eng.PeerLease(rep, all, replica.Work{Prefill: r.prefill, Tokens: r.tokens}, pin, now)
	n := fl.l.Kept()
	_, tokens := fl.l.Pinned()
	fl.keys, fl.pinned = n, tokens
	p.keys += n
	f.keys += n
	f.pinned[rep.ID] += tokens
	p.flight[r.req] = fl
	f.flights++
}

// applyEject applies an ejection record: evidence, not an order. The
// replica is ejected no longer than this router's own first cool-down,
// and softly, so that the all-ejected fallback still has it.
func (f *Fleet) applyEject(r *record, now time.Time) {
	rep, ok := f.eng.Pool().Get(r.replica)
	if !ok {
		return
	}
	most := uint64(f.o.Ejection.Base / time.Millisecond)
	if r.cool > most {
		f.clamped.Add(1)
	}
	rep.EjectSoft(now, now.Add(time.Duration(min(r.cool, most))*time.Millisecond))
}

// bound clamps a route record's work to what a router could have sent
// for its chain: no more prompt tokens than the chain's blocks hold, and
// one block more (the prompt's unfinished tail); no more uncached ones
// than that. all is the chain resolved (ok), else its new blocks alone
// stand for what is known and the prefix is counted in whole blocks of
// this router's size.
func (f *Fleet) bound(r *record, all []blockhash.Block, ok bool) {
	block := int64(max(f.eng.Splitter().BlockTokens(), 1))
	var most int64
	if ok {
		most = chainTokens(all) + block
	} else {
		most = chainTokens(r.chain.blocks) + int64(r.chain.prefix+1)*block
	}
	if r.tokens > most || r.prefill > r.tokens {
		f.clamped.Add(1)
	}
	r.tokens = min(r.tokens, most)
	r.prefill = min(r.prefill, r.tokens)
}

// chainTokens is the tokens of blocks.
func chainTokens(blocks []blockhash.Block) int64 {
	var n int64
	for _, b := range blocks {
		n += int64(b.Tokens)
	}
	return n
}

// resolve returns a chain's blocks in full: the prefix the sender named
// by its last key, rebuilt from this picture, then the new blocks. It
// reports false (counted) when this picture does not know the prefix.
// The result is valid until the next call. f.amu must be held.
func (f *Fleet) resolve(c *chain) ([]blockhash.Block, bool) {
	all := f.scratch[:0]
	if c.prefix > 0 {
		var ok bool
		all, ok = f.eng.Picture().Chain(c.prefixKey, all)
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
