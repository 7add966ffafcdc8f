package replay

import (
	"fmt"
	"html"
	"io"
	"math"
	"strings"
)

// palette holds ten distinguishable colours (Tableau 10), and dashes the
// patterns that tell apart series sharing a colour: series i is drawn in
// palette[i%10] with dashes[i/10%3], so 30 series are each distinct.
var (
	palette = []string{
		"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
		"#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
	}
	dashes = []string{"", "7,3", "2,2"}
)

func color(i int) string { return palette[i%len(palette)] }

func dash(i int) string { return dashes[i/len(palette)%len(dashes)] }

// svgDoc accumulates one SVG chart.
type svgDoc struct {
	b    strings.Builder
	w, h int
}

func newSVG(w, h int) *svgDoc {
	s := &svgDoc{w: w, h: h}
	fmt.Fprintf(&s.b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="11">`, w, h, w, h)
	return s
}

func (s *svgDoc) text(x, y float64, anchor, txt string) {
	fmt.Fprintf(&s.b, `<text x="%.1f" y="%.1f" text-anchor="%s">%s</text>`, x, y, anchor, html.EscapeString(txt))
}

func (s *svgDoc) line(x1, y1, x2, y2 float64, stroke string, width float64, dash string) {
	fmt.Fprintf(&s.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="%.1f"`, x1, y1, x2, y2, stroke, width)
	if dash != "" {
		fmt.Fprintf(&s.b, ` stroke-dasharray="%s"`, dash)
	}
	s.b.WriteString("/>")
}

func (s *svgDoc) rect(x, y, w, h float64, fill string) {
	fmt.Fprintf(&s.b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"/>`, x, y, w, h, fill)
}

func (s *svgDoc) polyline(pts [][2]float64, stroke string, width float64, dash string) {
	fmt.Fprintf(&s.b, `<polyline fill="none" stroke="%s" stroke-width="%.1f"`, stroke, width)
	if dash != "" {
		fmt.Fprintf(&s.b, ` stroke-dasharray="%s"`, dash)
	}
	s.b.WriteString(` points="`)
	for _, p := range pts {
		fmt.Fprintf(&s.b, "%.1f,%.1f ", p[0], p[1])
	}
	s.b.WriteString(`"/>`)
}

// legend draws one entry per name from (x, y) down, each a sample of its
// series' colour and dash: names[j] is series first+j.
func (s *svgDoc) legend(x, y float64, names []string, first int, width func(i int) float64) {
	for j, name := range names {
		i, yy := first+j, y+float64(j)*15
		s.line(x, yy+4, x+22, yy+4, color(i), width(i), dash(i))
		s.text(x+26, yy+8, "start", name)
	}
}

// isDefault reports whether a result is the default policy's, drawn on
// top and thicker: semantic, alone or in a picture mode or fleet variant.
func isDefault(r *Result) bool {
	return r.Name == "semantic" || strings.HasPrefix(r.Name, "semantic/")
}

func (s *svgDoc) String() string { return s.b.String() + "</svg>" }

// hitRateChart is a horizontal bar per policy with the references as lines.
func hitRateChart(s *Summary) string {
	rows := append(append([]*Result{}, s.Policies...), s.Extra...)
	const left, right, top, barH = 170.0, 60.0, 20.0, 18.0
	h := int(top + float64(len(rows))*(barH+6) + 40)
	c := newSVG(760, h)
	scale := func(v float64) float64 { return left + v*(760-left-right) }
	maxV := max(s.Infinite.TokenHitRate, 0.01)
	for i, r := range rows {
		y := top + float64(i)*(barH+6)
		c.text(left-6, y+barH-5, "end", r.Name)
		c.rect(left, y, scale(r.TokenHitRate/maxV)-left, barH, color(i))
		c.text(scale(r.TokenHitRate/maxV)+4, y+barH-5, "start", fmt.Sprintf("%.3f", r.TokenHitRate))
	}
	bottom := top + float64(len(rows))*(barH+6)
	for _, ref := range []*Result{s.Pooled, s.Infinite} {
		x := scale(ref.TokenHitRate / maxV)
		c.line(x, top-6, x, bottom, "#000", 1, "4,3")
		c.text(x, bottom+14, "middle", fmt.Sprintf("%s %.3f", ref.Name, ref.TokenHitRate))
	}
	return c.String()
}

// ttftChart draws each policy's TTFT distribution as a CDF on a log axis,
// the references too, every series in the legend, the default's last (on
// top) and thicker.
func ttftChart(s *Summary) string {
	rows := append(append(append([]*Result{}, s.Policies...), s.Extra...), s.Pooled, s.Infinite)
	const left, right, top, bottom, w = 50.0, 190.0, 15.0, 40.0, 780.0
	h := max(360.0, top+float64(len(rows))*15+bottom)
	lo, hi := math.Inf(1), 1.0
	for _, r := range rows {
		for _, q := range r.TTFTQuantiles {
			if q > 0 {
				lo = min(lo, q)
			}
			hi = max(hi, q)
		}
	}
	lo = math.Max(math.Pow(10, math.Floor(math.Log10(math.Max(lo, 0.1)))), 0.1)
	hi = math.Pow(10, math.Ceil(math.Log10(hi)))
	x := func(v float64) float64 {
		return left + (math.Log10(math.Max(v, lo))-math.Log10(lo))/(math.Log10(hi)-math.Log10(lo))*(w-left-right)
	}
	y := func(p float64) float64 { return top + (1-p)*(h-top-bottom) }
	c := newSVG(int(w), int(h))
	for d := lo; d <= hi*1.0001; d *= 10 {
		c.line(x(d), top, x(d), h-bottom, "#ddd", 1, "")
		c.text(x(d), h-bottom+14, "middle", fmt.Sprintf("%g", d))
	}
	for _, p := range []float64{0, 0.5, 0.9, 0.99} {
		c.line(left, y(p), w-right, y(p), "#eee", 1, "")
		c.text(left-4, y(p)+4, "end", fmt.Sprintf("p%g", p*100))
	}
	c.text((left+w-right)/2, h-8, "middle", "time to first token, ms (log scale)")
	width := func(i int) float64 {
		if isDefault(rows[i]) {
			return 3
		}
		return 1.5
	}
	names := make([]string, len(rows))
	order := make([]int, 0, len(rows)) // the default's last, on top
	for i, r := range rows {
		names[i] = r.Name
		if !isDefault(r) {
			order = append(order, i)
		}
	}
	for i, r := range rows {
		if isDefault(r) {
			order = append(order, i)
		}
	}
	for _, i := range order {
		var pts [][2]float64
		for p, q := range rows[i].TTFTQuantiles {
			pts = append(pts, [2]float64{x(q), y(float64(p) / 100)})
		}
		c.polyline(pts, color(i), width(i), dash(i))
	}
	c.legend(w-right+10, top, names, 0, width)
	return c.String()
}

// loadChart draws one policy's prefill tokens per replica over time.
func loadChart(r *Result) string {
	const left, top, bottom, w, h = 60.0, 22.0, 20.0, 360.0, 170.0
	peak := 1.0
	for _, b := range r.LoadOverTime {
		for _, v := range b {
			peak = max(peak, v)
		}
	}
	c := newSVG(int(w), int(h))
	c.text(w/2, 14, "middle", fmt.Sprintf("%s (imbalance %.2f)", r.Name, r.LoadImbalance))
	c.line(left, h-bottom, w-10, h-bottom, "#999", 1, "")
	c.line(left, top, left, h-bottom, "#999", 1, "")
	c.text(left-4, top+8, "end", fmt.Sprintf("%.0fk", peak/1000))
	c.text(left-4, h-bottom, "end", "0")
	c.text((left+w)/2, h-4, "middle", "trace time →")
	if len(r.LoadOverTime) == 0 {
		return c.String()
	}
	n := len(r.LoadOverTime)
	for rep := range r.LoadOverTime[0] {
		var pts [][2]float64
		for b := range r.LoadOverTime {
			pts = append(pts, [2]float64{
				left + float64(b)/float64(max(n-1, 1))*(w-10-left),
				h - bottom - r.LoadOverTime[b][rep]/peak*(h-bottom-top),
			})
		}
		c.polyline(pts, color(rep), 1.5, dash(rep))
	}
	return c.String()
}

// replicaLegend names the per-replica panels' series: replica r is drawn
// in color(r) and dash(r) in every panel. Eight to a column.
func replicaLegend(names []string) string {
	const perCol, colW = 8, 140
	cols := (len(names) + perCol - 1) / perCol
	c := newSVG(max(cols, 1)*colW, min(len(names), perCol)*15+8)
	for first := 0; first < len(names); first += perCol {
		c.legend(float64(first/perCol*colW), 2, names[first:min(first+perCol, len(names))], first, func(int) float64 { return 2 })
	}
	return c.String()
}

// replicaNames names the replicas of the run, as the model did, or by
// their index.
func (s *Summary) replicaNames() []string {
	names := make([]string, s.Replicas)
	for i := range names {
		names[i] = fmt.Sprintf("replica %d", i)
		if i < len(s.ReplicaNames) && s.ReplicaNames[i] != "" {
			names[i] = s.ReplicaNames[i]
		}
	}
	return names
}

func (s *Summary) html(w io.Writer) error {
	var b strings.Builder
	b.WriteString(`<!doctype html><html><head><meta charset="utf-8"><title>semroute replay</title><style>
body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,th:first-child{text-align:left}
.grid{display:flex;flex-wrap:wrap;gap:8px}</style></head><body>`)
	fmt.Fprintf(&b, "<h1>Replay of %s</h1>", html.EscapeString(s.Trace))
	if len(s.Model.Fleet) == 0 {
		fmt.Fprintf(&b, "<p>%d requests (%s), %d replicas of %d tokens, eviction %s; prefill %.1f ms + %.0f µs per uncached token; %.0f ms per output token; %d running sequences at most; speed-up %g; seed %d.</p>",
			s.Requests, html.EscapeString(s.Format), s.Replicas, s.BudgetTokens, html.EscapeString(s.Model.Eviction),
			s.Model.PrefillOverheadMS, s.Model.PrefillPerTokenUS, s.Model.InterTokenMS, s.Model.MaxRunning, s.Model.Speedup, s.Model.Seed)
	} else {
		fmt.Fprintf(&b, "<p>%d requests (%s), %d replicas in %d classes, eviction %s; speed-up %g; seed %d.</p><ul>",
			s.Requests, html.EscapeString(s.Format), s.Replicas, len(s.Model.Fleet), html.EscapeString(s.Model.Eviction), s.Model.Speedup, s.Model.Seed)
		for _, c := range s.Model.Fleet {
			b.WriteString("<li>" + html.EscapeString(c.String()) + "</li>")
		}
		b.WriteString("</ul>")
	}
	pred := s.predictions()
	b.WriteString("<table><tr><th>policy</th><th>token hit rate</th><th>÷ pooled</th><th>block hit rate</th><th>prefill tokens saved</th><th>TTFT mean ms</th><th>p50</th><th>p99</th><th>load imbalance</th>")
	if pred {
		b.WriteString("<th>picture</th><th>predicted cached tokens</th><th>actual cached tokens</th><th>prediction error</th><th>mean abs error</th>")
	}
	b.WriteString("</tr>")
	for _, r := range s.all() {
		fmt.Fprintf(&b, "<tr><td>%s</td><td>%.4f</td><td>%.3f</td><td>%.4f</td><td>%d</td><td>%.0f</td><td>%.0f</td><td>%.0f</td><td>%.3f</td>",
			html.EscapeString(r.Name), r.TokenHitRate, r.TokenHitRate/math.Max(s.Pooled.TokenHitRate, 1e-12), r.BlockHitRate,
			r.PrefillTokensSaved, r.TTFTMeanMS, r.TTFTP50MS, r.TTFTP99MS, r.LoadImbalance)
		if p := r.Prediction; pred && p != nil {
			fmt.Fprintf(&b, "<td>%s</td><td>%d</td><td>%d</td><td>%+.4f</td><td>%.4f</td>",
				html.EscapeString(p.Picture), p.PredictedTokens, p.ActualTokens, p.Error, p.MeanAbsError)
		} else if pred {
			b.WriteString("<td></td><td></td><td></td><td></td><td></td>")
		}
		b.WriteString("</tr>")
	}
	b.WriteString("</table>")
	if pred {
		b.WriteString("<p>Cached tokens are the engines' own (each replica's engine cache simulated apart from the router's picture). " +
			"Prediction error: (Σ predicted − Σ actual) ÷ Σ actual, predicted being the picture's match on the chosen replica when routed, " +
			"actual what the engine found when it scheduled the prefill; mean abs error: mean |predicted − actual| ÷ mean actual.</p>")
	}
	for _, n := range s.notes() {
		b.WriteString("<p>" + html.EscapeString(n) + "</p>")
	}
	if len(s.Model.Fleet) > 0 {
		b.WriteString(s.classTable())
	}
	b.WriteString("<h2>Token hit rate</h2>")
	b.WriteString(hitRateChart(s))
	b.WriteString("<h2>Time to first token</h2>")
	b.WriteString(ttftChart(s))
	b.WriteString("<h2>Prefill tokens computed per replica over time</h2>")
	b.WriteString(replicaLegend(s.replicaNames()))
	b.WriteString("<div class=grid>")
	for _, r := range append(append([]*Result{}, s.Policies...), s.Extra...) {
		b.WriteString(loadChart(r))
	}
	b.WriteString("</div></body></html>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// classTable is a mixed fleet's per-class results: a row per run and
// class.
func (s *Summary) classTable() string {
	var b strings.Builder
	b.WriteString("<h2>By replica class</h2><p>Where each request's prompt was computed.</p><table><tr><th>policy</th><th>class</th><th>requests</th><th>token hit rate</th><th>prefill tokens computed</th><th>TTFT p50 ms</th><th>p99</th><th>waited for KV room</th></tr>")
	for _, r := range s.all() {
		for _, c := range r.Classes {
			fmt.Fprintf(&b, "<tr><td>%s</td><td>%s</td><td>%d</td><td>%.4f</td><td>%d</td><td>%.0f</td><td>%.0f</td><td>%d</td></tr>",
				html.EscapeString(r.Name), html.EscapeString(c.Name), c.Requests, c.TokenHitRate, c.PrefillComputed, c.TTFTP50MS, c.TTFTP99MS, c.KVWaits)
		}
	}
	b.WriteString("</table>")
	return b.String()
}
