package main

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/semroute/semroute/agreement"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/kvsync"
	"github.com/semroute/semroute/monitor"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
	"github.com/semroute/semroute/tokenizer"
)

// followers runs one kvsync.Follower per replica whose engine publishes
// KV events, from when it joins the pool until it is retired.
type followers struct {
	pic       *routing.Picture
	engine    *routing.Engine
	blockSize int
	precise   bool // tokenizer.mode is not estimate: requests are keyed as events are
	log       *slog.Logger

	mu        sync.Mutex
	by        map[int]*kvsync.Follower // by replica id
	listeners map[string]*listener     // by kv_events.listen address
	listenOf  map[int]string           // replica id → its listen address
}

// listener is a bound kvevents.Listener and the replicas that use it.
type listener struct {
	l     *kvevents.Listener
	users int
}

func newFollowers(pic *routing.Picture, eng *routing.Engine, blockSize int, precise bool, log *slog.Logger) *followers {
	return &followers{pic: pic, engine: eng, blockSize: blockSize, precise: precise, log: log, by: map[int]*kvsync.Follower{},
		listeners: map[string]*listener{}, listenOf: map[int]string{}}
}

// llmdTopic is the topic llm-d's engines publish under, less the model:
// "kv@<host>:<port>@" of the replica's URL (llm-d-inference-sim's
// CreateKVEventsTopic, pkg/kv-cache/block_cache.go; llm-d's vLLM
// deployments set the same).
func llmdTopic(r *replica.Replica) string {
	port := r.URL.Port()
	switch {
	case port != "":
	case r.URL.Scheme == "https":
		port = "443"
	default:
		port = "80"
	}
	return "kv@" + r.URL.Hostname() + ":" + port + "@"
}

// listen returns the Listener bound at addr for replica id, binding it
// for the first replica.
func (fs *followers) listen(id int, addr string) (*kvevents.Listener, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	l := fs.listeners[addr]
	if l == nil {
		kl, err := kvevents.Listen(addr)
		if err != nil {
			return nil, err
		}
		l = &listener{l: kl}
		fs.listeners[addr] = l
		fs.log.Info("KV events: listening for engines that dial the router", "listen", kl.Addr())
	}
	l.users++
	fs.listenOf[id] = addr
	return l.l, nil
}

// unlisten drops replica id's use of its Listener, closing the Listener
// after its last replica. Call it after the replica's Follower is closed.
func (fs *followers) unlisten(id int) {
	fs.mu.Lock()
	addr, ok := fs.listenOf[id]
	delete(fs.listenOf, id)
	var closeL *kvevents.Listener
	if l := fs.listeners[addr]; ok && l != nil {
		if l.users--; l.users == 0 {
			delete(fs.listeners, addr)
			closeL = l.l
		}
	}
	fs.mu.Unlock()
	if closeL != nil {
		_ = closeL.Close()
	}
}

// add starts following r's events if its spec names them.
func (fs *followers) add(r *replica.Replica, s replica.Spec) {
	ev := s.KVEvents
	if ev.Endpoint == "" && ev.Listen == "" {
		return
	}
	if !fs.precise {
		fs.log.Warn("replica publishes KV events but tokenizer.mode is estimate: its events are ignored (they key blocks by engine tokens, which estimated requests do not have)",
			"replica", r.Name)
		return
	}
	fs.remove(r.ID) // a replica added again follows its new spec
	o := kvsync.Options{Model: fs.pic, ID: r.ID, Name: r.Name, Endpoint: ev.Endpoint, ReplayEndpoint: ev.ReplayEndpoint,
		Topic: ev.Topic, Rank: ev.DataParallelRank, BlockSize: fs.blockSize, OnLoRA: fs.engine.NoteAdapter, Logger: fs.log}
	if ev.Listen != "" {
		l, err := fs.listen(r.ID, ev.Listen)
		if err != nil {
			fs.log.Error("KV events: cannot listen; the replica's picture stays approximate", "replica", r.Name, "listen", ev.Listen, "err", err)
			return
		}
		o.Listener, o.Endpoint = l, ""
		if o.Topic == "" {
			o.Topic = llmdTopic(r)
		}
	}
	f, err := kvsync.Follow(o)
	if err != nil {
		fs.log.Error("KV events: cannot follow; the replica's picture stays approximate", "replica", r.Name, "err", err)
		fs.unlisten(r.ID)
		return
	}
	fs.mu.Lock()
	fs.by[r.ID] = f
	fs.mu.Unlock()
	fs.log.Info("KV events: following", "replica", r.Name, "endpoint", ev.Endpoint, "listen", ev.Listen, "topic", o.Topic, "replay", ev.ReplayEndpoint)
}

// remove stops following replica id.
func (fs *followers) remove(id int) {
	fs.mu.Lock()
	old := fs.by[id]
	delete(fs.by, id)
	fs.mu.Unlock()
	if old != nil {
		_ = old.Close()
	}
	fs.unlisten(id)
}

// follower returns replica id's follower; nil if it has none.
func (fs *followers) follower(id int) *kvsync.Follower {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	return fs.by[id]
}

// engineRestarted is the monitor's OnEngineRestart: replica r's engine
// restarted, as its metrics showed. A followed replica's picture is its
// follower's to clear, once a restart, whether its events or its metrics
// show it first; another's is cleared here.
func (fs *followers) engineRestarted(r *replica.Replica, rs monitor.Restart) {
	if f := fs.follower(r.ID); f != nil {
		f.EngineRestarted(rs.Since, rs.Reason)
		return
	}
	fs.pic.Clear(r.ID)
}

// close stops every follower.
func (fs *followers) close() {
	fs.mu.Lock()
	all := fs.by
	fs.by = map[int]*kvsync.Follower{}
	fs.mu.Unlock()
	for id, f := range all {
		_ = f.Close()
		fs.unlisten(id)
	}
}

// tokenizerFor makes the precise mode's tokenizer: a fixed URL, or an
// available replica that serves the request's model (its chat template and
// vocabulary are the model's), else one whose models are not known yet.
//
// Each call's outcome is told to ag under the name of the replica Pick
// chose (a fixed URL is no replica's); a call the client gave up on (its
// request was cancelled) says nothing.
func tokenizerFor(url string, timeout time.Duration, cacheTokens int, pool *replica.Pool, ag *agreement.Tracker) (*tokenizer.Client, error) {
	var names sync.Map // base URL Pick returned → replica name
	o := tokenizer.Options{URL: strings.TrimSuffix(url, "/"), Timeout: timeout, CacheTokens: cacheTokens,
		OnCall: func(base string, err error) {
			if name, ok := names.Load(base); ok && !errors.Is(err, context.Canceled) {
				ag.Tokenized(name.(string), err)
			}
		}}
	if url == "" {
		o.Pick = func(model string) string {
			now := time.Now()
			for _, r := range pool.Replicas() {
				if m := r.Models(); r.Available(now) && (m == nil || m.Serves(model)) && ag.TokenizerOK(r.Name) {
					base := strings.TrimSuffix(r.URL.String(), "/")
					names.Store(base, r.Name)
					return base
				}
			}
			return ""
		}
	}
	return tokenizer.New(o)
}

var (
	descEvLive      = prometheus.NewDesc("semroute_kv_events_live", "1 while the replica's cache picture follows its engine's KV events; 0 while it is the approximate one (no events yet, or silent).", []string{"replica"}, nil)
	descEvBatches   = prometheus.NewDesc("semroute_kv_events_batches_total", "KV event batches applied (live or replayed).", []string{"replica"}, nil)
	descEvReplayed  = prometheus.NewDesc("semroute_kv_events_replayed_batches_total", "KV event batches got from the replay socket to fill a gap.", []string{"replica"}, nil)
	descEvBlocks    = prometheus.NewDesc("semroute_kv_events_blocks_total", "Blocks applied from KV events, by event: stored, removed, orphan (stored after a parent the router never saw: skipped).", []string{"replica", "event"}, nil)
	descEvMalformed = prometheus.NewDesc("semroute_kv_events_malformed_total", "KV event messages that could not be read, skipped.", []string{"replica"}, nil)
	descEvOverLimit = prometheus.NewDesc("semroute_kv_events_over_limit_total", "KV event batches skipped unread for passing a bound, by bound: message_bytes, events_per_batch, blocks_per_event, tokens_per_event.", []string{"replica", "limit"}, nil)
	descEvSkipped   = prometheus.NewDesc("semroute_kv_events_skipped_total", "KV events not applied: a block size other than tokenizer.block_tokens, or token ids not filling their blocks.", []string{"replica"}, nil)
	descEvGaps      = prometheus.NewDesc("semroute_kv_events_gaps_total", "Sequence gaps in the replica's KV events.", []string{"replica"}, nil)
	descEvResets    = prometheus.NewDesc("semroute_kv_events_resets_total", "Times the replica's events picture was cleared: the engine restarted (once a restart, whether its events or its metrics showed it first) or cleared its cache, or a gap could not be filled.", []string{"replica"}, nil)
	descEvFallbacks = prometheus.NewDesc("semroute_kv_events_fallbacks_total", "Times the replica's events went silent while routed blocks went unconfirmed, and its picture fell back to the approximate one.", []string{"replica"}, nil)
	descEvTracked   = prometheus.NewDesc("semroute_kv_events_tracked_blocks", "Engine blocks known from the replica's KV events.", []string{"replica"}, nil)
)

func (fs *followers) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descEvLive, descEvBatches, descEvReplayed, descEvBlocks, descEvMalformed, descEvOverLimit, descEvSkipped, descEvGaps, descEvResets, descEvFallbacks, descEvTracked} {
		ch <- d
	}
}

func (fs *followers) Collect(ch chan<- prometheus.Metric) {
	fs.mu.Lock()
	list := make([]*kvsync.Follower, 0, len(fs.by))
	for _, f := range fs.by {
		list = append(list, f)
	}
	fs.mu.Unlock()
	for _, f := range list {
		st, name := f.Stats(), f.Name()
		c := func(d *prometheus.Desc, v uint64, labels ...string) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), append([]string{name}, labels...)...)
		}
		ch <- prometheus.MustNewConstMetric(descEvLive, prometheus.GaugeValue, b2f(st.Live), name)
		ch <- prometheus.MustNewConstMetric(descEvTracked, prometheus.GaugeValue, float64(st.Tracked), name)
		c(descEvBatches, st.Subscriber.Applied)
		c(descEvReplayed, st.Subscriber.Replayed)
		c(descEvBlocks, st.Stored, "stored")
		c(descEvBlocks, st.Removed, "removed")
		c(descEvBlocks, st.Orphans, "orphan")
		c(descEvMalformed, st.Subscriber.Malformed)
		for l, n := range st.Subscriber.OverLimit {
			c(descEvOverLimit, n, kvevents.Limit(l).String())
		}
		c(descEvSkipped, st.Skipped)
		c(descEvGaps, st.Subscriber.Gaps)
		c(descEvResets, st.Cleared) // every clear, the subscriber's resets among them, once
		c(descEvFallbacks, st.Fallbacks)
	}
}
