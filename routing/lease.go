package routing

import (
	"math"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/replica"
)

// A Lease is one request's time on one replica, from the moment it is
// committed there to its end: the blocks it pins in the replica's picture
// (as vLLM keeps a running request's blocks out of its free queue) and its
// share of the replica's load (replica.Work). It is the only place pins and
// load are taken and given back, for this router's own requests
// (Engine.Commit), its fleet peers' (Engine.PeerLease) and a replay's.
//
// Its states, and the step that leads to each (a step from a later state
// does nothing, so every step is idempotent and the front ends may call
// them in any order):
//
//	state         step                  what it does
//	LeaseIdle     (zero value)          nothing held
//	LeasePrefill  Engine.Commit, begin  blocks recorded and pinned; work counted, its prefill pending
//	LeaseDecode   FirstToken            the prefill's tokens move from pending to recent work
//	LeaseDrained  EngineDone            the engine freed the blocks: pins released (prefill ended if it was not)
//	LeaseEnded    End                   work no longer counted; pins released if they were not
//
// The drain, the step after which the replica no longer runs the request
// (EngineDone, or End without it), calls the decision's Request.OnDrain, if
// set, exactly once, with the lease's replica: the slot the request held
// there is free.
//
// The states the next capabilities add sit at its ends: a request waiting
// in the router's own queue is LeaseIdle until it is committed; a
// disaggregated request holds one lease on its prefill replica, ended at
// the transfer, and one on its decode replica.
//
// A Lease is not safe for concurrent use: one request's steps are made in
// order by the goroutine (or the event loop) that carries it.
type Lease struct {
	e     *Engine
	rep   *replica.Replica
	d     *Decision  // this router's decision, told to the Sync; nil for a peer's
	c     *Candidate // d's candidate now serving it, told to the Sync
	work  replica.Work
	pins  cachemodel.Pins
	state LeaseState
	// blocks are the chain committed: d.Blocks for a decision, a copy of
	// the pinned ones for a peer's. last is the chain's last key, for a
	// peer's unpinned request whose chain is rebuilt from the picture at
	// its end.
	blocks  []blockhash.Block
	last    uint64
	hasLast bool
	shared  bool // counted in its Picture's active blocks (SharedActive)
	remote  bool // Remote was reported: the replica decodes a prompt computed elsewhere
	// later: the blocks were recorded, not pinned, at the commit (the
	// request waits for its engine to admit it); FirstToken pins them.
	later bool
	// onDrain is the decision's Request.OnDrain, called at the drain; set
	// by Decide and kept by every begin (a failover's too).
	onDrain func(*replica.Replica)
}

// LeaseState is where a Lease is in its life; see Lease.
type LeaseState uint8

// The states of a Lease, in the only order it moves through them.
const (
	LeaseIdle LeaseState = iota
	LeasePrefill
	LeaseDecode
	LeaseDrained
	LeaseEnded
)

var leaseStateNames = [...]string{"idle", "prefill", "decode", "drained", "ended"}

func (s LeaseState) String() string {
	if int(s) < len(leaseStateNames) {
		return leaseStateNames[s]
	}
	return "unknown"
}

// State returns where l is in its life.
func (l *Lease) State() LeaseState { return l.state }

// Replica returns the replica l is on; nil while LeaseIdle.
func (l *Lease) Replica() *replica.Replica { return l.rep }

// Work returns the load l counts on its replica.
func (l *Lease) Work() replica.Work { return l.work }

// Pinned returns how many blocks, from the first, l pins, and their
// tokens; both 0 once the pins are released.
func (l *Lease) Pinned() (blocks int, tokens int64) {
	if l.state >= LeaseDrained {
		return 0, 0
	}
	n := min(l.pins.Blocks(), len(l.blocks))
	for _, b := range l.blocks[:n] {
		tokens += int64(b.Tokens)
	}
	return n, tokens
}

// begin records blocks on r and, when pin, pins them, or with later pins
// them only at the first token; counts w (its Tokens recomputed under
// SharedActive when shared) on r. l is idle or ended (Commit ends a live
// one first).
func (l *Lease) begin(e *Engine, r *replica.Replica, d *Decision, c *Candidate, blocks []blockhash.Block, w replica.Work, pin, later, shared bool, now time.Time) {
	*l = Lease{e: e, rep: r, d: d, c: c, work: w, blocks: blocks, shared: shared && e.pic.sharesActive(), state: LeasePrefill, onDrain: l.onDrain}
	switch {
	case len(blocks) == 0:
	case pin && later:
		e.pic.record(r.ID, blocks, now.UnixNano())
		l.later = true
	case pin:
		l.pins = e.pic.pin(r.ID, blocks, now.UnixNano())
	default:
		e.pic.record(r.ID, blocks, now.UnixNano())
		l.last, l.hasLast, l.blocks = blocks[len(blocks)-1].Hash, true, nil
	}
	if l.shared {
		l.work.Tokens = e.pic.activate(r.ID, blocks, 1)
	}
	r.Begin(&l.work, now)
}

// Remote reports that another replica computes the prompt (disaggregated
// prefill): l's replica only takes its KV and decodes
// (replica.Replica.Remote). What that replica's engine then reports of the
// prompt teaches nothing of its own cache (Engine.Finish).
func (l *Lease) Remote() {
	if l.state == LeaseIdle || l.state == LeaseEnded {
		return
	}
	l.remote = true
	if l.state == LeasePrefill {
		l.rep.Remote(&l.work)
	}
}

// FirstToken reports that the replica finished the prompt's prefill (its
// first token arrived) at now.
func (l *Lease) FirstToken(now time.Time) {
	if l.state != LeasePrefill {
		return
	}
	l.state = LeaseDecode
	if l.later { // its engine admitted it and computed its prompt: held until it ends
		l.pins, l.later = l.e.pic.pin(l.rep.ID, l.blocks, now.UnixNano()), false
	}
	l.rep.PrefillDone(&l.work, now)
	if l.d != nil && l.e.sync != nil {
		l.e.sync.PrefillDone(l.d, l.c)
	}
}

// EngineDone reports that the engine finished the request at now: it
// freed the request's blocks, which the picture may now evict, though the
// client may still be reading the answer. Their free time is recorded.
func (l *Lease) EngineDone(now time.Time) {
	if l.state == LeaseIdle || l.state >= LeaseDrained {
		return
	}
	l.FirstToken(now) // the prefill ended too, if no token said so
	l.state = LeaseDrained
	l.rep.Drained(&l.work, now)
	l.free(now)
	if l.onDrain != nil {
		l.onDrain(l.rep)
	}
}

// free releases l's pins and records its blocks' free time.
func (l *Lease) free(now time.Time) {
	id := l.rep.ID
	switch {
	case l.blocks != nil:
		l.e.pic.unpin(id, l.blocks, l.pins, now.UnixNano())
	case l.hasLast:
		l.e.pic.freeChain(id, l.last, now.UnixNano())
	}
	l.pins = cachemodel.Pins{}
}

// End ends l at now: its work stops counting on the replica and, unless
// EngineDone did, its blocks are freed. The lease is ended; Engine.Commit
// may begin it again on another replica.
func (l *Lease) End(now time.Time) {
	if l.state == LeaseIdle || l.state == LeaseEnded {
		return
	}
	if l.shared {
		l.work.Tokens = l.e.pic.activate(l.rep.ID, l.blocks, -1)
	}
	l.rep.End(&l.work, now)
	drain := l.state < LeaseDrained
	if drain {
		l.free(now)
	}
	l.state = LeaseEnded
	if l.d != nil && l.e.sync != nil {
		l.e.sync.Done(l.d, l.c)
	}
	if drain && l.onDrain != nil {
		l.onDrain(l.rep)
	}
}

// PeerLease begins a lease for a request another router of the fleet
// committed on r (its fleet record): w is the load that router counted,
// blocks its chain. With pin the blocks are pinned as that router pinned
// them, and the lease keeps its own copy of the chain (Kept), to free it
// all and unpin what was pinned; without, they are only recorded (a bound
// on what peers may pin was reached) and freed at the end through the
// picture's chain of the last one. It tells no Sync.
func (e *Engine) PeerLease(r *replica.Replica, blocks []blockhash.Block, w replica.Work, pin bool, now time.Time) *Lease {
	l := &Lease{}
	if pin {
		blocks = append([]blockhash.Block(nil), blocks...)
	}
	l.begin(e, r, nil, nil, blocks, w, pin, false, false, now)
	return l
}

// Kept returns how many blocks l keeps a copy of (a peer's pinned chain).
func (l *Lease) Kept() int { return len(l.blocks) }

// Commit begins d's lease on c's replica: d's blocks are recorded and
// pinned there, and the request's work counted, until the lease ends
// (Decision.Lease().End). A decision moved to another candidate (a
// failover) ends its lease first.
func (e *Engine) Commit(d *Decision, c *Candidate) {
	now := e.o.Now()
	d.lease.End(now) // a lease still live ends where it was
	d.served = c.Replica.ID
	e.reuses.of(c.Replica.ID).committed(e.pic, d, c, now.UnixNano())
	prefill := max(int64(d.Tokens-c.Match.Tokens)-int64(c.Reuse), 0)
	var tokens int64
	for _, b := range d.Blocks {
		tokens += int64(b.Tokens)
	}
	w := replica.Work{Prefill: prefill, Tokens: tokens}
	sp := e.Service(c.Replica)
	st := c.Replica.State(tokens, d.priority)
	if st.KVShort && c.Match.Blocks > 0 { // what its running requests hold needs no room (fits)
		st.KVShort = c.Replica.ShortOfRoom(tokens - int64(e.pic.model.Active(c.Replica.ID, d.Blocks[:min(c.Match.Blocks, len(d.Blocks))])))
	}
	w.Predicted = sp.TTFT(st, float64(prefill))
	// A request its engine will not admit at once holds no blocks there
	// until it is: vLLM allocates a waiting request's blocks only when it
	// schedules it, and may evict the cached ones it would have used to
	// admit the requests ahead. Its blocks are recorded, evictable, and
	// pinned at its first token.
	d.lease.begin(e, c.Replica, d, c, d.Blocks, w, true, st.Queued > 0 || st.KVShort, true, now)
	if e.sync != nil {
		e.sync.Committed(d, c)
	}
	if len(d.Blocks) == 0 {
		return // no prompt (a pass-through request): not a prefill to average
	}
	for { // avg ← avg + (x − avg)/32, lock-free
		old := e.avgPrefill.Load()
		avg := math.Float64frombits(old)
		if e.avgPrefill.CompareAndSwap(old, math.Float64bits(avg+(float64(prefill)-avg)/32)) {
			break
		}
	}
}

// Usage is what a front end learned of a request's answer by its end
// (Engine.Finish): the replica's status and usage report, the router's
// feedback setting and the reply it captured.
type Usage struct {
	// OK: the replica answered with status 200.
	OK bool
	// PromptTokens is the engine's count of the prompt
	// (usage.prompt_tokens; 0: not reported), in engine tokens.
	PromptTokens int64
	// CachedTokens is the prompt tokens the engine found cached
	// (usage.prompt_tokens_details.cached_tokens), read when CachedReported.
	CachedTokens   int64
	CachedReported bool
	// OutputTokens is the tokens the engine generated
	// (usage.completion_tokens; 0: not reported), and Streamed says the
	// answer was streamed: its first byte was its first token, apart from
	// its end. Both teach the replica's service time.
	OutputTokens int64
	Streamed     bool
	// Feedback corrects the picture of the serving replica from
	// CachedTokens (Engine.Feedback): the router's feedback setting.
	Feedback bool
	// Reply is the assistant's answer the front end captured, to learn as
	// the conversation's next prefix (LearnReply); nil: none.
	Reply []byte
}

// Finish ends recorded decision d's request, in the order the front ends
// made these steps one by one, at the engine's clock's now:
//
//  1. its lease ends (Lease.End): its work stops counting on the replica
//     serving it and, if EngineDone did not, its blocks are freed and
//     Request.OnDrain offered the slot;
//  2. with an OK answer reporting prompt tokens, unless the replica only
//     decoded a prompt computed elsewhere (Lease.Remote), the replica's
//     service time (replica.Replica.LearnService) and the engine's
//     token unit are learned (ObserveUsage) and, when u.Feedback and
//     CachedReported, the serving replica's picture is corrected
//     (Feedback), trimmed being the tokens that evicted;
//  3. a reply given is learned on the replica that wrote it (LearnReply),
//     learned being its blocks, valid until Recycle(d).
//
// A decision without blocks (no prompt: a pass-through request), or never
// committed, learns nothing. Call it once, from the request's goroutine;
// Recycle(d) after whatever reads d and learned.
func (e *Engine) Finish(d *Decision, u Usage) (learned []blockhash.Block, trimmed int64) {
	l := &d.lease
	l.End(e.o.Now())
	c := l.c
	if c == nil || len(d.Blocks) == 0 {
		return nil, 0
	}
	if u.OK && u.PromptTokens > 0 && !l.remote {
		uncached := float64(l.work.Prefill)
		if u.CachedReported {
			uncached = float64(max(u.PromptTokens-u.CachedTokens, 0))
		}
		l.rep.LearnService(&l.work, uncached, u.OutputTokens, u.Streamed)
		e.learned.Add(1)
		e.ObserveUsage(d.model, d, int(u.PromptTokens))
		if u.CachedReported && u.Feedback {
			trimmed = e.Feedback(d, c, int(u.CachedTokens))
		}
	}
	if u.Reply != nil {
		learned = e.LearnReply(d, c.Replica, u.Reply)
	}
	return learned, trimmed
}
