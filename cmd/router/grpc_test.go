package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	pb "github.com/semroute/semroute/api/proto/semroute/v1"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/replay"
	"github.com/semroute/semroute/routing"
)

// bearer sends a bearer token with every call, over plaintext too.
type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

func (bearer) RequireTransportSecurity() bool { return false }

func dial(t *testing.T, d *demo) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(d.run.grpcAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(bearer(d.app.current.Load().GRPC.Token)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestGRPCRouteReleaseListReplicas(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0"})
	conn := dial(t, d)
	c := pb.NewRouterClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	sys := text("grpc system prompt", 600)
	body, _ := json.Marshal(chat([2]string{"system", sys}, [2]string{"user", "hello"}))
	inputs := map[string]*pb.RouteRequest{
		"openai_body": {Input: &pb.RouteRequest_OpenaiBody{OpenaiBody: body}},
		"messages": {Model: "sim-model", Input: &pb.RouteRequest_Messages{Messages: &pb.ChatMessages{Messages: []*pb.ChatMessage{
			{Role: "system", Content: sys}, {Role: "user", Content: "hello again"}}}}},
		"prompt":    {Model: "sim-model", Input: &pb.RouteRequest_Prompt{Prompt: text("a completion prompt", 300)}},
		"blocks":    {Model: "sim-model", Input: &pb.RouteRequest_Blocks{Blocks: &pb.Blocks{Blocks: []*pb.Block{{Text: sys, Kind: "system"}, {Text: "q", Kind: "user_query"}}}}},
		"token_ids": {Model: "sim-model", Input: &pb.RouteRequest_TokenIds{TokenIds: &pb.TokenIds{Ids: make([]int32, 300)}}},
	}
	for name, in := range inputs {
		in.SessionId = "s-" + name
		resp, err := c.Route(ctx, in)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if resp.DecisionId == "" || resp.Replica == "" || resp.Url == "" || resp.Arm != "default" || resp.Policy != "semantic" ||
			resp.TotalTokens == 0 || len(resp.Candidates) != 4 {
			t.Fatalf("%s: %+v", name, resp)
		}
		chosen := 0
		for _, cand := range resp.Candidates {
			if cand.Chosen {
				chosen++
				if cand.Replica != resp.Replica || cand.MatchedTokens != resp.PredictedMatchedTokens || cand.Reason == "" {
					t.Fatalf("%s: chosen candidate %+v vs %+v", name, cand, resp)
				}
			}
		}
		if chosen != 1 {
			t.Fatalf("%s: %d chosen candidates", name, chosen)
		}
		if _, err := c.Release(ctx, &pb.ReleaseRequest{DecisionId: resp.DecisionId, Status: 200, PromptTokens: resp.TotalTokens, TtftMs: 12}); err != nil {
			t.Fatalf("%s release: %v", name, err)
		}
	}
	// The second chat request matched the first one's system prompt.
	second, err := c.Route(ctx, &pb.RouteRequest{Input: &pb.RouteRequest_OpenaiBody{OpenaiBody: body}, DryRun: true})
	if err != nil || second.PredictedMatchedTokens < 500 || second.DecisionId != "" {
		t.Fatalf("dry run after the first: %+v, %v", second, err)
	}
	if n, _ := d.app.core.Unreleased().Len(); n != 0 {
		t.Fatalf("%d decisions still held after release", n)
	}
	// Errors: a released id again, no input, a bad kind.
	if _, err := c.Release(ctx, &pb.ReleaseRequest{DecisionId: "nope"}); status.Code(err) != codes.NotFound {
		t.Fatalf("unknown release: %v", err)
	}
	if _, err := c.Route(ctx, &pb.RouteRequest{Model: "sim-model"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("no input: %v", err)
	}
	if _, err := c.Route(ctx, &pb.RouteRequest{Model: "m", Input: &pb.RouteRequest_Blocks{Blocks: &pb.Blocks{Blocks: []*pb.Block{{Text: "x", Kind: "weird"}}}}}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("bad kind: %v", err)
	}
	if _, err := c.Route(ctx, &pb.RouteRequest{Input: &pb.RouteRequest_OpenaiBody{OpenaiBody: []byte("{")}}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("bad body: %v", err)
	}

	list, err := c.ListReplicas(ctx, &pb.ListReplicasRequest{})
	if err != nil || len(list.Replicas) != 4 {
		t.Fatalf("ListReplicas: %+v, %v", list, err)
	}
	var tracked int64
	for _, r := range list.Replicas {
		if !r.Healthy || r.BudgetTokens != 262144 || r.InFlight != 0 {
			t.Errorf("replica %+v", r)
		}
		tracked += r.TrackedBlocks
	}
	if tracked == 0 {
		t.Error("no blocks tracked after routing")
	}

	h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "semroute.v1.Router"})
	if err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v %v", h, err)
	}
	// Reflection lists the service (what grpcurl list does).
	stream, err := reflectpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectpb.ServerReflectionRequest{MessageRequest: &reflectpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	rr, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, s := range rr.GetListServicesResponse().GetService() {
		found = found || s.Name == "semroute.v1.Router"
	}
	if !found {
		t.Fatalf("reflection lists %v", rr.GetListServicesResponse().GetService())
	}
}

func TestGRPCUnreleasedDecisionExpires(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte("routing:\n  release_after: 50ms\n"), 0o600)
	d := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0", config: cfg})
	c := pb.NewRouterClient(dial(t, d))
	resp, err := c.Route(context.Background(), &pb.RouteRequest{Model: "sim-model", Input: &pb.RouteRequest_Prompt{Prompt: "abandoned"}})
	if err != nil {
		t.Fatal(err)
	}
	r, _ := d.app.pool.Get(resp.Replica)
	if r.Load(time.Now()).InFlight != 1 {
		t.Fatal("a routed decision does not count as load")
	}
	testwait.Until(t, "an unreleased decision to stop counting as load", func() bool { return r.Load(time.Now()).InFlight == 0 })
}

func TestHTTPAndGRPCAgree(t *testing.T) {
	d := startTestDemo(t, demoOptions{sim: fastSim, grpcListen: "127.0.0.1:0"})
	c := pb.NewRouterClient(dial(t, d))
	for i := 0; i < 12; i++ {
		b, _ := json.Marshal(chat([2]string{"system", text(fmt.Sprint("agree ", i%3), 800)}, [2]string{"user", fmt.Sprint("question ", i)}))
		session := fmt.Sprint("sess-", i%5)
		dry, err := c.Route(context.Background(), &pb.RouteRequest{SessionId: session, DryRun: true, Input: &pb.RouteRequest_OpenaiBody{OpenaiBody: b}})
		if err != nil {
			t.Fatal(err)
		}
		r := post(t, d, "/v1/chat/completions", b, map[string]string{"X-Session-ID": session})
		mustOK(t, r)
		if r.replica != dry.Replica || int64(r.matched) != dry.PredictedMatchedTokens {
			t.Fatalf("request %d: HTTP went to %s (%d matched), gRPC said %s (%d)", i, r.replica, r.matched, dry.Replica, dry.PredictedMatchedTokens)
		}
	}
}

func TestArmsSplitAndStick(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "arms.yaml")
	os.WriteFile(cfg, []byte(`routing:
  arm_salt: exp-7
  arms:
    - {name: control, policy: least_load, weight: 1}
    - {name: treatment, policy: semantic, weight: 3}
`), 0o600)
	d := startTestDemo(t, demoOptions{sim: fastSim, config: cfg})
	core := d.app.core
	counts := map[string]int{}
	for s := 0; s < 2000; s++ {
		id := fmt.Sprint("session-", s)
		arm := core.PickArm(id, "tenant", uint64(s))
		for k := 0; k < 3; k++ { // the session's later requests, other tenants and keys
			if again := core.PickArm(id, fmt.Sprint("t", k), uint64(k)); again != arm {
				t.Fatalf("session %s moved from %s to %s", id, arm.Name, again.Name)
			}
		}
		counts[arm.Name]++
	}
	share := float64(counts["treatment"]) / 2000
	t.Logf("treatment share %.3f (configured 0.75): %v", share, counts)
	if share < 0.70 || share > 0.80 {
		t.Fatalf("treatment got %.3f of sessions, configured 0.75", share)
	}
	// Over HTTP: the header names the arm, the same for a session's requests.
	seen := map[string]string{}
	for i := 0; i < 40; i++ {
		session := fmt.Sprint("h-", i%10)
		r := post(t, d, "/v1/completions", map[string]any{"model": "sim-model", "prompt": fmt.Sprint("p", i), "max_tokens": 2},
			map[string]string{"X-Session-ID": session})
		mustOK(t, r)
		arm := r.arm
		if arm == "" {
			t.Fatal("no X-Semroute-Arm header")
		}
		if prev, ok := seen[session]; ok && prev != arm {
			t.Fatalf("session %s in arms %s and %s", session, prev, arm)
		}
		seen[session] = arm
	}
}

func TestDecisionLogReplaysToSameDecisions(t *testing.T) {
	for _, picture := range []string{"approximate", "events"} {
		t.Run(picture, func(t *testing.T) { decisionLogReplays(t, picture) })
	}
}

func decisionLogReplays(t *testing.T, picture string) {
	logPath := filepath.Join(t.TempDir(), "decisions.jsonl")
	// The token formula (routing.load_weight above 0): the seconds cost
	// reads the times the live router measured, which a replay learns again
	// from the log's but not to the nanosecond the live one did.
	cfg := filepath.Join(t.TempDir(), "tokens.yaml")
	if err := os.WriteFile(cfg, []byte("routing:\n  load_weight: 0.1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	d := startTestDemo(t, demoOptions{sim: fastSim, decisionLog: logPath, picture: picture, config: cfg})
	if picture == "events" {
		waitSubscribed(t, d)
	}
	// Multi-turn sessions over a few shared system prompts, sequential.
	history := map[int][][2]string{}
	for i := 0; i < 60; i++ {
		s := i % 12
		if history[s] == nil {
			history[s] = [][2]string{{"system", text(fmt.Sprint("tenant prompt ", s%3), 700)}}
		}
		msgs := append(history[s], [2]string{"user", text(fmt.Sprint("turn ", i), 40)})
		r := post(t, d, "/v1/chat/completions", chat(msgs...), map[string]string{"X-Session-ID": fmt.Sprint("conv-", s)})
		mustOK(t, r)
		if picture == "events" {
			// The replay applies an engine's events as it stores; live, they
			// arrive a moment later: the next decision waits for them, or
			// a loaded machine decides it on a picture the replay never has.
			waitEventsApplied(t, d)
		}
		var out struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		json.Unmarshal(r.body, &out)
		history[s] = append(msgs, [2]string{"assistant", out.Choices[0].Message.Content})
	}
	if err := d.close(); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr, err := replay.ReadDecisions(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != 60 || len(tr.Arms) != 1 || tr.Arms[0].Requests != 60 || tr.Arms[0].CachedRate == 0 {
		t.Fatalf("read %d requests, arms %+v", len(tr.Requests), tr.Arms)
	}
	replies := 0
	for _, r := range tr.Requests {
		if r.Reply != nil {
			replies++
		}
	}
	if replies == 0 && picture != "events" { // a precise decision learns no reply: the engine's events say what it cached
		t.Fatal("no reply blocks in the log")
	}
	sum, err := replay.Replay(tr.Requests, replay.Config{ReplicaNames: tr.Replicas, Budgets: tr.Budgets, RecordReplies: true},
		[]replay.Run{{Policy: "semantic", Params: routing.Params{"load_weight": 0.1}}, {Policy: "round_robin"}})
	if err != nil {
		t.Fatal(err)
	}
	same, alt := sum.Policies[0], sum.Policies[1]
	t.Logf("semantic changed %d of %d decisions (hit rate %.3f); round_robin would change %d", same.Changed, same.Requests, same.TokenHitRate, alt.Changed)
	if same.Changed != 0 {
		t.Fatalf("replayed under the policy that made them, %d of %d decisions differ", same.Changed, same.Requests)
	}
	if alt.Changed == 0 {
		t.Fatal("round robin would change no decision: the comparison cannot tell policies apart")
	}
}
