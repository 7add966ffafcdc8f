package router

import (
	"errors"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
)

// A prefill replica's answer is read within a client body's bounds: an
// array of a million numbers (230 MB and 250 ms a request, once) is
// refused after a linear scan, and a large one waits for the shared parse
// budget like a large body.
func TestPrefillAnswerBounded(t *testing.T) {
	million := []byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[` + strings.Repeat("1,", 999_999) + `1]},"usage":{"prompt_tokens":3}}`)
	if _, err := readPrefillAnswer(million, blockhash.Limits{}); err == nil {
		t.Fatal("a prefill answer of a million values was read")
	}
	budget := blockhash.NewBudget(blockhash.BudgetFloor * 2)
	large := []byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[` + strings.Repeat("1,", 3*blockhash.BudgetFloor) + `1]}}`)
	if _, err := readPrefillAnswer(large, blockhash.Limits{Budget: budget}); !errors.Is(err, blockhash.ErrBusy) {
		t.Fatalf("an answer past the parse budget: %v, want ErrBusy", err)
	}
	ans, err := readPrefillAnswer([]byte(`{"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2]},"usage":{"prompt_tokens":3}}`), blockhash.Limits{Budget: budget})
	if err != nil || ans.params == nil || budget.Used() != 0 {
		t.Fatalf("an ordinary answer: %v %v, %d values held", ans, err, budget.Used())
	}
}
