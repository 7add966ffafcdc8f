package replica

// Models is what a replica serves, as it reports it: the ids of its
// GET /v1/models (the base model under its served name, and each LoRA
// adapter it has registered), and the adapters of its running and waiting
// requests with the most it runs at once (vLLM's vllm:lora_requests_info:
// running_lora_adapters, waiting_lora_adapters, max_lora). It is immutable
// once set on a Replica; its lookups are map reads, as they run for every
// replica of every decision.
type Models struct {
	// Served are the model ids the replica answers to; Adapters the ones
	// among them that are LoRA adapters (their /v1/models entry has a
	// parent).
	Served, Adapters []string
	// Running and Waiting are the adapters in use and queued; MaxLoRA is
	// how many adapters a batch may hold (0: unknown).
	Running, Waiting []string
	MaxLoRA          int

	flags map[string]uint8 // id → modelServed | modelAdapter | modelLoaded
}

const (
	modelServed uint8 = 1 << iota
	modelAdapter
	modelLoaded // running or waiting
)

func newModels(served, adapters, running, waiting []string, maxLoRA int) *Models {
	m := &Models{Served: served, Adapters: adapters, Running: running, Waiting: waiting, MaxLoRA: maxLoRA,
		flags: make(map[string]uint8, len(served))}
	for _, id := range served {
		m.flags[id] |= modelServed
	}
	for _, id := range adapters {
		m.flags[id] |= modelAdapter
	}
	for _, l := range [][]string{running, waiting} {
		for _, id := range l {
			m.flags[id] |= modelLoaded
		}
	}
	return m
}

// Serves reports whether the replica answers to model.
func (m *Models) Serves(model string) bool { return m.flags[model]&modelServed != 0 }

// AdapterRank ranks the replica for a request naming model: 0 when the
// model is not one of its adapters or the adapter is loaded (running or
// waiting), 1 when it has room to load it (fewer running adapters than
// MaxLoRA, or MaxLoRA unknown), 2 when it would have to evict another.
func (m *Models) AdapterRank(model string) int8 {
	switch f := m.flags[model]; {
	case f&modelAdapter == 0, f&modelLoaded != 0:
		return 0
	case m.MaxLoRA == 0 || len(m.Running) < m.MaxLoRA:
		return 1
	}
	return 2
}

// SetServed records the models the replica answers to, and which of them
// are adapters (the monitor's refresh of /v1/models), keeping what
// SetLoRA recorded.
func (r *Replica) SetServed(served, adapters []string) {
	r.updateModels(func(old *Models) *Models {
		return newModels(served, adapters, old.Running, old.Waiting, old.MaxLoRA)
	})
}

// SetLoRA records the adapters in use from the replica's metrics, keeping
// the models it serves.
func (r *Replica) SetLoRA(running, waiting []string, maxLoRA int) {
	r.updateModels(func(old *Models) *Models {
		return newModels(old.Served, old.Adapters, running, waiting, maxLoRA)
	})
}

// updateModels replaces the replica's Models with next(the current ones,
// or empty ones), retrying if another update came first.
func (r *Replica) updateModels(next func(old *Models) *Models) {
	for {
		old := r.models.Load()
		cur := old
		if cur == nil {
			cur = &Models{}
		}
		if r.models.CompareAndSwap(old, next(cur)) {
			return
		}
	}
}

// Models returns what the replica serves, or nil until it is known.
func (r *Replica) Models() *Models {
	m := r.models.Load()
	if m == nil || m.Served == nil {
		return nil
	}
	return m
}
