package cluster

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// attacker connects to ns as a credential holder of the fleet (a
// compromised or misbehaving peer): what it sends is bounded all the
// same.
func attacker(t *testing.T, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.UserInfo(testAccount.User, testAccount.Password))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// forge publishes a batch of records under sender and epoch on the
// tests' records subject.
func forge(t *testing.T, nc *nats.Conn, sender string, epoch, seq uint64, recs ...[]byte) {
	t.Helper()
	b := appendHeader(nil, header{sender: sender, epoch: epoch, seq: seq, count: len(recs)})
	for _, r := range recs {
		b = append(b, r...)
	}
	if err := nc.Publish("t.records", b); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// Without the fleet's credentials a client can neither connect, publish
// nor subscribe; with them it is held to the fleet's subjects.
func TestFleetNATSNeedsCredentials(t *testing.T) {
	ns := serve(t, -1)
	if nc, err := nats.Connect(ns.ClientURL(), nats.MaxReconnects(0)); err == nil {
		nc.Close()
		t.Fatal("a client without credentials connected")
	} else if !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Fatalf("connect without credentials: %v, want an authorization error", err)
	}
	errs := make(chan error, 4)
	nc, err := nats.Connect(ns.ClientURL(), nats.UserInfo(testAccount.User, testAccount.Password),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { errs <- err }))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := nc.SubscribeSync("other.>"); err != nil {
		t.Fatal(err)
	}
	_ = nc.Flush()
	select {
	case err := <-errs:
		if !errors.Is(err, nats.ErrPermissionViolation) {
			t.Fatalf("subscribe outside the fleet's subjects: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("subscribing outside the fleet's subjects was allowed")
	}
	// And a router refuses to start without credentials, unless told.
	if _, err := New(Options{URLs: []string{ns.ClientURL()}}, newEngine(t)); err == nil || !strings.Contains(err.Error(), "insecure") {
		t.Fatalf("a router without credentials: %v", err)
	}
	if _, err := New(Options{URLs: []string{ns.ClientURL()}, Insecure: true}, newEngine(t)); err != nil {
		t.Fatalf("insecure: %v", err)
	}
}

// Attack 1 of issue 30: one batch of eject records, one per replica, with
// a cool-down of an hour. A peer's eject is evidence: soft, no longer than
// this router's own first cool-down, and the all-ejected fallback still
// routes.
func TestForgedEjectCannotCutTraffic(t *testing.T) {
	ns := serve(t, -1)
	f, e := startFleet(t, ns.ClientURL(), "victim")
	nc := attacker(t, ns.ClientURL())
	var recs [][]byte
	for _, s := range specs {
		recs = append(recs, appendUv(appendStr([]byte{recEject}, s.Name), uint64(time.Hour/time.Millisecond)))
	}
	forge(t, nc, "evil", 1, 1, recs...)
	ra, _ := e.Pool().Get("a")
	testwait.Until(t, "the forged ejection", func() bool { return f.Stats().Applied >= int64(len(specs)) })
	now := time.Now()
	if ra.Available(now) {
		t.Fatal("the peer's ejection was not applied at all")
	}
	if !ra.Usable(now) {
		t.Fatal("a peer's ejection is not soft: the all-ejected fallback cannot use the replica")
	}
	if !ra.Available(now.Add(f.o.Ejection.Base + time.Millisecond)) {
		t.Fatal("a peer's ejection lasts longer than this router's own first cool-down")
	}
	d, err := e.Decide(withPolicy(prompt(e, 1, 6)), false)
	if err != nil {
		t.Fatalf("every replica ejected by a peer: %v", err)
	}
	if d.Chosen() == nil {
		t.Fatal("no replica chosen")
	}
}

// Attack 2, over NATS: route records with a prefill of 2^62, and of
// 2^63−1, on three replicas. A peer's work is bounded by the chain it
// names (here none: one block).
func TestForgedPrefillOverNATSIsBounded(t *testing.T) {
	ns := serve(t, -1)
	f, e := startFleet(t, ns.ClientURL(), "victim")
	nc := attacker(t, ns.ClientURL())
	route := func(req uint64, rep string, prefill uint64) []byte {
		b := appendStr(appendUv([]byte{recRoute}, req), rep)
		return appendChain(appendUv(appendUv(b, prefill), prefill), nil, 0)
	}
	forge(t, nc, "evil", 1, 1, route(1, "a", 1<<62), route(2, "b", 1<<62), route(3, "c", math.MaxInt64), route(4, "c", math.MaxInt64))
	testwait.Until(t, "the forged records", func() bool { return f.Stats().Applied >= 4 })
	block := float64(e.Splitter().BlockTokens())
	for _, s := range specs {
		r, _ := e.Pool().Get(s.Name)
		if l := r.Load(time.Now()); l.PendingTokens < 0 || l.PendingTokens > 2*block || l.ActiveTokens < 0 || l.ActiveTokens > 2*block {
			t.Fatalf("%s: load %+v from forged records of no blocks, want at most a block each", s.Name, l)
		}
	}
	// Routing is not steered: a request goes where its own score says,
	// every replica still a candidate at about the same load.
	d, err := e.Decide(withPolicy(prompt(e, 9, 6)), false)
	if err != nil || len(d.Candidates) != len(specs) {
		t.Fatalf("after the forged records: %v, %d candidates", err, len(d.Candidates))
	}
}

// Attack 2, the records' lifetime: a peer's request stops counting as
// prefill after PrefillTTL, whatever it claimed.
func TestForgedPrefillIsBounded(t *testing.T) {
	e := newEngine(t)
	o := testOptions("nats://127.0.0.1:1", "me")
	o.PrefillTTL = time.Second
	f, err := New(o, e)
	if err != nil {
		t.Fatal(err)
	}
	route := func(req uint64, rep string, prefill uint64) []byte {
		b := appendStr(appendUv([]byte{recRoute}, req), rep)
		return appendChain(appendUv(appendUv(b, prefill), prefill), nil, 0)
	}
	f.amu.Lock()
	f.applyBatch(peerBatch(1, route(1, "a", 1<<62), route(2, "b", 1<<62), route(3, "c", math.MaxInt64), route(4, "c", math.MaxInt64)), "")
	f.amu.Unlock()
	block := float64(e.Splitter().BlockTokens())
	now := time.Now()
	for _, s := range specs {
		r, _ := e.Pool().Get(s.Name)
		l := r.Load(now)
		if l.PendingTokens < 0 || l.PendingTokens > 2*block || l.ActiveTokens < 0 || l.ActiveTokens > 2*block {
			t.Fatalf("%s: load %+v from forged records of no blocks, want at most a block each", s.Name, l)
		}
	}
	if st := f.Stats(); st.Clamped != 4 {
		t.Fatalf("clamped %d records, want 4", st.Clamped)
	}
	f.o.Now = func() time.Time { return now.Add(2 * time.Second) }
	f.expire()
	r, _ := e.Pool().Get("a")
	if l := r.Load(now); l.PendingTokens != 0 {
		t.Fatalf("a peer's request counts as prefill past PrefillTTL: %+v", l)
	}
}

// Attack 3: a forged snapshot responder. A peer's reset makes the router
// load that peer's picture; a responder that answers for ever is cut off
// at SnapshotTimeout, and the fleet's live records are applied all along.
func TestForgedSnapshotResponderIsBounded(t *testing.T) {
	ns := serve(t, -1)
	o := testOptions(ns.ClientURL(), "victim")
	o.SnapshotTimeout = 500 * time.Millisecond
	e := newEngine(t)
	f, err := New(o, e)
	if err != nil {
		t.Fatal(err)
	}
	nc := attacker(t, ns.ClientURL())
	// The responder answers every ask with chunks that never end.
	stop := make(chan struct{})
	defer close(stop)
	if _, err := nc.Subscribe("t.snapshot.evil", func(m *nats.Msg) {
		go func() {
			for {
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
				if nc.Publish(m.Reply, []byte{version}) != nil {
					return
				}
			}
		}()
	}); err != nil {
		t.Fatal(err)
	}
	_ = nc.Flush()
	if err := f.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	// evil is heard publishing during the warm start, and asked.
	forge(t, nc, "evil", 1, 1)
	testwait.Until(t, "ready despite the endless snapshot", f.Ready)
	// Live records are applied while a second endless load runs.
	forge(t, nc, "evil", 1, 2, []byte{recReset})
	_, real := startFleet(t, ns.ClientURL(), "honest")
	d, err := real.Decide(withPolicy(prompt(real, 7, 6)), true)
	if err != nil {
		t.Fatal(err)
	}
	rep, _ := e.Pool().Get(d.Chosen().Replica.Name)
	testwait.Until(t, "an honest peer's record applied during the forged load", func() bool { return rep.Load(time.Now()).InFlight == 1 })
}

// Attack 4: an empty batch under a live router's id and epoch with
// sequence 2^62. The router's own next batch is a gap, not a repeat: its
// records are applied.
func TestForgedSequenceCannotSilenceAPeer(t *testing.T) {
	ns := serve(t, -1)
	fa, ea := startFleet(t, ns.ClientURL(), "ra")
	fb, eb := startFleet(t, ns.ClientURL(), "rb")
	testwait.Until(t, "peers", func() bool { return fb.Stats().Peers == 1 })
	nc := attacker(t, ns.ClientURL())
	forge(t, nc, "ra", fa.epoch, 1<<62)
	testwait.Until(t, "the forged batch", func() bool { return fb.Stats().Gaps >= 1 })
	d, err := ea.Decide(withPolicy(prompt(ea, 3, 6)), true)
	if err != nil {
		t.Fatal(err)
	}
	rep, _ := eb.Pool().Get(d.Chosen().Replica.Name)
	testwait.Until(t, "ra's record applied after the forged sequence", func() bool { return rep.Load(time.Now()).InFlight == 1 })
}

// Attack 5, over NATS: forged senders past MaxPeers are refused.
func TestForgedPeersOverNATSAreBounded(t *testing.T) {
	ns := serve(t, -1)
	o := testOptions(ns.ClientURL(), "victim")
	o.MaxPeers = 4
	f, _ := startFleetWith(t, o)
	nc := attacker(t, ns.ClientURL())
	for s := range 12 {
		forge(t, nc, fmt.Sprint("forged-", s), 1, 1, []byte{recReset})
	}
	testwait.Until(t, "the forged batches", func() bool { st := f.Stats(); return st.Applied+st.Refused >= 12 })
	if st := f.Stats(); st.Peers > 4 || st.Refused != 8 {
		t.Fatalf("%d peers, %d batches refused; want at most 4 and 8", st.Peers, st.Refused)
	}
}

// Attack 5: many forged senders, each with many batches of large route
// records. The peers tracked are bounded, and the picture never holds
// more than its replica's budget because of them.
func TestForgedPeersCannotGrowMemory(t *testing.T) {
	var small []replica.Spec
	for _, s := range specs {
		s.BudgetTokens = 4096
		small = append(small, s)
	}
	e, err := routing.New(routing.Options{Replicas: small})
	if err != nil {
		t.Fatal(err)
	}
	f, err := New(testOptions("nats://127.0.0.1:1", "me"), e)
	if err != nil {
		t.Fatal(err)
	}
	f.o.MaxPeers = 8
	big := func(seed uint64) []blockhash.Block { return prompt(e, seed, 200).Blocks }
	for s := range 16 {
		sender := fmt.Sprint("forged-", s)
		for seq := range 4 {
			b := appendHeader(nil, header{sender: sender, epoch: 1, seq: uint64(seq + 1), count: 3})
			for i := range 3 {
				rec := appendStr(appendUv([]byte{recRoute}, uint64(seq*3+i+1)), specs[i].Name)
				b = append(b, appendChain(appendUv(appendUv(rec, 1<<20), 1<<20), big(uint64(s*100+seq*3+i)), 0)...)
			}
			f.amu.Lock()
			f.applyBatch(b, "")
			f.amu.Unlock()
		}
	}
	f.amu.Lock()
	peers := len(f.peers)
	f.amu.Unlock()
	if peers != 8 {
		t.Fatalf("%d peers tracked, want MaxPeers 8", peers)
	}
	if st := f.Stats(); st.Refused != 8*4 {
		t.Fatalf("refused %d batches, want 32", st.Refused)
	}
	for _, s := range specs {
		r, _ := e.Pool().Get(s.Name)
		st, _ := e.Picture().Stats(r.ID)
		if st.Tokens > st.Budget {
			t.Fatalf("%s: the picture holds %d tokens, its budget is %d", s.Name, st.Tokens, st.Budget)
		}
	}
}

// withPolicy gives req the default policy.
func withPolicy(req routing.Request) routing.Request {
	req.Policy, _ = routing.NewPolicy(routing.PolicySpec{Type: "semantic"})
	return req
}

// FuzzDecode: no batch makes the decoder panic, allocate past what the
// batch can hold, or return a record past the bounds a router sends.
func FuzzDecode(f *testing.F) {
	e := newEngine(f)
	req := prompt(e, 1, 12)
	route := appendChain(appendUv(appendUv(appendStr(appendUv([]byte{recRoute}, 1), "a"), 50), 100), req.Blocks, 4)
	f.Add(peerBatch(1, route, appendUv([]byte{recDone}, 1), []byte{recReset}))
	f.Add(peerBatch(2, appendUv(appendStr([]byte{recEject}, "b"), 2000), appendUv([]byte{recPrefill}, 1)))
	f.Add(peerBatch(3, appendChain(appendStr([]byte{recReply}, "c"), req.Blocks, 0)))
	f.Fuzz(func(t *testing.T, b []byte) {
		blocks := 0
		_ = decode(b, func(header) bool { return true }, func(r *record) {
			blocks += len(r.chain.blocks)
			if r.chain.prefix > maxPrefix {
				t.Fatalf("prefix %d", r.chain.prefix)
			}
			for _, bl := range r.chain.blocks {
				if bl.Tokens < 0 || bl.Tokens > maxBlockTokens || bl.Kind >= blockhash.NumKinds {
					t.Fatalf("block %+v", bl)
				}
			}
		})
		if blocks > len(b)/9 {
			t.Fatalf("%d blocks from %d bytes", blocks, len(b))
		}
	})
}

// Attack 4: a credential holder claims where Responses API responses are
// stored and whose they are (the home records routers once applied):
// 70,000 claims, for ids it never answered, are neither taken nor kept,
// however many. A response's id proves its home and tenant itself
// (router/respid.go); the batches' other records still apply.
func TestForgedHomesAreNotTaken(t *testing.T) {
	ns := serve(t, -1)
	f, e := startFleet(t, ns.ClientURL(), "victim")
	nc := attacker(t, ns.ClientURL())
	const batches, per = 7, 10_000
	for s := range uint64(batches) {
		recs := make([][]byte, per)
		for i := range recs {
			id := fmt.Sprintf("resp_sr1_%d_%d", s, i)
			recs[i] = appendStr(appendStr(appendStr([]byte{recHome}, id), "a"), "mallory")
		}
		if s == batches-1 {
			recs = append(recs, appendUv(appendStr([]byte{recEject}, "b"), uint64(time.Second/time.Millisecond)))
		}
		forge(t, nc, "evil", 1, s+1, recs...)
	}
	testwait.Until(t, "the forged homes", func() bool { return f.Stats().IgnoredHomes == batches*per })
	rb, _ := e.Pool().Get("b")
	testwait.Until(t, "the batch's other record", func() bool { return !rb.Available(time.Now()) })
}
