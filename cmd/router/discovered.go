package main

import (
	"context"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/replica"
)

// discovered is a discovery source whose replicas all take what the
// discovery section says of every engine: where its KV events are
// (discovery.kv_events, "{host}" resolved for each replica by
// replica.Ranks) and its data-parallel ranks.
type discovered struct {
	replica.Source
	events replica.KVEvents
	dp     replica.DataParallel
}

// discoveredOf wraps src with what d says of every discovered engine.
func discoveredOf(src replica.Source, d configs.DiscoveryConfig) replica.Source {
	return discovered{Source: src, events: replica.KVEvents(d.KVEvents), dp: replica.DataParallel{Size: d.DataParallelSize}}
}

// Specs implements replica.Source.
func (d discovered) Specs(ctx context.Context) ([]replica.Spec, error) {
	specs, err := d.Source.Specs(ctx)
	for i := range specs {
		specs[i].KVEvents, specs[i].DataParallel = d.events, d.dp
	}
	return specs, err
}
