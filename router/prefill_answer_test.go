package router

import (
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
)

// A prefill replica's answer is read within a client body's bounds: an
// array of a million numbers (230 MB and 250 ms a request, once) is
// refused after a linear scan; a large one is read with no tree of it, so
// it costs about its size and takes nothing from the parse budget that
// client bodies share (a prefill must not fail for the load of others).
func TestPrefillAnswerBounded(t *testing.T) {
	million := []byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[` + strings.Repeat("1,", 999_999) + `1]},"usage":{"prompt_tokens":3}}`)
	if _, err := readPrefillAnswer(million, blockhash.Limits{}); err == nil {
		t.Fatal("a prefill answer of a million values was read")
	}
	budget := blockhash.NewBudget(blockhash.BudgetFloor * 2)
	large := []byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[` + strings.Repeat("1,", 3*blockhash.BudgetFloor) + `1]},"usage":{"prompt_tokens":3}}`)
	ans, err := readPrefillAnswer(large, blockhash.Limits{Budget: budget})
	if err != nil || len(ans.params) < 6*blockhash.BudgetFloor || ans.usage.PromptTokens != 3 || budget.Used() != 0 {
		t.Fatalf("a large answer: %v, %d bytes of params, usage %+v, %d values of the budget held", err, len(ans.params), ans.usage, budget.Used())
	}
	for _, empty := range []string{`{}`, `{"kv_transfer_params":{}}`, `{"kv_transfer_params":{ }}`, `{"kv_transfer_params":null}`, `{"kv_transfer_params":[1]}`} {
		if ans, err := readPrefillAnswer([]byte(empty), blockhash.Limits{}); err != nil || ans.params != nil {
			t.Fatalf("%s: params %s, %v", empty, ans.params, err)
		}
	}
}
