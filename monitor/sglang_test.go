package monitor

import (
	"strings"
	"testing"
)

// sglangExposition is what an SGLang server's /metrics shows of the
// families the router reads (names, types and labels as
// sglang/srt/metrics/collector.py registers them), among others it skips.
const sglangExposition = `# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 0.42
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 0.6
# HELP sglang:cache_config_info Information of the cache config.
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{num_pages="1000",page_size="16"} 1.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="qwen"} 12345.0
`

func TestParseSGLangMetrics(t *testing.T) {
	s, err := ParseMetrics(strings.NewReader(sglangExposition))
	if err != nil {
		t.Fatal(err)
	}
	if !s.HasRunning || s.Running != 3 || !s.HasWaiting || s.Waiting != 5 || !s.HasKV || s.KVUsage != 0.42 {
		t.Fatalf("load: %+v", s)
	}
	if s.Blocks != 1000 || s.BlockSize != 16 {
		t.Fatalf("cache: %d blocks of %d, want 1000 of 16", s.Blocks, s.BlockSize)
	}
	if !s.HasCounter || s.Counter != 12345 {
		t.Fatalf("prompt tokens (restarts): %v %v", s.HasCounter, s.Counter)
	}
	// From v0.5.11 the capacity is a gauge of its own.
	newer := strings.Replace(sglangExposition, `sglang:cache_config_info{num_pages="1000",page_size="16"} 1.0`,
		"# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens 24000", 1)
	if s, _ = ParseMetrics(strings.NewReader(newer)); s.Blocks*s.BlockSize != 24000 {
		t.Fatalf("max_total_num_tokens: %d blocks of %d", s.Blocks, s.BlockSize)
	}
	// A replica exporting vLLM's names is read by them.
	both := sglangExposition + "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 7\n"
	if s, _ = ParseMetrics(strings.NewReader(both)); s.Running != 7 {
		t.Fatalf("vLLM's gauge lost to SGLang's: %d", s.Running)
	}
}
