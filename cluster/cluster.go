// Package cluster shares one router's picture with the other routers of a
// fleet over NATS, so that every router routes as if it saw all of the
// fleet's traffic.
//
// Each router publishes what changes its picture and load (routing.Sync:
// decisions committed, prefills finished, requests ended, replies
// learned, replicas ejected) as records, batched into one NATS message
// every FlushInterval on <prefix>.records, and applies what its peers
// publish to its own picture and replica load, as if it had made the
// decisions itself. Nothing depends on synchronised clocks: a record is
// applied at the receiver's time, and order is the sender's sequence.
//
// Warm start comes from a peer: a router that starts or reconnects asks
// the first peer it hears from (on <prefix>.snapshot.<id>) for its
// picture, and the peer streams back the blocks it holds on each replica;
// the router applies them, then the records that arrived meanwhile,
// before it says it is Ready. A router that hears a peer (re)connect
// loads that peer's picture too, so that what either learned while apart
// reaches the other. A peer
// holds the current picture in memory already, so nothing has to be
// written to NATS continually for a newcomer to find it, and NATS needs
// no JetStream: a plain NATS server (or cluster) is enough.
//
// Faults: with NATS down a router routes on its own picture (Connected
// reports false; records are dropped and counted, not buffered, since
// they would be stale on arrival) and resyncs from a peer when NATS
// returns. A peer silent for PeerTimeout is gone: its requests in flight
// stop counting as load. A gap in a peer's sequence (records lost) makes
// the router forget that peer's requests in flight rather than count
// work that may have ended.
package cluster

import (
	"cmp"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// Options configure a Fleet. Zero fields take the defaults.
type Options struct {
	// URLs are the NATS servers to connect to (nats://host:4222); at least
	// one.
	URLs []string
	// ID names this router to its peers; default the host name and a
	// random suffix. Two routers must not share one.
	ID string
	// Prefix starts every subject; default "semroute". Fleets sharing a
	// NATS server keep apart by prefix.
	Prefix string
	// Credentials file (NATS JWT and nkey seed), NkeySeed (a file holding
	// an nkey's seed), User and Password, Token, or a client certificate
	// in TLS: the fleet's subjects steer every router of it, so one of
	// them is required unless Insecure is set.
	Credentials, NkeySeed string
	TLS                   *tls.Config
	User, Password, Token string
	// Insecure lets a router join a NATS server without authenticating.
	// Any client that reaches that server can then steer or stop the
	// fleet's routing: the router says so at start and every
	// InsecureReminder (default 5 minutes). For tests and the demo's
	// loopback server only.
	Insecure         bool
	InsecureReminder time.Duration
	// Ejection is this router's passive-ejection tuning: a peer's ejection
	// of a replica is evidence, applied as a soft ejection (one the
	// all-ejected fallback may use) no longer than Ejection.Base.
	Ejection replica.Ejection
	// MaxPeers bounds the peers tracked at once: batches from further
	// senders are refused (counted) until one times out. Default 64.
	MaxPeers int
	// PrefillTTL is the longest a peer's request counts as prefill work
	// before its prefill is taken as done; FlightTTL the longest it counts
	// as in flight at all. They bound what a record a peer never ends can
	// weigh. Defaults 30s and 5 minutes.
	PrefillTTL, FlightTTL time.Duration
	// FlushInterval is how long a record may wait to be batched. Default
	// 2ms.
	FlushInterval time.Duration
	// MaxBatchBytes flushes a batch early once this large. Default 64 KiB.
	MaxBatchBytes int
	// BufferBytes bounds the records waiting to be published: past it a
	// record is dropped (counted). Default 4 MiB.
	BufferBytes int
	// Heartbeat is how often a router that has published nothing says it
	// is alive. Default 1s. PeerTimeout is the silence after which a peer
	// is gone. Default 5s.
	Heartbeat, PeerTimeout time.Duration
	// SnapshotTimeout bounds a warm start's load of a peer's snapshot,
	// from the ask to the last chunk: past it the router routes on what it
	// has. Default 10s.
	SnapshotTimeout time.Duration
	// ConnectTimeout bounds the first connection; a router that cannot
	// reach NATS starts alone and keeps trying. Default 2s.
	ConnectTimeout time.Duration
	Logger         *slog.Logger
	// Now is the clock. Nil means time.Now.
	Now func() time.Time
}

func (o *Options) defaults() error {
	if len(o.URLs) == 0 {
		return errors.New("cluster: no NATS url")
	}
	if o.ID == "" {
		o.ID = fmt.Sprintf("router-%08x", rand.Uint32())
	}
	if strings.ContainsAny(o.Prefix, " *>\t") {
		return fmt.Errorf("cluster: prefix %q has a space or a wildcard", o.Prefix)
	}
	o.Prefix = cmp.Or(strings.TrimSuffix(o.Prefix, "."), "semroute")
	o.FlushInterval = cmp.Or(max(o.FlushInterval, 0), 2*time.Millisecond)
	o.MaxBatchBytes = cmp.Or(max(o.MaxBatchBytes, 0), 64<<10)
	o.BufferBytes = cmp.Or(max(o.BufferBytes, 0), 4<<20)
	o.Heartbeat = cmp.Or(max(o.Heartbeat, 0), time.Second)
	o.PeerTimeout = cmp.Or(max(o.PeerTimeout, 0), 5*time.Second)
	o.SnapshotTimeout = cmp.Or(max(o.SnapshotTimeout, 0), 10*time.Second)
	o.ConnectTimeout = cmp.Or(max(o.ConnectTimeout, 0), 2*time.Second)
	o.InsecureReminder = cmp.Or(max(o.InsecureReminder, 0), 5*time.Minute)
	o.Ejection = o.Ejection.WithDefaults()
	o.MaxPeers = cmp.Or(max(o.MaxPeers, 0), 64)
	o.PrefillTTL = cmp.Or(max(o.PrefillTTL, 0), 30*time.Second)
	o.FlightTTL = cmp.Or(max(o.FlightTTL, 0), 5*time.Minute)
	if !o.authenticated() && !o.Insecure {
		return errors.New("cluster: no NATS credentials: any client reaching the server could steer or stop the fleet's routing; " +
			"set credentials, nkey_seed, user and password, token or a client certificate (cert_file), or insecure: true to run without")
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return nil
}

// authenticated reports whether o names a way to authenticate to NATS.
func (o *Options) authenticated() bool {
	return o.Credentials != "" || o.NkeySeed != "" || o.User != "" || o.Token != "" ||
		(o.TLS != nil && (len(o.TLS.Certificates) > 0 || o.TLS.GetClientCertificate != nil))
}

// Stats are a fleet member's counters since it started.
type Stats struct {
	Published, Applied int64 // records
	// Dropped records, by reason: the publish buffer was full, or NATS
	// was unreachable.
	DroppedFull, DroppedDown int64
	Batches, Bytes           int64 // published
	// Malformed batches, Gaps in peers' sequences, Unresolved chains (a
	// peer named a prefix this picture does not know).
	Malformed, Gaps, Unresolved int64
	// Refused batches from senders past Options.MaxPeers; Clamped records
	// whose work or cool-down went past what this router allows; Stale
	// peers' requests forgotten after Options.FlightTTL.
	Refused, Clamped, Stale int64
	// IgnoredHomes are older routers' records of where a Responses API
	// response is stored: not taken (a response's id proves its home).
	IgnoredHomes int64
	// ChainsShared, ChainsReceived and ChainsDropped count records of
	// stored responses' conversations (chains.go).
	ChainsShared, ChainsReceived, ChainsDropped int64
	// Snapshots served and loaded; SnapshotBlocks applied from them.
	SnapshotsServed, SnapshotsLoaded, SnapshotBlocks int64
	Peers                                            int   // seen within PeerTimeout
	Connected                                        bool  // to NATS
	LagNanos                                         int64 // last own batch's time from record to delivery
}

// Fleet is one router's membership of a fleet: it is the engine's
// routing.Sync, and applies its peers' records to the engine's picture
// and replicas. Safe for concurrent use.
type Fleet struct {
	o       Options
	eng     *routing.Engine
	epoch   uint64
	records string // subjects
	snap    string
	chains  string

	onChain func(rec []byte) // chains.go; nil: none kept

	nc *nats.Conn

	mu      sync.Mutex
	buf     []byte // records of the batch being filled
	n       int    // records in buf
	first   int64  // when buf's first record was added (ns, local clock)
	seq     uint64 // last batch published
	flushCh chan struct{}

	amu   sync.Mutex // applying peers' records; peers
	peers map[peerKey]*peer
	// flights and keys count every peer's requests in flight and their
	// pinned keys; pinned is the tokens peers pin, by replica id.
	flights, keys int
	pinned        map[int]int64
	scratch       []blockhash.Block // resolve's
	snapSub       *nats.Subscription

	ready     atomic.Bool
	connected atomic.Bool
	resync    chan string     // peers to load from; "" any
	loadCtx   context.Context // ends at Close: a snapshot being loaded stops
	stopLoad  context.CancelFunc
	stop      chan struct{}
	done      sync.WaitGroup
	closeOnce sync.Once

	published, applied, droppedFull, droppedDown, batches, bytes atomic.Int64
	malformed, gaps, unresolved, refused, clamped, stale         atomic.Int64
	ignoredHomes                                                 atomic.Int64
	chainsShared, chainsReceived, chainsDropped                  atomic.Int64
	served, loaded, snapBlocks, lag                              atomic.Int64
	reqs                                                         atomic.Uint64 // request ids, unique within the epoch
}

type peerKey struct {
	id    string
	epoch uint64
}

// peer is what a router knows of one peer.
type peer struct {
	id     string
	seq    uint64
	seen   time.Time
	flight map[uint64]*flight // its requests in flight, by its request id
	keys   int                // the flights' kept blocks, all together
	// records is the records applied from the peer: only a peer that has
	// published some is asked for a snapshot.
	records int64
}

// flight is a peer's request in flight on one of our replicas: its lease
// there (its pins and load, as its own router holds them), and what it
// adds to the bounds on pins: keys is the blocks of its chain it keeps
// (Lease.Kept), pinned the tokens it pins. start is when its record was
// applied (local clock).
type flight struct {
	l      *routing.Lease
	keys   int
	pinned int64
	start  time.Time
}

// maxFlights bounds the requests in flight kept for all peers together.
const maxFlights = 1 << 16

// maxPinnedKeys bounds the pinned blocks kept for all peers together (24
// bytes each: 24 MiB): past it peers' requests are recorded without pins.
const maxPinnedKeys = 1 << 20

// pinShare is the share of a replica's token budget that peers' requests
// may pin: past it they are recorded without pins, so that the picture
// can still evict down to its budget whatever peers send.
const pinShare = 2

// New returns a member of the fleet for eng, not yet connected (Start).
// It does not set itself as eng's Sync: Start does.
func New(o Options, eng *routing.Engine) (*Fleet, error) {
	if err := o.defaults(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Fleet{o: o, eng: eng, loadCtx: ctx, stopLoad: cancel, epoch: rand.Uint64(), records: o.Prefix + ".records", snap: o.Prefix + ".snapshot", chains: o.Prefix + ".chains",
		flushCh: make(chan struct{}, 1), peers: map[peerKey]*peer{}, pinned: map[int]int64{}, resync: make(chan string, 8), stop: make(chan struct{})}, nil
}

// ID returns this router's id in the fleet.
func (f *Fleet) ID() string { return f.o.ID }

// Ready reports whether the warm start is over: the picture has what a
// peer had, or no peer answered, or NATS was unreachable at start.
func (f *Fleet) Ready() bool { return f.ready.Load() }

// Connected reports whether the router is connected to NATS.
func (f *Fleet) Connected() bool { return f.connected.Load() }

// Start connects to NATS, subscribes, sets f as the engine's Sync and
// begins the warm start in the background; Ready reports when it is
// over. NATS being unreachable is not an error: the router starts alone,
// ready, and joins when NATS comes.
func (f *Fleet) Start(ctx context.Context) error {
	opts := []nats.Option{
		nats.Name("semroute " + f.o.ID),
		nats.Timeout(f.o.ConnectTimeout),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectBufSize(-1), // records during an outage would be stale: drop and count them
		nats.RetryOnFailedConnect(true),
		nats.ConnectHandler(func(nc *nats.Conn) { f.up(nc, "connected") }),
		nats.ReconnectHandler(func(nc *nats.Conn) { f.up(nc, "reconnected") }),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if !f.connected.Swap(false) {
				return
			}
			if err == nil { // Close: this router left, nothing was lost
				f.o.Logger.Info("fleet: disconnected from NATS")
				return
			}
			f.o.Logger.Warn("fleet: lost NATS; routing on this router's picture alone", "err", err)
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			f.o.Logger.Warn("fleet: NATS error", "err", err)
		}),
	}
	if f.o.Credentials != "" {
		opts = append(opts, nats.UserCredentials(f.o.Credentials))
	}
	if f.o.NkeySeed != "" {
		o, err := nats.NkeyOptionFromSeed(f.o.NkeySeed)
		if err != nil {
			return fmt.Errorf("cluster: nkey seed: %w", err)
		}
		opts = append(opts, o)
	}
	if f.o.TLS != nil {
		opts = append(opts, nats.Secure(f.o.TLS))
	}
	if f.o.User != "" {
		opts = append(opts, nats.UserInfo(f.o.User, f.o.Password))
	}
	if f.o.Token != "" {
		opts = append(opts, nats.Token(f.o.Token))
	}
	nc, err := nats.Connect(strings.Join(f.o.URLs, ","), opts...)
	if err != nil && !errors.Is(err, nats.ErrNoServers) {
		return fmt.Errorf("cluster: %w", err)
	}
	f.nc = nc
	if _, err := nc.Subscribe(f.records, f.onBatch); err != nil {
		nc.Close()
		return fmt.Errorf("cluster: subscribe %s: %w", f.records, err)
	}
	if f.onChain != nil {
		if _, err := nc.Subscribe(f.chains, f.onChainMsg); err != nil {
			nc.Close()
			return fmt.Errorf("cluster: subscribe %s: %w", f.chains, err)
		}
	}
	f.eng.SetSync(f)
	f.remindInsecure()
	f.done.Add(2)
	go f.flusher()
	go f.keeper(ctx)
	if nc.IsConnected() {
		f.up(nc, "connected")
	} else {
		f.o.Logger.Warn("fleet: NATS unreachable; starting alone and retrying", "urls", f.o.URLs)
		f.ready.Store(true)
	}
	return nil
}

// up is called when the connection comes up: it asks for a warm start.
func (f *Fleet) up(nc *nats.Conn, how string) {
	if f.connected.Swap(true) {
		return
	}
	f.o.Logger.Info("fleet: "+how+" to NATS", "id", f.o.ID, "url", nc.ConnectedUrlRedacted())
	// Ends of requests may have been dropped while NATS was away: the
	// peers forget this router's requests in flight rather than count
	// them for ever.
	f.add(func(b []byte) []byte { return append(b, recReset) })
	f.askResync("")
}

// askResync asks the keeper for a warm start from peer ("": any).
func (f *Fleet) askResync(peer string) {
	select {
	case f.resync <- peer:
	default:
	}
}

// Close leaves the fleet: it publishes what is buffered and disconnects.
func (f *Fleet) Close() {
	f.closeOnce.Do(func() {
		close(f.stop)
		f.stopLoad()
		f.done.Wait()
		if f.nc != nil {
			f.flush()
			if f.nc.IsConnected() {
				_ = f.nc.FlushTimeout(time.Second)
			}
			f.nc.Close()
		}
	})
}

// Stats returns the member's counters.
func (f *Fleet) Stats() Stats {
	f.amu.Lock()
	peers := 0
	now := f.o.Now()
	for _, p := range f.peers {
		if now.Sub(p.seen) < f.o.PeerTimeout {
			peers++
		}
	}
	f.amu.Unlock()
	return Stats{
		Published: f.published.Load(), Applied: f.applied.Load(),
		DroppedFull: f.droppedFull.Load(), DroppedDown: f.droppedDown.Load(),
		Batches: f.batches.Load(), Bytes: f.bytes.Load(),
		Malformed: f.malformed.Load(), Gaps: f.gaps.Load(), Unresolved: f.unresolved.Load(),
		Refused: f.refused.Load(), Clamped: f.clamped.Load(), Stale: f.stale.Load(), IgnoredHomes: f.ignoredHomes.Load(),
		ChainsShared: f.chainsShared.Load(), ChainsReceived: f.chainsReceived.Load(), ChainsDropped: f.chainsDropped.Load(),
		SnapshotsServed: f.served.Load(), SnapshotsLoaded: f.loaded.Load(), SnapshotBlocks: f.snapBlocks.Load(),
		Peers: peers, Connected: f.connected.Load(), LagNanos: f.lag.Load(),
	}
}

// add appends one record, built by enc, to the batch being filled, or
// drops it when NATS is down or the buffer is full.
func (f *Fleet) add(enc func([]byte) []byte) {
	if !f.connected.Load() {
		f.droppedDown.Add(1)
		return
	}
	f.mu.Lock()
	if len(f.buf) >= f.o.BufferBytes {
		f.mu.Unlock()
		f.droppedFull.Add(1)
		return
	}
	if f.n == 0 {
		f.first = f.o.Now().UnixNano()
	}
	f.buf = enc(f.buf)
	f.n++
	full := len(f.buf) >= f.o.MaxBatchBytes
	f.mu.Unlock()
	if full {
		select {
		case f.flushCh <- struct{}{}:
		default:
		}
	}
}

// flush publishes the batch being filled, if any.
func (f *Fleet) flush() {
	f.mu.Lock()
	if f.n == 0 {
		f.mu.Unlock()
		return
	}
	body, n, first := f.buf, f.n, f.first
	f.buf, f.n = nil, 0
	f.seq++
	msg := appendHeader(make([]byte, 0, len(body)+64), header{sender: f.o.ID, epoch: f.epoch, seq: f.seq, count: n})
	msg = append(msg, body...)
	f.mu.Unlock()
	f.publish(msg, n, first)
}

func (f *Fleet) publish(msg []byte, records int, first int64) {
	m := &nats.Msg{Subject: f.records, Data: msg, Header: nats.Header{}}
	m.Header.Set(hdrFirst, fmt.Sprint(first))
	if err := f.nc.PublishMsg(m); err != nil {
		f.droppedDown.Add(int64(records))
		return
	}
	f.published.Add(int64(records))
	f.batches.Add(1)
	f.bytes.Add(int64(len(msg)))
}

// hdrFirst carries, in a batch's NATS header, when its first record was
// made on the sender's clock: only the sender reads it, to measure its
// own lag (no clock is compared with another's).
const hdrFirst = "Semroute-First"

// flusher publishes batches every FlushInterval, early when one is full,
// and a heartbeat (an empty batch) every Heartbeat. It is the only
// publisher, so batches leave in sequence.
func (f *Fleet) flusher() {
	defer f.done.Done()
	t := time.NewTicker(f.o.FlushInterval)
	defer t.Stop()
	lastBeat := f.o.Now()
	for {
		select {
		case <-f.stop:
			return
		case <-t.C:
		case <-f.flushCh:
		}
		f.flush()
		if now := f.o.Now(); now.Sub(lastBeat) >= f.o.Heartbeat {
			lastBeat = now
			if f.connected.Load() {
				f.mu.Lock()
				f.seq++
				msg := appendHeader(nil, header{sender: f.o.ID, epoch: f.epoch, seq: f.seq})
				f.mu.Unlock()
				f.publish(msg, 0, now.UnixNano())
			}
		}
	}
}

// keeper runs warm starts when asked, expires silent peers and stale
// requests of peers, and reminds of an unauthenticated fleet.
func (f *Fleet) keeper(ctx context.Context) {
	defer f.done.Done()
	t := time.NewTicker(f.o.PeerTimeout / 4)
	defer t.Stop()
	remind := time.NewTicker(f.o.InsecureReminder)
	defer remind.Stop()
	for {
		select {
		case <-f.stop:
			return
		case <-ctx.Done():
			return
		case peer := <-f.resync:
			f.warmStart(peer)
		case <-t.C:
			f.expire()
		case <-remind.C:
			f.remindInsecure()
		}
	}
}

// remindInsecure warns, on a fleet joined without authenticating, that
// anyone reaching NATS can steer it.
func (f *Fleet) remindInsecure() {
	if !f.o.authenticated() {
		f.o.Logger.Warn("fleet: NATS without authentication (cluster.insecure): any client that reaches the server can steer or stop this fleet's routing",
			"urls", f.o.URLs)
	}
}

// expire forgets peers silent for PeerTimeout and their load.
func (f *Fleet) expire() {
	now := f.o.Now()
	f.amu.Lock()
	defer f.amu.Unlock()
	for k, p := range f.peers {
		if now.Sub(p.seen) >= f.o.PeerTimeout {
			f.o.Logger.Info("fleet: peer gone; its requests in flight stop counting", "peer", k.id, "in_flight", len(p.flight))
			f.endAll(p, now)
			delete(f.peers, k)
			continue
		}
		for id, fl := range p.flight {
			switch age := now.Sub(fl.start); {
			case age >= f.o.FlightTTL:
				f.end(p, fl, now)
				delete(p.flight, id)
				f.stale.Add(1)
			case age >= f.o.PrefillTTL:
				fl.l.FirstToken(now)
			}
		}
	}
}

// endAll ends every request p has in flight. f.amu must be held.
func (f *Fleet) endAll(p *peer, now time.Time) {
	for id, fl := range p.flight {
		f.end(p, fl, now)
		delete(p.flight, id)
	}
}

// end ends p's request in flight fl: its work stops counting, and its
// blocks are freed in the picture (and unpinned). f.amu must be held.
func (f *Fleet) end(p *peer, fl *flight, now time.Time) {
	fl.l.End(now)
	f.flights--
	p.keys -= fl.keys
	f.keys -= fl.keys
	f.pinned[fl.l.Replica().ID] -= fl.pinned
}

// Committed implements routing.Sync.
func (f *Fleet) Committed(d *routing.Decision, c *routing.Candidate) {
	if d.SyncID == 0 { // small: a uvarint of one to three bytes in each of the request's records
		d.SyncID = f.reqs.Add(1)
	}
	f.add(func(b []byte) []byte {
		b = append(b, recRoute)
		b = binary.AppendUvarint(b, d.SyncID)
		b = appendStr(b, c.Replica.Name)
		w := d.Lease().Work()
		b = binary.AppendUvarint(b, uint64(max(w.Prefill, 0)))
		b = binary.AppendUvarint(b, uint64(max(w.Tokens, 0)))
		return appendChain(b, d.Blocks, c.Match.Blocks)
	})
}

// PrefillDone implements routing.Sync.
func (f *Fleet) PrefillDone(d *routing.Decision, _ *routing.Candidate) {
	f.add(func(b []byte) []byte { return binary.AppendUvarint(append(b, recPrefill), d.SyncID) })
}

// Done implements routing.Sync.
func (f *Fleet) Done(d *routing.Decision, _ *routing.Candidate) {
	f.add(func(b []byte) []byte { return binary.AppendUvarint(append(b, recDone), d.SyncID) })
}

// Learned implements routing.Sync.
func (f *Fleet) Learned(_ *routing.Decision, r *replica.Replica, chain []blockhash.Block, from int) {
	f.add(func(b []byte) []byte {
		return appendChain(appendStr(append(b, recReply), r.Name), chain, from)
	})
}

// Ejected implements routing.Sync.
func (f *Fleet) Ejected(r *replica.Replica, cool time.Duration) {
	f.add(func(b []byte) []byte {
		return binary.AppendUvarint(appendStr(append(b, recEject), r.Name), uint64(cool.Milliseconds()))
	})
}

var _ routing.Sync = (*Fleet)(nil)
