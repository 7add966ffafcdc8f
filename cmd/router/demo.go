package main

import (
	"cmp"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/simreplica"
)

type demoOptions struct {
	listen   string
	replicas int
	config   string // optional YAML merged over the embedded demo config
	policy   string // optional routing policy override
	// picture is "events" (precise mode: the replicas publish KV events,
	// the router tokenizes through them) or "" / "approximate".
	picture string
	sim     simreplica.Options
	// grpcListen and decisionLog override the config's when set.
	grpcListen  string
	decisionLog string
}

// demo is the router in front of simulated replicas, all in one process.
type demo struct {
	app      *app
	run      *running
	router   *listening
	sims     []*simreplica.Running
	once     sync.Once
	closeErr error
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
	if o.grpcListen != "" {
		v.Set("grpc_listen", o.grpcListen)
	}
	if v.GetString("grpc_listen") != "" && v.GetString("grpc.token") == "" && v.GetString("grpc.tls_client_ca_file") == "" {
		v.Set("grpc.token", rand.Text()) // the gRPC API is never open; printExample shows the token
	}
	if o.decisionLog != "" {
		v.Set("decision_log.path", o.decisionLog)
	}
	switch o.picture {
	case "", "approximate":
	case "events":
		v.Set("tokenizer.mode", "replica")
		o.sim.KVEvents = &kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv-events"}
	default:
		return nil, fmt.Errorf("--picture %q is not events or approximate", o.picture)
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
		rep := configs.Replica{Name: fmt.Sprintf("sim-%d", i), URL: s.URL, BudgetTokens: int64(so.NumBlocks * so.BlockSize)}
		if pub, replay := s.KVEventsEndpoints(); pub != "" {
			rep.KVEvents = configs.KVEventsConfig{Endpoint: pub, ReplayEndpoint: replay, Topic: "kv-events"}
		}
		reps = append(reps, rep)
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
	if d.run, err = d.app.start(); err != nil {
		d.close()
		return nil, err
	}
	d.router = d.run.http
	log.Info("semroute demo listening", "addr", d.router.addr, "grpc", d.run.grpcAddr(), "replicas", len(reps), "policy", cfg.Routing.Policy,
		"tokenizer", cfg.Tokenizer.Mode, "picture", cmp.Or(o.picture, "approximate"))
	return d, nil
}

// close stops the router and the replicas; it is safe to call more than once.
func (d *demo) close() error {
	d.once.Do(func() { d.closeErr = d.shutdown() })
	return d.closeErr
}

func (d *demo) shutdown() error {
	var errs []error
	if d.run != nil {
		errs = append(errs, d.run.stop(5*time.Second))
	} else if d.app != nil && d.app.decisions != nil {
		errs = append(errs, d.app.decisions.Close())
	}
	for _, s := range d.sims {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}

// demoSystemPrompt is the example's system prompt: long enough (about 150
// tokens) to fill whole blocks, so that the second request hits the cache.
const demoSystemPrompt = "You are the support assistant of a small bicycle shop. " +
	"Answer in two or three friendly sentences. The shop repairs city, road and mountain bikes, " +
	"sells tubes, tyres, lights, locks and helmets, and rents electric bikes by the day. " +
	"It opens from nine to six on weekdays and from ten to four on Saturdays, and it is closed on Sundays. " +
	"A basic service costs forty euros and takes one day; a full service costs ninety euros and takes three. " +
	"Never promise a repair time shorter than the workshop quotes, and suggest booking online for services."

// demoBody is the example request's JSON body.
func demoBody(model string) string {
	return fmt.Sprintf(`{"model":"%s","messages":[{"role":"system","content":"%s"},{"role":"user","content":"Hello!"}]}`, model, demoSystemPrompt)
}

func printExample(w io.Writer, d *demo) {
	fmt.Fprintf(w, `semroute is routing to %d simulated replicas at %s

Try:
  curl -s %s/v1/chat/completions -H 'Content-Type: application/json' -H 'X-Session-ID: demo-1' \
    -d '%s' -i

Send it twice: the second answer comes from the same replica (X-Semroute-Replica)
with X-Semroute-Matched-Tokens > 0, and its usage reports cached_tokens > 0.
Add "stream": true to stream. Ctrl-C stops the demo.
`, len(d.sims), d.router.url(), d.router.url(), demoBody(d.sims[0].Options().Model))
	if g := d.run.grpcAddr(); g != "" {
		fmt.Fprintf(w, "\ngRPC Route API on %s (grpcurl -plaintext -H 'authorization: Bearer %s' %s list)\n", g, d.app.cfg.GRPC.Token, g)
	}
}
