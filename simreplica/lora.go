package simreplica

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// loraUse counts the requests of each LoRA adapter that wait and run, and
// exports them as vLLM does: vllm:lora_requests_info, a gauge whose labels
// are max_lora, running_lora_adapters and waiting_lora_adapters (names
// comma-separated) and whose value is when they were recorded, in unix
// seconds (vllm/v1/metrics/loggers.py: set_to_current_time). Earlier
// label sets stay exported with their older times; a reader takes the
// sample with the largest value. Safe for concurrent use.
type loraUse struct {
	mu               sync.Mutex
	running, waiting map[string]int
	max              int
	info             *prometheus.GaugeVec
}

func newLoRAUse(reg *prometheus.Registry, maxLoRA int, engine string) *loraUse {
	u := &loraUse{running: map[string]int{}, waiting: map[string]int{}, max: maxLoRA,
		info: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "vllm:lora_requests_info", Help: "Running stats on lora requests.",
			ConstLabels: prometheus.Labels{"engine": engine}},
			[]string{"max_lora", "waiting_lora_adapters", "running_lora_adapters"})}
	reg.MustRegister(u.info)
	u.record()
	return u
}

// add counts one request of adapter (none if "") as waiting (wait ±1) or
// running (run ±1).
func (u *loraUse) add(adapter string, wait, run int) {
	if adapter == "" {
		return
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	bump(u.waiting, adapter, wait)
	bump(u.running, adapter, run)
	u.record()
}

func bump(m map[string]int, k string, d int) {
	if m[k] += d; m[k] <= 0 {
		delete(m, k)
	}
}

// record sets the gauge for the current adapters to now, as vLLM's logger
// does on every change it logs.
func (u *loraUse) record() {
	join := func(m map[string]int) string { return strings.Join(slices.Sorted(maps.Keys(m)), ",") }
	w, r := join(u.waiting), join(u.running)
	u.info.WithLabelValues(strconv.Itoa(u.max), w, r).Set(float64(time.Now().UnixNano()) / 1e9)
}
