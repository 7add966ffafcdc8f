package plugin

import (
	"strings"
	"testing"
	"time"
)

type embedded struct {
	Depth int `json:"depth"`
}

type testParams struct {
	embedded
	Weight  float64  `json:"weight"`
	Count   int      `json:"count"`
	Wait    Duration `json:"wait"`
	Ignored int      `json:"-"`
}

func TestDecode(t *testing.T) {
	p := testParams{Weight: 1, Count: 2}
	if err := (Params{"count": 5, "wait": "1.5s", "depth": 3}).Decode(&p); err != nil {
		t.Fatal(err)
	}
	if p.Weight != 1 || p.Count != 5 || p.Depth != 3 || time.Duration(p.Wait) != 1500*time.Millisecond {
		t.Errorf("decoded %+v: count and wait set, weight kept", p)
	}
	if err := (Params{"wait": 2}).Decode(&p); err != nil || time.Duration(p.Wait) != 2*time.Second {
		t.Errorf("seconds: %v, %v", p.Wait, err)
	}
	err := (Params{"wieght": 2}).Decode(&p)
	if err == nil || !strings.Contains(err.Error(), `unknown parameter "wieght" (have depth, weight, count, wait)`) {
		t.Errorf("a misspelt name: %v", err)
	}
	for _, bad := range []Params{{"count": "many"}, {"wait": "soon"}, {"wait": true}, {"Ignored": 1}} {
		if err := bad.Decode(&p); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	if err := Params(nil).Decode(&p); err != nil {
		t.Error(err)
	}
}
