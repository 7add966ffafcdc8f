package replay

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// Write writes summary.json, summary.md, one CSV per run and report.html to
// dir, creating it.
func (s *Summary) Write(dir string) error {
	if err := os.MkdirAll(filepath.Join(dir, "runs"), 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "summary.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(dir, "summary.md"), s.Markdown); err != nil {
		return err
	}
	for _, r := range s.all() {
		if err := writeFile(filepath.Join(dir, "runs", r.FileName()+".csv"), r.CSV); err != nil {
			return err
		}
	}
	return writeFile(filepath.Join(dir, "report.html"), s.HTML)
}

func writeFile(path string, f func(io.Writer) error) error {
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(out)
	if err := f(w); err != nil {
		out.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := w.Flush(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func (s *Summary) all() []*Result {
	out := append([]*Result{}, s.Policies...)
	out = append(out, s.Extra...)
	return append(out, s.Pooled, s.Infinite)
}

// FileName is the run's name made safe as a file name: a picture mode's
// run is named policy/mode, written as policy_mode.
func (r *Result) FileName() string {
	return strings.NewReplacer("/", "_", "\\", "_").Replace(r.Name)
}

// CSV writes one line per request: arrival, replica, prompt and cached
// tokens, time to first token, for a run with a picture mode the cached
// tokens the picture predicted, and for a disaggregated one the prefill
// replica (-1: none). The replica is the one that decoded; cached tokens
// are the prefill replica's when it had one.
func (r *Result) CSV(w io.Writer) error {
	header := "arrival_ms,replica,prompt_tokens,cached_tokens,ttft_ms"
	if r.Prediction != nil {
		header += ",predicted_cached_tokens"
	}
	pd := r.Disaggregated > 0
	if pd {
		header += ",prefill_replica"
	}
	if _, err := fmt.Fprintln(w, header); err != nil {
		return err
	}
	for _, x := range r.rows {
		if _, err := fmt.Fprintf(w, "%.0f,%d,%d,%d,%.3f", x.arrivalMS, x.replica, x.promptTokens, x.cachedTokens, x.ttftMS); err != nil {
			return err
		}
		if r.Prediction != nil {
			if _, err := fmt.Fprintf(w, ",%d", x.predicted); err != nil {
				return err
			}
		}
		if pd {
			if _, err := fmt.Fprintf(w, ",%d", x.prefill); err != nil {
				return err
			}
		}
		if _, err := io.WriteString(w, "\n"); err != nil {
			return err
		}
	}
	return nil
}

// predictions reports whether any run has a picture mode: the tables then
// carry the prediction columns.
func (s *Summary) predictions() bool {
	for _, r := range s.all() {
		if r.Prediction != nil {
			return true
		}
	}
	return false
}

// PredictionHeader is the header of the prediction columns TableRow's
// table gains when a run has a picture mode (append it after
// TableHeader's columns).
const PredictionHeader = " picture | predicted cached tokens | actual cached tokens | prediction error | mean abs error |"

// PredictionCells formats r's prediction columns (empty cells for runs
// without a picture mode, as the references).
func (r *Result) PredictionCells() string {
	p := r.Prediction
	if p == nil {
		return " | | | | |"
	}
	return fmt.Sprintf(" %s | %d | %d | %+.4f | %.4f |", p.Picture, p.PredictedTokens, p.ActualTokens, p.Error, p.MeanAbsError)
}

// TableRow formats a result as a Markdown table row.
func (r *Result) TableRow(pooled *Result) string {
	rel := ""
	if pooled != nil && pooled.TokenHitRate > 0 {
		rel = fmt.Sprintf("%.3f", r.TokenHitRate/pooled.TokenHitRate)
	}
	return fmt.Sprintf("| %s | %.4f | %s | %.4f | %d | %.0f | %.0f | %.0f | %.3f |",
		r.Name, r.TokenHitRate, rel, r.BlockHitRate, r.PrefillTokensSaved, r.TTFTMeanMS, r.TTFTP50MS, r.TTFTP99MS, r.LoadImbalance)
}

// TableHeader is the header of TableRow's table.
const TableHeader = "| policy | token hit rate | ÷ pooled | block hit rate | prefill tokens saved | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | load imbalance |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"

// Markdown writes the summary as a Markdown document.
func (s *Summary) Markdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# Replay of %s\n\n", s.Trace)
	b.WriteString(s.modelLine() + "\n\n")
	pred := s.predictions()
	if pred {
		head, align, _ := strings.Cut(TableHeader, "\n")
		b.WriteString(head + PredictionHeader + "\n" + align + "---|---:|---:|---:|---:|\n")
	} else {
		b.WriteString(TableHeader + "\n")
	}
	for _, r := range s.all() {
		b.WriteString(r.TableRow(s.Pooled))
		if pred {
			b.WriteString(r.PredictionCells())
		}
		b.WriteString("\n")
	}
	if pred {
		b.WriteString("\nCached tokens are the engines' own: each replica's engine cache is simulated apart from the router's picture. " +
			"Prediction error is (Σ predicted − Σ actual) ÷ Σ actual, predicted being the picture's match on the replica chosen when the request was routed, " +
			"actual what the engine found cached when it scheduled the prefill; mean abs error is the mean |predicted − actual| ÷ the mean actual.\n")
	}
	for _, n := range s.notes() {
		b.WriteString("\n" + n + "\n")
	}
	if len(s.Model.Fleet) > 0 {
		b.WriteString("\n" + byClassNote + "\n\n")
		for _, r := range s.all() {
			b.WriteString("- " + r.Name + ": " + r.classCells() + "\n")
		}
	}
	if len(s.Arms) > 0 {
		b.WriteString("\n## Arms observed in the decision log\n\n| arm | policy | requests | TTFT p50 ms | TTFT p99 ms | cached token rate |\n|---|---|---:|---:|---:|---:|\n")
		for _, a := range s.Arms {
			fmt.Fprintf(&b, "| %s | %s | %d | %.1f | %.1f | %.4f |\n", a.Name, a.Policy, a.Requests, a.TTFTP50MS, a.TTFTP99MS, a.CachedRate)
		}
		b.WriteString("\n## Decisions each policy would change\n\n| policy | changed | share | predicted token hit rate |\n|---|---:|---:|---:|\n")
		for _, r := range append(append([]*Result{}, s.Policies...), s.Extra...) {
			fmt.Fprintf(&b, "| %s | %d | %.4f | %.4f |\n", r.Name, r.Changed, r.ChangedShare, r.TokenHitRate)
		}
		b.WriteString("\n" + changedNote + "\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// modelLine describes the replay's trace and replicas in one sentence:
// the replicas' one model, or each class of a mixed fleet.
func (s *Summary) modelLine() string {
	fleet := fmt.Sprintf("%d replicas of %d tokens, eviction %s; prefill %.1f ms + %.0f µs/token, %.0f ms/output token, %d running max",
		s.Replicas, s.BudgetTokens, s.Model.Eviction, s.Model.PrefillOverheadMS, s.Model.PrefillPerTokenUS, s.Model.InterTokenMS, s.Model.MaxRunning)
	if len(s.Model.Fleet) > 0 {
		classes := make([]string, len(s.Model.Fleet))
		for k, c := range s.Model.Fleet {
			classes[k] = c.String()
		}
		fleet = fmt.Sprintf("%d replicas in %d classes, eviction %s: %s", s.Replicas, len(s.Model.Fleet), s.Model.Eviction, strings.Join(classes, "; "))
	}
	return fmt.Sprintf("%d requests (%s format), %s; speed-up %g; seed %d; replay took %.1f s.",
		s.Requests, s.Format, fleet, s.Model.Speedup, s.Model.Seed, s.WallSeconds)
}

// kvWaitsNote says how many requests of each run waited for room in
// their engine's KV cache, when some did; "" otherwise.
func (s *Summary) kvWaitsNote() string {
	n, some := "KV-bound engines: requests that waited, first in their replica's queue, for room in its KV cache (the engines admit first come first served, as vLLM's scheduler does):", false
	for _, r := range s.all() {
		n += fmt.Sprintf(" %s %d;", r.Name, r.KVWaits)
		some = some || r.KVWaits > 0
	}
	if !some {
		return ""
	}
	return strings.TrimSuffix(n, ";") + "."
}

// byClassNote heads the per-class results of a mixed fleet.
const byClassNote = "By replica class, where each request's prompt was computed: requests, token hit rate, prefill tokens computed, TTFT p50 / p99 ms, requests that waited for KV room."

// classCells formats r's per-class results, as byClassNote says.
func (r *Result) classCells() string {
	cells := make([]string, len(r.Classes))
	for k, c := range r.Classes {
		cells[k] = fmt.Sprintf("%s %d, %.4f, %d, %.0f / %.0f, %d", c.Name, c.Requests, c.TokenHitRate, c.PrefillComputed, c.TTFTP50MS, c.TTFTP99MS, c.KVWaits)
	}
	return strings.Join(cells, "; ")
}

// changedNote says why a policy replayed on its own decision log may still
// change some of them.
const changedNote = "Replayed under the policy that made them, decisions change only where the live router knew " +
	"what the replay does not: other routers' requests (a fleet), the replicas' reported load and KV usage between " +
	"requests, and, in precise mode, its engines' KV events as they arrived and the tokens they counted; " +
	"the replay's picture learns by feedback. Sequential traffic replays unchanged in both modes " +
	"(go test -run TestDecisionLogReplaysToSameDecisions ./cmd/router)."

// HTML writes the report page (filled in below).
func (s *Summary) HTML(w io.Writer) error { return s.html(w) }

// notes are the report's remarks on the trace and the engines, in plain
// text, for summary.md and report.html alike: tied arrivals when a tenth or
// more of the requests share a millisecond with the one before, and the
// references' limit when engines reuse beyond the prefix.
func (s *Summary) notes() []string {
	var out []string
	if s.TiedArrivals*10 >= s.Requests && s.Requests > 0 {
		if s.Model.SpreadTiesMS > 0 {
			out = append(out, fmt.Sprintf("%d of %d requests arrive in the same millisecond as the one before them in the trace; each such run was spread over up to %g ms, ending before the next (--spread-ties).",
				s.TiedArrivals, s.Requests, s.Model.SpreadTiesMS))
		} else {
			out = append(out, fmt.Sprintf("%d of %d requests arrive in the same millisecond as the one before them. "+
				"They are replayed as arriving at once, so routers that share state with a delay cannot see each other's choices among them; "+
				"if the trace's timestamps were bucketed, --spread-ties spreads each run over the bucket.", s.TiedArrivals, s.Requests))
		}
	}
	if s.Model.Reuse != "" {
		out = append(out, fmt.Sprintf("The engines reuse beyond the exact prefix (%s). The pooled and infinite references reuse the exact prefix alone: they are not these engines' ceiling.", s.Model.Reuse))
	}
	if n := s.kvWaitsNote(); n != "" {
		out = append(out, n)
	}
	if pd := s.Model.Disaggregation; pd != nil {
		n := fmt.Sprintf("Disaggregated: %d prefill and %d decode replicas, a KV transfer %.1f ms + %.1f µs/token, prompts of %d uncached tokens or more through a prefill replica. "+
			"Cached tokens are counted where the prompt was computed; TTFT ends when the decode replica has the KV. Requests disaggregated, and tokens transferred:",
			pd.PrefillReplicas, pd.DecodeReplicas, pd.TransferLatencyMS, pd.TransferPerTokenUS, pd.MinPrefillTokens)
		for _, r := range s.all() {
			n += fmt.Sprintf(" %s %d, %d;", r.Name, r.Disaggregated, r.TransferTokens)
		}
		out = append(out, strings.TrimSuffix(n, ";")+".")
	}
	return out
}
