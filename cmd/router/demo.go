package main

import (
	"cmp"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/spf13/viper"

	"github.com/semroute/semroute/cluster"
	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/internal/httpserve"
	"github.com/semroute/semroute/kvevents"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/simreplica"
)

type demoOptions struct {
	listen   string
	replicas int
	// routers > 1 runs that many routers sharing one picture over an
	// embedded NATS server, behind a round-robin front on listen.
	routers int
	config  string // optional YAML merged over the embedded demo config
	policy  string // optional routing policy override
	// picture is "events" (precise mode: the replicas publish KV events,
	// the router tokenizes through them) or "" / "approximate".
	picture string
	// reuse "blend" makes the replicas blend (sim.Blend, default if unset)
	// and tells the router so (replicas[].reuse); with sim.Blend set,
	// reuse "prefix" keeps the router unaware of it (the baseline).
	reuse string
	sim   simreplica.Options
	// models, if set, are served in turn: replica i serves models[i mod
	// len(models)]. simFor, if set, adjusts replica i's options (tests).
	models []string
	simFor func(i int, o *simreplica.Options)
	// grpcListen and decisionLog override the config's when set.
	grpcListen  string
	decisionLog string
	// pd, "P:D", makes the first P replicas prefill and the next D decode
	// (replicas[].role); it sets replicas to P+D.
	pd string
}

// demo is the router in front of simulated replicas, all in one process.
// With several routers, app and run are the first; router is the front.
type demo struct {
	app      *app
	run      *running
	router   *httpserve.Server
	apps     []*app
	runs     []*running
	nats     *server.Server
	sims     []*simreplica.Running
	once     sync.Once
	closeErr error
}

// startDemo starts o.replicas simulated replicas on 127.0.0.1 and the router
// on o.listen, with the embedded demo config. Logs go to logw.
func startDemo(o demoOptions, logw io.Writer) (*demo, error) {
	prefills, err := o.resolveCounts()
	if err != nil {
		return nil, err
	}
	v, err := o.load()
	if err != nil {
		return nil, err
	}
	if err := o.choosePicture(v); err != nil {
		return nil, err
	}
	if err := o.chooseReuse(); err != nil {
		return nil, err
	}
	d := &demo{}
	reps, err := d.startSims(o, prefills)
	if err == nil {
		v.Set("replicas", reps)
		err = d.startRouters(v, logw, o)
	}
	if err != nil {
		d.close()
		return nil, err
	}
	return d, nil
}

// resolveCounts checks the counts of replicas and routers, --pd setting
// the replicas' to P+D, and returns P, the prefill replicas (0 without
// --pd). o.routers < 1 is 1.
func (o *demoOptions) resolveCounts() (prefills int, err error) {
	if o.pd != "" {
		var decodes int
		if prefills, decodes, err = parsePD(o.pd); err != nil {
			return 0, err
		}
		o.replicas = prefills + decodes
	}
	if o.replicas < 1 || o.replicas > 256 {
		return 0, fmt.Errorf("--replicas %d is not in [1, 256]", o.replicas)
	}
	o.routers = max(o.routers, 1)
	if o.routers > 16 {
		return 0, fmt.Errorf("--routers %d is not in [1, 16]", o.routers)
	}
	return prefills, nil
}

// load returns the demo's config: the embedded demo config, --config's
// file over it, then the flags that override it. A gRPC API without a
// token or client certificates gets a token made for this run: it is never
// open (printExample shows the token).
func (o *demoOptions) load() (*viper.Viper, error) {
	v := configs.NewViper()
	if _, err := configs.LoadBytes(v, configs.DemoYAML); err != nil {
		return nil, fmt.Errorf("embedded demo config: %w", err)
	}
	if o.config != "" {
		if _, err := configs.Load(v, o.config); err != nil {
			return nil, err
		}
	}
	for key, val := range map[string]string{"listen": o.listen, "routing.policy": o.policy, "grpc_listen": o.grpcListen, "decision_log.path": o.decisionLog} {
		if val != "" {
			v.Set(key, val)
		}
	}
	if v.GetString("grpc_listen") != "" && v.GetString("grpc.token") == "" && v.GetString("grpc.tls_client_ca_file") == "" {
		v.Set("grpc.token", rand.Text())
	}
	return v, nil
}

// choosePicture sets how the router knows the replicas' caches (--picture):
// approximate (estimated tokens) by default, or events, the replicas then
// publishing KV events and the router tokenizing through them.
func (o *demoOptions) choosePicture(v *viper.Viper) error {
	switch o.picture {
	case "", "approximate":
		v.Set("tokenizer.mode", "estimate")
	case "events":
		v.Set("tokenizer.mode", "auto") // precise: the engines' tokens
		o.sim.KVEvents = &kvevents.PublisherOptions{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv-events"}
	default:
		return fmt.Errorf("--picture %q is not events or approximate", o.picture)
	}
	return nil
}

// chooseReuse gives the simulated engines the reuse past the prefix
// --reuse names, with its defaults unless o.sim sets it.
func (o *demoOptions) chooseReuse() error {
	switch o.reuse {
	case "", replica.ReusePrefix:
	case replica.ReuseBlend:
		if o.sim.Blend == nil {
			o.sim.Blend = &simreplica.Blend{}
		}
	case replica.ReuseDonor:
		if o.sim.Donor == nil {
			o.sim.Donor = &simreplica.Donor{}
		}
	default:
		return fmt.Errorf("--reuse %q is not prefix, blend or donor", o.reuse)
	}
	return nil
}

// startSims starts the demo's simulated replicas, the first prefills of
// them prefill replicas, and returns their entries of the config.
func (d *demo) startSims(o demoOptions, prefills int) ([]configs.Replica, error) {
	var reps []configs.Replica
	for i := range o.replicas {
		so := o.sim
		if len(o.models) > 0 {
			so.Model = o.models[i%len(o.models)]
		}
		if o.simFor != nil {
			o.simFor(i, &so)
		}
		s, err := simreplica.Start(so, "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		d.sims = append(d.sims, s)
		reps = append(reps, simReplica(s, i, prefills, o.reuse))
	}
	return reps, nil
}

// simReplica returns the config entry of the demo's simulated replica s,
// the i-th: its name and budget, its role when the first prefills prefill,
// its scheduling policy, the reuse it is told of (only --reuse's: a
// replica that blends while the router is told nothing is --reuse
// prefix's baseline), and its KV events.
func simReplica(s *simreplica.Running, i, prefills int, reuse string) configs.Replica {
	so := s.Options()
	rep := configs.Replica{Name: fmt.Sprintf("sim-%d", i), URL: s.URL, BudgetTokens: int64(so.NumBlocks * so.BlockSize)}
	if so.Scheduling == simreplica.SchedulingPriority {
		rep.Scheduling = string(replica.SchedulingPriority)
	}
	switch {
	case i < prefills:
		rep.Role, rep.Name = string(replica.RolePrefill), fmt.Sprintf("sim-prefill-%d", i)
	case prefills > 0:
		rep.Role, rep.Name = string(replica.RoleDecode), fmt.Sprintf("sim-decode-%d", i-prefills)
	}
	if b := so.Blend; b != nil && reuse == replica.ReuseBlend {
		rep.Reuse = configs.ReuseConfig{Mode: replica.ReuseBlend, Recompute: b.Recompute, BudgetTokens: int64(b.BudgetTokens)}
	}
	if dn := so.Donor; dn != nil && reuse == replica.ReuseDonor {
		rep.Reuse = configs.ReuseConfig{Mode: replica.ReuseDonor, MinSimilarity: dn.MinSimilarity}
	}
	if pub, replay := s.KVEventsEndpoints(); pub != "" {
		rep.KVEvents = configs.KVEventsConfig{Endpoint: pub, ReplayEndpoint: replay, Topic: "kv-events"}
	}
	return rep
}

// startRouters starts the demo's router on v's listen address or, with
// o.routers > 1, its fleet: the routers on ports of their own, sharing
// one picture over an embedded NATS server, behind a round-robin front on
// that address.
func (d *demo) startRouters(v *viper.Viper, logw io.Writer, o demoOptions) error {
	if o.routers == 1 {
		if err := d.startRouter(v, logw, o.picture); err != nil {
			return err
		}
		d.router = d.run.http
		return nil
	}
	// The fleet's NATS, with a password made for this run: only the
	// demo's routers can publish on it.
	account := cluster.Account{User: "semroute-demo", Password: rand.Text()}
	var err error
	if d.nats, err = cluster.Serve("127.0.0.1", -1, account); err != nil {
		return err
	}
	listen := v.GetString("listen")
	v.Set("cluster.urls", []string{d.nats.ClientURL()})
	v.Set("cluster.user", account.User)
	v.Set("cluster.password", account.Password)
	v.Set("listen", "127.0.0.1:0")
	for i := range o.routers {
		v.Set("cluster.id", fmt.Sprintf("router-%d", i))
		if i > 0 {
			v.Set("grpc_listen", "") // the first router's only
		}
		if err := d.startRouter(v, logw, o.picture); err != nil {
			return err
		}
	}
	var urls []string
	for _, r := range d.runs {
		urls = append(urls, r.http.URL())
	}
	if d.router, err = httpserve.Serve(listen, newFront(urls), d.app.log); err != nil {
		return err
	}
	d.app.log.Info("semroute demo front listening: round robin over the routers", "addr", d.router.Addr, "routers", urls, "nats", d.nats.ClientURL())
	return nil
}

// startRouter builds and starts one router of the demo from v.
func (d *demo) startRouter(v *viper.Viper, logw io.Writer, picture string) error {
	cfg, err := configs.Decode(v)
	if err != nil {
		return err
	}
	log := newLogger(cfg.Log, logw)
	if id := cfg.Cluster.ID; id != "" {
		log = log.With("router", id)
	}
	a, err := build(cfg, log)
	if err != nil {
		return err
	}
	run, err := a.start()
	if err != nil {
		if a.decisions != nil {
			_ = a.decisions.Close()
		}
		return err
	}
	d.apps, d.runs = append(d.apps, a), append(d.runs, run)
	if d.app == nil {
		d.app, d.run = a, run
	}
	log.Info("semroute demo listening", "addr", run.http.Addr, "grpc", run.grpcAddr(), "replicas", len(cfg.Replicas), "policy", cfg.Routing.Policy.Type,
		"tokenizer", cfg.Tokenizer.Mode, "picture", cmp.Or(picture, "approximate"))
	return nil
}

// close stops the router and the replicas; it is safe to call more than once.
func (d *demo) close() error {
	d.once.Do(func() { d.closeErr = d.shutdown() })
	return d.closeErr
}

func (d *demo) shutdown() error {
	var errs []error
	if d.router != nil && (len(d.runs) != 1 || d.router != d.run.http) {
		errs = append(errs, d.router.Stop(5*time.Second)) // the front
	}
	for _, r := range d.runs {
		errs = append(errs, r.stop(5*time.Second))
	}
	if d.nats != nil {
		d.nats.Shutdown()
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
`, len(d.sims), d.router.URL(), d.router.URL(), demoBody(d.sims[0].Options().Model))
	if g := d.run.grpcAddr(); g != "" {
		fmt.Fprintf(w, "\ngRPC Route API on %s (grpcurl -plaintext -H 'authorization: Bearer %s' %s list)\n", g, d.app.cfg.GRPC.Token, g)
	}
}

// parsePD parses --pd P:D: P prefill and D decode replicas, at most 256
// in all.
func parsePD(s string) (prefills, decodes int, err error) {
	p, d, ok := strings.Cut(s, ":")
	prefills, errP := strconv.Atoi(p)
	decodes, errD := strconv.Atoi(d)
	if !ok || errP != nil || errD != nil || prefills < 1 || decodes < 1 || prefills+decodes > 256 {
		return 0, 0, fmt.Errorf("--pd %q is not P:D with P and D at least 1 and at most 256 in all (e.g. 2:2)", s)
	}
	return prefills, decodes, nil
}

// pdRoles returns the roles of p prefill replicas followed by d decode
// replicas.
func pdRoles(p, d int) []replica.Role {
	roles := make([]replica.Role, 0, p+d)
	for range p {
		roles = append(roles, replica.RolePrefill)
	}
	for range d {
		roles = append(roles, replica.RoleDecode)
	}
	return roles
}
