// Package configs holds the example configurations and the loader: a YAML
// file, then SEMROUTE_* environment variables, then flags, each overriding
// the one before, with defaults and validation whose errors name the field.
//
// Only this package and cmd/router know about viper; the domain packages take
// plain options built from a Config.
package configs

import (
	_ "embed"
	"errors"
	"fmt"
	goyaml "github.com/goccy/go-yaml"
	"maps"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/go-viper/mapstructure/v2"
	"github.com/spf13/viper"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/decisionlog"
	"github.com/semroute/semroute/eviction"
	"github.com/semroute/semroute/flow"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/matcher"
	"github.com/semroute/semroute/monitor"
	"github.com/semroute/semroute/plugin"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
	"github.com/semroute/semroute/tokenizer"
)

// DemoYAML is the embedded configuration of `router demo`.
//
//go:embed demo.yaml
var DemoYAML []byte

// ExampleYAML is the documented example configuration, router.yaml.
//
//go:embed router.yaml
var ExampleYAML []byte

// Config is the router's whole configuration.
type Config struct {
	Listen string `mapstructure:"listen" json:"listen"`
	// GRPCListen serves the gRPC Route API; empty means off.
	GRPCListen  string            `mapstructure:"grpc_listen" json:"grpc_listen"`
	GRPC        GRPCConfig        `mapstructure:"grpc" json:"grpc"`
	DecisionLog DecisionLogConfig `mapstructure:"decision_log" json:"decision_log"`
	Log         LogConfig         `mapstructure:"log" json:"log"`
	Routing     RoutingConfig     `mapstructure:"routing" json:"routing"`
	Blocks      BlocksConfig      `mapstructure:"blocks" json:"blocks"`
	Cache       CacheConfig       `mapstructure:"cache" json:"cache"`
	Tokenizer   TokenizerConfig   `mapstructure:"tokenizer" json:"tokenizer"`
	Limits      LimitsConfig      `mapstructure:"limits" json:"limits"`
	Health      HealthConfig      `mapstructure:"health" json:"health"`
	Timeouts    TimeoutConfig     `mapstructure:"timeouts" json:"timeouts"`
	Admin       AdminConfig       `mapstructure:"admin" json:"admin"`
	Auth        AuthConfig        `mapstructure:"auth" json:"auth"`
	Metrics     MetricsConfig     `mapstructure:"metrics" json:"metrics"`
	Tracing     TracingConfig     `mapstructure:"tracing" json:"tracing"`
	Discovery   DiscoveryConfig   `mapstructure:"discovery" json:"discovery"`
	Runtime     RuntimeConfig     `mapstructure:"runtime" json:"runtime"`
	Cluster     ClusterConfig     `mapstructure:"cluster" json:"cluster"`
	FlowControl FlowControlConfig `mapstructure:"flow_control" json:"flow_control"`
	// Disaggregation tunes prefill/decode disaggregation, which replicas
	// of role prefill turn on.
	Disaggregation DisaggregationConfig `mapstructure:"disaggregation" json:"disaggregation"`
	Replicas       []Replica            `mapstructure:"replicas" json:"replicas"`
}

// FlowControlConfig is the router's queue (package flow): a request whose
// best replica is saturated waits in the router instead of in that
// engine's queue, and is decided again when a slot is free for it. Read at
// start only.
type FlowControlConfig struct {
	// Enabled turns the queue on (the default for a lone router; off by
	// default in a fleet, cluster.urls, whose queues do not share their
	// reservations yet): a request that could not start within its
	// deadline is refused at once (429, Retry-After), one that waits does
	// so in the router, by priority and fair between tenants. Off: every
	// request goes to a replica at once, and engines queue.
	Enabled bool `mapstructure:"enabled" json:"enabled"`
	// MaxRequests, MaxBytes and TTL bound the queue; past them a request
	// is answered 429 with Retry-After. Defaults 5,000, 1 GiB and 60 s.
	MaxRequests int           `mapstructure:"max_requests" json:"max_requests"`
	MaxBytes    int64         `mapstructure:"max_bytes" json:"max_bytes"`
	TTL         time.Duration `mapstructure:"ttl" json:"ttl"`
	// LookAhead is how many of a flow's oldest requests a freed replica
	// compares; AgeBound how much younger than the oldest a request may be
	// and still go before it. Defaults 32 and 2 s.
	LookAhead int           `mapstructure:"look_ahead" json:"look_ahead"`
	AgeBound  time.Duration `mapstructure:"age_bound" json:"age_bound"`
	// Priorities maps an inference objective (the x-gateway-inference-
	// objective or x-llm-d-inference-objective header) to its priority:
	// higher first; negative: sheddable, never queued. Others: 0.
	Priorities map[string]int `mapstructure:"priorities" json:"priorities"`
	// TTFTTargets maps an inference objective to its time-to-first-token
	// target: a request of it that the queue predicts could not start
	// within the target is refused at once (429, Retry-After), as one past
	// the TTL is. Others: the TTL.
	TTFTTargets map[string]time.Duration `mapstructure:"ttft_targets" json:"ttft_targets"`
	// Reserve is how many slots of the pool a request keeps free for the
	// higher priorities while they arrive, on as few replicas as they go
	// to: 0 (the default) sizes it by their expected concurrency m (their
	// rate times the seconds a request holds a slot), m + √m; a positive
	// value is that many slots; a negative one keeps none.
	Reserve int `mapstructure:"reserve" json:"reserve"`
}

// DisaggregationConfig is prefill/decode disaggregation's (router.PDOptions).
type DisaggregationConfig struct {
	// MinPrefillTokens: a request whose decode replica would compute less
	// of its prompt than this goes to that replica alone (conditional
	// disaggregation). Negative: every request is disaggregated. Default
	// 256.
	MinPrefillTokens int `mapstructure:"min_prefill_tokens" json:"min_prefill_tokens"`
}

// ClusterConfig makes the router one of a fleet sharing one cache picture
// over NATS (package cluster). No URLs: the router is alone. Read at start
// only.
type ClusterConfig struct {
	// URLs of the NATS servers (nats://host:4222 or tls://…).
	URLs []string `mapstructure:"urls" json:"urls"`
	// ID names this router to its peers; default the host name (a pod's
	// name in Kubernetes), which must differ between routers.
	ID string `mapstructure:"id" json:"id"`
	// Prefix starts the fleet's NATS subjects. Default "semroute".
	Prefix string `mapstructure:"prefix" json:"prefix"`
	// Credentials is a NATS credentials file (JWT and nkey seed);
	// NkeySeed a file holding an nkey's seed; User and Password, or Token,
	// are for servers with simple auth. One of them, or a client
	// certificate (CertFile), is required unless Insecure is set.
	Credentials string `mapstructure:"credentials" json:"credentials"`
	NkeySeed    string `mapstructure:"nkey_seed" json:"nkey_seed"`
	User        string `mapstructure:"user" json:"user"`
	Password    string `mapstructure:"password" json:"-"`
	Token       string `mapstructure:"token" json:"-"`
	// TLS: a CA to trust, and a client certificate and key for servers
	// that ask for one.
	CAFile   string `mapstructure:"ca_file" json:"ca_file"`
	CertFile string `mapstructure:"cert_file" json:"cert_file"`
	KeyFile  string `mapstructure:"key_file" json:"key_file"`
	// Insecure lets the router join NATS without authenticating: anyone
	// who reaches the server can then steer or stop the fleet's routing.
	// The router warns at start and every 5 minutes.
	Insecure bool `mapstructure:"insecure" json:"insecure"`
	// FlushInterval is how long a record may wait to be batched (default
	// 2ms); BufferBytes bounds the records waiting (default 4 MiB: past it
	// they are dropped and counted).
	FlushInterval time.Duration `mapstructure:"flush_interval" json:"flush_interval"`
	BufferBytes   int           `mapstructure:"buffer_bytes" json:"buffer_bytes"`
	// PeerTimeout is the silence after which a peer is gone and its
	// requests in flight stop counting (default 5s).
	PeerTimeout time.Duration `mapstructure:"peer_timeout" json:"peer_timeout"`
}

// RuntimeConfig tunes the Go runtime under the router. Read at start only.
type RuntimeConfig struct {
	// GCFloorMB is a heap size in MiB below which the garbage collector is
	// paced as if the heap had reached it: while the live heap is small,
	// GOGC is raised after each collection so that the next one comes when
	// the heap reaches about GCFloorMB; a larger live heap is collected at
	// the usual GOGC=100. It trades up to this much memory for far fewer
	// collections in a router whose cache picture is still small. 0 turns
	// it off, as does setting the GOGC environment variable (then obeyed).
	GCFloorMB int `mapstructure:"gc_floor_mb" json:"gc_floor_mb"`
}

// TracingConfig turns on OpenTelemetry spans exported over OTLP/HTTP.
type TracingConfig struct {
	// OTLPEndpoint is the collector's URL, e.g. http://otel-collector:4318;
	// empty turns tracing off (an incoming traceparent still passes through).
	OTLPEndpoint string  `mapstructure:"otlp_endpoint" json:"otlp_endpoint"`
	ServiceName  string  `mapstructure:"service_name" json:"service_name"`
	SampleRatio  float64 `mapstructure:"sample_ratio" json:"sample_ratio"`
}

// DiscoveryConfig finds replicas in DNS, next to the static list.
type DiscoveryConfig struct {
	// DNSName is resolved every Interval: with SRV true as an SRV name
	// (targets and ports from the records), else as a host whose A/AAAA
	// records are the replicas, on Port. Empty turns discovery off.
	DNSName  string        `mapstructure:"dns_name" json:"dns_name"`
	SRV      bool          `mapstructure:"srv" json:"srv"`
	Port     int           `mapstructure:"port" json:"port"`
	Scheme   string        `mapstructure:"scheme" json:"scheme"`
	Interval time.Duration `mapstructure:"interval" json:"interval"`
	// BudgetTokens for discovered replicas; 0 learns it from each
	// replica's vllm:cache_config_info.
	BudgetTokens int64 `mapstructure:"budget_tokens" json:"budget_tokens"`
	// Kubernetes finds the replicas through the Kubernetes API (package
	// kubedisc), in the router's own namespace unless Namespace is set:
	// the ready endpoints of Service's EndpointSlices, the ready pods of
	// Selector, or the ready pods of InferencePool. All empty: off.
	// Scheme and BudgetTokens apply; Port is the pods' port (Selector; an
	// InferencePool without a target port).
	Kubernetes KubernetesDiscovery `mapstructure:"kubernetes" json:"kubernetes"`
	// KVEvents, if set, keeps every discovered replica's cache picture
	// from its engine's KV events, as replicas[].kv_events does one's:
	// with listen, the router binds one address every engine dials, and
	// tells them apart by llm-d's topic "kv@<host>:<port>@" of each
	// replica's address (topic must then be empty); with endpoint (and
	// replay_endpoint), it dials each replica's engine at the address
	// with "{host}" replaced by the replica's host, e.g.
	// "tcp://{host}:5557". Zero: no events, the picture is approximate.
	KVEvents KVEventsConfig `mapstructure:"kv_events" json:"kv_events"`
	// DataParallelSize is the data-parallel ranks of every discovered
	// engine, as replicas[].data_parallel_size. 0 or 1: one.
	DataParallelSize int `mapstructure:"data_parallel_size" json:"data_parallel_size"`
}

// KubernetesDiscovery: see DiscoveryConfig.Kubernetes.
type KubernetesDiscovery struct {
	Namespace     string `mapstructure:"namespace" json:"namespace"`
	Service       string `mapstructure:"service" json:"service"`
	PortName      string `mapstructure:"port_name" json:"port_name"` // the EndpointSlice port (Service); empty: the first
	Selector      string `mapstructure:"selector" json:"selector"`
	InferencePool string `mapstructure:"inference_pool" json:"inference_pool"`
	// PoolAPI is the InferencePool's API version: v1 (inference.networking.k8s.io)
	// or v1alpha2 (inference.networking.x-k8s.io).
	PoolAPI string `mapstructure:"pool_api" json:"pool_api"`
	// MaxReplicas bounds the replicas discovered; past it the ones listed
	// stay and new ones wait, with one warning. 0: kubedisc's default
	// (1,024).
	MaxReplicas int `mapstructure:"max_replicas" json:"max_replicas"`
	// TrustedManagers are EndpointSlice managers (the
	// endpointslice.kubernetes.io/managed-by label) trusted beside
	// Kubernetes' own controllers, for their slices' endpoints that name
	// a pod (a service mesh's controller, say). Empty: Kubernetes' alone.
	TrustedManagers []string `mapstructure:"trusted_managers" json:"trusted_managers"`
}

// On reports whether Kubernetes discovery is configured.
func (k KubernetesDiscovery) On() bool {
	return k.Service != "" || k.Selector != "" || k.InferencePool != ""
}

// HealthConfig sets active checks, scraping and passive ejection.
type HealthConfig struct {
	CheckInterval time.Duration `mapstructure:"check_interval" json:"check_interval"`
	CheckTimeout  time.Duration `mapstructure:"check_timeout" json:"check_timeout"`
	Fall          int           `mapstructure:"fall" json:"fall"`
	Rise          int           `mapstructure:"rise" json:"rise"`
	// ScrapeInterval reads each replica's /metrics; 0 turns it off.
	ScrapeInterval time.Duration `mapstructure:"scrape_interval" json:"scrape_interval"`
	EjectBase      time.Duration `mapstructure:"eject_base" json:"eject_base"`
	EjectMax       time.Duration `mapstructure:"eject_max" json:"eject_max"`
	EjectForgive   time.Duration `mapstructure:"eject_forgive" json:"eject_forgive"`
	// Soft failures (500 or 504 answers, timeouts, a replica silent
	// mid-answer) eject a replica only when EjectConsecutive come in a row
	// among at least EjectMinVolume answers of the last 10 to 20 s, of
	// which EjectFailureShare percent failed (Envoy's failure_percentage),
	// from at least EjectMinSources client addresses (replica.Ejection);
	// refused or reset connections and 502 or 503 answers eject at once.
	EjectConsecutive  int `mapstructure:"eject_consecutive" json:"eject_consecutive"`
	EjectMinVolume    int `mapstructure:"eject_min_volume" json:"eject_min_volume"`
	EjectFailureShare int `mapstructure:"eject_failure_share" json:"eject_failure_share"`
	EjectMinSources   int `mapstructure:"eject_min_sources" json:"eject_min_sources"`
	// EjectTimeouts timeouts in a row with no answer between (a prefill
	// past its bound) eject a replica
	// whatever the traffic's volume or sources: a hung replica, seen at
	// low traffic (replica.Ejection.Timeouts).
	EjectTimeouts int `mapstructure:"eject_timeouts" json:"eject_timeouts"`
}

// Ejection is the passive ejection h describes.
func (h HealthConfig) Ejection() replica.Ejection {
	return replica.Ejection{Base: h.EjectBase, Max: h.EjectMax, Forgive: h.EjectForgive, Consecutive: h.EjectConsecutive,
		MinVolume: h.EjectMinVolume, FailureShare: h.EjectFailureShare, MinSources: h.EjectMinSources, Timeouts: h.EjectTimeouts}
}

// TimeoutConfig bounds each upstream request and shutdown.
type TimeoutConfig struct {
	Connect       time.Duration `mapstructure:"connect" json:"connect"`
	FirstByte     time.Duration `mapstructure:"first_byte" json:"first_byte"`
	Idle          time.Duration `mapstructure:"idle" json:"idle"`
	ClientWrite   time.Duration `mapstructure:"client_write" json:"client_write"`
	ShutdownGrace time.Duration `mapstructure:"shutdown_grace" json:"shutdown_grace"`
	// PrefillFloor and PrefillTokensPerSecond bound a disaggregated
	// request's prefill: its whole answer within PrefillFloor plus its
	// uncached prompt at PrefillTokensPerSecond, at most FirstByte; past
	// it the request goes to its decode replica (limits.Timeouts).
	PrefillFloor           time.Duration `mapstructure:"prefill_floor" json:"prefill_floor"`
	PrefillTokensPerSecond float64       `mapstructure:"prefill_tokens_per_second" json:"prefill_tokens_per_second"`
}

// GRPCConfig secures and bounds the gRPC API. With grpc_listen set, a
// token or a client CA (mTLS) is required.
type GRPCConfig struct {
	// Token is the bearer token every call must carry in its
	// "authorization" metadata; the health service needs none. Reloadable.
	Token string `mapstructure:"token" json:"token"`
	// TLSCertFile and TLSKeyFile serve TLS; TLSClientCAFile also requires
	// and verifies client certificates (mTLS). Empty: plaintext.
	TLSCertFile     string `mapstructure:"tls_cert_file" json:"tls_cert_file"`
	TLSKeyFile      string `mapstructure:"tls_key_file" json:"tls_key_file"`
	TLSClientCAFile string `mapstructure:"tls_client_ca_file" json:"tls_client_ca_file"`
	// ExtProcWithoutToken lets the endpoint picker (Envoy's ext_proc
	// service) be called without the token: the gateways of the Gateway
	// API Inference Extension call their picker over TLS without
	// credentials. The Router service still takes the token. Reloadable.
	ExtProcWithoutToken bool `mapstructure:"ext_proc_without_token" json:"ext_proc_without_token"`
	// ExtProcMaxBufferedBytes caps the bytes of request bodies the
	// endpoint picker buffers at once across all of its streams; past it
	// a request is answered 429. At least limits.max_body_bytes. Read at
	// start.
	ExtProcMaxBufferedBytes int64 `mapstructure:"ext_proc_max_buffered_bytes" json:"ext_proc_max_buffered_bytes"`
	// MaxUnreleasedDecisions and MaxUnreleasedBlocks cap the Route
	// decisions awaiting Release and the prompt blocks they keep; past
	// either, the oldest is finished as expired. The old spellings
	// max_unreleased_decisions and max_unreleased_blocks still set them.
	MaxUnreleasedDecisions int `mapstructure:"max_unreleased_decisions" json:"max_unreleased_decisions"`
	MaxUnreleasedBlocks    int `mapstructure:"max_unreleased_blocks" json:"max_unreleased_blocks"`
	// HeldDecisions and HeldBlocks are MaxUnreleasedDecisions and
	// MaxUnreleasedBlocks under the names they had first, still read.
	HeldDecisions *int `mapstructure:"max_held_decisions" json:"-"`
	HeldBlocks    *int `mapstructure:"max_held_blocks" json:"-"`
}

// AdminConfig sets the admin API's listener and bearer token; the API is
// off unless both are set.
type AdminConfig struct {
	Listen string `mapstructure:"listen" json:"listen"`
	Token  string `mapstructure:"token" json:"token"`
}

// AuthConfig is the API keys the router checks itself, and the one it
// sends the replicas.
type AuthConfig struct {
	// APIKeysFile is a YAML file of hashed client keys, each with its
	// tenant (package apikey); the router follows changes to it. Empty:
	// clients' keys are not checked (they reach the replicas unless
	// UpstreamAPIKey replaces them).
	APIKeysFile string `mapstructure:"api_keys_file" json:"api_keys_file"`
	// UpstreamAPIKey, if set, is sent to every replica as "Authorization:
	// Bearer" (vLLM's --api-key), in place of whatever the client sent;
	// clients never see it. Best from SEMROUTE_AUTH_UPSTREAM_API_KEY.
	UpstreamAPIKey string `mapstructure:"upstream_api_key" json:"upstream_api_key"`
}

// MetricsConfig says where the router's Prometheus metrics are served and
// what they may name. Read at start only.
type MetricsConfig struct {
	// Listener serves GET /metrics on the main listener ("main", the
	// default: unauthenticated, as Prometheus scrapes) or on the admin
	// listener only ("admin": behind admin.token, which Prometheus then
	// sends as its bearer token).
	Listener string `mapstructure:"listener" json:"listener"`
	// TenantLabels names the tenants in semroute_tenant_requests_total:
	// "hash" (the default: t- and a hash of the name; `router hashkey
	// --tenant NAME` prints it), "name", or "omit" (one series, all).
	TenantLabels string `mapstructure:"tenant_labels" json:"tenant_labels"`
}

// LogConfig selects the log format and level.
type LogConfig struct {
	Level  string `mapstructure:"level" json:"level"`   // debug, info, warn, error
	Format string `mapstructure:"format" json:"format"` // text or json
}

// RoutingConfig selects and tunes the routing policy.
type RoutingConfig struct {
	// Policy is the routing policy and its own parameters:
	// `policy: {type: dynamo, params: {temperature: 0.5}}`, or only its
	// type (`policy: semantic`). LoadWeight, RecentWeight, SpillFactor and
	// SpillMarginTokens are the semantic policy's parameters by their older
	// keys; its params win over them.
	Policy            routing.PolicySpec `mapstructure:"policy" json:"policy"`
	LoadWeight        float64            `mapstructure:"load_weight" json:"load_weight"`
	RecentWeight      float64            `mapstructure:"recent_weight" json:"recent_weight"`
	SpillFactor       float64            `mapstructure:"spill_factor" json:"spill_factor"`
	SpillMarginTokens float64            `mapstructure:"spill_margin_tokens" json:"spill_margin_tokens"`
	LoadHalfLife      time.Duration      `mapstructure:"load_half_life" json:"load_half_life"`
	Attempts          int                `mapstructure:"attempts" json:"attempts"`
	RecordReplies     bool               `mapstructure:"record_replies" json:"record_replies"`
	KindWeights       map[string]float64 `mapstructure:"kind_weights" json:"kind_weights"`
	// SharedActive counts blocks shared by running requests once in a
	// replica's KV load (engines with cascade attention).
	SharedActive bool          `mapstructure:"shared_active" json:"shared_active"`
	Seed         uint64        `mapstructure:"seed" json:"seed"`
	Matcher      MatcherConfig `mapstructure:"semantic_matcher" json:"semantic_matcher"`
	// Arms split traffic between policies (A/B); empty means one arm with
	// Policy. Assignment is sticky per session, salted with ArmSalt.
	Arms    []ArmConfig `mapstructure:"arms" json:"arms"`
	ArmSalt string      `mapstructure:"arm_salt" json:"arm_salt"`
	// ReleaseAfter ends a gRPC decision never released.
	ReleaseAfter time.Duration `mapstructure:"release_after" json:"release_after"`
}

// ArmConfig is one A/B arm: a routing policy with its parameters, in the
// shape of routing.policy, and its share of sessions. The semantic policy's
// parameters default to the routing section's; the arm's own older keys
// (load_weight, ...) and then its params override them.
type ArmConfig struct {
	Name              string             `mapstructure:"name" json:"name"`
	Policy            routing.PolicySpec `mapstructure:"policy" json:"policy"`
	Weight            float64            `mapstructure:"weight" json:"weight"`
	LoadWeight        *float64           `mapstructure:"load_weight" json:"load_weight"`
	RecentWeight      *float64           `mapstructure:"recent_weight" json:"recent_weight"`
	SpillFactor       *float64           `mapstructure:"spill_factor" json:"spill_factor"`
	SpillMarginTokens *float64           `mapstructure:"spill_margin_tokens" json:"spill_margin_tokens"`
}

// DecisionLogConfig configures the JSONL decision log.
type DecisionLogConfig struct {
	Path          string        `mapstructure:"path" json:"path"` // empty: no log
	MaxBytes      int64         `mapstructure:"max_bytes" json:"max_bytes"`
	MaxFiles      int           `mapstructure:"max_files" json:"max_files"`
	Buffer        int           `mapstructure:"buffer" json:"buffer"`
	FsyncInterval time.Duration `mapstructure:"fsync_interval" json:"fsync_interval"`
	// RawIDs logs session and tenant ids as given, not hashed.
	RawIDs bool `mapstructure:"raw_ids" json:"raw_ids"`
	// LogPrompts logs prompt text with each decision.
	LogPrompts bool `mapstructure:"log_prompts" json:"log_prompts"`
}

// MatcherConfig turns on the semantic fallback.
type MatcherConfig struct {
	Enabled bool `mapstructure:"enabled" json:"enabled"`
	// Threshold: ask the matcher when the best exact match covers less than
	// this share of the prompt.
	Threshold     float64 `mapstructure:"threshold" json:"threshold"`
	MinSimilarity float64 `mapstructure:"min_similarity" json:"min_similarity"`
	MaxDonors     int     `mapstructure:"max_donors" json:"max_donors"`
}

// BlocksConfig sets how prompts are cut.
type BlocksConfig struct {
	BlockTokens   int `mapstructure:"block_tokens" json:"block_tokens"`
	BytesPerToken int `mapstructure:"bytes_per_token" json:"bytes_per_token"`
}

// CacheConfig sets the cache picture.
type CacheConfig struct {
	// Eviction is the picture's eviction policy and its parameters:
	// `eviction: vllm`, or `{type: kind_adaptive, params: {...}}`.
	Eviction            plugin.Spec `mapstructure:"eviction" json:"eviction"`
	DefaultBudgetTokens int64       `mapstructure:"default_budget_tokens" json:"default_budget_tokens"`
	// MaxBudgetTokens bounds the budget a replica reports
	// (vllm:cache_config_info), in tokens: more is clamped, warned about
	// and counted. Default 8,388,608 (monitor.DefaultMaxBudget).
	MaxBudgetTokens int64 `mapstructure:"max_budget_tokens" json:"max_budget_tokens"`
	// Feedback corrects the picture of a replica without KV events from
	// the cached tokens its engine reports (default true).
	Feedback bool `mapstructure:"feedback" json:"feedback"`
	// ResponseChainsBytes bounds the memory, in bytes, kept of the
	// conversations stored Responses API responses hold, to route a
	// request continuing one (previous_response_id) on its whole prompt.
	// 0: 64 MiB; -1: none kept (continuations are routed on their new
	// input).
	ResponseChainsBytes int64 `mapstructure:"response_chains_bytes" json:"response_chains_bytes"`
}

// TokenizerConfig chooses how prompts are counted. Read at start only.
type TokenizerConfig struct {
	// Mode is "auto" (the default), "replica" or "estimate". "estimate"
	// cuts text by bytes per token, scaled to the engine's unit as its
	// usage reports arrive. "replica" and "auto" are precise: every
	// request's engine token ids from a replica's vLLM POST /tokenize, cut
	// into the engine's blocks, keyed as its KV events are; a replica whose
	// /tokenize fails, or whose counts disagree with the prompt_tokens its
	// engine reports, is not asked (package agreement), and a request no
	// replica can tokenize is routed on the estimate. "replica" is kept as
	// the old spelling of "auto".
	Mode string `mapstructure:"mode" json:"mode"`
	// BlockTokens is the engine's KV block size in tokens (vLLM's
	// --block-size). Default 16.
	BlockTokens int `mapstructure:"block_tokens" json:"block_tokens"`
	// Timeout bounds one /tokenize call; past it the request is routed on
	// the estimate. Default 50ms.
	Timeout time.Duration `mapstructure:"timeout" json:"timeout"`
	// URL is the server to ask; empty means any available replica.
	URL string `mapstructure:"url" json:"url"`
	// CacheTokens bounds the token ids cached (4 bytes each). Default
	// 4,194,304.
	CacheTokens int `mapstructure:"cache_tokens" json:"cache_tokens"`
}

// KVEventsConfig is where a replica's engine publishes its KV events
// (vLLM's --kv-events-config with the zmq publisher).
type KVEventsConfig struct {
	// Endpoint is the engine's bound PUB socket, which the router dials,
	// e.g. tcp://10.0.0.5:5557 (vLLM binds when its own endpoint has a
	// wildcard: "endpoint": "tcp://*:5557"). "{host}" in it (and in
	// ReplayEndpoint) is the host of the replica's URL. Empty: none.
	Endpoint string `mapstructure:"endpoint" json:"endpoint"`
	// Listen, instead of Endpoint, is an address the router binds and the
	// engine dials, e.g. tcp://0.0.0.0:5557 (vLLM dials when its endpoint
	// names a host: "endpoint": "tcp://router:5557"; llm-d deploys it so,
	// and llm-d's simulator always dials). Replicas may share one Listen
	// address: each is then told apart by Topic.
	Listen string `mapstructure:"listen" json:"listen"`
	// ReplayEndpoint is the engine's replay socket, e.g. tcp://10.0.0.5:5558.
	ReplayEndpoint string `mapstructure:"replay_endpoint" json:"replay_endpoint"`
	// Topic is the topic subscribed to, a prefix ("" receives all; vLLM's
	// default topic is ""). With Listen it defaults to llm-d's
	// "kv@<host>:<port>@" of the replica's URL.
	Topic string `mapstructure:"topic" json:"topic"`
	// DataParallelRank is the engine's data-parallel rank whose batches
	// are followed (vLLM's data_parallel_rank; 0, the default, also takes
	// batches without one); -1 follows every rank.
	DataParallelRank int `mapstructure:"data_parallel_rank" json:"data_parallel_rank"`
}

// LimitsConfig bounds request input. Reloadable.
type LimitsConfig struct {
	MaxBodyBytes    int64 `mapstructure:"max_body_bytes" json:"max_body_bytes"`
	MaxMessages     int   `mapstructure:"max_messages" json:"max_messages"`
	MaxHeaderBytes  int   `mapstructure:"max_header_bytes" json:"max_header_bytes"`
	MaxOutputTokens int   `mapstructure:"max_output_tokens" json:"max_output_tokens"`
	// MaxBodyBytesInFlight caps the bytes of the HTTP request bodies held
	// at once, across requests; past it a request gets 503 (see
	// limits.Request.MaxBodyBytesInFlight).
	MaxBodyBytesInFlight int64 `mapstructure:"max_body_bytes_in_flight" json:"max_body_bytes_in_flight"`
	// MaxJSONDepth bounds the nesting of arrays and objects in a request
	// body; a deeper body gets 400 as soon as the limit is passed.
	MaxJSONDepth int `mapstructure:"max_json_depth" json:"max_json_depth"`
	// MaxJSONValues bounds the values (strings, numbers, literals, arrays,
	// objects) in one body; MaxJSONValuesInFlight those of the large bodies
	// (over 4,096 values) being parsed at once, whose parse trees cost
	// about 300-450 bytes a value: past it a large body gets 503.
	MaxJSONValues         int   `mapstructure:"max_json_values" json:"max_json_values"`
	MaxJSONValuesInFlight int64 `mapstructure:"max_json_values_in_flight" json:"max_json_values_in_flight"`
}

// Replica is one static replica. The admin API reads the same fields,
// under the same names, from JSON.
type Replica struct {
	Name         string  `mapstructure:"name" json:"name"`
	URL          string  `mapstructure:"url" json:"url"`
	BudgetTokens int64   `mapstructure:"budget_tokens" json:"budget_tokens"`
	Weight       float64 `mapstructure:"weight" json:"weight"`
	// KVEvents, if set, keeps the replica's cache picture from its
	// engine's KV events.
	KVEvents KVEventsConfig `mapstructure:"kv_events" json:"kv_events"`
	// Reuse is what the replica's engine reuses beyond the exact prefix.
	Reuse ReuseConfig `mapstructure:"reuse" json:"reuse"`
	// MaxRunning is how many requests the replica's engine runs at once
	// before it queues (vLLM's --max-num-seqs); 0: learned from what it
	// reports.
	MaxRunning int64 `mapstructure:"max_running" json:"max_running,omitempty"`
	// Role is the replica's part in prefill/decode disaggregation:
	// prefill, decode or both (the default: a whole engine). With any
	// prefill replica, the requests of the models it serves are
	// disaggregated (see docs/prefill-decode.md).
	Role string `mapstructure:"role" json:"role,omitempty"`
	// DataParallelSize is how many data-parallel ranks the replica's
	// engine runs behind its URL (vLLM's --data-parallel-size, SGLang's
	// --dp-size): each rank is routed to as a replica of its own, named
	// "<name>-dp<rank>", with its own cache picture (budget_tokens is one
	// rank's), and its requests carry the X-data-parallel-rank header.
	// Its kv_events addresses are rank 0's; rank k's ports are k higher,
	// as vLLM binds them. 0 or 1: one rank.
	DataParallelSize int `mapstructure:"data_parallel_size" json:"data_parallel_size,omitempty"`
	// Scheduling is the replica's engine's scheduling policy, vLLM's
	// --scheduling-policy: fcfs (the default) or priority. The router
	// sends a priority engine each request's priority (the negation of
	// its flow-control priority: vLLM serves lower first); it never
	// forwards a client's own.
	Scheduling string `mapstructure:"scheduling" json:"scheduling,omitempty"`
}

// ReuseConfig is an engine's reuse of KV beyond the exact prefix
// (replica.Reuse, whose fields it has in the same order: Spec converts
// it). The zero value: the exact prefix alone. A blending replica must be
// in the config when the router starts.
type ReuseConfig struct {
	// Mode is "prefix" (or empty), "blend" (position-independent
	// segments, as CacheBlend in LMCache) or "donor" (a similar earlier
	// prompt's KV, as SGLang's SemanticPrefixProvider).
	Mode string `mapstructure:"mode" json:"mode,omitempty"`
	// Recompute is blend's recomputed share; 0: 0.15.
	Recompute float64 `mapstructure:"recompute" json:"recompute,omitempty"`
	// BudgetTokens is the tokens of segments the engine keeps for
	// blending; 0: the replica's budget.
	BudgetTokens int64 `mapstructure:"budget_tokens" json:"budget_tokens,omitempty"`
	// MinSimilarity is donor's least similarity of a donor the engine
	// reuses, in [0, 1]; 0: 0.5.
	MinSimilarity float64 `mapstructure:"min_similarity" json:"min_similarity,omitempty"`
}

// DefaultBudgetTokens is the KV cache budget, in tokens, assumed for a
// replica whose budget is neither configured nor reported
// (vllm:cache_config_info): 262,144 tokens, a mid-sized GPU's cache.
const DefaultBudgetTokens = 1 << 18

// SetDefaults registers every key's default on v, which also makes every key
// settable from the environment.
func SetDefaults(v *viper.Viper) {
	v.SetDefault("listen", "127.0.0.1:8080")
	v.SetDefault("log.level", "info")
	v.SetDefault("log.format", "text")
	v.SetDefault("routing.policy", "semantic")
	v.SetDefault("routing.load_weight", routing.DefaultLoadWeight)
	v.SetDefault("routing.recent_weight", routing.DefaultRecentWeight)
	v.SetDefault("routing.spill_factor", routing.DefaultSpillFactor)
	v.SetDefault("routing.spill_margin_tokens", routing.DefaultSpillMarginTokens)
	v.SetDefault("routing.load_half_life", replica.DefaultHalfLife)
	v.SetDefault("routing.attempts", routing.DefaultAttempts)
	v.SetDefault("routing.record_replies", true)
	v.SetDefault("routing.kind_weights", map[string]float64{})
	v.SetDefault("routing.shared_active", false)
	v.SetDefault("routing.seed", 0)
	v.SetDefault("routing.semantic_matcher.enabled", false)
	v.SetDefault("routing.semantic_matcher.threshold", routing.DefaultMatcherThreshold)
	v.SetDefault("routing.semantic_matcher.min_similarity", matcher.DefaultMinSimilarity)
	v.SetDefault("routing.semantic_matcher.max_donors", matcher.DefaultMaxDonors)
	v.SetDefault("routing.arms", []ArmConfig{})
	v.SetDefault("routing.arm_salt", "")
	v.SetDefault("routing.release_after", limits.DefaultReleaseAfter)
	v.SetDefault("grpc_listen", "")
	v.SetDefault("grpc.token", "")
	v.SetDefault("grpc.tls_cert_file", "")
	v.SetDefault("grpc.tls_key_file", "")
	v.SetDefault("grpc.tls_client_ca_file", "")
	v.SetDefault("grpc.ext_proc_without_token", false)
	v.SetDefault("grpc.ext_proc_max_buffered_bytes", limits.DefaultExtProcBufferBytes)
	v.SetDefault("grpc.max_unreleased_decisions", limits.DefaultMaxUnreleased)
	v.SetDefault("grpc.max_unreleased_blocks", limits.DefaultMaxUnreleasedBlocks)
	v.SetDefault("decision_log.path", "")
	v.SetDefault("decision_log.max_bytes", decisionlog.DefaultMaxBytes)
	v.SetDefault("decision_log.max_files", decisionlog.DefaultMaxFiles)
	v.SetDefault("decision_log.buffer", decisionlog.DefaultBuffer)
	v.SetDefault("decision_log.fsync_interval", decisionlog.DefaultFsyncInterval)
	v.SetDefault("decision_log.raw_ids", false)
	v.SetDefault("decision_log.log_prompts", false)
	v.SetDefault("blocks.block_tokens", blockhash.DefaultBlockTokens)
	v.SetDefault("blocks.bytes_per_token", blockhash.DefaultBytesPerToken)
	v.SetDefault("cache.eviction", eviction.Default)
	v.SetDefault("cache.default_budget_tokens", DefaultBudgetTokens)
	v.SetDefault("cache.feedback", true)
	v.SetDefault("cache.max_budget_tokens", 1<<23)
	v.SetDefault("tokenizer.mode", "auto")
	v.SetDefault("tokenizer.block_tokens", 16)
	v.SetDefault("tokenizer.timeout", tokenizer.DefaultTimeout)
	v.SetDefault("tokenizer.url", "")
	v.SetDefault("tokenizer.cache_tokens", tokenizer.DefaultCacheTokens)
	v.SetDefault("limits.max_body_bytes", limits.DefaultMaxBodyBytes)
	v.SetDefault("limits.max_body_bytes_in_flight", limits.DefaultMaxBodyBytesInFlight)
	v.SetDefault("limits.max_messages", limits.DefaultMaxMessages)
	v.SetDefault("limits.max_header_bytes", limits.DefaultMaxHeaderBytes)
	v.SetDefault("limits.max_output_tokens", limits.DefaultMaxOutputTokens)
	v.SetDefault("limits.max_json_depth", blockhash.DefaultMaxDepth)
	v.SetDefault("limits.max_json_values", blockhash.DefaultMaxValues)
	v.SetDefault("limits.max_json_values_in_flight", blockhash.DefaultBudgetValues)
	v.SetDefault("health.check_interval", monitor.DefaultCheckInterval)
	v.SetDefault("health.check_timeout", monitor.DefaultCheckTimeout)
	v.SetDefault("health.fall", monitor.DefaultFall)
	v.SetDefault("health.rise", monitor.DefaultRise)
	v.SetDefault("health.scrape_interval", monitor.DefaultScrapeInterval)
	v.SetDefault("health.eject_base", replica.DefaultEjectBase)
	v.SetDefault("health.eject_max", replica.DefaultEjectMax)
	v.SetDefault("health.eject_forgive", replica.DefaultEjectForgive)
	v.SetDefault("health.eject_consecutive", replica.DefaultEjectStrikes)
	v.SetDefault("health.eject_min_volume", replica.DefaultEjectVolume)
	v.SetDefault("health.eject_failure_share", replica.DefaultEjectShare)
	v.SetDefault("health.eject_min_sources", replica.DefaultEjectSources)
	v.SetDefault("health.eject_timeouts", replica.DefaultEjectTimeouts)
	v.SetDefault("timeouts.connect", limits.DefaultConnect)
	v.SetDefault("timeouts.first_byte", limits.DefaultFirstByte)
	v.SetDefault("timeouts.idle", limits.DefaultIdle)
	v.SetDefault("timeouts.client_write", limits.DefaultClientWrite)
	v.SetDefault("timeouts.shutdown_grace", "30s")
	v.SetDefault("timeouts.prefill_floor", limits.DefaultPrefillFloor)
	v.SetDefault("timeouts.prefill_tokens_per_second", limits.DefaultPrefillTokensPerSecond)
	v.SetDefault("tracing.otlp_endpoint", "")
	v.SetDefault("tracing.service_name", "semroute")
	v.SetDefault("tracing.sample_ratio", 1.0)
	v.SetDefault("discovery.dns_name", "")
	v.SetDefault("discovery.srv", false)
	v.SetDefault("discovery.port", 8000)
	v.SetDefault("discovery.scheme", "http")
	v.SetDefault("discovery.interval", "10s")
	v.SetDefault("discovery.budget_tokens", 0)
	for _, k := range []string{"namespace", "service", "port_name", "selector", "inference_pool"} {
		v.SetDefault("discovery.kubernetes."+k, "")
	}
	v.SetDefault("discovery.kubernetes.pool_api", "v1")
	v.SetDefault("discovery.kubernetes.max_replicas", 0)
	v.SetDefault("discovery.kubernetes.trusted_managers", []string{})
	v.SetDefault("runtime.gc_floor_mb", 64)
	v.SetDefault("flow_control.enabled", true)
	v.SetDefault("flow_control.max_requests", flow.DefaultMaxRequests)
	v.SetDefault("flow_control.max_bytes", flow.DefaultMaxBytes)
	v.SetDefault("flow_control.ttl", flow.DefaultTTL)
	v.SetDefault("flow_control.look_ahead", flow.DefaultLookAhead)
	v.SetDefault("flow_control.age_bound", flow.DefaultAgeBound)
	v.SetDefault("flow_control.priorities", map[string]int{})
	v.SetDefault("flow_control.ttft_targets", map[string]time.Duration{})
	v.SetDefault("flow_control.reserve", 0)
	v.SetDefault("disaggregation.min_prefill_tokens", 256)
	// The fleet's secrets, so that SEMROUTE_CLUSTER_PASSWORD and the like
	// reach them from the environment (a Secret), never the config file.
	for _, k := range []string{"user", "password", "token", "credentials", "nkey_seed"} {
		v.SetDefault("cluster."+k, "")
	}
	v.SetDefault("cluster.insecure", false)
	v.SetDefault("auth.api_keys_file", "")
	v.SetDefault("auth.upstream_api_key", "")
	v.SetDefault("metrics.listener", "main")
	v.SetDefault("metrics.tenant_labels", "hash")
	v.SetDefault("admin.listen", "")
	v.SetDefault("admin.token", "")
	v.SetDefault("replicas", []Replica{})
}

// NewViper returns a viper with the defaults, reading SEMROUTE_* variables
// (SEMROUTE_ROUTING_POLICY sets routing.policy).
func NewViper() *viper.Viper {
	v := viper.New()
	SetDefaults(v)
	v.SetEnvPrefix("SEMROUTE")
	v.SetEnvKeyReplacer(strings.NewReplacer(".", "_"))
	v.AutomaticEnv()
	v.SetConfigType("yaml")
	return v
}

// Load reads the YAML file at path (none if path is empty) into v, then
// unmarshals and validates the result. Unknown keys are errors.
func Load(v *viper.Viper, path string) (*Config, error) {
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("read config: %w", err)
		}
		if err := v.MergeConfig(strings.NewReader(string(b))); err != nil {
			return nil, fmt.Errorf("parse config %s: %w", path, syntaxError(b, err))
		}
	}
	return Decode(v)
}

// LoadBytes is Load for a YAML document in memory.
func LoadBytes(v *viper.Viper, yaml []byte) (*Config, error) {
	if err := v.MergeConfig(strings.NewReader(string(yaml))); err != nil {
		return nil, fmt.Errorf("parse config: %w", syntaxError(yaml, err))
	}
	return Decode(v)
}

// syntaxError is the error of a YAML document doc that viper's parser
// refused with err, told where it is: go-yaml v3 gives the line before
// the problem's for many errors (the 0-based line of the construct being
// parsed), so the document is parsed again by goccy/go-yaml, whose error
// names the line and column (not the text: a config holds secrets, and a
// reload's error is logged). Where that parser accepts the document, err
// is returned as it is.
func syntaxError(doc []byte, err error) error {
	var v any
	if perr := goyaml.Unmarshal(doc, &v); perr != nil {
		return errors.New("yaml: " + goyaml.FormatError(perr, false, false))
	}
	return err
}

// Decode unmarshals v and validates it.
//
// Every problem is reported at once: keys the config does not know, and
// what is wrong with the values of those it does.
func Decode(v *viper.Viper) (*Config, error) {
	var c Config
	hook := viper.DecodeHook(mapstructure.ComposeDecodeHookFunc(
		mapstructure.StringToTimeDurationHookFunc(), mapstructure.StringToSliceHookFunc(","), policyByType))
	if err := v.UnmarshalExact(&c, hook); err != nil {
		// Unknown keys alone: the values of the known ones are checked too.
		var known Config
		m := invalidKeys.FindAllStringSubmatch(err.Error(), -1)
		if m == nil || v.Unmarshal(&known, hook) != nil {
			return nil, fmt.Errorf("config: %w%s", err, fromEnv(err))
		}
		var keys []string
		for _, k := range m {
			prefix := strings.TrimPrefix(strings.TrimPrefix(k[1], "configs.Config"), ".")
			for _, key := range strings.Split(k[2], ", ") {
				if prefix != "" {
					key = prefix + "." + key
				}
				keys = append(keys, key)
			}
		}
		return nil, errors.Join(fmt.Errorf("config: unknown keys: %s", strings.Join(keys, ", ")), known.Validate())
	}
	c.renamed(v)
	c.fleetDefaults(v)
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// fromEnv names the SEMROUTE_* variables that set the keys a decoding
// error quotes ('routing.attempts' cannot parse …), when they are set: a
// bad value from the environment is otherwise reported under its key
// alone, which no file holds. "" when none is.
func fromEnv(err error) string {
	var names []string
	for _, m := range quotedKey.FindAllStringSubmatch(err.Error(), -1) {
		name := envName(m[1])
		if _, ok := os.LookupEnv(name); ok && !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		return ""
	}
	return "\n(set by the environment: " + strings.Join(names, ", ") + ")"
}

// quotedKey finds a key a decoding error quotes: 'routing.attempts'.
var quotedKey = regexp.MustCompile(`'([a-z0-9_.]+)'`)

// invalidKeys finds the keys mapstructure's exact decoding did not know,
// and where: "'configs.Config.routing' has invalid keys: a, b".
var invalidKeys = regexp.MustCompile(`'([^']*)' has invalid keys: ([^\n]+)`)

// policyByType decodes a policy given as a string (`policy: semantic`,
// SEMROUTE_ROUTING_POLICY, `eviction: lru`) as the spec of that type with
// no params.
func policyByType(from, to reflect.Type, data any) (any, error) {
	if (to == reflect.TypeFor[routing.PolicySpec]() || to == reflect.TypeFor[plugin.Spec]()) && from.Kind() == reflect.String {
		return map[string]any{"type": data}, nil
	}
	return data, nil
}

// PolicySpec returns the routing policy of the section (no arms): its
// policy with the semantic policy's older keys under its params.
func (r RoutingConfig) PolicySpec() routing.PolicySpec {
	return r.spec(r.Policy, nil)
}

// ArmSpec returns arm i's routing policy, its semantic parameters merged
// from the section's older keys, the arm's and its params, in that order.
func (r RoutingConfig) ArmSpec(i int) routing.PolicySpec {
	a := r.Arms[i]
	return r.spec(a.Policy, map[string]*float64{"load_weight": a.LoadWeight, "recent_weight": a.RecentWeight,
		"spill_factor": a.SpillFactor, "spill_margin_tokens": a.SpillMarginTokens})
}

func (r RoutingConfig) spec(s routing.PolicySpec, arm map[string]*float64) routing.PolicySpec {
	if p, ok := routing.LookupPolicy(s.Type); !ok || p.Name != "semantic" {
		return s
	}
	params := routing.Params{"load_weight": r.LoadWeight, "recent_weight": r.RecentWeight,
		"spill_factor": r.SpillFactor, "spill_margin_tokens": r.SpillMarginTokens}
	for k, v := range arm {
		if v != nil {
			params[k] = *v
		}
	}
	maps.Copy(params, s.Params)
	s.Params = params
	return s
}

// renamed takes the values given under keys' old names (GRPCConfig's
// Held* fields) to their new names, unless the new name is given too.
func (c *Config) renamed(v *viper.Viper) {
	g := &c.GRPC
	if g.HeldDecisions != nil && !given(v, "grpc.max_unreleased_decisions") {
		g.MaxUnreleasedDecisions = *g.HeldDecisions
	}
	if g.HeldBlocks != nil && !given(v, "grpc.max_unreleased_blocks") {
		g.MaxUnreleasedBlocks = *g.HeldBlocks
	}
	if c.Tokenizer.Mode == "replica" { // auto's old name: the mode that runs is named as the docs name it
		c.Tokenizer.Mode = "auto"
	}
}

// fleetDefaults turns flow control off by default for a router of a fleet
// (cluster.urls): its queue does not share its reservations with its
// peers' yet, and two routers with their queues did worse than one
// (BENCHMARKS.md, "A fleet of routers over NATS"). Set, it is as set.
func (c *Config) fleetDefaults(v *viper.Viper) {
	if len(c.Cluster.URLs) > 0 && !given(v, "flow_control.enabled") {
		c.FlowControl.Enabled = false
	}
}

// given reports whether key is set in v's config file or by its SEMROUTE_*
// variable, not only by its default.
func given(v *viper.Viper, key string) bool {
	_, env := os.LookupEnv(envName(key))
	return env || v.InConfig(key)
}

// envName is the SEMROUTE_* variable that sets key (NewViper).
func envName(key string) string {
	return "SEMROUTE_" + strings.ToUpper(strings.ReplaceAll(key, ".", "_"))
}
