package routing

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/replica"
)

// Defaults of EngineOptions.Attempts and MatcherThreshold.
const (
	DefaultAttempts         = 3
	DefaultMatcherThreshold = 0.5
)

// ErrNoReplica means no replica is available to take the request.
var ErrNoReplica = errors.New("no replica available")

// ErrUnknownModel means no replica serves the request's model: every
// replica's models are known (replica.Models) and none lists it. Decide
// returns it as an *UnknownModelError.
var ErrUnknownModel = errors.New("no replica serves the model")

// UnknownModelError names the model no replica serves.
type UnknownModelError struct{ Model string }

func (e *UnknownModelError) Error() string {
	return fmt.Sprintf("no replica serves the model %q", e.Model)
}
func (e *UnknownModelError) Is(target error) bool { return target == ErrUnknownModel }

// EngineOptions configure an Engine (see New). The zero value is usable:
// the routing policy is not the engine's, but each Request's (its A/B arm's,
// or the replay's run's).
type EngineOptions struct {
	// Weights multiply matched and prompt tokens by block kind. Nil means
	// DefaultWeights.
	Weights *cachemodel.Weights
	// Attempts is how many replicas a request may be tried on: the ranked
	// candidates kept in a Decision. Default 3.
	Attempts int
	// Now is the clock. Nil means time.Now.
	Now func() time.Time
	// SharedActive counts a block used by several requests running at once
	// on one replica once in its KV load (replica.Load.ActiveTokens), as
	// engines with cascade attention store it once. Off: once per request.
	SharedActive bool
	// Matcher, if set, is the donor index: served requests are registered
	// as donors, and the cache model's OnEvict should call Matcher.Forget.
	// A replica whose engine reuses donors (replica.ReuseDonor) is credited
	// with its most similar donor's tokens past the exact prefix, times
	// their similarity. Required when such a replica is in the pool.
	Matcher Matcher
	// PreferDonor makes the matcher a fallback for every engine: when the
	// best exact prefix match covers less than MatcherThreshold of the
	// prompt, the replica of the most similar donor, if at least
	// PreferSimilarity similar, is moved to the front unless it is spilled.
	PreferDonor      bool
	PreferSimilarity float64
	// MatcherThreshold is the share of the prompt below which PreferDonor
	// asks the matcher. Default 0.5.
	MatcherThreshold float64
	// A prefix block is hot (View.Hot) when, per cache-model HotHalfLife,
	// at least HotUses requests used it and more than HotShare ÷ (available
	// replicas) of all requests did: it carries more than a replica's fair
	// share of the traffic. Defaults 8 and 1.5; a negative HotUses turns hot
	// prefixes off.
	HotUses  float64
	HotShare float64
}

// DefaultWeights are the default kind weights: kinds that later requests
// reuse across sessions (system prompts, tool schemas, documents) count a
// little more than their tokens, the new question a little less, since
// co-locating the former is what makes later requests hit.
func DefaultWeights() *cachemodel.Weights {
	w := cachemodel.UnitWeights()
	w[blockhash.KindSystem] = 1.2
	w[blockhash.KindTools] = 1.2
	w[blockhash.KindRetrievedContext] = 1.1
	w[blockhash.KindUserQuery] = 0.8
	return w
}

// Engine is the routing core shared by every front end.
type Engine struct {
	o     EngineOptions
	split *blockhash.Splitter
	pool  *replica.Pool

	mu sync.Mutex // NoteAdapter's copy-on-write of adapters

	avgPrefill atomic.Uint64               // float64 bits: EWMA of committed requests' uncached tokens
	fleet      atomic.Pointer[fleetParams] // the fleet's service time (fleetService)
	learned    atomic.Int64                // answers the replicas' service times learned from (Finish)

	join func(replica.Spec) (int, error) // New's: gives a joining replica its cache picture

	units units // engine tokens per estimated token, per model

	adapters atomic.Pointer[map[string]bool] // NoteAdapter's, copy-on-write under mu

	counting counting // how each event-driven replica's engine counts its hits

	sync Sync // SetSync's; nil: a router alone

	pic *Picture // the cache picture: every read and write of it goes through it

	reuses *reuses // each replica's Reuse, set as it joins (New's)
}

// newEngine returns an Engine over split, pic and pool.
func newEngine(o EngineOptions, split *blockhash.Splitter, pic *Picture, pool *replica.Pool) (*Engine, error) {
	if o.Weights == nil {
		o.Weights = DefaultWeights()
	}
	for k, w := range o.Weights {
		if w < 0 {
			return nil, errors.New("routing: kind weight for " + blockhash.Kind(k).String() + " is negative")
		}
	}
	o.Attempts = cmp.Or(max(o.Attempts, 0), DefaultAttempts)
	if o.Now == nil {
		o.Now = time.Now
	}
	o.MatcherThreshold = cmp.Or(o.MatcherThreshold, DefaultMatcherThreshold)
	o.HotUses = cmp.Or(o.HotUses, 8)
	o.HotShare = cmp.Or(o.HotShare, 1.5)
	return &Engine{o: o, split: split, pool: pool, pic: pic, reuses: new(reuses)}, nil
}

// Splitter returns the engine's splitter.
func (e *Engine) Splitter() *blockhash.Splitter { return e.split }

// Pool returns the engine's replica pool.
func (e *Engine) Pool() *replica.Pool { return e.pool }

// Now returns the engine's clock reading.
func (e *Engine) Now() time.Time { return e.o.Now() }

// HasMatcher reports whether the engine has a semantic matcher, which needs
// each request's text.
func (e *Engine) HasMatcher() bool { return e.o.Matcher != nil }

// Decision is the outcome of routing one request.
type Decision struct {
	Policy string // the policy's name
	Blocks []blockhash.Block
	Tokens int // estimated prompt tokens
	Key    uint64
	// Ranked holds the best Attempts candidates, best first; Ranked[0] is
	// the choice. Candidates holds every candidate scored, in no order.
	Ranked     []Candidate
	Candidates []Candidate
	waiting    int64 // the prefill tokens Wait counted on Ranked[0]
	priority   int   // the priority Wait counted it at
	// SyncID names the request to the engine's Sync (which sets it); 0
	// without one.
	SyncID uint64
	// Saturated is set when every candidate's replica was saturated when
	// the request was ranked (replica.Replica.Saturated): its engine will
	// queue it. Deferred: Request.Defer kept it from being recorded.
	Saturated, Deferred bool
	// served is the id of the replica now serving it, lease its time
	// there (set by Commit).
	served int
	lease  Lease

	pooled  bool              // Blocks came from the block pool
	learned []blockhash.Block // LearnReply's chain, from the block pool
	model   string            // Request.Model: the unit ObserveUsage learns is its
	scale   scales            // engine tokens per estimated token in Blocks (zero: 1)
	est     estimate          // Blocks' estimated tokens, before scale
	exact   bool              // Blocks count token ids, not estimates
	// precise: Blocks are the engine's own token blocks of blockTokens ids
	// (PrepareTokens), keyed as its KV events are.
	precise     bool
	blockTokens int
}

// Lease returns d's time on the replica serving it (Engine.Commit), whose
// steps the front end reports: FirstToken, EngineDone, End.
func (d *Decision) Lease() *Lease { return &d.lease }

// Precise reports whether d was decided on the engine's own tokens
// (PrepareTokens) rather than on an estimate.
func (d *Decision) Precise() bool { return d.precise }

// Chosen returns the winning candidate.
func (d *Decision) Chosen() *Candidate { return &d.Ranked[0] }

// SessionKey returns the key that keeps a session's ties on one replica: the
// session id if given, else the body's user, else the first block's hash.
func SessionKey(sessionID, user string, blocks []blockhash.Block) uint64 {
	switch {
	case sessionID != "":
		return xxhash.Sum64String(sessionID)
	case user != "":
		return xxhash.Sum64String(user)
	case len(blocks) > 0:
		return blocks[0].Hash
	}
	return 0
}

func rendezvous(key uint64, name string) uint64 {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], key)
	var d xxhash.Digest
	d.Reset()
	_, _ = d.Write(b[:])
	_, _ = d.WriteString(name)
	return d.Sum64()
}

// Request is the engine's input: a request as the engine routes it (see
// Prepare), where View is what a policy sees of it.
type Request struct {
	Blocks []blockhash.Block
	// Key is the session key (SessionKey).
	Key uint64
	// Text is the request's text, for the semantic matcher and prompt
	// logging; may be nil.
	Text [][]byte
	// Policy scores the candidates: the request's A/B arm's, or the
	// replay run's. Required by Decide.
	Policy Policy
	// Allow, if set, says which replicas may take the request (a gateway's
	// subset hint); the others are not candidates. Nil allows all.
	Allow func(*replica.Replica) bool
	// Home says the replicas Allow admits hold state the request needs (a
	// stored response it continues): one of them is used while draining
	// too, and none other while they are down.
	Home bool
	// Hold asks Decide, recording, not to record the decision when the
	// replica it ranks first is saturated (its engine would queue the
	// request) and would not serve it before the requests it queues (an
	// engine scheduling by priority serves a request above the default
	// priority first: it goes there): it comes back Held, unrecorded, for the caller to queue the
	// request in the router (package flow; see Wait and DispatchCost) and
	// decide it again once a slot is free for it. Drop the deferred decision;
	// the request's blocks stay with the request.
	Defer bool
	// Keep, if set with Hold, returns how many free slots of a replica
	// the request must leave for the traffic it gives way to (flow.Demand):
	// it is held too when the replica it ranks first has no more free
	// (replica.Replica.Free), and with Room such a replica counts as
	// saturated for it.
	Keep func(*replica.Replica) int64
	// Priority is the request's (higher first), what it waits behind on a
	// replica whose engine schedules by priority (replica.Replica.State).
	Priority int
	// Room makes candidates of only the replicas that are not saturated,
	// or of all as usual if none has room: a request the router's queue
	// held, whose turn came with a free slot.
	Room bool
	// Slot, if set, is a replica whose slot the router's queue kept for
	// this request (replica.Replica.Reserve): with Room, it is a candidate
	// with room though the kept slot makes it count as saturated.
	Slot *replica.Replica
	// OnDrain, if set, is called once the replica serving the decision no
	// longer runs the request: at its lease's drain (Lease.EngineDone, or
	// Lease.End without it; a failover's End too, for the replica it
	// leaves), exactly once per replica the decision was committed on,
	// with that replica, on the goroutine making the step, after its load
	// stopped counting the request's slot. The router's queue offers the
	// freed slot there. It must not block; set one func per front end, not
	// a closure per request (a Request is copied by value, and a closure
	// allocates).
	OnDrain func(*replica.Replica)
	// Model is the model the request names. A replica whose models are
	// known and do not include it is not a candidate; among those that
	// serve it as a LoRA adapter, the ones with it loaded rank first, then
	// the ones with room for it (replica.Models.AdapterRank). Empty: any.
	Model string
	// pooled says Blocks came from the engine's block pool (Prepare made
	// them), so Recycle may take them back.
	pooled bool
	// scale is the engine tokens per estimated token Prepare applied to
	// the blocks' Tokens (zero: 1); exact says the tokens were not
	// estimated (token ids), so the engine's count teaches nothing.
	scale scales
	est   estimate
	exact bool
	// Tail is the prompt's tokens in no block (PrepareTokens: the last
	// partial block), counted in the prompt's tokens.
	Tail int
	// blockTokens is the engine block size of a precise request (0: the
	// splitter's).
	blockTokens int
}

// Copy returns a request like r that may be routed beside it: its own
// block list, not the engine's pool's (a decision's end takes a pooled
// list back, and the other decision would read it after).
func (r Request) Copy() Request {
	c := r
	c.Blocks, c.pooled = slices.Clone(r.Blocks), false
	return c
}

// DetachText copies the request's text (kept for the matcher or prompt
// logging), so that it outlives the parsed body it aliases.
func (r *Request) DetachText() {
	for i, t := range r.Text {
		r.Text[i] = bytes.Clone(t)
	}
}

// Prepare splits req into the engine's Request, keyed by SessionKey. The
// text is kept when withText is set or a matcher needs it. Route it once:
// its block list is the engine's, and Recycle takes it back when the
// decision made from it ends.
func (e *Engine) Prepare(req *blockhash.Request, sessionID string, withText bool) Request {
	in := Request{Blocks: e.split.Split(newBlocks(e.split.Count(req)), req), pooled: true, Model: req.Model}
	if req.TokenIDsOnly() { // token ids are counted exactly already: nothing to scale, nothing to learn
		in.exact = true
	} else {
		in.scale = e.units.scales(req.Model)
		in.est = scaleTokens(in.Blocks, in.scale)
	}
	in.Key = SessionKey(sessionID, req.User, in.Blocks)
	in.Text = e.text(req, withText)
	return in
}

// PrepareTokens makes the engine's Request from a prompt's exact engine
// token ids (precise mode: ids from the engine's /tokenize), cut into
// the engine's cache blocks of blockTokens ids and keyed as its KV events
// are (blockhash.AppendTokenBlocks), under the LoRA adapter req.Model
// names if it is one the engines reported (NoteAdapter). req gives the
// kinds, the session key and the text; the ids are not kept.
func (e *Engine) PrepareTokens(req *blockhash.Request, ids []int32, blockTokens int, sessionID string, withText bool) Request {
	seed := blockhash.TokenSeed("")
	if e.isAdapter(req.Model) {
		seed = blockhash.TokenSeed(req.Model)
	}
	bl, tail := blockhash.AppendTokenBlocks(newBlocks(len(ids)/max(blockTokens, 1)), seed, ids, blockTokens, req)
	if e.pic.blending() { // a replica blends: its documents' blocks need keys of their own
		blockhash.SetTokenSegments(bl, len(ids), blockTokens, req)
	}
	in := Request{Blocks: bl, Tail: tail, pooled: true, exact: true, blockTokens: blockTokens, Model: req.Model}
	in.Key = SessionKey(sessionID, req.User, in.Blocks)
	in.Text = e.text(req, withText)
	return in
}

// text returns req's parts' text when it is to be kept (withText, or a
// matcher needs it), else nil.
func (e *Engine) text(req *blockhash.Request, withText bool) [][]byte {
	if (!withText && e.o.Matcher == nil) || len(req.Parts) == 0 {
		return nil
	}
	text := make([][]byte, len(req.Parts))
	for i := range req.Parts {
		text[i] = req.Parts[i].Text
	}
	return text
}

// NoteAdapter records that an engine serves LoRA adapter name (its KV
// events named it), so that requests for it are keyed as its blocks are.
// At most maxModels adapters are kept.
func (e *Engine) NoteAdapter(name string) {
	if name == "" || e.isAdapter(name) {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	old := e.adapters.Load()
	if old != nil && (len(*old) >= maxModels || (*old)[name]) {
		return
	}
	next := map[string]bool{name: true}
	if old != nil {
		maps.Copy(next, *old)
	}
	e.adapters.Store(&next)
}

func (e *Engine) isAdapter(name string) bool {
	m := e.adapters.Load()
	return m != nil && (*m)[name]
}

// estimate is a prompt's estimated tokens, of tool schemas and of the rest.
type estimate struct{ tools, other float64 }

// scaleTokens turns estimated tokens into engine tokens, at least 1 a
// block, and returns the estimate it scaled.
func scaleTokens(blocks []blockhash.Block, s scales) (est estimate) {
	for i := range blocks {
		b := &blocks[i]
		if b.Kind == blockhash.KindTools {
			est.tools += float64(b.Tokens)
		} else {
			est.other += float64(b.Tokens)
		}
		if f := s.of(b.Kind); f != 1 {
			b.Tokens = max(int32(math.Round(float64(b.Tokens)*f)), 1)
		}
	}
	return est
}

// ObserveUsage learns the engine's unit for model from a finished request:
// the engine of the replica serving d (Commit) reported prompt tokens for
// the prompt d was decided on.
func (e *Engine) ObserveUsage(model string, d *Decision, promptTokens int) {
	if d.exact {
		return
	}
	e.units.observe(model, d.served, d.est.tools, d.est.other, promptTokens)
}

// TokenScale returns the engine tokens per estimated token learned for
// model (1 until the engine has reported usage for it).
func (e *Engine) TokenScale(model string) float64 { return e.units.scale(model) }

// Decide scores every available replica for a request and ranks
// them. When record is true it also caches the blocks on the choice (so a
// burst of identical prompts goes to one place), tells an Observer policy
// and the matcher, and counts the request's work against the replica (its
// lease, Decision.Lease); the caller must then end it when the request
// ends (Finish, or the lease's End).
func (e *Engine) Decide(ri Request, record bool) (*Decision, error) {
	pol := ri.Policy
	if pol == nil {
		return nil, errors.New("routing: Request.Policy is required")
	}
	d := &Decision{Blocks: ri.Blocks, Key: ri.Key, Policy: pol.Name(), pooled: ri.pooled, scale: ri.scale, est: ri.est, exact: ri.exact,
		precise: ri.blockTokens > 0, blockTokens: ri.blockTokens, Tokens: ri.Tail, model: ri.Model}
	d.lease.onDrain = ri.OnDrain // kept across the lease's commits
	for _, b := range ri.Blocks {
		d.Tokens += int(b.Tokens)
	}
	var sketch []uint64 // the text's, made once for the matcher's every use
	if e.o.Matcher != nil && ri.Text != nil {
		sketch = e.o.Matcher.Sketch(ri.Model, ri.Text)
	}
	in, err := e.rank(d, pol, &ri, sketch)
	if err != nil {
		return nil, err
	}
	if e.o.PreferDonor {
		e.preferDonor(d, sketch)
	}
	if record && ri.Defer && full(d.Chosen().Replica, ri.Keep) && !jumps(d.Chosen().Replica, ri.Priority) {
		d.Deferred = true
		return d, nil
	}
	if record {
		if o, ok := pol.(Observer); ok {
			o.Chosen(in, d.Chosen())
		}
		e.Commit(d, d.Chosen())
		if sketch != nil && len(d.Blocks) > 0 {
			e.o.Matcher.Register(d.Blocks[len(d.Blocks)-1].Hash, d.Chosen().Replica.ID, d.Tokens, sketch)
		}
	}
	return d, nil
}

// preferDonor moves the replica of a donor at least PreferSimilarity
// similar to the text sketch summarises to the front when the exact match
// is short.
func (e *Engine) preferDonor(d *Decision, sketch []uint64) {
	if sketch == nil || d.Tokens == 0 {
		return
	}
	best := 0
	for i := range d.Candidates {
		best = max(best, d.Candidates[i].Match.Tokens)
	}
	if float64(best) >= e.o.MatcherThreshold*float64(d.Tokens) {
		return
	}
	id, bestSim := -1, -1.0
	e.o.Matcher.Donors(sketch, func(r int, _ uint64, _ int, sim float64) {
		if sim > bestSim && sim >= e.o.PreferSimilarity {
			id, bestSim = r, sim
		}
	})
	if id < 0 {
		return
	}
	for i := range d.Candidates {
		c := d.Candidates[i]
		if c.Replica.ID != id || c.Reason == reasonSpill || c.Reason == reasonNoRoom { // not moved to the front
			continue
		}
		c.Reason = "donor"
		ranked := []Candidate{c}
		for _, r := range d.Ranked {
			if r.Replica.ID != id {
				ranked = append(ranked, r)
			}
		}
		d.Ranked = ranked[:min(len(ranked), e.o.Attempts)]
		return
	}
}

func (e *Engine) view(d *Decision) *View {
	in := &View{Blocks: d.Blocks, Tokens: d.Tokens, Key: d.Key, BlockTokens: cmp.Or(d.blockTokens, e.split.BlockTokens())}
	for _, b := range d.Blocks {
		in.Weighted += e.o.Weights[b.Kind] * float64(b.Tokens)
	}
	in.AvgPrefill = math.Float64frombits(e.avgPrefill.Load())
	if e.o.HotUses > 0 && len(d.Candidates) > 0 {
		in.Hot = e.pic.hot(d.Blocks, e.o.Weights, e.o.HotUses, e.o.HotShare/float64(len(d.Candidates)), e.o.Now().UnixNano())
		// A key taken from a hot first block is every request's that shares
		// it: the first block past the hot prefix tells them apart (a
		// conversation's turns still share it), so that ties spread them.
		if h := in.Hot.Blocks; h > 0 && h < len(d.Blocks) && d.Key == d.Blocks[0].Hash {
			d.Key = d.Blocks[h].Hash
			in.Key = d.Key
		}
	}
	return in
}

// rank scores the available replicas that allow admits (all, if nil) with
// pol and keeps the best Attempts;
// it returns what the policy was told. sketch is the matcher's of the
// request's text (nil: none), for the donors of replicas whose engines
// reuse them. Its steps: the picture's lookups (lookup), the replicas the
// request may use (gather: model and adapter, availability, panic mode),
// each one's credit (credit; creditDonors), then the policy's score and
// the rank.
func (e *Engine) rank(d *Decision, pol Policy, ri *Request, sketch []uint64) (*View, error) {
	model := ri.Model
	sc, _ := scratchPool.Get().(*scratch)
	if sc == nil {
		sc = &scratch{}
	}
	defer scratchPool.Put(sc)
	e.pic.lookup(d.Blocks, e.o.Weights, sc)
	now := e.o.Now()
	g := gathering{e: e, d: d, sc: sc, reps: e.pool.Replicas(), now: now, nowNs: now.UnixNano(), allow: ri.Allow, home: ri.Home, onlyRoom: ri.Room, slot: ri.Slot, keep: ri.Keep, model: model, priority: ri.Priority,
		adapter: model != "" && e.isAdapter(model), reuses: e.reuses.load()}
	d.Candidates = newCandidates(len(g.reps))
	g.all()
	d.Candidates = d.Candidates[:g.n]
	d.Saturated = g.n > 0 && !g.room
	if g.reuses.donors && sketch != nil {
		e.creditDonorsOf(d, sketch, sc)
	}
	if len(d.Candidates) == 0 {
		if model != "" && len(g.reps) > 0 && !g.unknown && !g.served { // every replica's models known, none serves it
			return nil, &UnknownModelError{Model: model}
		}
		return nil, ErrNoReplica
	}
	in := e.view(d)
	in.budgets, in.e = sc.budgets, e
	pol.Score(in, d.Candidates)
	in.budgets, in.e = nil, nil // sc's: it goes back to the pool when rank returns (an Observer's Chosen sees no budgets)
	d.Ranked = rank(d.Candidates, d.Key, e.o.Attempts)
	return in, nil
}

// gathering is one rank's pass over the pool: what it fills in, and what
// it learns of the pool on the way (is the model served at all, are some
// replicas' models unknown, is there a donor engine).
type gathering struct {
	e               *Engine
	d               *Decision
	sc              *scratch
	reps            []*replica.Replica
	now             time.Time
	nowNs           int64 // now, in Unix nanoseconds
	allow           func(*replica.Replica) bool
	model           string
	adapter         bool // the model is a LoRA adapter somewhere: its replicas are ranked
	n               int  // candidates filled
	unknown, served bool
	onlyRoom        bool                         // Request.Room: only replicas that are not saturated
	home            bool                         // Request.Home: a draining replica allowed is used
	slot            *replica.Replica             // Request.Slot: one with room kept for the request
	keep            func(*replica.Replica) int64 // Request.Keep
	room            bool                         // some candidate's replica is not saturated
	reuses          *reuseSet                    // the replicas' Reuse, one snapshot for the decision
	priority        int                          // Request.Priority
}

// all fills d.Candidates. Passive ejection is a guess from failures that
// may have been the requests' own: when it has taken out every replica the
// request could use, gather runs again panicking, and those take it (as
// Envoy's panic mode) rather than the router refusing every request until
// a cool-down ends. Active health checks and draining still rule. A
// request asking for room (Request.Room) where no replica has any is
// gathered again as any other.
func (g *gathering) all() {
	if ejected := g.gather(false); g.n == 0 && ejected {
		g.gather(true)
	}
	if g.n == 0 && g.onlyRoom {
		g.onlyRoom = false
		g.all()
	}
}

// gather fills d.Candidates from the replicas the request may use and
// reports whether some were left out only for soft failures
// (replica.Replica.Usable); panicking, those are used too.
func (g *gathering) gather(panicking bool) (ejected bool) {
	for _, r := range g.reps {
		rank, ok := g.models(r)
		full := full(r, g.keep) && r != g.slot
		if !ok || (g.allow != nil && !g.allow(r)) || (g.onlyRoom && full) {
			continue
		}
		if !r.Available(g.now) && !(g.home && r.Up(g.now)) {
			usable := r.Usable(g.now)
			ejected = ejected || usable
			if !panicking || !usable {
				continue
			}
		}
		g.add(r, rank)
		g.room = g.room || !full
	}
	return ejected
}

// add fills the next candidate with replica r, of adapter rank rank: its
// load, the state the request would meet there, and its credit.
func (g *gathering) add(r *replica.Replica, rank int8) {
	c := &g.d.Candidates[g.n] // filled in place: a candidate is ~120 bytes
	g.n++
	c.Replica, c.adapter = r, rank
	r.LoadInto(&c.Load, g.nowNs)
	c.State = r.State(int64(g.d.Tokens), g.priority)
	if r == g.slot && c.State.Queued > 0 { // the slot kept for it is its own
		c.State.Queued--
	}
	g.e.credit(c, g.sc, g.reuses)
}

// jumps reports whether a request of priority goes before the requests
// waiting in r's engine: r schedules by priority (replica.Scheduling) and
// the request's is above the default's. It is sent there rather than held
// in the router's queue: the engine serves it at its next slot.
func jumps(r *replica.Replica, priority int) bool {
	return r.Scheduling.Prioritized() && priority > 0
}

// full reports whether replica r is saturated, or has no more free
// slots than keep (Request.Keep) says a request must leave there.
func full(r *replica.Replica, keep func(*replica.Replica) int64) bool {
	if r.Saturated() {
		return true
	}
	if keep == nil {
		return false
	}
	free, known := r.Free()
	return known && free <= keep(r)
}

// models reports whether replica r may serve the request's model and, for
// an adapter, its rank (replica.Models.AdapterRank; 2 where r's models are
// not known yet, after those known to serve it).
func (g *gathering) models(r *replica.Replica) (rank int8, ok bool) {
	if g.model == "" {
		return 0, true // no model: no lookup
	}
	m := r.Models()
	if m == nil {
		g.unknown = true
		if g.adapter {
			return 2, true
		}
		return 0, true
	}
	if !m.Serves(g.model) {
		return 0, false
	}
	g.served = true
	if g.adapter {
		return m.AdapterRank(g.model), true
	}
	return 0, true
}

// credit sets candidate c's match, cache size, reuse past the match and
// predicted cached tokens from the lookup in sc.
func (e *Engine) credit(c *Candidate, sc *scratch, rs *reuseSet) {
	id := c.Replica.ID
	if id < len(sc.matches) {
		c.Match, c.CacheTokens = sc.matches[id], sc.sizes[id]
	}
	if rs.credits {
		c.Reuse = rs.of(id).credit(c, sc)
	}
	c.predicted = c.Match.Confirmed
	if c.Match.Past > 0 || c.Match.Tokens > c.Match.Confirmed { // the readings differ: one lock
		rd := e.counting.read(id)
		c.predicted = rd.predict(c.Match)
		c.Reuse += rd.past * float64(c.Match.Past) // the engine reuses what it counts
	}
	c.learned = true
}

// creditDonorsOf indexes d's candidates by replica ID in sc and credits
// their donors (creditDonors).
func (e *Engine) creditDonorsOf(d *Decision, sketch []uint64, sc *scratch) {
	sc.at = sc.at[:0]
	for i := range d.Candidates {
		id := d.Candidates[i].Replica.ID
		for len(sc.at) <= id {
			sc.at = append(sc.at, 0)
		}
		sc.at[id] = int32(i + 1)
	}
	e.creditDonors(d, sketch, sc.at)
}

// creditDonors credits each candidate whose engine reuses donors with its
// most similar donor, if the engine would take it (Reuse.donor).
// at[id] is the candidate index + 1 of the replica with that ID (0: not
// a candidate), so that a donor costs one lookup however many replicas.
func (e *Engine) creditDonors(d *Decision, sketch []uint64, at []int32) {
	e.o.Matcher.Donors(sketch, func(r int, _ uint64, tokens int, sim float64) {
		if r < 0 || r >= len(at) || at[r] == 0 {
			return
		}
		c := &d.Candidates[at[r]-1]
		if credit, ok := e.reuses.of(r).donor(c, d.Tokens, tokens, sim); ok {
			c.Reuse = credit
		}
	})
}

// scratch is a decision's per-replica working memory, reused across
// decisions.
type scratch struct {
	matches []cachemodel.Match
	sizes   []int64
	budgets []int64
	beyond  []float64
	at      []int32 // creditDonors' candidate by replica ID
}

var scratchPool sync.Pool // *scratch

// slicePool lends slices and takes them back without allocating in a
// steady state: a slice travels in a *[]T box, and an emptied box waits in
// a second pool for the next slice given back (putting &s for each slice
// would allocate the box every time). Safe for concurrent use.
type slicePool[T any] struct{ full, empty sync.Pool }

func (p *slicePool[T]) get() ([]T, bool) {
	b, ok := p.full.Get().(*[]T)
	if !ok {
		return nil, false
	}
	s := *b
	*b = nil
	p.empty.Put(b)
	return s, true
}

func (p *slicePool[T]) put(s []T) {
	b, _ := p.empty.Get().(*[]T)
	if b == nil {
		b = new([]T)
	}
	*b = s
	p.full.Put(b)
}

// candidatePool holds candidate lists given back by Recycle.
var candidatePool slicePool[Candidate]

// newCandidates returns a zeroed candidate list of length n, reusing a
// recycled one when it is long enough.
func newCandidates(n int) []Candidate {
	if c, ok := candidatePool.get(); ok && cap(c) >= n {
		return c[:n] // Recycle zeroed it
	}
	return make([]Candidate, n)
}

// blockPool holds block lists given back by Recycle.
var blockPool slicePool[blockhash.Block]

// newBlocks returns an empty block list with room for n blocks, reusing a
// recycled one when it is large enough.
func newBlocks(n int) []blockhash.Block {
	if b, ok := blockPool.get(); ok && cap(b) >= n {
		return b[:0]
	}
	return make([]blockhash.Block, 0, n)
}

func putBlocks(b []blockhash.Block) {
	if cap(b) > 0 {
		blockPool.put(b)
	}
}

// Uncached returns the prompt tokens d's request would compute on replica
// id, as d saw it (its candidate's match and reuse; the whole prompt where
// id was no candidate): the unit of routing's cost, and of the router's
// queue's choice when id frees.
func (d *Decision) Uncached(id int) float64 {
	c := d.candidate(id)
	if c == nil {
		return float64(d.Tokens)
	}
	return d.uncached(c, c.Match.Tokens)
}

// uncached returns the prompt tokens d's request would compute with
// matched tokens of its prefix cached, less what c's engine reuses beyond
// it (c may be nil: nothing).
func (d *Decision) uncached(c *Candidate, matched int) float64 {
	u := float64(d.Tokens - matched)
	if c != nil {
		u -= c.Reuse
	}
	return u
}

// candidate returns d's candidate on replica id, or nil.
func (d *Decision) candidate(id int) *Candidate {
	for i := range d.Candidates {
		if c := &d.Candidates[i]; c.Replica.ID == id {
			return c
		}
	}
	return nil
}

// Drop gives back a deferred decision's candidate list (Request.Defer): its
// blocks stay with the request, which is decided again.
func (e *Engine) Drop(d *Decision) {
	if d == nil {
		return
	}
	d.pooled = false
	e.Recycle(d)
}

// Recycle gives d's candidate list, and the block lists Prepare and
// LearnReply made for it, back for reuse by later decisions. Call it once
// nothing reads d.Candidates, d.Blocks or learned blocks any more (after
// Finish, and whatever reads what it returned); d.Ranked and d.Chosen stay
// valid, d.Blocks becomes nil. Calling it is optional; calling it twice is
// harmless.
func (e *Engine) Recycle(d *Decision) {
	if d == nil {
		return
	}
	if d.Candidates != nil {
		c := d.Candidates[:cap(d.Candidates)]
		clear(c)
		d.Candidates = nil
		candidatePool.put(c)
	}
	if d.pooled {
		putBlocks(d.Blocks)
		d.Blocks, d.pooled = nil, false
	}
	putBlocks(d.learned)
	d.learned = nil
}

// LearnReply caches the assistant's reply, chained after the request's
// blocks, on replica r: it is the prefix of the conversation's next turn. It
// returns the reply's blocks, valid until Recycle(d).
//
// A precise decision learns nothing: the reply's tokens as the next turn's
// template renders them are not the ids generated, and an engine with KV
// events reports what it cached itself.
func (e *Engine) LearnReply(d *Decision, r *replica.Replica, reply []byte) []blockhash.Block {
	if len(d.Blocks) == 0 || d.precise {
		return nil
	}
	p := blockhash.Part{Role: blockhash.RoleAssistant, Base: blockhash.KindAssistantHistory, Text: reply}
	n := len(d.Blocks)
	putBlocks(d.learned)
	all := append(newBlocks(n+e.split.CountPart(&p)), d.Blocks...)
	all = e.split.AppendPart(all, d.Blocks[n-1].Hash, &p)
	scaleTokens(all[n:], d.scale)
	d.learned = all
	// The prompt's blocks were recorded when the request was routed: the
	// reply extends them without counting the request a second time (which
	// made a prefix hot after half the uses it needs).
	e.pic.Replied(r.ID, all, n, e.o.Now())
	if e.sync != nil {
		e.sync.Learned(d, r, all, n)
	}
	return all[n:]
}

// Feedback corrects the picture of a replica that reports no KV events
// from what its engine said of d's prompt: cached is the prompt tokens it
// found cached (usage.prompt_tokens_details.cached_tokens), against the
// Match.Tokens the picture predicted on c, the candidate that served d.
//
// Fewer than predicted, by a block or more: the engine lost blocks the
// picture still holds, so its simulated eviction lags the engine's. The
// replica's oldest blocks are evicted from the picture to the amount of the
// difference, and its budget shrinks by an eighth of it. More than
// predicted: the engine keeps more than the picture does, so the budget
// grows by an eighth of the difference. The budget stays within a
// quarter and four times what it was before any feedback. The request's
// own blocks are not trimmed: the engine has just computed and cached
// them. Event-driven replicas are left alone: their events are the truth.
// It returns the tokens evicted.
func (e *Engine) Feedback(d *Decision, c *Candidate, cached int) int64 {
	id := c.Replica.ID
	if cached < 0 {
		return 0
	}
	if e.pic.EventDriven(id) {
		e.counting.observe(id, c.Match, cached, cmp.Or(d.blockTokens, e.split.BlockTokens()))
		return 0
	}
	predicted, onlyFewer := e.reuses.of(id).predicted(c)
	diff := predicted - int64(cached)
	if onlyFewer && diff < 0 {
		return 0
	}
	block := int64(cmp.Or(d.blockTokens, e.split.BlockTokens()))
	if diff > -block && diff < block {
		return 0
	}
	return e.pic.correct(id, diff)
}

func (e *Engine) forgetFeedback(id int) {
	e.counting.forget(id)
}
