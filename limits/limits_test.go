package limits

import (
	"math"
	"testing"
	"time"
)

// A prefill's bound is its floor plus its uncached tokens at the
// conservative throughput, capped by the first-byte timeout; the
// documented figures of the defaults hold.
func TestPrefillBound(t *testing.T) {
	var zero Timeouts
	for _, c := range []struct {
		t        Timeouts
		uncached float64
		want     time.Duration
	}{
		{zero, 0, 10 * time.Second},
		{zero, -5, 10 * time.Second},
		{zero, math.NaN(), 10 * time.Second},
		{zero, 1000, 12 * time.Second},
		{zero, 32000, 74 * time.Second},
		{zero, 145000, 300 * time.Second},
		{zero, 1e12, 300 * time.Second},
		{zero, math.Inf(1), 300 * time.Second},
		{Timeouts{PrefillFloor: time.Second, PrefillTokensPerSecond: 2000}, 3000, 2500 * time.Millisecond},
		{Timeouts{PrefillFloor: time.Minute, FirstByte: 30 * time.Second}, 0, 30 * time.Second},
		{Timeouts{PrefillFloor: -time.Second, PrefillTokensPerSecond: -1}, 500, 11 * time.Second},
	} {
		if got := c.t.Prefill(c.uncached); got != c.want {
			t.Errorf("%+v.Prefill(%v) = %v, want %v", c.t, c.uncached, got, c.want)
		}
	}
	d := zero.WithDefaults()
	if d.PrefillFloor != DefaultPrefillFloor || d.PrefillTokensPerSecond != DefaultPrefillTokensPerSecond {
		t.Fatalf("defaults: %+v", d)
	}
}
