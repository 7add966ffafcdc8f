package routing

import (
	"errors"
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
	// The adapter: loaded on reps[2] ranks it first; then room.
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
	// The base model is not an adapter: no tier.
	if d, _ := req("alpha"); d.Chosen().Tier >= 1<<adapterTierShift {
		t.Fatalf("base model tier %d", d.Chosen().Tier)
	}
}
