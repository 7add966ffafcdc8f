package replay

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/routing"
)

// tightTrace is n requests of 16-token blocks: one of 24 shared documents
// (6 to 25 blocks, the first few far more popular) and 1 to 3 blocks of
// question, arriving 40 ms apart on average, each answering 32 to 191
// tokens. On a few thousand tokens per replica, engines evict all the
// time, and what a request generates takes room the router never saw.
func tightTrace(n int, seed uint64) []Request {
	rng := rand.New(rand.NewPCG(seed, 1))
	const bt = 16
	var id [16]byte
	chain := func(h uint64, a, b int) uint64 {
		binary.LittleEndian.PutUint64(id[:8], uint64(a))
		binary.LittleEndian.PutUint64(id[8:], uint64(b))
		return blockhash.ChainHash(h, blockhash.RoleTokens, id[:])
	}
	docs := make([][]blockhash.Block, 24)
	for d := range docs {
		h := blockhash.Seed("doc")
		for j := range 6 + rng.IntN(20) {
			h = chain(h, d, j)
			docs[d] = append(docs[d], blockhash.Block{Hash: h, Tokens: bt})
		}
	}
	out := make([]Request, 0, n)
	var t int64
	for i := range n {
		t += int64(rng.ExpFloat64() * float64(40*time.Millisecond))
		d := int(float64(len(docs)) * rng.Float64() * rng.Float64())
		bl := append([]blockhash.Block(nil), docs[d]...)
		h := bl[len(bl)-1].Hash
		for j := range 1 + rng.IntN(3) {
			h = chain(h, -1-i, j)
			bl = append(bl, blockhash.Block{Hash: h, Tokens: bt})
		}
		out = append(out, Request{Arrival: t, Blocks: bl, Tokens: len(bl) * bt, Output: 32 + rng.IntN(160),
			Key: routing.SessionKey("", "", bl)})
	}
	return out
}

func tightModel() Config {
	m := Config{Replicas: 4, BudgetTokens: 3000, BlockTokens: 16, InterToken: 2 * time.Millisecond}
	m.Seed = 1
	return m
}

// TestPictureModesPredictionError: on tight budgets, the picture fed by
// the engines' events predicts their cached tokens within 1%, better than
// the picture learning only from routing; feedback does no worse than the
// latter and, where routing does not depend on the picture (round robin),
// strictly better.
func TestPictureModesPredictionError(t *testing.T) {
	reqs := tightTrace(1200, 3)
	var runs []Run
	for _, p := range []string{"round_robin", "semantic"} {
		for _, mode := range PictureModes {
			runs = append(runs, Run{Label: p + "/" + mode, Policy: p, Picture: mode})
		}
	}
	sum, err := Replay(reqs, tightModel(), runs)
	if err != nil {
		t.Fatal(err)
	}
	for k := 0; k < len(sum.Policies); k += 3 {
		approx, fb, ev := sum.Policies[k], sum.Policies[k+1], sum.Policies[k+2]
		for _, r := range []*Result{approx, fb, ev} {
			p := r.Prediction
			if p == nil {
				t.Fatalf("%s: no prediction", r.Name)
			}
			t.Logf("%-22s hit %.4f error %+.4f mean abs %.4f (predicted %d, actual %d; engines evicted %d blocks; orphans %d)",
				r.Name, r.TokenHitRate, p.Error, p.MeanAbsError, p.PredictedTokens, p.ActualTokens, p.EngineEvictions, p.Orphans)
			if p.EngineEvictions == 0 || p.ActualTokens != r.CachedTokens {
				t.Errorf("%s: engines evicted %d blocks, actual %d against cached %d", r.Name, p.EngineEvictions, p.ActualTokens, r.CachedTokens)
			}
		}
		a, f, e := math.Abs(approx.Prediction.Error), math.Abs(fb.Prediction.Error), math.Abs(ev.Prediction.Error)
		if a < 0.02 {
			t.Errorf("%s: error %.4f: the trace no longer tells the modes apart", approx.Name, a)
		}
		if e >= 0.01 || e >= a {
			t.Errorf("%s: |error| %.4f, want < 1%% and < approximate's %.4f", ev.Name, e, a)
		}
		if ev.Prediction.MeanAbsError >= approx.Prediction.MeanAbsError {
			t.Errorf("%s: mean abs error %.4f, approximate's %.4f", ev.Name, ev.Prediction.MeanAbsError, approx.Prediction.MeanAbsError)
		}
		if f > a {
			t.Errorf("%s: |error| %.4f above approximate's %.4f", fb.Name, f, a)
		}
	}
	// Round robin routes blind to the picture: every mode serves the same
	// requests on the same replicas, so the engines find the same tokens,
	// and only the prediction differs.
	rr := sum.Policies[:3]
	if rr[0].CachedTokens != rr[1].CachedTokens || rr[0].CachedTokens != rr[2].CachedTokens {
		t.Errorf("round robin's engines found %d, %d and %d tokens: the engines depend on the picture",
			rr[0].CachedTokens, rr[1].CachedTokens, rr[2].CachedTokens)
	}
	if f, a := math.Abs(rr[1].Prediction.Error), math.Abs(rr[0].Prediction.Error); f >= a {
		t.Errorf("round_robin/feedback |error| %.4f, not below approximate's %.4f: feedback corrected nothing", f, a)
	}
}

func TestPictureUnknownMode(t *testing.T) {
	reqs := tightTrace(10, 1)
	_, err := Replay(reqs, tightModel(), []Run{{Policy: "semantic", Picture: "exact"}})
	if err == nil || !strings.Contains(err.Error(), `unknown picture mode "exact"`) {
		t.Fatalf("err = %v", err)
	}
	if got, err := ParsePictures(" events, approximate ,"); err != nil || strings.Join(got, ",") != "events,approximate" {
		t.Fatalf("ParsePictures: %v, %v", got, err)
	}
	for _, bad := range []string{"events,Events", "approximate,approximate", "precise"} {
		if _, err := ParsePictures(bad); err == nil {
			t.Errorf("ParsePictures(%q) succeeded", bad)
		}
	}
	if got, err := ParsePictures(""); err != nil || got != nil {
		t.Fatalf("ParsePictures(\"\") = %v, %v", got, err)
	}
}

// TestPictureReports: every run carries the prediction in summary.json,
// summary.md, report.html and its CSV, a run without a picture mode under
// feedback's (the default); the references, which have no picture, none.
func TestPictureReports(t *testing.T) {
	reqs := tightTrace(200, 2)
	sum, err := Replay(reqs, tightModel(), []Run{{Policy: "semantic"}, {Label: "semantic/events", Policy: "semantic", Picture: PictureEvents}})
	if err != nil {
		t.Fatal(err)
	}
	if p := sum.Policies[0].Prediction; p == nil || p.Picture != PictureFeedback || sum.Pooled.Prediction != nil {
		t.Fatalf("the default run's prediction %+v, the pooled reference's %+v", p, sum.Pooled.Prediction)
	}
	dir := t.TempDir()
	if err := sum.Write(dir); err != nil {
		t.Fatal(err)
	}
	var js struct {
		Policies []struct {
			Name       string
			Prediction *struct {
				Picture   string  `json:"picture"`
				Predicted int64   `json:"predicted_cached_tokens"`
				Actual    int64   `json:"actual_cached_tokens"`
				Error     float64 `json:"relative_error"`
				MAE       float64 `json:"mean_abs_error"`
			}
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &js); err != nil {
		t.Fatal(err)
	}
	if p := js.Policies[1].Prediction; js.Policies[0].Prediction == nil || p == nil || p.Picture != "events" || p.Actual == 0 || p.Actual != sum.Policies[1].CachedTokens {
		t.Fatalf("summary.json policies: %+v", js.Policies)
	}
	md, _ := os.ReadFile(filepath.Join(dir, "summary.md"))
	page, _ := os.ReadFile(filepath.Join(dir, "report.html"))
	for _, want := range []string{"| prediction error |", "| semantic/events |", " | events | "} {
		if !strings.Contains(string(md), want) {
			t.Errorf("summary.md lacks %q:\n%s", want, md)
		}
	}
	if !strings.Contains(string(page), "<th>prediction error</th>") || !strings.Contains(string(page), "<td>events</td>") {
		t.Error("report.html lacks the prediction columns")
	}
	csv, err := os.ReadFile(filepath.Join(dir, "runs", "semantic_events.csv"))
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Split(string(csv), "\n"); !strings.HasSuffix(lines[0], ",predicted_cached_tokens") || strings.Count(lines[1], ",") != 5 {
		t.Fatalf("semantic_events.csv starts %q", lines[:2])
	}
	pooled, _ := os.ReadFile(filepath.Join(dir, "runs", "pooled.csv"))
	if strings.Contains(string(pooled), "predicted") {
		t.Error("pooled.csv, a reference without a picture, has a prediction column")
	}
}

// TestEnginePinsRunningRequests: an engine never evicts a block a running
// request holds, even over its budget; once the request ends, it may.
func TestEnginePinsRunningRequests(t *testing.T) {
	reqs := mooncake(t, 2,
		`{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 3]}`,
		`{"timestamp": 1, "input_length": 6, "output_length": 1, "hash_ids": [4, 5, 6]}`,
		`{"timestamp": 2, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 3]}`)
	for _, ev := range []string{"lru", "vllm"} {
		m := Config{Eviction: ev}
		e, err := newEngineCaches(&m, []int64{8}) // four blocks
		if err != nil {
			t.Fatal(err)
		}
		e.serve(0, 0, &reqs[0], 0)
		e.serve(1, 0, &reqs[1], 1) // six blocks held, all pinned
		if got, _ := e.serve(2, 0, &reqs[2], 2); got != 6 {
			t.Fatalf("%s: a running request's blocks were evicted: %d tokens cached, want 6", ev, got)
		}
		e.finish(0, 0, &reqs[0], nil, 3)
		e.finish(2, 0, &reqs[2], nil, 4)
		e.finish(1, 0, &reqs[1], nil, 5)
		if e.evict != 0 {
			t.Fatalf("%s: %d blocks evicted while pinned", ev, e.evict)
		}
		e.serve(3, 0, &reqs[1], 6) // 12 tokens of 8: two free blocks go, the tail first
		if got := e.held(0, reqs[0].Blocks).Blocks; got != 1 || e.evict != 2 {
			t.Fatalf("%s: after the requests ended, %d blocks of the first stay, %d evicted", ev, got, e.evict)
		}
	}
}

// TestEngineOutputBlocks: an engine caches its reply's blocks where the
// trace shows them, else whole blocks of output under keys of its own.
func TestEngineOutputBlocks(t *testing.T) {
	req := Request{Blocks: []blockhash.Block{{Hash: 7, Tokens: 16}}, Output: 40}
	out := outputBlocks(&req, 3, 16)
	if len(out) != 2 || out[0].Tokens != 16 || out[0].Hash == out[1].Hash {
		t.Fatalf("output blocks %+v", out)
	}
	if other := outputBlocks(&req, 4, 16); other[0].Hash == out[0].Hash {
		t.Fatal("two requests share output blocks")
	}
	req.Reply = []blockhash.Block{{Hash: 9, Tokens: 5}}
	if got := outputBlocks(&req, 3, 16); len(got) != 1 || got[0].Hash != 9 {
		t.Fatalf("with a reply: %+v", got)
	}
}
