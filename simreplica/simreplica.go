// Package simreplica is a simulated OpenAI-compatible inference replica: it
// speaks /v1/chat/completions and /v1/completions (streaming or not),
// /v1/models, /health and /metrics with vLLM's metric names, and behaves like
// an engine with automatic prefix caching.
//
// The prompt is rendered and tokenized by the replica's Tokenizer (see
// Options.Tokenizer: the old estimate of BytesPerToken bytes per token, or a
// word-level tokenizer with a chat template, which, like a real engine's,
// does not count what a router estimates), and cut into cache blocks of
// BlockSize token ids keyed by a chained hash of the ids (BlockHash), seeded
// by the served model or LoRA adapter (RootHash). usage.prompt_tokens is the
// token count; prompt_tokens_details.cached_tokens the cached full blocks ×
// BlockSize, never the last prompt token. Blocks live in an LRU of NumBlocks
// entries; when a request finishes its prefill its blocks are refreshed tail
// first, so the head of a prompt outlives its tail as in vLLM. Options.OnKVEvent
// hears every block stored, evicted or cleared, as vLLM's KV events report
// them. Time to first token is Overhead + PrefillPerToken × uncached prompt
// tokens; every further token takes InterToken. Prefills take turns in
// arrival order (one replica computes PrefillPerToken⁻¹ prompt tokens a
// second however many requests it holds), and a request looks the cache up
// when its turn comes, so it waits behind the prefills queued before it: a
// simplification of vLLM's scheduler, which shares each step's token budget
// among several prefills and lets decoding slow them. At most MaxRunning
// requests run; the rest wait, in arrival order, or with Options.Scheduling
// priority in the order of their body's priority, the least important
// running request preempted when the KV cache runs out, as vLLM's
// --scheduling-policy priority (see priorityScheduler). POST /tokenize and
// /detokenize answer as vLLM's do. The Responses and Messages APIs are
// served as vLLM serves them (agentic.go); a chat, Responses or Messages
// request with tools may be answered with a tool call, deterministic in
// its prompt (toolcall.go).
//
// A Server is safe for concurrent use.
package simreplica

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	lru "github.com/hashicorp/golang-lru/v2/simplelru"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/internal/enginereuse"
	"github.com/semroute/semroute/kvevents"
)

// Options configure a simulated replica. Zero fields take the defaults; a
// negative duration means no time at all (instant answers).
type Options struct {
	Model string // served model name; default "sim-model"
	// APIKey, if set, is required of every /v1/* request as
	// "Authorization: Bearer", as vLLM's --api-key: 401 otherwise.
	APIKey          string
	BlockSize       int           // tokens per cache block; default 16
	NumBlocks       int           // cache capacity in blocks; default 16384 (262,144 tokens)
	BytesPerToken   int           // the bytes tokenizer's bytes per token; default 4
	MaxRunning      int           // running sequences; default 64
	Overhead        time.Duration // fixed part of time to first token; default 2ms
	PrefillPerToken time.Duration // per uncached prompt token; default 20µs
	InterToken      time.Duration // per output token after the first; default 2ms
	OutputTokens    int           // output length when max_tokens is absent; default 16
	MaxOutputTokens int           // cap on max_tokens; default 4096
	MaxBodyBytes    int64         // request body limit; default 32 MiB
	// Tokenizer names the engine's tokenizer and chat template:
	// TokenizerWords (the default, "") or TokenizerBytes. See Tokenizer.
	Tokenizer string
	// LoRAs are adapters served besides Model: a request may name one as
	// its model. Their blocks are other blocks than the base model's for
	// the same tokens, and their KV events carry the adapter's name and
	// id (1 + its index here).
	LoRAs []string
	// EnableLoRA is vLLM's --enable-lora (implied by LoRAs): adapters may
	// also be loaded and unloaded while serving, through POST
	// /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM allows
	// with VLLM_ALLOW_RUNTIME_LORA_UPDATING.
	EnableLoRA bool
	// MaxLoRAs is vLLM's --max-loras, reported as max_lora in
	// vllm:lora_requests_info (the adapters of running and waiting
	// requests); default 1. The replica does not hold a request back for
	// it.
	MaxLoRAs int
	// MaxModelLen is the context length: a request whose prompt and
	// max_tokens together exceed it is refused with 400, as vLLM refuses
	// it; /tokenize and /v1/models report it. Default 1,048,576.
	MaxModelLen int
	// OnKVEvent, if set, hears every change of the prefix cache as vLLM's
	// KV events report it (see KVEvent): BlockStored when a prefill's
	// new full blocks enter the cache, BlockRemoved when blocks are
	// evicted (before the BlockStored that evicted them), and
	// AllBlocksCleared on DropCache and Restart. It is called with the
	// cache locked, so in the order of the changes, one call at a time:
	// it must return quickly (hand the event to a queue) and must not
	// call back into the Server.
	OnKVEvent func(KVEvent)
	// KVEvents, if set, publishes the prefix cache's events over ZMQ as
	// vLLM does with --kv-events-config (publisher zmq): a PUB socket at
	// KVEvents.Endpoint, a replay socket at ReplayEndpoint, sequence
	// numbers from 0 (see package kvevents). Use "tcp://127.0.0.1:0" for a
	// free port and Server.KVEventsEndpoints to learn it. OnKVEvent still
	// hears every event.
	KVEvents *kvevents.PublisherOptions
	// Blend, if set, makes the replica reuse documents and tool results
	// wherever they appear in a prompt, as CacheBlend does: see Blend.
	Blend *Blend
	// Donor, if set, makes the replica reuse a similar earlier prompt's
	// cached KV when its prefix cache holds less of a prompt: see Donor.
	// Not with Blend.
	Donor *Donor
	// TransferLatency and TransferPerToken are the time a decode request
	// given a prefill replica's kv_transfer_params (do_remote_prefill)
	// takes to pull the prompt's KV it does not hold, in place of
	// computing it: TransferLatency plus TransferPerToken a token.
	// Defaults 2ms and 2µs. A request with do_remote_decode computes the
	// prompt and, answered whole (not streamed), carries the parameters of
	// its KV, as vLLM's NIXL connector does (disaggregated prefill; the
	// router asks for one token).
	TransferLatency  time.Duration
	TransferPerToken time.Duration
	// Scheduling is vLLM's --scheduling-policy: SchedulingFCFS (the
	// default, "") serves requests in arrival order whatever their
	// priority; SchedulingPriority orders the waiting requests by their
	// body's priority (lower sooner, default 0), then arrival, and
	// preempts the least important running request when the KV cache of
	// NumBlocks blocks runs out (see priorityScheduler). A priority
	// replica's context length is at most NumBlocks × BlockSize tokens,
	// as vLLM will not start with a max_model_len its KV cache cannot
	// hold.
	Scheduling string
	// DataParallelRank is the engine's data-parallel rank: its metrics
	// carry it as their engine label (vLLM labels one engine's "0"), and,
	// when over 0 or DataParallelSize is over 1, its KV event batches
	// carry it as data_parallel_rank. NewDataParallel sets both.
	DataParallelRank int
	// DataParallelSize is the ranks of the engine the replica is one of
	// (see NewDataParallel); 0 or 1: one.
	DataParallelSize int
}

func (o *Options) defaults() {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&o.BlockSize, 16)
	def(&o.NumBlocks, 16384)
	def(&o.BytesPerToken, 4)
	def(&o.MaxRunning, 64)
	def(&o.OutputTokens, 16)
	def(&o.MaxOutputTokens, 4096)
	if o.Model == "" {
		o.Model = "sim-model"
	}
	if o.Overhead == 0 {
		o.Overhead = 2 * time.Millisecond
	}
	if o.PrefillPerToken == 0 {
		o.PrefillPerToken = 20 * time.Microsecond
	}
	if o.InterToken == 0 {
		o.InterToken = 2 * time.Millisecond
	}
	if o.MaxBodyBytes == 0 {
		o.MaxBodyBytes = 32 << 20
	}
	if o.TransferLatency == 0 {
		o.TransferLatency = 2 * time.Millisecond
	}
	if o.TransferPerToken == 0 {
		o.TransferPerToken = 2 * time.Microsecond
	}
	def(&o.MaxModelLen, 1<<20)
	def(&o.MaxLoRAs, 1)
	if o.Tokenizer == "" {
		o.Tokenizer = TokenizerWords
	}
	if o.Scheduling == "" {
		o.Scheduling = SchedulingFCFS
	}
}

// Stats are a replica's counters since it started.
type Stats struct {
	Unauthorized int64 // refused for their key (Options.APIKey)
	Requests     int64 // requests admitted (valid bodies)
	Completed    int64 // finished normally
	Cancelled    int64 // ended because the client went away
	PromptTokens int64
	CachedTokens int64 // reported in usage: the prefix cache's hit and, with Blend, the segments reused
	// ReusedTokens is the part of CachedTokens that Blend or Donor reused
	// past the prefix cache's hit.
	ReusedTokens int64
	// RemoteDecodes are the prefills done for a decode replica
	// (do_remote_decode); Transfers the decodes that took a prefill's KV
	// (do_remote_prefill).
	RemoteDecodes, Transfers int64
}

// model is a served model: the base model or a LoRA adapter.
type model struct {
	name   string
	lora   string // the adapter's name; "" for the base model
	loraID int    // 1 + the adapter's index in Options.LoRAs; 0 for the base model
	root   uint64 // RootHash(name)
}

// Server is one simulated replica.
type Server struct {
	o      Options
	reg    *prometheus.Registry // the engine's metrics
	kv     *kvPublisher         // nil unless Options.KVEvents
	kvOnce sync.Once
	blend  *blendStore // nil unless Options.Blend
	donor  *donorStore // nil unless Options.Donor
	mux    *http.ServeMux
	sem    chan struct{}
	// prefill is the one prompt computation at a time (see prefillQueue).
	prefill prefillQueue
	lora    *loraUse // nil without LoRAs
	tok     *Tokenizer
	// prio schedules the requests under SchedulingPriority, in place of
	// sem and prefill; nil under SchedulingFCFS.
	prio *priorityScheduler

	modelsMu sync.RWMutex
	models   map[string]model // guarded by modelsMu: adapters come and go
	loras    []string         // the adapters, in the order they came
	loraIDs  int              // the last adapter id given

	mu      sync.Mutex
	cache   *lru.LRU[uint64, struct{}]
	evicted []uint64 // storeLocked's scratch
	// pins counts the running requests using each cached block: vLLM
	// does not evict a running request's blocks. epoch changes when the
	// cache is dropped, and the pins with it.
	pins  map[uint64]int32
	epoch uint64

	requests, completed, cancelled, promptTokens, cachedTokens, reusedTokens atomic.Int64
	// remoteDecodes and transfers count the prefills done for a decode
	// replica and the decodes that pulled a prefill's KV.
	remoteDecodes, transfers atomic.Int64
	engineID                 string         // kv_transfer_params' remote_engine_id
	responses                *responseStore // the Responses API's stored responses: the API server's, shared by its ranks
	unauthorized             atomic.Int64   // requests refused for their key (Options.APIKey)
	// Counters exported to /metrics; Restart zeroes them, as a restarted
	// engine would.
	queries, hits, promptTotal, genTotal, extQueries, extHits atomic.Int64
	fault                                                     atomic.Int32 // status to answer everything with; 0: none
	traceparent                                               atomic.Value // string: the last completion request's traceparent header

	running, waiting, usage prometheus.Gauge
	// held is the KV blocks running requests hold. vllm:kv_cache_usage_perc
	// is held ÷ NumBlocks, as in vLLM: cached blocks that no running
	// request uses are free (evictable), not in use.
	held atomic.Int64
}

// New returns a simulated replica.
func New(o Options) (*Server, error) {
	o.defaults()
	o.LoRAs = slices.Clone(o.LoRAs)
	if err := checkScheduling(o.Scheduling); err != nil {
		return nil, err
	}
	tok, err := NewTokenizer(o.Tokenizer, o.BytesPerToken)
	if err != nil {
		return nil, err
	}
	c, err := lru.NewLRU[uint64, struct{}](o.NumBlocks, nil)
	if err != nil {
		return nil, err
	}
	s := &Server{o: o, cache: c, pins: map[uint64]int32{}, sem: make(chan struct{}, o.MaxRunning), mux: http.NewServeMux(), tok: tok,
		models: map[string]model{o.Model: {name: o.Model, root: RootHash(o.Model)}}, engineID: rand.Text(), responses: &responseStore{}}
	if err := s.serveLoRAs(o.LoRAs); err != nil {
		return nil, err
	}
	if err := s.reusePastPrefix(); err != nil {
		return nil, err
	}
	s.reg = s.registerMetrics()
	s.routes(s.reg)
	if o.Scheduling == SchedulingPriority {
		s.prio = newPriorityScheduler(o.MaxRunning, o.NumBlocks, o.BlockSize)
		s.prio.onMove = func(q *seq, wait, run int) {
			s.waiting.Add(float64(wait))
			s.running.Add(float64(run))
			s.loraAdd(q.lora, wait, run)
		}
		s.prio.onHold = s.hold
	}
	if o.KVEvents != nil {
		if s.kv, err = newKVPublisher(*o.KVEvents); err != nil {
			return nil, err
		}
		if o.DataParallelRank > 0 || o.DataParallelSize > 1 {
			s.kv.rank = &s.o.DataParallelRank
		}
		user := o.OnKVEvent
		s.o.OnKVEvent = func(ev KVEvent) {
			if user != nil {
				user(ev)
			}
			s.kv.send(ev)
		}
	}
	return s, nil
}

// serveLoRAs serves the adapters of Options.LoRAs besides the base model,
// with ids 1 + their index.
func (s *Server) serveLoRAs(loras []string) error {
	for i, name := range loras {
		if _, dup := s.models[name]; dup || name == "" {
			return fmt.Errorf("simreplica: LoRA name %q is empty or served twice", name)
		}
		s.models[name] = model{name: name, lora: name, loraID: i + 1, root: RootHash(name)}
	}
	s.loras, s.loraIDs = slices.Clone(loras), len(loras)
	return nil
}

// reusePastPrefix makes the stores of Options.Blend (its defaults filled
// in) or Options.Donor, the engine's reuse past the prefix cache.
func (s *Server) reusePastPrefix() (err error) {
	o := s.o
	if o.Blend != nil {
		if o.Tokenizer != TokenizerWords {
			return fmt.Errorf("simreplica: Blend needs the %q tokenizer", TokenizerWords)
		}
		b := *o.Blend
		if b.Recompute == 0 {
			b.Recompute = DefaultRecompute
		}
		if b.BudgetTokens <= 0 {
			b.BudgetTokens = o.NumBlocks * o.BlockSize
		}
		s.o.Blend = &b
		if s.blend, err = newBlendStore(b, o.BlockSize); err != nil {
			return err
		}
	}
	if o.Donor != nil {
		if o.Blend != nil {
			return errors.New("simreplica: Donor and Blend are exclusive")
		}
		if s.donor, err = newDonorStore(*o.Donor); err != nil {
			return err
		}
	}
	return nil
}

// registerMetrics makes the replica's vLLM metrics, labelled with its
// model, and returns their registry: the gauges of running and waiting
// requests and of KV cache usage, the prefix cache's counters (the
// external cache's with Blend or Donor), the cache config, and LoRA
// adapters' use when adapters are served.
func (s *Server) registerMetrics() *prometheus.Registry {
	o := s.o
	reg := prometheus.NewRegistry()
	engine := fmt.Sprint(o.DataParallelRank)
	lbl := prometheus.Labels{"model_name": o.Model, "engine": engine}
	g := func(name, help string) prometheus.Gauge {
		m := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: lbl})
		reg.MustRegister(m)
		return m
	}
	ctr := func(name, help string, v *atomic.Int64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: lbl},
			func() float64 { return float64(v.Load()) }))
	}
	s.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
	s.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
	s.usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
	ctr("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", &s.queries)
	ctr("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", &s.hits)
	ctr("vllm:prompt_tokens_total", "Number of prefill tokens processed.", &s.promptTotal)
	ctr("vllm:generation_tokens_total", "Number of generation tokens processed.", &s.genTotal)
	if s.blend != nil || s.donor != nil {
		ctr("vllm:external_prefix_cache_queries_total", "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.", &s.extQueries)
		ctr("vllm:external_prefix_cache_hits_total", "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.", &s.extHits)
	}
	info := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "vllm:cache_config_info", Help: "Information of the LLMEngine CacheConfig."},
		[]string{"block_size", "num_gpu_blocks", "engine"})
	info.WithLabelValues(fmt.Sprint(o.BlockSize), fmt.Sprint(o.NumBlocks), engine).Set(1)
	reg.MustRegister(info)
	if len(o.LoRAs) > 0 || o.EnableLoRA {
		s.lora = newLoRAUse(reg, o.MaxLoRAs, engine)
	}
	return reg
}

// routes serves the replica's API on s.mux, its metrics from reg: the
// OpenAI-compatible endpoints, vLLM's /tokenize and /detokenize, /health,
// and the adapter endpoints when adapters are served.
func (s *Server) routes(reg *prometheus.Registry) {
	if s.lora != nil {
		s.mux.HandleFunc("POST /v1/load_lora_adapter", s.loadLoRA)
		s.mux.HandleFunc("POST /v1/unload_lora_adapter", s.unloadLoRA)
	}
	s.mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	s.mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	s.mux.HandleFunc("GET /v1/models", s.listModels)
	s.mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.complete(w, r, blockhash.Chat) })
	s.mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.complete(w, r, blockhash.Completion) })
	s.mux.HandleFunc("POST /v1/responses", func(w http.ResponseWriter, r *http.Request) { s.complete(w, r, blockhash.Responses) })
	s.mux.HandleFunc("POST /v1/messages", func(w http.ResponseWriter, r *http.Request) { s.complete(w, r, blockhash.Messages) })
	s.mux.HandleFunc("GET /v1/responses/{id}", s.getResponse)
	s.mux.HandleFunc("POST /tokenize", s.tokenize)
	s.mux.HandleFunc("POST /detokenize", s.detokenize)
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if st := s.fault.Load(); st != 0 {
		ep := blockhash.Chat // OpenAI's shape
		if r.URL.Path == "/v1/messages" {
			ep = blockhash.Messages
		}
		apiError(w, ep, int(st), "InternalServerError", "simulated fault")
		return
	}
	if k := s.o.APIKey; k != "" && strings.HasPrefix(r.URL.Path, "/v1") && r.Header.Get("Authorization") != "Bearer "+k {
		s.unauthorized.Add(1)
		writeJSON(w, http.StatusUnauthorized, map[string]any{"error": "Unauthorized"}) // vLLM's answer
		return
	}
	s.mux.ServeHTTP(w, r)
}

// Fault makes the replica answer every request, /health included, with
// status; 0 heals it.
func (s *Server) Fault(status int) { s.fault.Store(int32(status)) }

// Restart empties the cache and zeroes the exported counters, as a
// restarted engine would.
func (s *Server) Restart() {
	s.DropCache()
	if s.blend != nil {
		s.blend.clear()
	}
	if s.donor != nil {
		s.donor.clear()
	}
	for _, c := range []*atomic.Int64{&s.queries, &s.hits, &s.promptTotal, &s.genTotal, &s.extQueries, &s.extHits} {
		c.Store(0)
	}
}

// Stats returns the replica's counters.
func (s *Server) Stats() Stats {
	return Stats{
		Requests: s.requests.Load(), Completed: s.completed.Load(), Cancelled: s.cancelled.Load(),
		PromptTokens: s.promptTokens.Load(), CachedTokens: s.cachedTokens.Load(), ReusedTokens: s.reusedTokens.Load(),
		RemoteDecodes: s.remoteDecodes.Load(), Transfers: s.transfers.Load(), Unauthorized: s.unauthorized.Load(),
	}
}

// Options returns the replica's options with defaults filled in.
func (s *Server) Options() Options { return s.o }

// Tokenizer returns the replica's tokenizer.
func (s *Server) Tokenizer() *Tokenizer { return s.tok }

// DropCache empties the prefix cache, as a restart would, and reports
// AllBlocksCleared.
func (s *Server) DropCache() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cache.Purge()
	clear(s.pins)
	s.epoch++
	if s.o.OnKVEvent != nil {
		s.o.OnKVEvent(KVEvent{Type: AllBlocksCleared})
	}
}

// CachedBlocks returns the number of blocks in the prefix cache.
func (s *Server) CachedBlocks() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cache.Len()
}

// listModels answers /v1/models as vLLM does: the base model, then each
// adapter with the base model as its parent.
func (s *Server) listModels(w http.ResponseWriter, _ *http.Request) {
	data := []map[string]any{{"id": s.o.Model, "object": "model", "created": 0, "owned_by": "semroute-sim",
		"root": s.o.Model, "parent": nil, "max_model_len": s.o.MaxModelLen}}
	s.modelsMu.RLock()
	loras := slices.Clone(s.loras)
	s.modelsMu.RUnlock()
	for _, name := range loras {
		data = append(data, map[string]any{"id": name, "object": "model", "created": 0, "owned_by": "semroute-sim",
			"root": name, "parent": s.o.Model, "max_model_len": s.o.MaxModelLen})
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

// model returns the served model a request names.
func (s *Server) model(name string) (model, bool) {
	s.modelsMu.RLock()
	m, ok := s.models[name]
	s.modelsMu.RUnlock()
	return m, ok
}

// loadLoRA answers POST /v1/load_lora_adapter as vLLM does
// ({"lora_name", "lora_path"}): the adapter is served from now on.
func (s *Server) loadLoRA(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string `json:"lora_name"`
		Path string `json:"lora_path"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&req); err != nil || req.Name == "" || req.Path == "" {
		writeError(w, http.StatusBadRequest, "BadRequestError", "Both 'lora_name' and 'lora_path' must be provided.")
		return
	}
	s.modelsMu.Lock()
	if _, dup := s.models[req.Name]; dup {
		s.modelsMu.Unlock()
		writeError(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("The lora adapter '%s' has already been loaded.", req.Name))
		return
	}
	s.loraIDs++
	s.models[req.Name] = model{name: req.Name, lora: req.Name, loraID: s.loraIDs, root: RootHash(req.Name)}
	s.loras = append(s.loras, req.Name)
	s.modelsMu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", req.Name)
}

// unloadLoRA answers POST /v1/unload_lora_adapter as vLLM does
// ({"lora_name"}).
func (s *Server) unloadLoRA(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Name string `json:"lora_name"`
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&req); err != nil || req.Name == "" {
		writeError(w, http.StatusBadRequest, "BadRequestError", "'lora_name' needs to be provided to unload a LoRA adapter.")
		return
	}
	s.modelsMu.Lock()
	m, ok := s.models[req.Name]
	if !ok || m.lora == "" {
		s.modelsMu.Unlock()
		writeError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The lora adapter '%s' cannot be found.", req.Name))
		return
	}
	delete(s.models, req.Name)
	s.loras = slices.DeleteFunc(s.loras, func(n string) bool { return n == req.Name })
	s.modelsMu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	fmt.Fprintf(w, "Success: LoRA adapter '%s' removed successfully.", req.Name)
}

// modelNotFound answers a request of endpoint ep for a model not served.
func modelNotFound(w http.ResponseWriter, ep blockhash.Endpoint, name string) {
	apiError(w, ep, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", name))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError answers an error in OpenAI's shape, as vLLM's ErrorResponse:
// {"error": {"message", "type", "code"}}, typ vLLM's error type
// ("BadRequestError", "NotFoundError", ...).
func writeError(w http.ResponseWriter, status int, typ, msg string) {
	writeJSON(w, status, map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": status}})
}

// apiError answers an error of a request of endpoint ep in its API's
// shape: on /v1/messages Anthropic's, {"type": "error", "error": {"type",
// "message"}}, as vLLM's Anthropic router translates its ErrorResponse
// (vllm/entrypoints/anthropic/api_router.py, translate_error_response:
// the type is vLLM's own, "BadRequestError" and the like, not Anthropic's
// "invalid_request_error"); OpenAI's (writeError) on the others.
func apiError(w http.ResponseWriter, ep blockhash.Endpoint, status int, typ, msg string) {
	if ep != blockhash.Messages {
		writeError(w, status, typ, msg)
		return
	}
	writeJSON(w, status, map[string]any{"type": "error", "error": map[string]any{"type": typ, "message": msg}})
}

// scratch is one request's working memory, reused by later requests so
// that an instant replica makes little garbage: its own collections would
// otherwise show up in every latency measured through it.
type scratch struct {
	body, prompt []byte
	keys         []uint64
	ids, seg     []int32
	spans        []span
}

var scratchPool = sync.Pool{New: func() any { return new(scratch) }}

// readBody reads r's body into buf's memory, growing it as needed.
func readBody(w http.ResponseWriter, r *http.Request, limit int64, buf []byte) ([]byte, error) {
	rd := http.MaxBytesReader(w, r.Body, limit)
	if n := r.ContentLength; n > 0 && n <= limit {
		buf = slices.Grow(buf[:0], int(n))[:n]
		_, err := io.ReadFull(rd, buf)
		return buf, err
	}
	b := bytes.NewBuffer(buf[:0])
	_, err := b.ReadFrom(rd)
	return b.Bytes(), err
}

// lookup appends the chained hashes of the full blocks of ids (a prompt
// for m) to keys[:0] and returns them, the token count, and how many
// leading tokens are cached.
func (s *Server) lookup(ids []int32, m model, keys []uint64) (_ []uint64, tokens, cached int) {
	tokens = max(len(ids), 1)
	bs := s.o.BlockSize
	h := m.root
	keys = keys[:0]
	for off := 0; off+bs <= len(ids); off += bs { // full blocks only
		h = BlockHash(h, ids[off:off+bs])
		keys = append(keys, h)
	}
	s.mu.Lock()
	cached = s.heldLocked(keys) * bs
	s.mu.Unlock()
	// An engine always computes at least the last prompt token.
	if cached >= tokens {
		cached = (tokens - 1) / bs * bs
	}
	return keys, tokens, cached
}

// heldFrom returns how many of keys, from the first, the prefix cache holds.
func (s *Server) heldFrom(keys []uint64) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.heldLocked(keys)
}

// heldLocked is heldFrom with s.mu held.
func (s *Server) heldLocked(keys []uint64) int {
	n := 0
	for n < len(keys) && s.cache.Contains(keys[n]) {
		n++
	}
	return n
}

// store caches a prompt's blocks (see storeLocked) and pins those cached
// for the running request; the returned func unpins them when it ends.
func (s *Server) store(keys []uint64, ids []int32, m model) (unpin func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	held := slices.Clone(s.storeLocked(keys, ids, m))
	for _, k := range held {
		s.pins[k]++
	}
	epoch := s.epoch
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.epoch != epoch {
			return // the cache was dropped, and the pins with it
		}
		// The blocks no other request uses are freed tail first, as vLLM
		// queues them, so that a block goes before its parent.
		for i := len(held) - 1; i >= 0; i-- {
			k := held[i]
			if s.pins[k]--; s.pins[k] <= 0 {
				delete(s.pins, k)
				s.cache.Get(k)
			}
		}
	}
}

// evictLocked evicts the least recently used block no running request
// uses and returns it; ok is false when every block is in use. Blocks in
// use it passes over become the most recently used, as vLLM puts a
// request's blocks at the tail of its free queue when it ends. s.mu must
// be held.
func (s *Server) evictLocked() (key uint64, ok bool) {
	for range s.cache.Len() {
		k, _, ok := s.cache.GetOldest()
		if !ok {
			return 0, false
		}
		if s.pins[k] == 0 {
			s.cache.Remove(k)
			return k, true
		}
		s.cache.Get(k)
	}
	return 0, false
}

// hold counts blocks as held by a running request (negative: released)
// and updates vllm:kv_cache_usage_perc.
func (s *Server) hold(blocks int64) {
	n := s.held.Add(blocks)
	s.usage.Set(min(float64(n)/float64(s.o.NumBlocks), 1))
}

// LastTraceparent returns the traceparent header of the last completion
// request, or "".
func (s *Server) LastTraceparent() string { v, _ := s.traceparent.Load().(string); return v }

// completion is one completion request on its way through the replica:
// what its body asks for, read and checked before it waits for a slot
// (prepare), then what the cache gives its prompt, looked up when its
// prefill turn comes (lookupPrompt). Its prompt and token ids are in sc.
type completion struct {
	ep      blockhash.Endpoint
	agentic bool // the Responses or Messages API, rendered into the chat template
	req     *blockhash.Request
	m       model
	fl      flags
	out     int // output tokens: max_tokens, or Options.OutputTokens, or the tool call's
	// plan is the tool call its answer makes (see planCall); nil: text.
	plan *toolPlan
	// priority is the body's priority (SchedulingPriority only; 0
	// otherwise).
	priority int
	sc       *scratch
	// sample is the prompt's Donor sample; donorKey and donorKeys the
	// most similar earlier prompt's key and blocks' keys (nil: none).
	// Found before the prefill turn: similarity does not change with the
	// cache.
	sample    enginereuse.Sample
	donorKey  uint64
	donorKeys []uint64

	// keys are the prompt's full blocks' hashes; tokens its token count,
	// cached those the prefix cache holds and reused those Blend or Donor
	// gives past them.
	keys                   []uint64
	tokens, cached, reused int
}

// complete answers a completion request of any endpoint: it is read and
// tokenized, waits for a running slot and its prefill turn, computes what
// the cache does not hold, and generates its answer.
func (s *Server) complete(w http.ResponseWriter, r *http.Request, ep blockhash.Endpoint) {
	s.traceparent.Store(r.Header.Get("traceparent"))
	sc := scratchPool.Get().(*scratch)
	defer scratchPool.Put(sc)
	body, ok := s.readRequest(w, r, sc.body, ep)
	sc.body = body
	if !ok {
		return
	}
	req, err := blockhash.Parse(ep, body, blockhash.Limits{})
	if err != nil {
		apiError(w, ep, http.StatusBadRequest, "BadRequestError", err.Error())
		return
	}
	defer req.Recycle()
	c, ok := s.prepare(w, ep, req, sc)
	if !ok {
		return
	}
	s.requests.Add(1)
	ctx := r.Context()
	if s.prio != nil {
		s.completePrioritized(ctx, w, r, &c)
		return
	}
	done, ok := s.schedule(ctx, c.m.lora)
	if !ok {
		s.cancelled.Add(1)
		return
	}
	defer done()

	s.lookupPrompt(&c)
	blocks := int64((c.tokens + c.out + s.o.BlockSize - 1) / s.o.BlockSize)
	s.hold(blocks)
	defer s.hold(-blocks)
	unpin, computed := s.computePrefill(ctx, &c)
	if unpin != nil {
		defer unpin()
	}
	if !computed || !sleep(ctx, s.o.Overhead) {
		s.cancelled.Add(1)
		return
	}
	// vLLM counts the whole prompt, cached or not, once its first token
	// is out (vllm/v1/metrics/stats.py, IterationStats.update_from_output:
	// num_prompt_tokens += prompt_len); what was computed is the prompt less
	// the prefix and external cache hits.
	s.promptTotal.Add(int64(c.tokens))

	if !s.newGeneration(r, &c).answer(ctx, w, &c) {
		s.cancelled.Add(1)
		return
	}
	s.genTotal.Add(int64(c.out))
	s.completed.Add(1)
}

// prepare checks what a parsed completion request asks for (its model, its
// switches, its output and context lengths) and tokenizes its prompt into
// sc, before the request waits for a slot, as vLLM's API server tokenizes
// before the engine schedules. A request refused is answered here, and ok
// is false.
func (s *Server) prepare(w http.ResponseWriter, ep blockhash.Endpoint, req *blockhash.Request, sc *scratch) (c completion, ok bool) {
	c = completion{ep: ep, req: req, sc: sc, out: s.o.OutputTokens,
		agentic: ep == blockhash.Responses || ep == blockhash.Messages}
	if c.m, ok = s.model(req.Model); !ok {
		modelNotFound(w, ep, req.Model)
		return c, false
	}
	if !s.readSwitches(w, &c) {
		return c, false
	}
	if c.agentic && !s.agenticPrompt(w, req, c.fl) {
		return c, false
	}
	if !s.tokenizePrompt(w, &c) {
		return c, false
	}
	if s.blend != nil { // found before the prefill turn, which is one at a time
		sc.spans, sc.seg = s.spans(sc.spans[:0], sc.seg, req, sc.ids, c.m)
	}
	if s.donor != nil { // so is the donor: similarity does not change with the cache
		c.sample, c.donorKey, c.donorKeys = s.donor.find(sc.prompt, c.m.loraID)
	}
	return c, true
}

// tokenizePrompt tokenizes c's prompt into c.sc, plans its tool call if
// its answer makes one (which sets its output length), and checks its
// context length; a request refused is answered here, and ok is false.
func (s *Server) tokenizePrompt(w http.ResponseWriter, c *completion) (ok bool) {
	tokEP, sc := c.ep, c.sc
	if c.agentic { // rendered into the chat template, as vLLM renders them
		tokEP = blockhash.Chat
	}
	sc.ids, sc.prompt = s.tok.promptIDs(sc.ids, sc.prompt, c.req, tokEP, c.fl.chat)
	var err error
	if c.plan, err = planCall(c.req.Parts, c.fl.choice, sc.ids, c.req.MaxTokens); err != nil {
		apiError(w, c.ep, http.StatusBadRequest, "BadRequestError", err.Error())
		return false
	}
	if c.plan != nil {
		c.out = c.plan.tokens()
	}
	maxLen := s.o.MaxModelLen
	if s.prio != nil { // what its KV cache holds
		maxLen = min(maxLen, s.o.NumBlocks*s.o.BlockSize)
	}
	if n := max(len(sc.ids), 1); n+c.out > maxLen {
		apiError(w, c.ep, http.StatusBadRequest, "BadRequestError", fmt.Sprintf(
			"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
			maxLen, n+c.out, n, c.out))
		return false
	}
	return true
}

// readSwitches reads into c the switches of its body that blockhash does
// not read (flags; the priority under SchedulingPriority) and its output
// length; a body whose switches are refused is answered here, and ok is
// false.
func (s *Server) readSwitches(w http.ResponseWriter, c *completion) (ok bool) {
	// The body already parsed as JSON; the few switches read here are read
	// from it with fastjson rather than decoding it all again.
	var err error
	if c.fl, err = readFlags(c.sc.body, c.ep); err != nil {
		apiError(w, c.ep, http.StatusBadRequest, "BadRequestError", err.Error())
		return false
	}
	if s.prio != nil {
		if c.priority, err = readPriority(c.sc.body, c.ep); err != nil {
			apiError(w, c.ep, http.StatusBadRequest, "BadRequestError", err.Error())
			return false
		}
	}
	if c.req.MaxTokens > 0 {
		c.out = c.req.MaxTokens
	}
	if c.out > s.o.MaxOutputTokens {
		apiError(w, c.ep, http.StatusBadRequest, "BadRequestError",
			fmt.Sprintf("max_tokens %d is more than this model allows (%d)", c.out, s.o.MaxOutputTokens))
		return false
	}
	return true
}

// schedule waits for a running slot, then for the prefill turn: until it
// comes the request is waiting, as in vLLM's scheduler, and the cache is
// looked up only then. With ok it returns holding both, the request
// counted as running for adapter lora ("": the base model); done ends its
// run and frees the slot, and the prefill turn is the caller's to release.
// ok is false, holding nothing, when ctx ends first.
func (s *Server) schedule(ctx context.Context, lora string) (done func(), ok bool) {
	s.waiting.Inc()
	s.loraAdd(lora, 1, 0)
	select {
	case s.sem <- struct{}{}:
	case <-ctx.Done():
		s.waiting.Dec()
		s.loraAdd(lora, -1, 0)
		return nil, false
	}
	if !s.prefill.acquire(ctx) {
		s.waiting.Dec()
		s.loraAdd(lora, -1, 0)
		<-s.sem
		return nil, false
	}
	s.waiting.Dec()
	s.running.Inc()
	s.loraAdd(lora, -1, 1)
	return func() {
		s.running.Dec()
		s.loraAdd(lora, 0, -1)
		<-s.sem
	}, true
}

// lookupPrompt finds, with the prefill turn held, what the prefix cache
// holds of c's prompt and what Blend or Donor reuse past it, and counts
// them.
func (s *Server) lookupPrompt(c *completion) {
	c.keys, c.tokens, c.cached = s.lookup(c.sc.ids, c.m, c.sc.keys)
	c.sc.keys = c.keys
	switch {
	case s.blend != nil:
		// An engine always computes at least the last prompt token.
		c.reused = max(min(s.blend.reuse(c.sc.spans, c.cached), c.tokens-1-c.cached), 0)
	case s.donor != nil:
		c.reused = s.donorReuse(c.donorKey, c.donorKeys, c.tokens, c.cached)
	}
	if s.blend != nil || s.donor != nil {
		s.extQueries.Add(int64(c.tokens - c.cached))
		s.extHits.Add(int64(c.reused))
	}
	s.promptTokens.Add(int64(c.tokens))
	s.cachedTokens.Add(int64(c.cached + c.reused))
	s.reusedTokens.Add(int64(c.reused))
	s.queries.Add(int64(c.tokens))
	s.hits.Add(int64(c.cached))
}

// computePrefill takes the prefill's time (the uncached tokens computed,
// or pulled from a prefill replica with do_remote_prefill), then caches
// the prompt's blocks, pinned for the request until unpin, and gives the
// prefill turn to the next request whatever happens. computed is false,
// and nothing stored, when ctx ended first.
func (s *Server) computePrefill(ctx context.Context, c *completion) (unpin func(), computed bool) {
	defer s.prefill.release() // whatever happens, the next prefill's turn comes
	d := time.Duration(c.tokens-c.cached-c.reused) * s.o.PrefillPerToken
	if c.fl.remotePrefill { // pulled from the prefill replica, not computed
		d = s.o.TransferLatency + time.Duration(c.tokens-c.cached)*s.o.TransferPerToken
		s.transfers.Add(1)
	}
	if !sleep(ctx, d) {
		return nil, false
	}
	unpin = s.store(c.keys, c.sc.ids, c.m)
	if s.blend != nil {
		s.blend.put(c.sc.spans)
	}
	if s.donor != nil {
		s.donor.put(c.sample, c.m.loraID, c.keys)
	}
	return unpin, true
}

// newGeneration returns the answer's generator for c, whose prompt is
// computed: its id, its seed (the prompt's last block, so that a replayed
// conversation gets the same replies) and, for a prefill done for a decode
// replica (do_remote_decode, answered whole), where its KV is.
func (s *Server) newGeneration(r *http.Request, c *completion) *generation {
	g := &generation{
		s: s, model: c.m.name, ep: c.ep, req: c.req, tokens: c.tokens, cached: c.cached + c.reused, out: c.out,
		id: fmt.Sprintf("cmpl-%016x", keys0(c.keys)^uint64(time.Now().UnixNano())), seed: keys0(c.keys),
		usage: c.fl.includeUsage,
	}
	if c.plan != nil {
		g.call = c.plan.call(g.word)
	}
	if c.fl.remotePrefill {
		// vLLM counts the tokens its connector brought (all the prompt
		// but its last token, which the decode computes) with its own
		// prefix cache's as cached (NixlConnector.get_num_new_matched_tokens).
		g.cached = max(c.tokens-1, c.cached)
	}
	if c.fl.remoteDecode && !c.req.Stream { // a prefill for a decode replica: where its KV is, in the whole answer alone, as vLLM
		g.kv = s.transferParams(r.Host, len(c.keys))
		s.remoteDecodes.Add(1)
	}
	return g
}

// transferParams returns the kv_transfer_params of a prefill's whole
// answer for a decode replica, as vLLM's NIXL connector gives them: this
// engine, reached at hostport (the request's Host), and the prompt's
// blocks 0 to blocks-1.
func (s *Server) transferParams(hostport string, blocks int) map[string]any {
	host, port, _ := net.SplitHostPort(hostport)
	p, _ := strconv.Atoi(port)
	ids := make([]int, blocks)
	for i := range ids {
		ids[i] = i
	}
	return map[string]any{"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": s.engineID,
		"remote_block_ids": ids, "remote_host": host, "remote_port": p, "tp_size": 1}
}

// answer generates c's answer as its endpoint and stream switch ask; it
// reports whether it all reached the client.
func (g *generation) answer(ctx context.Context, w http.ResponseWriter, c *completion) bool {
	switch {
	case c.agentic:
		g.id, g.echo = agenticID(c.ep, c.fl.requestID), c.fl.echo
		return g.agentic(ctx, w, c.req.Stream)
	case c.req.Stream:
		return g.stream(ctx, w)
	default:
		return g.whole(ctx, w)
	}
}

func keys0(keys []uint64) uint64 {
	if len(keys) == 0 {
		return 0
	}
	return keys[len(keys)-1]
}

func (s *Server) loraAdd(adapter string, wait, run int) {
	if s.lora != nil {
		s.lora.add(adapter, wait, run)
	}
}

// sleep waits d or until ctx ends; it reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool { return sleepUnless(ctx, d, nil) }

// sleepUnless waits d, or until ctx ends or stop closes (nil: never); it
// reports whether d passed.
func sleepUnless(ctx context.Context, d time.Duration, stop <-chan struct{}) bool {
	if d <= 0 {
		select {
		case <-stop:
			return false
		default:
			return ctx.Err() == nil
		}
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
	case <-stop:
	}
	return false
}

type generation struct {
	s              *Server
	model          string // the served name the request asked for
	ep             blockhash.Endpoint
	req            *blockhash.Request
	tokens, cached int
	out            int
	id             string
	seed           uint64
	usage          bool
	// created is when an agentic answer began, in Unix seconds: the
	// created_at of its response.
	created int64
	// echo are the request's fields a Responses answer repeats (see
	// responseEcho); nil for the other APIs.
	echo map[string]any
	// call is the tool call the answer makes, in place of text; nil: text.
	call *toolCall
	kv   map[string]any // kv_transfer_params of a prefill's answer (do_remote_decode); nil: none
	// run paces the output tokens under the priority scheduler; nil
	// under fcfs (InterToken each).
	run *prioritized
}

// word returns output token i: deterministic in the prompt, so a replayed
// conversation gets the same replies.
func (g *generation) word(i int) string {
	return fmt.Sprintf(" w%d", (g.seed+uint64(i)*2654435761)%997)
}

// text returns the generation's output text.
func (g *generation) text() string {
	var sb strings.Builder
	for i := 0; i < g.out; i++ {
		sb.WriteString(g.word(i))
	}
	return sb.String()
}

func (g *generation) usageJSON() map[string]any {
	return map[string]any{
		"prompt_tokens": g.tokens, "completion_tokens": g.out, "total_tokens": g.tokens + g.out,
		"prompt_tokens_details": map[string]any{"cached_tokens": g.cached},
	}
}

func (g *generation) object(stream bool) string {
	switch {
	case g.ep == blockhash.Completion:
		return "text_completion"
	case stream:
		return "chat.completion.chunk"
	}
	return "chat.completion"
}

func (g *generation) choice(text string, finish any, stream bool) map[string]any {
	c := map[string]any{"index": 0, "finish_reason": finish}
	switch {
	case g.ep == blockhash.Completion:
		c["text"] = text
	case stream:
		c["delta"] = map[string]any{"role": "assistant", "content": text}
	default:
		c["message"] = map[string]any{"role": "assistant", "content": text}
	}
	return c
}

func (g *generation) whole(ctx context.Context, w http.ResponseWriter) bool {
	if !g.decodeAll(ctx) {
		return false
	}
	ans := map[string]any{
		"id": g.id, "object": g.object(false), "created": time.Now().Unix(), "model": g.model,
		"choices": []any{g.wholeChoice()}, "usage": g.usageJSON(),
	}
	if g.kv != nil {
		ans["kv_transfer_params"] = g.kv
	}
	writeJSON(w, http.StatusOK, ans)
	return true
}

// wholeChoice is the whole answer's choice: its text, or its tool call
// (a message with no content).
func (g *generation) wholeChoice() map[string]any {
	if g.call == nil {
		return g.choice(g.text(), "length", false)
	}
	return map[string]any{"index": 0, "finish_reason": "tool_calls",
		"message": map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{g.call.chatCall()}}}
}

// streamChoice is the streamed choice of output token i, with the finish
// reason on the last.
func (g *generation) streamChoice(i int) map[string]any {
	var finish any
	switch {
	case i < g.out-1:
	case g.call != nil:
		finish = "tool_calls"
	default:
		finish = "length"
	}
	if g.call == nil {
		return g.choice(g.word(i), finish, true)
	}
	return map[string]any{"index": 0, "finish_reason": finish, "delta": g.call.chatDelta(i)}
}

func (g *generation) stream(ctx context.Context, w http.ResponseWriter) bool {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	chunk := func(choices []any) map[string]any {
		return map[string]any{"id": g.id, "object": g.object(true), "created": time.Now().Unix(), "model": g.model, "choices": choices}
	}
	for i := 0; i < g.out; i++ {
		if i > 0 && !g.decodeNext(ctx, i) {
			return false
		}
		if !send(chunk([]any{g.streamChoice(i)})) {
			return false
		}
	}
	if g.usage {
		c := chunk([]any{})
		c["usage"] = g.usageJSON()
		if !send(c) {
			return false
		}
	}
	if _, err := io.WriteString(w, "data: [DONE]\n\n"); err != nil {
		return false
	}
	return rc.Flush() == nil
}

// Running is a simulated replica serving on a socket.
type Running struct {
	*Server
	URL string // http://host:port
	srv *http.Server
}

// Start serves a new simulated replica on addr ("127.0.0.1:0" picks a port).
func Start(o Options, addr string) (*Running, error) {
	s, err := New(o)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", addr, err)
	}
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return &Running{Server: s, URL: "http://" + ln.Addr().String(), srv: srv}, nil
}

// agenticID returns the id of an answer of the Responses (ep) or Messages
// API: a Responses body's request_id when it has one, as vLLM's
// ResponsesRequest.request_id is the response's id, else a new one.
func agenticID(ep blockhash.Endpoint, requestID string) string {
	switch {
	case ep != blockhash.Responses:
		return "msg_" + rand.Text()
	case requestID != "":
		return requestID
	}
	return "resp_" + rand.Text()
}

// Close stops serving at once, cutting open connections, and closes the
// KV events sockets.
func (r *Running) Close() error { return errors.Join(r.srv.Close(), r.Server.Close()) }

// Close closes the KV events sockets, after sending what is queued; the
// Server must not serve afterwards. Safe to call more than once.
func (s *Server) Close() error {
	var err error
	s.kvOnce.Do(func() {
		if s.kv != nil {
			err = s.kv.close()
		}
	})
	return err
}

// KVEventsEndpoints returns where the KV events are published and
// replayed, or "" when they are not.
func (s *Server) KVEventsEndpoints() (pub, replay string) {
	if s.kv == nil {
		return "", ""
	}
	return s.kv.pub.Endpoint(), s.kv.pub.ReplayEndpoint()
}

// KVEventsSubscribed reports whether a subscriber is connected to the KV
// events (a ZeroMQ subscriber misses what is published before it joins).
func (s *Server) KVEventsSubscribed() bool { return s.kv != nil && s.kv.pub.Subscribed() }

// KVEventsPublished returns the KV event batches sent so far.
func (s *Server) KVEventsPublished() uint64 {
	if s.kv == nil {
		return 0
	}
	return s.kv.sent.Load()
}

// Shutdown stops accepting and waits for requests in flight until ctx ends.
func (r *Running) Shutdown(ctx context.Context) error { return r.srv.Shutdown(ctx) }
