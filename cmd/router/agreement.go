package main

import (
	"context"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/semroute/semroute/agreement"
	"github.com/semroute/semroute/kvsync"
	"github.com/semroute/semroute/replica"
)

// warnEvery bounds how often one replica's one cause is warned about.
const warnEvery = time.Minute

// newAgreement makes the tracker of every replica's sources, whose changes
// are logged: a warning naming the replica and the cause when one starts
// (at most once a minute per replica and cause), and a line when it ends.
func newAgreement(log *slog.Logger) *agreement.Tracker {
	var mu sync.Mutex
	last := map[string]time.Time{}
	return agreement.New(agreement.Options{OnChange: func(name string, c agreement.Cause, on bool, detail string) {
		if !on {
			log.Info("replica agrees with its engine again", "replica", name, "cause", string(c))
			return
		}
		mu.Lock()
		k := name + "\x00" + string(c)
		quiet := time.Since(last[k]) < warnEvery
		if !quiet {
			last[k] = time.Now()
		}
		mu.Unlock()
		if !quiet {
			log.Warn("replica disagrees with its engine: "+fallbackOf(c), "replica", name, "cause", string(c), "detail", detail)
		}
	}})
}

// fallbackOf says what the router does for a replica while c holds.
func fallbackOf(c agreement.Cause) string {
	switch c {
	case agreement.TokenizeFailing, agreement.TokensDisagree:
		return "its /tokenize is not asked; requests are routed on another replica's tokens or on estimates"
	case agreement.EventOrphans:
		return "its KV events are not trusted; its cache picture is the approximate one"
	case agreement.EventsSilent, agreement.EventsUnusable:
		return "its cache picture is the approximate one"
	default:
		return "the router's picture of its cache is off; check budgets, block size and tokenizer"
	}
}

// judgeEvents feeds the tracker each follower's events since the last call
// and trusts or distrusts each follower by the verdict, every interval
// until ctx ends.
func (a *app) judgeEvents(ctx context.Context, interval time.Duration) {
	type seen struct{ stored, orphans, skipped, applied, finished uint64 }
	last := map[int]seen{}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		status := map[string]agreement.Status{}
		for _, s := range a.agreement.Status() {
			status[s.Replica] = s
		}
		a.events.mu.Lock()
		fs := make(map[int]*kvsync.Follower, len(a.events.by))
		for id, f := range a.events.by {
			fs[id] = f
		}
		a.events.mu.Unlock()
		for id, f := range fs {
			st, rs := f.Stats(), status[f.Name()]
			prev := last[id]
			last[id] = seen{st.Stored, st.Orphans, st.Skipped, st.Subscriber.Applied, rs.Finished}
			// Silent: no batch since the last look while requests were
			// served there (an idle engine is silent and fine).
			heard := st.Subscriber.Applied > prev.applied
			routed := rs.Finished >= prev.finished+4
			a.agreement.Events(f.Name(), st.Stored-prev.stored, st.Orphans-prev.orphans, st.Skipped-prev.skipped, heard || !routed, routed)
			f.Trust(!slices.Contains(rs.Causes, agreement.EventOrphans))
		}
	}
}

var (
	descDisagree = prometheus.NewDesc("semroute_replica_disagreement", "1 while the replica disagrees with its engine for the cause (tokenize_failing, tokens_disagree, predictions_off, events_orphans, events_silent, events_unusable, time_off); for the first six the router then falls back for it to the best mode that works.", []string{"replica", "cause"}, nil)
	descPredRate = prometheus.NewDesc("semroute_replica_predicted_ratio", "Predicted ÷ reported cached tokens over the replica's last 64 requests (0 before any reported hit).", []string{"replica"}, nil)
	descTTFTRate = prometheus.NewDesc("semroute_replica_ttft_predicted_ratio", "Predicted ÷ observed time to first token over the replica's last 64 streamed requests (0 before any).", []string{"replica"}, nil)
	descTTFTErr  = prometheus.NewDesc("semroute_replica_ttft_log_error", "Mean |log(observed ÷ predicted)| time to first token over the replica's last 64 streamed requests: 0.1 is about 10% off; time_off from ln 2.", []string{"replica"}, nil)
)

// agreementMetrics exports the tracker's verdicts, and 0 for the pool's
// replicas it has heard nothing of yet (an alert on a cause then has a
// series from the start).
type agreementMetrics struct {
	t    *agreement.Tracker
	pool *replica.Pool
}

func (m agreementMetrics) Describe(ch chan<- *prometheus.Desc) {
	ch <- descDisagree
	ch <- descPredRate
	ch <- descTTFTRate
	ch <- descTTFTErr
}

func (m agreementMetrics) Collect(ch chan<- prometheus.Metric) {
	statuses := m.t.Status()
	known := map[string]bool{}
	for _, s := range statuses {
		known[s.Replica] = true
	}
	if m.pool != nil {
		for _, r := range m.pool.Replicas() {
			if !known[r.Name] {
				statuses = append(statuses, agreement.Status{Replica: r.Name})
			}
		}
	}
	for _, s := range statuses {
		on := map[agreement.Cause]bool{}
		for _, c := range s.Causes {
			on[c] = true
		}
		for _, c := range agreement.Causes {
			v := 0.0
			if on[c] {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(descDisagree, prometheus.GaugeValue, v, s.Replica, string(c))
		}
		ch <- prometheus.MustNewConstMetric(descPredRate, prometheus.GaugeValue, s.PredictedRatio, s.Replica)
		ch <- prometheus.MustNewConstMetric(descTTFTRate, prometheus.GaugeValue, s.TTFTRatio, s.Replica)
		ch <- prometheus.MustNewConstMetric(descTTFTErr, prometheus.GaugeValue, s.TTFTError, s.Replica)
	}
}

// adminAgreement lists every replica's verdict.
func (a *app) adminAgreement(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, a.agreement.Status())
}
