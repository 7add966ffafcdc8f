package kvsync

import (
	"cmp"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/semroute/semroute/kvevents"
)

// DefaultSilence is how long a replica's events may be silent, while
// blocks routed to it go unconfirmed, before its picture falls back to
// the approximate one.
const DefaultSilence = 10 * time.Second

// Options configure a Follower. Model, Endpoint and BlockSize are
// required.
type Options struct {
	Model Picture
	// ID and Name are the replica's in the picture and in logs.
	ID   int
	Name string
	// Endpoint, ReplayEndpoint and Topic are the engine's KV events
	// sockets (kvevents.SubscriberOptions); Listener, instead of Endpoint,
	// is a bound socket the engine dials.
	Endpoint, ReplayEndpoint, Topic string
	Listener                        *kvevents.Listener
	// Rank, when ≥ 0, follows only that data-parallel rank's batches
	// (Applier.FollowRank); the zero Options follow rank 0's and those
	// without a rank. Use -1 for every rank.
	Rank int
	// BlockSize is the engine's block size in tokens, the router's precise
	// block size.
	BlockSize int
	// MaxBlocks bounds the blocks tracked (DefaultMaxBlocks).
	MaxBlocks int
	// Silence: see DefaultSilence.
	Silence time.Duration
	// OnLoRA hears every adapter named by the events (Engine.NoteAdapter).
	OnLoRA func(string)
	// Limits bound the batches read (kvevents.Limits; the zero Limits are
	// the defaults). A batch past them is skipped and counted in
	// Stats.Subscriber.OverLimit; the picture goes on without it.
	Limits kvevents.Limits
	// Now is the picture's clock. Nil means time.Now.
	Now    func() time.Time
	Logger *slog.Logger
}

// Stats describe a Follower.
type Stats struct {
	Counts
	Subscriber kvevents.Stats
	// Tracked is the engine blocks known now.
	Tracked int
	// Live is false while the replica's picture is the approximate one
	// (its events went silent, or none came yet).
	Live bool
	// Fallbacks counts the times the events went silent.
	Fallbacks uint64
	// Restarts counts the engine restarts seen elsewhere (EngineRestarted),
	// and Kept those of them the events had already shown: the picture
	// rebuilt from the new engine's events was kept.
	Restarts, Kept uint64
}

// Follower follows one replica's KV events into the picture: it applies
// every batch, clears the picture when the events stop describing the
// engine (a restart, a gap its replay could not fill), and falls back to
// the approximate picture for the replica while they are silent. Stats and
// Close are safe for concurrent use.
//
// An engine restart is cleared once, whether the events show it first or
// its metrics do (EngineRestarted): each clear starts the engine's new
// generation, and the events applied after it are kept.
type Follower struct {
	o   Options
	ap  *Applier // under apMu: batches, and resets from the subscriber or EngineRestarted
	sub *kvevents.Subscriber

	apMu sync.Mutex
	// applied is whether a batch was applied since the picture was last
	// cleared, under apMu: a reset with none is nothing to clear.
	applied bool
	// shown is when the events last cleared the picture (a reset, an
	// AllBlocksCleared): unix ns of the wall clock, 0 before any.
	shown atomic.Int64
	// restarts and kept: Stats.Restarts and Stats.Kept.
	restarts, kept atomic.Uint64

	mu        sync.Mutex // serialises the picture's mode changes
	live      atomic.Bool
	distrust  atomic.Bool // Trust(false): batches still apply, the picture stays approximate
	fallbacks atomic.Uint64
	tracked   atomic.Int64
	expiredAt atomic.Int64 // the replica's PendingExpired at the last batch

	stop  chan struct{}
	done  chan struct{}
	close sync.Once
	err   error
}

// Follow starts following. The replica's picture becomes event-driven at
// the first batch.
func Follow(o Options) (*Follower, error) {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	o.Silence = cmp.Or(o.Silence, DefaultSilence)
	f := &Follower{o: o, ap: NewApplier(o.Model, o.ID, o.BlockSize, o.MaxBlocks, o.OnLoRA), stop: make(chan struct{}), done: make(chan struct{})}
	f.ap.FollowRank(o.Rank)
	sub, err := kvevents.NewSubscriber(kvevents.SubscriberOptions{
		Endpoint: o.Endpoint, Listener: o.Listener, ReplayEndpoint: o.ReplayEndpoint, Topic: o.Topic,
		OnBatch: f.batch, OnReset: f.reset, Limits: o.Limits, Logger: o.Logger.With("replica", o.Name),
	})
	if err != nil {
		return nil, err
	}
	f.sub = sub
	go f.watch()
	return f, nil
}

func (f *Follower) batch(_ uint64, b kvevents.Batch) {
	if !f.live.Load() && !f.distrust.Load() { // the lock only on the way back to live
		f.mu.Lock()
		if !f.live.Load() && !f.distrust.Load() {
			f.o.Model.SetEventDriven(f.o.ID, true)
			f.live.Store(true)
			f.o.Logger.Info("KV events live: the replica's cache picture follows its engine", "replica", f.o.Name)
		}
		f.mu.Unlock()
	}
	f.apMu.Lock()
	cleared := f.ap.cleared.Load()
	f.ap.Apply(&b, f.o.Now().UnixNano())
	if f.ap.cleared.Load() != cleared { // an AllBlocksCleared, or past MaxBlocks
		f.shown.Store(time.Now().UnixNano())
	}
	f.applied = true
	f.tracked.Store(int64(f.ap.Tracked()))
	f.apMu.Unlock()
	if st, ok := f.o.Model.Stats(f.o.ID); ok {
		f.expiredAt.Store(st.PendingExpired)
	}
}

// reset is the subscriber's: the events no longer describe the engine (it
// restarted, or a gap could not be filled). With no batch applied since
// the picture was last cleared (a restart its metrics showed first), there
// is nothing to clear.
func (f *Follower) reset(reason string) {
	f.apMu.Lock()
	defer f.apMu.Unlock()
	f.shown.Store(time.Now().UnixNano())
	if !f.applied {
		f.o.Logger.Info("KV events: the replica's cache picture was already cleared", "replica", f.o.Name, "reason", reason)
		return
	}
	f.clear()
	f.o.Logger.Warn("KV events: the replica's cache picture was cleared", "replica", f.o.Name, "reason", reason)
}

// clear forgets the replica's picture; under apMu.
func (f *Follower) clear() {
	f.ap.Reset()
	f.applied = false
	f.tracked.Store(0)
}

// EngineRestarted is a restart of the engine seen elsewhere (in its
// metrics: the monitor), which happened after since. If the events
// cleared the picture after since, they showed this restart already: the
// picture rebuilt since from the new engine's events is kept. Otherwise
// the picture is cleared, and the engine's next batch starts its new
// sequence (from what its replay buffer holds before it, a restarted
// engine's first events may have been lost before its publisher
// connected), so that the events' own sight of the same restart does not
// clear it again. It reports whether it cleared. Safe for concurrent use.
func (f *Follower) EngineRestarted(since time.Time, reason string) bool {
	f.restarts.Add(1)
	f.apMu.Lock()
	defer f.apMu.Unlock()
	if f.shown.Load() > since.UnixNano() {
		f.kept.Add(1)
		f.o.Logger.Info("KV events: the engine restart was already seen in its events; the picture rebuilt from them is kept",
			"replica", f.o.Name, "reason", reason)
		return false
	}
	f.sub.Resync()
	f.clear()
	f.o.Logger.Warn("KV events: the replica's cache picture was cleared", "replica", f.o.Name, "reason", reason)
	return true
}

// watch expires pending blocks and falls back to the approximate picture
// when the events are silent while routed blocks go unconfirmed (an idle
// engine is silent too, and stays live).
func (f *Follower) watch() {
	defer close(f.done)
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-f.stop:
			return
		case <-t.C:
		}
		f.o.Model.ExpirePending(f.o.Now().UnixNano())
		if !f.live.Load() || !f.sub.Silent(f.o.Silence) {
			continue
		}
		st, ok := f.o.Model.Stats(f.o.ID)
		if !ok || st.PendingExpired <= f.expiredAt.Load() {
			continue
		}
		f.mu.Lock()
		if f.live.Load() && f.sub.Silent(f.o.Silence) {
			f.o.Model.SetEventDriven(f.o.ID, false)
			f.live.Store(false)
			f.fallbacks.Add(1)
			f.o.Logger.Warn("KV events silent while routed blocks went unconfirmed: the replica's cache picture falls back to the approximate one",
				"replica", f.o.Name, "silent_for", f.o.Silence)
		}
		f.mu.Unlock()
	}
}

// Trust says whether the events describe the engine well enough to be the
// replica's picture (the router judges it from what the engine reports:
// package agreement). Untrusted, batches still apply, so that their
// agreement can be judged again, but the picture is the approximate one:
// routed blocks count as cached without waiting for the events.
func (f *Follower) Trust(on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.distrust.Store(!on)
	if !on && f.live.Load() {
		f.o.Model.SetEventDriven(f.o.ID, false)
		f.live.Store(false)
	}
}

// Name is the replica's name (Options.Name).
func (f *Follower) Name() string { return f.o.Name }

// Stats returns the Follower's counters.
func (f *Follower) Stats() Stats {
	return Stats{Counts: f.ap.Counts(), Subscriber: f.sub.Stats(), Tracked: int(f.tracked.Load()), Live: f.live.Load(), Fallbacks: f.fallbacks.Load(),
		Restarts: f.restarts.Load(), Kept: f.kept.Load()}
}

// Close stops following; the replica's picture becomes approximate.
func (f *Follower) Close() error {
	f.close.Do(func() {
		close(f.stop)
		<-f.done
		f.err = f.sub.Close()
		f.o.Model.SetEventDriven(f.o.ID, false)
	})
	return f.err
}
