package monitor

import (
	"strings"
	"testing"
)

// vLLM serving data-parallel ranks labels each rank's gauges with its
// index (engine); a rank's scrape reads its own, while a replica of one
// rank reads them all.
func TestParseEngineMetricsReadsOneRank(t *testing.T) {
	const text = `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 5
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0
vllm:num_requests_waiting{engine="1",model_name="m"} 2
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="200"} 1
`
	for _, c := range []struct {
		engine           string
		running, waiting int64
		usage            float64
		blocks           int64
	}{{"1", 5, 2, 0.5, 200}, {"0", 3, 0, 0.25, 100}, {"", 8, 2, 0.75, 100}} {
		s, err := ParseEngineMetrics(strings.NewReader(text), c.engine)
		if err != nil {
			t.Fatal(err)
		}
		if s.Running != c.running || s.Waiting != c.waiting || s.KVUsage != c.usage || s.Blocks != c.blocks {
			t.Errorf("engine %q: running %d waiting %d usage %v blocks %d; want %d %d %v %d", c.engine, s.Running, s.Waiting, s.KVUsage, s.Blocks,
				c.running, c.waiting, c.usage, c.blocks)
		}
	}
}
