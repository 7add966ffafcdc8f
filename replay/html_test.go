package replay

import (
	"fmt"
	"regexp"
	"strings"
	"testing"
)

// The TTFT chart draws every series, the references included, each in
// its own colour and dash, names each in its legend, and draws the
// default last (on top) and thicker; the per-replica panels have a legend
// naming every replica in its own style.
func TestReportChartsAreLegible(t *testing.T) {
	res := func(name string) *Result {
		q := make([]float64, 101)
		for p := range q {
			q[p] = float64(10 + p)
		}
		return &Result{Name: name, TTFTQuantiles: q}
	}
	s := &Summary{Replicas: 12, Pooled: res("pooled"), Infinite: res("infinite")}
	for i := range 13 {
		s.Policies = append(s.Policies, res(fmt.Sprintf("policy-%d", i)))
	}
	s.Policies[3].Name = "semantic"
	s.Extra = []*Result{res("semantic-no-copy")}
	chart := ttftChart(s)
	lines := regexp.MustCompile(`<polyline fill="none" stroke="([^"]+)" stroke-width="([^"]+)"(?: stroke-dasharray="([^"]+)")?`).FindAllStringSubmatch(chart, -1)
	if len(lines) != 16 {
		t.Fatalf("%d series drawn, want 16 (13 policies, an ablation, pooled, infinite)", len(lines))
	}
	styles := map[string]bool{}
	for _, l := range lines {
		styles[l[1]+"/"+l[3]] = true
	}
	if len(styles) != 16 {
		t.Errorf("%d distinct colour and dash pairs for 16 series", len(styles))
	}
	if last := lines[len(lines)-1]; last[2] != "3.0" {
		t.Errorf("the last series drawn is %v, want the default's, thicker", last)
	}
	for _, r := range append(append([]*Result{s.Pooled, s.Infinite}, s.Policies...), s.Extra...) {
		if !strings.Contains(chart, ">"+r.Name+"</text>") {
			t.Errorf("%s is not in the legend", r.Name)
		}
	}
	legend := replicaLegend(s.replicaNames())
	for i := range 12 {
		if !strings.Contains(legend, fmt.Sprintf(">replica %d</text>", i)) {
			t.Errorf("replica %d is not in the panels' legend", i)
		}
	}
	if n := strings.Count(legend, "<line"); n != 12 {
		t.Errorf("%d legend samples for 12 replicas", n)
	}
}
