package replay

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/decisionlog"
)

// DecisionTrace is a decision log read as a trace.
type DecisionTrace struct {
	Requests []Request
	// Replicas and Budgets are the pool, in order, as the first decision
	// saw it.
	Replicas []string
	Budgets  []int64
	// Arms summarises what each arm observed, from the log alone.
	Arms []ArmStats
}

// ArmStats is one arm's observed results in a decision log.
type ArmStats struct {
	Name      string  `json:"name"`
	Policy    string  `json:"policy"`
	Requests  int     `json:"requests"`
	TTFTP50MS float64 `json:"ttft_ms_p50"`
	TTFTP99MS float64 `json:"ttft_ms_p99"`
	// CachedRate is the cached prompt tokens the replicas reported ÷ the
	// prompt tokens they reported.
	CachedRate float64 `json:"cached_token_rate"`
}

func parseBlocks(bl []decisionlog.Block) ([]blockhash.Block, error) {
	out := make([]blockhash.Block, len(bl))
	for i, b := range bl {
		h, err := strconv.ParseUint(b.Hash, 16, 64)
		if err != nil {
			return nil, fmt.Errorf("block %d hash %q: %w", i, b.Hash, err)
		}
		k, err := blockhash.ParseKind(b.Kind)
		if err != nil {
			return nil, fmt.Errorf("block %d: %w", i, err)
		}
		out[i] = blockhash.Block{Hash: h, Kind: k, Tokens: b.Tokens}
	}
	return out, nil
}

// ReadDecisions reads a decision log (router decision_log) as a trace: each
// decision with an outcome becomes a request with the logged blocks, session
// key, reply blocks and timing, in decision order (one without blocks, a
// prompt shorter than a block, with its prompt tokens and none to match).
// Replaying it under the policy that made the decisions, with the same model
// parameters, makes the same decisions.
func ReadDecisions(r io.Reader) (*DecisionTrace, error) {
	recs, err := finishedDecisions(r)
	if err != nil {
		return nil, err
	}
	t := &DecisionTrace{Replicas: recs[0].Replicas, Budgets: recs[0].Budgets}
	base := recs[0].TimeNs
	var arms armTally
	for _, rec := range recs {
		req, err := decisionRequest(rec, base)
		if err != nil {
			return nil, err
		}
		t.Requests = append(t.Requests, req)
		arms.add(rec)
	}
	t.Arms = arms.stats()
	return t, nil
}

// finishedDecisions reads the finished decisions of a log in time order:
// at least one, each naming its pool.
func finishedDecisions(r io.Reader) ([]*decisionlog.Record, error) {
	var recs []*decisionlog.Record
	err := decisionlog.Read(r, func(rec *decisionlog.Record) error {
		if rec.Outcome == nil || rec.Stage == "prefill" {
			return nil // unfinished; or a disaggregated request's prefill, replayed as its decode's request
		}
		if len(rec.Replicas) == 0 {
			return fmt.Errorf("decision %s: no replicas", rec.ID)
		}
		recs = append(recs, rec)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(recs) == 0 {
		return nil, errors.New("decision log: no finished decisions")
	}
	sort.SliceStable(recs, func(i, j int) bool { return recs[i].TimeNs < recs[j].TimeNs })
	return recs, nil
}

// decisionRequest returns the request a finished decision replays,
// arriving base nanoseconds after the trace's start.
func decisionRequest(rec *decisionlog.Record, base int64) (Request, error) {
	blocks, err := parseBlocks(rec.Blocks)
	if err != nil {
		return Request{}, fmt.Errorf("decision %s: %w", rec.ID, err)
	}
	reply, err := parseBlocks(rec.Outcome.ReplyBlocks)
	if err != nil {
		return Request{}, fmt.Errorf("decision %s reply: %w", rec.ID, err)
	}
	key, err := strconv.ParseUint(rec.Key, 16, 64)
	if err != nil {
		return Request{}, fmt.Errorf("decision %s key %q: %w", rec.ID, rec.Key, err)
	}
	o := rec.Outcome
	req := Request{Arrival: rec.TimeNs - base, Session: rec.Session, Tenant: rec.Tenant, Key: key, Blocks: blocks,
		Output: int(o.OutputTokens), Logged: &Logged{Arm: rec.Arm, Policy: rec.Policy, Chosen: rec.Chosen, Status: o.Status,
			TTFTNs: o.TTFTNs, DurationNs: o.DurationNs, PromptTokens: o.PromptTokens, CachedTokens: o.CachedTokens}}
	for _, b := range blocks {
		req.Tokens += int(b.Tokens)
	}
	if len(blocks) == 0 {
		// A prompt shorter than one of the engine's blocks (precise
		// mode keys whole blocks only): nothing to match, routed on
		// load, its prefill the tokens the replica reported.
		req.Tokens = max(int(o.PromptTokens), rec.Tokens)
	}
	if len(reply) > 0 {
		req.Reply = reply
	}
	return req, nil
}

// armTally adds up what each arm of a decision log observed.
type armTally struct {
	arms  map[string]*armObserved
	order []string // the arms' names, as first seen
}

// armObserved is one arm's decisions so far.
type armObserved struct {
	stats          ArmStats
	ttft           []float64 // ms
	prompt, cached int64
}

// add counts a finished decision in its arm.
func (t *armTally) add(rec *decisionlog.Record) {
	a := t.arms[rec.Arm]
	if a == nil {
		if t.arms == nil {
			t.arms = map[string]*armObserved{}
		}
		a = &armObserved{stats: ArmStats{Name: rec.Arm, Policy: rec.Policy}}
		t.arms[rec.Arm] = a
		t.order = append(t.order, rec.Arm)
	}
	o := rec.Outcome
	a.stats.Requests++
	if o.TTFTNs > 0 {
		a.ttft = append(a.ttft, float64(o.TTFTNs)/1e6)
	}
	a.prompt += o.PromptTokens
	a.cached += o.CachedTokens
}

// stats returns each arm's results, by name.
func (t *armTally) stats() []ArmStats {
	sort.Strings(t.order)
	var out []ArmStats
	for _, name := range t.order {
		a := t.arms[name]
		s := sortedCopy(a.ttft)
		a.stats.TTFTP50MS, a.stats.TTFTP99MS = percentile(s, 0.5), percentile(s, 0.99)
		if a.prompt > 0 {
			a.stats.CachedRate = float64(a.cached) / float64(a.prompt)
		}
		out = append(out, a.stats)
	}
	return out
}
