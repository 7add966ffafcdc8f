package main

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/simreplica"
)

type demoOptions struct {
	listen   string
	replicas int
	config   string // optional YAML merged over the embedded demo config
	policy   string // optional routing policy override
	sim      simreplica.Options
}

// demo is the router in front of simulated replicas, all in one process.
type demo struct {
	app    *app
	router *listening
	sims   []*simreplica.Running
}

// startDemo starts o.replicas simulated replicas on 127.0.0.1 and the router
// on o.listen, with the embedded demo config. Logs go to logw.
func startDemo(o demoOptions, logw io.Writer) (*demo, error) {
	if o.replicas < 1 || o.replicas > 256 {
		return nil, fmt.Errorf("--replicas %d is not in [1, 256]", o.replicas)
	}
	v := configs.NewViper()
	if _, err := configs.LoadBytes(v, configs.DemoYAML); err != nil {
		return nil, fmt.Errorf("embedded demo config: %w", err)
	}
	if o.config != "" {
		if _, err := configs.Load(v, o.config); err != nil {
			return nil, err
		}
	}
	if o.listen != "" {
		v.Set("listen", o.listen)
	}
	if o.policy != "" {
		v.Set("routing.policy", o.policy)
	}
	d := &demo{}
	var reps []configs.Replica
	for i := 0; i < o.replicas; i++ {
		s, err := simreplica.Start(o.sim, "127.0.0.1:0")
		if err != nil {
			d.close()
			return nil, err
		}
		d.sims = append(d.sims, s)
		so := s.Options()
		reps = append(reps, configs.Replica{
			Name: fmt.Sprintf("sim-%d", i), URL: s.URL, BudgetTokens: int64(so.NumBlocks * so.BlockSize),
		})
	}
	v.Set("replicas", reps)
	cfg, err := configs.Decode(v)
	if err != nil {
		d.close()
		return nil, err
	}
	log := newLogger(cfg.Log, logw)
	if d.app, err = build(cfg, log); err != nil {
		d.close()
		return nil, err
	}
	if d.router, err = serve(cfg.Listen, d.app.server, log); err != nil {
		d.close()
		return nil, err
	}
	log.Info("semroute demo listening", "addr", d.router.addr, "replicas", len(reps), "policy", cfg.Routing.Policy)
	return d, nil
}

func (d *demo) close() error {
	var errs []error
	if d.router != nil {
		errs = append(errs, d.router.stop(5*time.Second))
	}
	for _, s := range d.sims {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}

func printExample(w io.Writer, d *demo) {
	model := d.sims[0].Options().Model
	fmt.Fprintf(w, `semroute is routing to %d simulated replicas at %s

Try:
  curl -s %s/v1/chat/completions -H 'Content-Type: application/json' -H 'X-Session-ID: demo-1' \
    -d '{"model":"%s","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Hello!"}]}' -i

Send it twice: the second answer comes from the same replica (X-Semroute-Replica)
with X-Semroute-Matched-Tokens > 0. Add "stream": true to stream. Ctrl-C stops.
`, len(d.sims), d.router.url(), d.router.url(), model)
}
