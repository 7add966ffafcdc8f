package replay

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// Sync modes of a run with several routers (Run.Routers).
const (
	// SyncNone: each router sees only the requests sent to it.
	SyncNone = "none"
	// SyncShared: each router applies the others' decisions, load and
	// learned replies Run.SyncDelay after they happen, as package cluster
	// does over NATS.
	SyncShared = "shared"
)

func checkSync(r Run) error {
	switch {
	case r.Routers <= 1:
		if r.Sync != "" || r.SyncDelay != 0 {
			return fmt.Errorf("sync %q without routers: set Routers > 1", r.Sync)
		}
		return nil
	case r.Routers > 64:
		return fmt.Errorf("%d routers: at most 64", r.Routers)
	case r.Sync != SyncNone && r.Sync != SyncShared:
		return fmt.Errorf("sync %q is not %s or %s", r.Sync, SyncNone, SyncShared)
	case r.SyncDelay < 0:
		return fmt.Errorf("negative sync delay %v", r.SyncDelay)
	}
	return nil
}

// fleetDecider routes each request through one of several routers picked
// at random, as a Kubernetes Service spreads connections; each router is
// a whole engineDecider with its own picture and replica load.
type fleetDecider struct {
	rs   []*engineDecider
	of   []int // request → router
	rng  *rand.Rand
	sync *fleetSync // nil: SyncNone
}

func (f *fleetDecider) decide(i int, now int64) (place, error) {
	f.sync.flush(now)
	k := f.rng.IntN(len(f.rs))
	f.of[i] = k
	return f.rs[k].decide(i, now)
}

func (f *fleetDecider) prefillDone(i int, now int64, cached int) {
	f.sync.flush(now)
	f.rs[f.of[i]].prefillDone(i, now, cached)
}

func (f *fleetDecider) transferred(i int, now int64) {
	f.sync.flush(now)
	f.rs[f.of[i]].transferred(i, now)
}

func (f *fleetDecider) done(i int, now int64) {
	f.sync.flush(now)
	k := f.of[i]
	d := f.rs[k]
	rep := d.ps[i].Served.Replica.ID
	d.done(i, now)
	if f.sync != nil && d.m.RecordReplies && d.reqs[i].Reply != nil {
		all := append(append([]blockhash.Block(nil), d.reqs[i].Blocks...), d.reqs[i].Reply...)
		f.sync.push(syncOp{t: now + f.sync.delay, from: k, kind: opExtend, rep: rep, blocks: all, n: len(d.reqs[i].Blocks)})
	}
}

// stored and removed: every router follows the engines' KV events itself.
func (f *fleetDecider) stored(rep int, parent uint64, hasParent bool, blocks []blockhash.Block, now int64) {
	for _, r := range f.rs {
		r.stored(rep, parent, hasParent, blocks, now)
	}
}

func (f *fleetDecider) removed(rep int, key uint64) {
	for _, r := range f.rs {
		r.removed(rep, key)
	}
}

// fleetSync carries each router's changes to the others after a delay:
// the replay's stand-in for package cluster. Operations are applied in
// the order made, each at its own time, before the next event of the
// simulation at or after that time.
type fleetSync struct {
	rs    []*engineDecider
	delay int64 // ns
	q     []syncOp
	head  int
	next  uint64
	// works[j][id] is router j's lease of another router's request id.
	works []map[uint64]*routing.Lease
}

const (
	opCommit = iota
	opPrefill
	opDone
	opExtend
)

type syncOp struct {
	t      int64
	from   int
	kind   int
	id     uint64
	rep    int
	work   replica.Work
	blocks []blockhash.Block
	n      int // opExtend: the prompt's blocks
}

func (s *fleetSync) push(op syncOp) {
	s.q = append(s.q, op) // one delay for all: queued in time order
}

// flush applies the operations due by now.
func (s *fleetSync) flush(now int64) {
	if s == nil {
		return
	}
	for s.head < len(s.q) && s.q[s.head].t <= now {
		op := &s.q[s.head]
		for j, r := range s.rs {
			if j != op.from {
				s.apply(j, r, op)
			}
		}
		s.q[s.head] = syncOp{}
		s.head++
	}
	if s.head > 4096 && s.head*2 > len(s.q) {
		s.q = append(s.q[:0], s.q[s.head:]...)
		s.head = 0
	}
}

func (s *fleetSync) apply(j int, r *engineDecider, op *syncOp) {
	at := time.Unix(0, op.t)
	switch op.kind {
	case opCommit: // pinned as cluster pins a peer's request
		s.works[j][op.id] = r.eng.PeerLease(r.pool.Replicas()[op.rep], op.blocks, op.work, true, at)
	case opPrefill:
		if l := s.works[j][op.id]; l != nil {
			l.FirstToken(at)
		}
	case opDone:
		if l := s.works[j][op.id]; l != nil {
			l.End(at)
			delete(s.works[j], op.id)
		}
	case opExtend:
		r.pic.Replied(op.rep, op.blocks, op.n, at)
	}
}

// sender is one router's routing.Sync: it queues what the router does
// for the others.
type sender struct {
	s    *fleetSync
	from int
	now  *int64
}

func (x *sender) Committed(d *routing.Decision, c *routing.Candidate) {
	x.s.next++
	d.SyncID = x.s.next
	x.s.push(syncOp{t: *x.now + x.s.delay, from: x.from, kind: opCommit, id: d.SyncID, rep: c.Replica.ID,
		work: d.Lease().Work(), blocks: append([]blockhash.Block(nil), d.Blocks...)})
}

func (x *sender) PrefillDone(d *routing.Decision, _ *routing.Candidate) {
	x.s.push(syncOp{t: *x.now + x.s.delay, from: x.from, kind: opPrefill, id: d.SyncID})
}

func (x *sender) Done(d *routing.Decision, _ *routing.Candidate) {
	x.s.push(syncOp{t: *x.now + x.s.delay, from: x.from, kind: opDone, id: d.SyncID})
}

func (x *sender) Learned(*routing.Decision, *replica.Replica, []blockhash.Block, int) {} // the replay learns replies itself (fleetDecider.done)

func (x *sender) Ejected(*replica.Replica, time.Duration) {} // no failures in a replay
