package router

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"github.com/semroute/semroute/replica"
	"strconv"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
	"google.golang.org/protobuf/proto"

	pb "github.com/semroute/semroute/api/proto/semroute/v1"
	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/limits"
	"github.com/semroute/semroute/routing"
)

// GRPCService adapts the Core to the semroute.v1.Router gRPC service.
type GRPCService struct {
	pb.UnimplementedRouterServer
	core   *Core
	limits func() limits.Request
}

var _ pb.RouterServer = (*GRPCService)(nil)

// GRPCOptions configure the gRPC front end.
type GRPCOptions struct {
	// Limits returns the limits in force, called per call: MaxBodyBytes
	// bounds openai_body and Parse what the parser accepts of every input.
	// Nil means the defaults.
	Limits func() limits.Request
	// Token returns the bearer token every call but the health service's
	// must carry in its "authorization" metadata ("Bearer <token>"). It is
	// called per call, so a rotated token takes effect at once. Nil, or an
	// empty token, means no token is asked for (the transport, e.g. mTLS,
	// must then authenticate).
	Token func() string
	// ExtProcOpen, if set and true, lets the endpoint picker's calls in
	// without the token (gateways call it without credentials). Called per
	// call.
	ExtProcOpen func() bool
	// ExtProc configures the endpoint picker (Envoy's ext_proc protocol),
	// served beside the Router service; its Limits are the ones above.
	ExtProc ExtProcOptions
}

// Bounds of the gRPC server: streams per connection, the handshake, and
// an idle connection's life.
const (
	grpcMaxStreams  = 100
	grpcHandshake   = 10 * time.Second
	grpcIdle        = 2 * time.Minute
	grpcPing        = 30 * time.Second
	grpcPingTimeout = 10 * time.Second
)

// NewGRPCServer returns a gRPC server with the Router service, the
// endpoint picker of Envoy's ext_proc protocol (ExtProcService), the standard
// health service (serving; it needs no token, so that probes work) and
// server reflection registered. The token is checked when a call's headers
// arrive, before its message is read, so an unauthenticated caller costs
// no message decoding; a connection carries at most 100 concurrent
// streams, must finish its handshake in 10 s, is pinged after 30 s without
// traffic (and closed if the ping goes unanswered for 10 s), and is closed
// after 2 minutes without a call. opts are passed to grpc.NewServer after these.
func NewGRPCServer(core *Core, o GRPCOptions, opts ...grpc.ServerOption) *grpc.Server {
	auth := authenticator{token: o.Token, extProcOpen: o.ExtProcOpen}
	if o.Limits == nil {
		l := limits.Request{}.WithDefaults()
		o.Limits = func() limits.Request { return l }
	}
	opts = append([]grpc.ServerOption{
		grpc.InTapHandle(auth.tap),
		grpc.MaxConcurrentStreams(grpcMaxStreams),
		grpc.ConnectionTimeout(grpcHandshake),
		// Pings find a connection whose peer is gone (a half-open gateway
		// connection would otherwise hold its streams' load for grpc-go's
		// default two hours).
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: grpcIdle, Time: grpcPing, Timeout: grpcPingTimeout}),
	}, opts...)
	s := grpc.NewServer(opts...)
	pb.RegisterRouterServer(s, &GRPCService{core: core, limits: o.Limits})
	ep := o.ExtProc
	ep.Limits = o.Limits
	extprocv3.RegisterExternalProcessorServer(s, NewExtProcService(core, ep))
	hs := health.NewServer()
	for _, name := range []string{"", pb.Router_ServiceDesc.ServiceName, extprocv3.ExternalProcessor_ServiceDesc.ServiceName, healthLiveness, healthReadiness} {
		hs.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
	}
	healthpb.RegisterHealthServer(s, healthService{Server: hs, ready: core.ready})
	reflection.Register(s)
	return s
}

// The health names the Gateway API Inference Extension's endpoint-picker
// deployments probe, beside the services' own.
const (
	healthLiveness  = "liveness"
	healthReadiness = "readiness"
)

// healthService answers grpc.health.v1 Check: liveness and the Router
// service are serving while the process runs; readiness and the
// endpoint picker (ExternalProcessor) only while some replica can take a
// request (ready), as a picker with none has nothing to pick. Watch
// reports the static statuses.
type healthService struct {
	*health.Server
	ready func() bool
}

func (h healthService) Check(ctx context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	switch req.GetService() {
	case healthReadiness, extprocv3.ExternalProcessor_ServiceDesc.ServiceName:
		if !h.ready() {
			return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_NOT_SERVING}, nil
		}
	}
	return h.Server.Check(ctx, req)
}

// authenticator checks each call's bearer token, in constant time.
type authenticator struct {
	token       func() string
	extProcOpen func() bool
}

// check returns nil when method needs no token or md carries the right one.
func (a authenticator) check(md metadata.MD, method string) error {
	// Probes need no token: Check only. Watch holds a stream (and its
	// connection) open, so it takes the token like every other call.
	if a.token == nil || method == "/grpc.health.v1.Health/Check" {
		return nil
	}
	if a.extProcOpen != nil && method == extprocv3.ExternalProcessor_Process_FullMethodName && a.extProcOpen() {
		return nil
	}
	want := a.token()
	if want == "" {
		return nil
	}
	for _, v := range md.Get("authorization") {
		if subtle.ConstantTimeCompare([]byte(v), []byte("Bearer "+want)) == 1 {
			return nil
		}
	}
	return status.Error(codes.Unauthenticated, `a valid bearer token is required in the "authorization" metadata`)
}

// tap checks a call's token from its headers, before its message is read.
func (a authenticator) tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	return ctx, a.check(info.Header, info.FullMethodName)
}

func invalid(err error) error { return status.Error(codes.InvalidArgument, err.Error()) }

// arrival translates a RouteRequest into the request it describes: an
// OpenAI body (openai_body, or the body messages and prompt make), or a
// request of token ids or pre-split blocks, within lim.
func arrival(in *pb.RouteRequest, lim *limits.Request) (Arrival, error) {
	model := in.GetModel()
	switch x := in.GetInput().(type) {
	case *pb.RouteRequest_OpenaiBody:
		if int64(len(x.OpenaiBody)) > lim.MaxBodyBytes {
			return Arrival{}, &blockhash.InputError{Field: "openai_body", Msg: "is larger than the limit of " + strconv.FormatInt(lim.MaxBodyBytes, 10) + " bytes"}
		}
		if in.GetEndpoint() == pb.Endpoint_ENDPOINT_COMPLETIONS {
			return Arrival{API: blockhash.Completion, Body: x.OpenaiBody}, nil
		}
		return Arrival{API: blockhash.Chat, Body: x.OpenaiBody}, nil
	case *pb.RouteRequest_Messages:
		b, err := messagesBody(model, x.Messages.GetMessages(), lim)
		return Arrival{API: blockhash.Chat, Body: b}, err
	case *pb.RouteRequest_Prompt:
		b, _ := json.Marshal(map[string]any{"model": model, "prompt": x.Prompt}) // strings marshal
		return Arrival{API: blockhash.Completion, Body: b}, nil
	case *pb.RouteRequest_TokenIds:
		if model == "" || len(x.TokenIds.GetIds()) == 0 {
			return Arrival{}, errors.New("token_ids: model and at least one id are required")
		}
		return Arrival{Parsed: &blockhash.Request{Model: model, Parts: []blockhash.Part{blockhash.TokenPart(x.TokenIds.GetIds())}}}, nil
	case *pb.RouteRequest_Blocks:
		req, err := blocksRequest(model, x.Blocks.GetBlocks(), lim)
		return Arrival{Parsed: req, PreSplit: true}, err
	}
	return Arrival{}, errors.New("one of openai_body, messages, prompt, blocks or token_ids is required")
}

// messagesBody makes the chat body of messages, as many as the message
// limit.
func messagesBody(model string, in []*pb.ChatMessage, lim *limits.Request) ([]byte, error) {
	if n := len(in); lim.Parse.MaxMessages > 0 && n > lim.Parse.MaxMessages {
		return nil, &blockhash.InputError{Field: "messages", Msg: "has " + strconv.Itoa(n) + " entries, more than the limit of " + strconv.Itoa(lim.Parse.MaxMessages)}
	}
	msgs := make([]map[string]string, 0, len(in))
	for _, m := range in {
		msg := map[string]string{"role": m.GetRole(), "content": m.GetContent()}
		if m.GetName() != "" {
			msg["name"] = m.GetName()
		}
		msgs = append(msgs, msg)
	}
	return json.Marshal(map[string]any{"model": model, "messages": msgs}) // strings marshal
}

// blocksRequest makes a request of pre-split blocks with their kinds (none:
// other), as many as the message limit.
func blocksRequest(model string, blocks []*pb.Block, lim *limits.Request) (*blockhash.Request, error) {
	if model == "" || len(blocks) == 0 {
		return nil, errors.New("blocks: model and at least one block are required")
	}
	if lim.Parse.MaxMessages > 0 && len(blocks) > lim.Parse.MaxMessages {
		return nil, errors.New("blocks: more blocks than the message limit")
	}
	r := &blockhash.Request{Model: model}
	for i, b := range blocks {
		k := blockhash.KindOther
		if b.GetKind() != "" {
			var err error
			if k, err = blockhash.ParseKind(b.GetKind()); err != nil {
				return nil, &blockhash.InputError{Field: "blocks[" + strconv.Itoa(i) + "].kind", Msg: err.Error()}
			}
		}
		r.Parts = append(r.Parts, blockhash.Part{Role: blockhash.RolePrompt, Base: k, Text: []byte(b.GetText())})
	}
	return r, nil
}

// Route implements pb.RouterServer.
func (g *GRPCService) Route(ctx context.Context, in *pb.RouteRequest) (*pb.RouteResponse, error) {
	lim := g.limits()
	a, err := arrival(in, &lim)
	if err != nil {
		return nil, invalid(err)
	}
	a.Session, a.Tenant, a.Route, a.Ctx, a.Bytes, a.DryRun = in.GetSessionId(), in.GetTenantId(), "grpc", ctx, int64(proto.Size(in)), in.GetDryRun()
	ad, err := g.core.Admit(a, &lim)
	switch {
	case errors.Is(err, blockhash.ErrBusy):
		return nil, status.Error(codes.ResourceExhausted, err.Error())
	case err != nil:
		return nil, invalid(err)
	}
	defer ad.Recycle()
	var rt *Routed
	p, err := g.core.Place(ad.CoreRequest)
	if err == nil {
		rt = p.Routed
	}
	switch {
	case errors.As(err, new(*QueueError)):
		return nil, status.Error(codes.ResourceExhausted, err.Error())
	case errors.Is(err, routing.ErrNoReplica):
		return nil, status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, routing.ErrUnknownModel):
		return nil, status.Error(codes.NotFound, err.Error())
	case err != nil:
		return nil, status.Error(codes.Internal, err.Error())
	}
	c := rt.Chosen()
	out := &pb.RouteResponse{
		DecisionId: rt.ID, Replica: c.Replica.Name, Url: c.Replica.PublicURL(), Arm: rt.Arm.Name, Policy: rt.Policy,
		PredictedMatchedTokens: int64(c.Predicted()), TotalTokens: int64(rt.Tokens),
	}
	if dp := c.Replica.DataParallel; dp.On() {
		out.Headers = map[string]string{replica.HeaderDataParallelRank: strconv.Itoa(dp.Rank)}
	}
	for _, cand := range rt.Candidates {
		out.Candidates = append(out.Candidates, &pb.Candidate{
			Replica: cand.Replica.Name, Score: cand.Score, MatchedTokens: int64(cand.Match.Tokens),
			InFlight: cand.Load.InFlight, PendingTokens: cand.Load.PendingTokens, RecentTokens: cand.Load.RecentTokens,
			Reason: cand.Reason, Chosen: cand.Replica == c.Replica,
		})
	}
	if !in.GetDryRun() {
		g.core.unreleased.Add(rt) // after the response is built: once kept, expiry may finish it
	}
	return out, nil
}

// Release implements pb.RouterServer.
func (g *GRPCService) Release(_ context.Context, in *pb.ReleaseRequest) (*pb.ReleaseResponse, error) {
	if in.GetDecisionId() == "" {
		return nil, invalid(errors.New("decision_id is required"))
	}
	if in.GetPromptTokens() < 0 || in.GetOutputTokens() < 0 || in.GetCachedTokens() < 0 || in.GetCachedTokens() > in.GetPromptTokens() ||
		!(in.GetTtftMs() >= 0 && in.GetTtftMs() < 1e9) || !(in.GetDurationMs() >= 0 && in.GetDurationMs() < 1e9) || in.GetStatus() < 0 || in.GetStatus() > 999 {
		return nil, invalid(errors.New("token counts and times must not be negative (nor cached_tokens exceed prompt_tokens), status must be an HTTP status"))
	}
	err := g.core.unreleased.Release(in.GetDecisionId(), Outcome{
		Status: int(in.GetStatus()), PromptTokens: in.GetPromptTokens(), OutputTokens: in.GetOutputTokens(),
		// A cached_tokens of 0 is the field unset as often as a miss: only
		// a positive count is taken as reported.
		CachedTokens: in.GetCachedTokens(), CachedReported: in.GetCachedTokens() > 0, TTFTNs: int64(in.GetTtftMs() * float64(time.Millisecond)),
		DurationNs: int64(in.GetDurationMs() * float64(time.Millisecond)),
	})
	if errors.Is(err, ErrUnknownDecision) {
		return nil, status.Error(codes.NotFound, err.Error())
	}
	return &pb.ReleaseResponse{}, err
}

// ListReplicas implements pb.RouterServer.
func (g *GRPCService) ListReplicas(context.Context, *pb.ListReplicasRequest) (*pb.ListReplicasResponse, error) {
	now := g.core.e.Now()
	out := &pb.ListReplicasResponse{}
	for _, r := range g.core.e.Pool().Replicas() {
		st, _ := g.core.e.Picture().Stats(r.ID)
		l := r.Load(now)
		out.Replicas = append(out.Replicas, &pb.Replica{
			Name: r.Name, Url: r.PublicURL(), Healthy: r.Available(now), InFlight: l.InFlight, PendingTokens: l.PendingTokens,
			BudgetTokens: st.Budget, TrackedBlocks: st.Blocks, TrackedTokens: st.Tokens, Evictions: st.Evictions,
		})
	}
	return out, nil
}
