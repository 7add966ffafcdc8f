package replay

import (
	"cmp"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ReplicaClass is Count replicas alike in a mixed fleet (Config.Classes):
// their engine's speed, sequence limit and KV cache. A zero field takes
// the Config's value for every replica (PrefillOverhead, PrefillPerToken,
// InterToken, MaxRunning, BudgetTokens).
type ReplicaClass struct {
	// Name names the class in reports; "" is "class-k", k its place in
	// Config.Classes from 0. Letters, digits, '-', '_' and '.' only.
	Name            string
	Count           int // replicas of the class, at least 1
	PrefillOverhead time.Duration
	PrefillPerToken time.Duration
	InterToken      time.Duration
	MaxRunning      int
	BudgetTokens    int64
}

// engineModel is one replica's engine, its class's fields over the
// Config's: what the simulation times and admits by.
type engineModel struct {
	class           int // index in Config.Classes; 0 without classes
	prefillOverhead time.Duration
	prefillPerToken time.Duration
	interToken      time.Duration
	maxRunning      int
	budget          int64
}

// prefill returns the time the engine takes to prefill uncached tokens.
func (e *engineModel) prefill(uncached int64) int64 {
	return int64(e.prefillOverhead) + uncached*int64(e.prefillPerToken)
}

// classKeys are ParseClass's keys, in the order String writes them.
var classKeys = []string{"name", "count", "prefill_overhead", "prefill_per_token", "inter_token", "max_running", "budget_tokens"}

// ParseClass reads a replica class as the replay command's --class takes
// it: comma-separated key=value pairs, count required, durations as Go
// writes them (100us, 1.5ms), for example
//
//	name=slow,count=4,prefill_per_token=300us,inter_token=60ms,max_running=64,budget_tokens=200000
//
// An unknown or repeated key is an error naming the keys; String writes
// a class back in this form.
func ParseClass(s string) (ReplicaClass, error) {
	var c ReplicaClass
	seen := map[string]bool{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return ReplicaClass{}, fmt.Errorf("class %q: %q is not key=value (keys: %s)", s, kv, strings.Join(classKeys, ", "))
		}
		if seen[k] {
			return ReplicaClass{}, fmt.Errorf("class %q: %s given twice", s, k)
		}
		seen[k] = true
		if err := c.set(k, v); err != nil {
			return ReplicaClass{}, fmt.Errorf("class %q: %w", s, err)
		}
	}
	if !seen["count"] {
		return ReplicaClass{}, fmt.Errorf("class %q: no count", s)
	}
	return c, c.check()
}

// set sets the field named k from v.
func (c *ReplicaClass) set(k, v string) error {
	var err error
	switch k {
	case "name":
		c.Name = v
	case "count":
		c.Count, err = strconv.Atoi(v)
	case "prefill_overhead":
		c.PrefillOverhead, err = time.ParseDuration(v)
	case "prefill_per_token":
		c.PrefillPerToken, err = time.ParseDuration(v)
	case "inter_token":
		c.InterToken, err = time.ParseDuration(v)
	case "max_running":
		c.MaxRunning, err = strconv.Atoi(v)
	case "budget_tokens":
		c.BudgetTokens, err = strconv.ParseInt(v, 10, 64)
	default:
		return fmt.Errorf("unknown key %q (keys: %s)", k, strings.Join(classKeys, ", "))
	}
	if err != nil {
		return fmt.Errorf("%s: %w", k, err)
	}
	return nil
}

// check checks the class's own fields.
func (c *ReplicaClass) check() error {
	switch {
	case c.Count < 1 || c.Count > 4096:
		return fmt.Errorf("count %d not in [1, 4096]", c.Count)
	case c.PrefillOverhead < 0 || c.PrefillPerToken < 0 || c.InterToken < 0:
		return errors.New("class times must not be negative")
	case c.MaxRunning < 0 || c.BudgetTokens < 0:
		return errors.New("class max_running and budget_tokens must not be negative")
	}
	if strings.IndexFunc(c.Name, notNameRune) >= 0 {
		return fmt.Errorf("name %q: letters, digits, '-', '_' and '.' only", c.Name)
	}
	return nil
}

// notNameRune reports whether r may not be in a class's name.
func notNameRune(r rune) bool {
	return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.')
}

// String writes the class as ParseClass reads it, its zero fields left out.
func (c ReplicaClass) String() string {
	var parts []string
	add := func(k string, v any, zero bool) {
		if !zero {
			parts = append(parts, fmt.Sprintf("%s=%v", k, v))
		}
	}
	add("name", c.Name, c.Name == "")
	add("count", c.Count, false)
	add("prefill_overhead", c.PrefillOverhead, c.PrefillOverhead == 0)
	add("prefill_per_token", c.PrefillPerToken, c.PrefillPerToken == 0)
	add("inter_token", c.InterToken, c.InterToken == 0)
	add("max_running", c.MaxRunning, c.MaxRunning == 0)
	add("budget_tokens", c.BudgetTokens, c.BudgetTokens == 0)
	return strings.Join(parts, ",")
}

// className returns class k's name in reports.
func (m *Config) className(k int) string {
	if k < len(m.Classes) && m.Classes[k].Name != "" {
		return m.Classes[k].Name
	}
	return fmt.Sprintf("class-%d", k)
}

// resolveFleet checks Classes against the replica count and fills
// m.fleet, each replica's engine: its class's fields over the Config's,
// and its budget from Budgets when a decision log gave them. The Config's
// own fields must be defaulted first.
func (m *Config) resolveFleet() error {
	if len(m.Classes) > 0 {
		if len(m.Budgets) > 0 {
			return errors.New("replica classes and per-replica budgets (a decision log's) both given: give the budgets in the classes")
		}
		n := 0
		names := map[string]bool{}
		for k := range m.Classes {
			if err := m.Classes[k].check(); err != nil {
				return fmt.Errorf("class %d: %w", k, err)
			}
			name := m.className(k)
			if names[name] {
				return fmt.Errorf("class name %q given twice", name)
			}
			names[name] = true
			n += m.Classes[k].Count
		}
		if m.Replicas != 0 && m.Replicas != n {
			return fmt.Errorf("classes count %d replicas, the fleet has %d", n, m.Replicas)
		}
		m.Replicas = n
	}
	m.Replicas = cmp.Or(m.Replicas, DefaultReplicas)
	if m.Replicas < 1 || m.Replicas > 4096 {
		return fmt.Errorf("replicas %d not in [1, 4096]", m.Replicas)
	}
	m.fleet = make([]engineModel, m.Replicas)
	r := 0
	for k := range max(len(m.Classes), 1) {
		c, count := ReplicaClass{}, m.Replicas
		if len(m.Classes) > 0 {
			c, count = m.Classes[k], m.Classes[k].Count
		}
		for range count {
			e := engineModel{class: k, prefillOverhead: cmp.Or(c.PrefillOverhead, m.PrefillOverhead),
				prefillPerToken: cmp.Or(c.PrefillPerToken, m.PrefillPerToken), interToken: cmp.Or(c.InterToken, m.InterToken),
				maxRunning: cmp.Or(c.MaxRunning, m.MaxRunning), budget: cmp.Or(c.BudgetTokens, m.BudgetTokens)}
			if r < len(m.Budgets) {
				e.budget = m.Budgets[r]
			}
			m.fleet[r] = e
			r++
		}
	}
	return nil
}

// ClassSummary records one replica class as the replay ran it, its
// defaults filled in.
type ClassSummary struct {
	Name              string  `json:"name"`
	Count             int     `json:"count"`
	FirstReplica      int     `json:"first_replica"` // its replicas are FirstReplica to FirstReplica+Count−1
	PrefillOverheadMS float64 `json:"prefill_overhead_ms"`
	PrefillPerTokenUS float64 `json:"prefill_per_token_us"`
	InterTokenMS      float64 `json:"inter_token_ms"`
	MaxRunning        int     `json:"max_running"`
	BudgetTokens      int64   `json:"budget_tokens"`
}

// fleetSummary returns the classes as run; nil without Classes.
func (m *Config) fleetSummary() []ClassSummary {
	if len(m.Classes) == 0 {
		return nil
	}
	out := make([]ClassSummary, len(m.Classes))
	first := 0
	for k, c := range m.Classes {
		e := m.fleet[first]
		out[k] = ClassSummary{Name: m.className(k), Count: c.Count, FirstReplica: first,
			PrefillOverheadMS: float64(e.prefillOverhead) / 1e6, PrefillPerTokenUS: float64(e.prefillPerToken) / 1e3,
			InterTokenMS: float64(e.interToken) / 1e6, MaxRunning: e.maxRunning, BudgetTokens: e.budget}
		first += c.Count
	}
	return out
}

// String describes the class in a report's words.
func (c ClassSummary) String() string {
	return fmt.Sprintf("%s ×%d (replicas %d–%d): prefill %.1f ms + %.0f µs/token, %.0f ms/output token, %d running max, %d tokens",
		c.Name, c.Count, c.FirstReplica, c.FirstReplica+c.Count-1, c.PrefillOverheadMS, c.PrefillPerTokenUS, c.InterTokenMS, c.MaxRunning, c.BudgetTokens)
}

// ClassResult is what one run did on one replica class: the requests
// whose prompt it computed there (the prefill replica's class,
// disaggregated).
type ClassResult struct {
	Name            string  `json:"name"`
	Requests        int     `json:"requests"`
	PromptTokens    int64   `json:"prompt_tokens"`
	CachedTokens    int64   `json:"cached_tokens"`
	TokenHitRate    float64 `json:"token_hit_rate"`
	PrefillComputed int64   `json:"prefill_computed"`   // prompt tokens its replicas computed
	KVWaits         int     `json:"kv_waits,omitempty"` // as Result.KVWaits
	TTFTP50MS       float64 `json:"ttft_ms_p50"`
	TTFTP99MS       float64 `json:"ttft_ms_p99"`
}

// byClass fills r.Classes from its rows, when m has classes.
func (r *Result) byClass(m *Config) {
	if len(m.Classes) == 0 {
		return
	}
	r.Classes = make([]ClassResult, len(m.Classes))
	ttfts := make([][]float64, len(m.Classes))
	for k := range r.Classes {
		r.Classes[k].Name = m.className(k)
	}
	for _, x := range r.rows {
		at := x.replica
		if x.prefill >= 0 {
			at = x.prefill
		}
		k := m.fleet[at].class
		c := &r.Classes[k]
		c.Requests++
		c.PromptTokens += int64(x.promptTokens)
		c.CachedTokens += int64(x.cachedTokens)
		if x.kvWaited {
			c.KVWaits++
		}
		ttfts[k] = append(ttfts[k], x.ttftMS)
	}
	for rep, n := range r.PrefillComputed {
		r.Classes[m.fleet[rep].class].PrefillComputed += n
	}
	for k := range r.Classes {
		c := &r.Classes[k]
		if c.PromptTokens > 0 {
			c.TokenHitRate = float64(c.CachedTokens) / float64(c.PromptTokens)
		}
		sorted := sortedCopy(ttfts[k])
		c.TTFTP50MS, c.TTFTP99MS = percentile(sorted, 0.5), percentile(sorted, 0.99)
	}
}
