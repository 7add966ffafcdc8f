package router

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "github.com/semroute/semroute/api/proto/semroute/v1"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// startRanksPicker serves the gRPC API over two engines of two
// data-parallel ranks each: four replicas, two URLs.
func startRanksPicker(t *testing.T) *grpc.ClientConn {
	t.Helper()
	var specs []replica.Spec
	for _, u := range []string{"http://127.0.0.1:9000", "http://127.0.0.1:9001"} {
		specs = append(specs, replica.Spec{Name: "e" + u[len(u)-1:], URL: u, DataParallel: replica.DataParallel{Size: 2}})
	}
	specs = replica.Ranks(specs)
	now := time.Unix(1000, 0)
	e, err := routing.New(routing.Options{Replicas: specs, Engine: routing.EngineOptions{Now: func() time.Time { return now }}})
	if err != nil {
		t.Fatal(err)
	}
	pol, _ := routing.NewPolicy(routing.PolicySpec{Type: "least_load"})
	core, err := NewCore(CoreOptions{Engine: e, Arms: []Arm{{Name: "default", Policy: pol, Weight: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	return serveGRPC(t, core, GRPCOptions{})
}

// A rank of a data-parallel engine is told to whoever forwards: Route
// answers the header the request must carry, and the endpoint picker sets
// it (the client's own removed) with fallbacks only among the other
// engines' same rank, each endpoint once.
func TestDataParallelRankReachesTheGateway(t *testing.T) {
	conn := startRanksPicker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rr, err := pb.NewRouterClient(conn).Route(ctx, &pb.RouteRequest{Model: "m", DryRun: true, Input: &pb.RouteRequest_Prompt{Prompt: "hello"}})
	if err != nil {
		t.Fatal(err)
	}
	if want := rr.GetReplica()[len(rr.GetReplica())-1:]; rr.GetHeaders()[replica.HeaderDataParallelRank] != want {
		t.Errorf("Route chose %s and said headers %v", rr.GetReplica(), rr.GetHeaders())
	}
	p := &picker{conn: conn}
	cl := p.open(t)
	cl.send(reqHeaders(fullDuplex, epHeaders(":method", "POST", ":path", "/v1/completions", "content-type", "application/json", "x-data-parallel-rank", "7"), false),
		reqBody([]byte(`{"model":"m","prompt":"hello"}`), true))
	r, err := cl.st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	mut := r.GetRequestHeaders().GetResponse().GetHeaderMutation()
	got := map[string]string{}
	for _, h := range mut.GetSetHeaders() {
		got[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	dest := strings.Split(got[HeaderDestination], ",")
	rank := got["x-data-parallel-rank"]
	if (rank != "0" && rank != "1") || len(dest) != 2 || dest[0] == dest[1] {
		t.Errorf("the picker set rank %q and destinations %v: want the chosen rank, on both engines once each", rank, dest)
	}
}
