package routing

import (
	"errors"
	"fmt"
	"testing"
)

// Only replicas that serve the request's model are candidates; a replica
// whose models are not known yet may take any; a model no replica serves
// is ErrUnknownModel once every replica's models are known, ErrNoReplica
// while its replicas are merely unavailable or not allowed; an adapter
// goes where it is loaded, then where there is room for it.
func TestDecideByModel(t *testing.T) {
	f := newFixture(t, 4, "semantic")
	reps := f.pool.Replicas()
	req := func(model string) (*Decision, error) {
		r := parseChat(t, "system", "a long shared system prompt for the model test", "user", "hi")
		r.Model = model
		return f.decide(r, "s", false)
	}
	// Models unknown: anyone.
	if _, err := req("gamma"); err != nil {
		t.Fatalf("models unknown: %v", err)
	}
	reps[0].SetServed([]string{"alpha", "alpha-sql"}, []string{"alpha-sql"})
	reps[1].SetServed([]string{"beta"}, nil)
	reps[2].SetServed([]string{"alpha", "alpha-sql"}, []string{"alpha-sql"})
	// reps[3] unknown: a candidate for every model.
	for i := 0; i < 3; i++ {
		d, err := req("beta")
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range d.Candidates {
			if c.Replica != reps[1] && c.Replica != reps[3] {
				t.Fatalf("beta: %s is a candidate", c.Replica.Name)
			}
		}
	}
	if _, err := req("gamma"); err != nil {
		t.Fatalf("gamma with a replica of unknown models: %v", err)
	}
	reps[3].SetServed([]string{"beta"}, nil)
	var um *UnknownModelError
	if _, err := req("gamma"); !errors.As(err, &um) || um.Model != "gamma" || !errors.Is(err, ErrUnknownModel) {
		t.Fatalf("gamma, served by none: %v", err)
	}
	reps[1].Drain()
	reps[3].Drain()
	if _, err := req("beta"); !errors.Is(err, ErrNoReplica) {
		t.Fatalf("beta, its replicas drained: %v", err)
	}
	// The adapter (as the monitor tells the engine): loaded on reps[2]
	// ranks it first; then room.
	f.e.NoteAdapter("alpha-sql")
	reps[2].SetLoRA([]string{"alpha-sql"}, nil, 1)
	reps[0].SetLoRA(nil, nil, 1)
	d, err := req("alpha-sql")
	if err != nil || d.Chosen().Replica != reps[2] {
		t.Fatalf("adapter loaded on r2: %v %v", d.Chosen().Replica.Name, err)
	}
	reps[2].SetLoRA([]string{"other"}, nil, 1) // r2 full of another adapter; r0 has room
	if d, _ := req("alpha-sql"); d.Chosen().Replica != reps[0] {
		t.Fatalf("room on r0, none on r2: chose %s", d.Chosen().Replica.Name)
	}
	// The base model is not an adapter: no adapter rank.
	if d, _ := req("alpha"); d.Chosen().adapter != 0 {
		t.Fatalf("base model adapter rank %d", d.Chosen().adapter)
	}
}

// An adapter's rank is its own sort key, before the policy's tiers: with
// power_of_two (whose unsampled replicas take the largest tier) it once
// overflowed into the best rank. A replica whose models are unknown ranks
// after those known to have room; an empty pool is no replica, not an
// unknown model.
func TestAdapterRankWithTiersAndUnknowns(t *testing.T) {
	f := newFixture(t, 8, "power_of_two")
	reps := f.pool.Replicas()
	for _, r := range reps {
		r.SetServed([]string{"base", "sql"}, []string{"sql"})
		r.SetLoRA(nil, nil, 1)
	}
	f.e.NoteAdapter("sql")
	for i := 0; i < 100; i++ {
		r := parseChat(t, "user", "q")
		r.Model = "sql"
		d, err := f.decide(r, "s", false)
		if err != nil {
			t.Fatal(err)
		}
		if c := d.Chosen(); c.Reason == "not sampled" {
			t.Fatalf("decision %d chose a replica power_of_two did not sample (tier %d)", i, c.Tier)
		}
	}

	g := newFixture(t, 2, "semantic")
	r0 := g.pool.Replicas()[0] // r1's models stay unknown
	r0.SetServed([]string{"base", "sql"}, []string{"sql"})
	r0.SetLoRA([]string{"other"}, nil, 2) // room for one more
	g.e.NoteAdapter("sql")
	for i := 0; i < 20; i++ {
		r := parseChat(t, "user", fmt.Sprint("q", i))
		r.Model = "sql"
		if d, _ := g.decide(r, fmt.Sprint("s", i), false); d.Chosen().Replica != r0 {
			t.Fatalf("request %d went to %s, whose models are unknown, not to r0 with room", i, d.Chosen().Replica.Name)
		}
	}

	empty := newFixture(t, 1, "semantic")
	empty.pool.Remove(empty.pool.Replicas()[0].Name)
	r := parseChat(t, "user", "q")
	r.Model = "base"
	if _, err := empty.decide(r, "s", false); !errors.Is(err, ErrNoReplica) {
		t.Fatalf("an empty pool: %v", err)
	}
}
