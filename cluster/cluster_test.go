package cluster

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/internal/testlog"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

var specs = []replica.Spec{
	{Name: "a", URL: "http://a.test", BudgetTokens: 1 << 20},
	{Name: "b", URL: "http://b.test", BudgetTokens: 1 << 20},
	{Name: "c", URL: "http://c.test", BudgetTokens: 1 << 20},
}

// testAccount is the fleet's credential on the tests' NATS servers.
var testAccount = Account{User: "fleet", Password: "test-password", Prefix: "t"}

func newEngine(t testing.TB) *routing.Engine {
	t.Helper()
	e, err := routing.New(routing.Options{Replicas: specs})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func testOptions(url, id string) Options {
	return Options{Logger: testLogger(), URLs: []string{url}, ID: id, Prefix: "t", Heartbeat: 50 * time.Millisecond,
		PeerTimeout: 400 * time.Millisecond, SnapshotTimeout: 2 * time.Second, FlushInterval: time.Millisecond,
		User: testAccount.User, Password: testAccount.Password}
}

func startFleet(t testing.TB, url, id string) (*Fleet, *routing.Engine) {
	t.Helper()
	return startFleetWith(t, testOptions(url, id))
}

// startFleetWith starts a member with options o over a new engine and
// waits until it is ready.
func startFleetWith(t testing.TB, o Options) (*Fleet, *routing.Engine) {
	t.Helper()
	e := newEngine(t)
	f, err := New(o, e)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	testwait.Until(t, "ready", f.Ready)
	return f, e
}

func serve(t testing.TB, port int) *server.Server {
	t.Helper()
	s, err := Serve("127.0.0.1", port, testAccount)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Shutdown)
	return s
}

// prompt returns a request of n blocks: a shared system prompt of 4
// blocks then n−4 of its own.
func prompt(e *routing.Engine, seed uint64, n int) routing.Request {
	rng := rand.New(rand.NewPCG(seed, 1))
	text := func(words int) string {
		b := []byte{}
		for range words {
			b = fmt.Appendf(b, "w%d ", rng.IntN(1e6))
		}
		return string(b)
	}
	req := &blockhash.Request{Parts: []blockhash.Part{
		{Role: blockhash.RoleSystem, Base: blockhash.KindSystem, Text: []byte(fmt.Sprintf("%0*d", 4*64*4, 7))},
		{Role: blockhash.RoleUser, Base: blockhash.KindUserQuery, Text: []byte(text((n - 4) * 40))},
	}}
	return e.Prepare(req, "", false)
}

// matchOn returns the tokens replica name holds of blocks in e's picture.
func matchOn(e *routing.Engine, name string, blocks []blockhash.Block) int {
	r, _ := e.Pool().Get(name)
	return e.Picture().Match(blocks)[r.ID].Tokens
}

func TestCodecRoundTrip(t *testing.T) {
	e := newEngine(t)
	req := prompt(e, 1, 12)
	blocks := req.Blocks
	blocks[5].Kind = blockhash.KindRetrievedContext
	var got []record
	var gotBlocks [][]blockhash.Block
	b := appendHeader(nil, header{sender: "r1", epoch: 9, seq: 3, count: 3})
	b = append(b, recRoute)
	b = appendStr(appendUv(b, 77), "a")
	b = appendUv(appendUv(b, 100), 700)
	b = appendChain(b, blocks, 4)
	b = append(b, recEject)
	b = appendUv(appendStr(b, "b"), 1500)
	b = appendStr(appendStr(appendStr(append(b, recHome), "resp_1"), "a"), "acme")
	if err := decode(b, func(header) bool { return true }, func(r *record) {
		got = append(got, *r)
		gotBlocks = append(gotBlocks, append([]blockhash.Block(nil), r.chain.blocks...))
	}); err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Fatalf("%d records", len(got))
	}
	if got[2].typ != recHome || got[2].id != "resp_1" || got[2].replica != "a" || got[2].tenant != "acme" {
		t.Fatalf("home %+v", got[2])
	}
	r := got[0]
	if r.typ != recRoute || r.req != 77 || r.replica != "a" || r.prefill != 100 || r.tokens != 700 ||
		r.chain.prefix != 4 || r.chain.prefixKey != blocks[3].Hash {
		t.Fatalf("route %+v", r)
	}
	if fmt.Sprint(gotBlocks[0]) != fmt.Sprint(blocks[4:]) {
		t.Fatalf("blocks %v, want %v", gotBlocks[0], blocks[4:])
	}
	if got[1].typ != recEject || got[1].replica != "b" || got[1].cool != 1500 {
		t.Fatalf("eject %+v", got[1])
	}
	// Every truncation and every corruption fails cleanly, never panics.
	for i := range b {
		_ = decode(b[:i], func(header) bool { return true }, func(*record) {})
	}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 20000 {
		c := append([]byte(nil), b...)
		for range 1 + rng.IntN(4) {
			c[rng.IntN(len(c))] = byte(rng.Uint32())
		}
		_ = decode(c, func(header) bool { return true }, func(*record) {})
	}
}

func appendUv(b []byte, v uint64) []byte { return binary.AppendUvarint(b, v) }

// TestPeersShareThePicture routes on one router and checks the other's
// picture and load: the blocks, the request in flight, its prefill and
// its end, a learned reply, and an ejection.
func TestPeersShareThePicture(t *testing.T) {
	ns := serve(t, -1)
	fa, ea := startFleet(t, ns.ClientURL(), "ra")
	_, eb := startFleet(t, ns.ClientURL(), "rb")
	testwait.Until(t, "peers", func() bool { return fa.Stats().Peers == 1 })

	req := prompt(ea, 1, 10)
	req.Policy, _ = routing.NewPolicy(routing.PolicySpec{Type: "semantic"})
	d, err := ea.Decide(req, true)
	if err != nil {
		t.Fatal(err)
	}
	name := d.Chosen().Replica.Name
	rb, _ := eb.Pool().Get(name)
	testwait.Until(t, "blocks on the peer", func() bool { return matchOn(eb, name, d.Blocks) == d.Tokens })
	testwait.Until(t, "load on the peer", func() bool { return rb.Load(time.Now()).InFlight == 1 })
	if l := rb.Load(time.Now()); l.PendingTokens == 0 {
		t.Fatalf("peer's replica has no pending prefill: %+v", l)
	}
	d.Lease().FirstToken(ea.Now())
	testwait.Until(t, "prefill done on the peer", func() bool { return rb.Load(time.Now()).PendingTokens == 0 })
	reply := ea.LearnReply(d, d.Chosen().Replica, []byte("an answer of some length to make a block or two of reply text, "+
		"repeated: an answer of some length to make a block or two of reply text"))
	chain := append(append([]blockhash.Block(nil), d.Blocks...), reply...)
	testwait.Until(t, "reply on the peer", func() bool { return matchOn(eb, name, chain) == matchOn(ea, name, chain) })
	d.Lease().End(ea.Now())
	testwait.Until(t, "end on the peer", func() bool { return rb.Load(time.Now()).InFlight == 0 })

	// A second request sharing the system prompt names it by its last
	// key: the peer rebuilds it from its own picture.
	req2 := prompt(ea, 2, 10)
	req2.Policy = req.Policy
	d2, err := ea.Decide(req2, true)
	if err != nil {
		t.Fatal(err)
	}
	if d2.Chosen().Replica.Name != name || d2.Chosen().Match.Blocks < 4 {
		t.Fatalf("second request went to %s matching %d blocks", d2.Chosen().Replica.Name, d2.Chosen().Match.Blocks)
	}
	testwait.Until(t, "second request on the peer", func() bool { return matchOn(eb, name, d2.Blocks) == d2.Tokens })
	d2.Lease().End(ea.Now())

	ra, _ := ea.Pool().Get("c")
	ea.Fail(ra, time.Now(), replica.Ejection{})
	rc, _ := eb.Pool().Get("c")
	testwait.Until(t, "ejection on the peer", func() bool { return !rc.Available(time.Now()) })
	if st := fa.Stats(); st.Published < 6 || st.DroppedFull+st.DroppedDown != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestWarmStartFromAPeer: a router that joins late loads the picture a
// peer built before it said it was ready.
func TestWarmStartFromAPeer(t *testing.T) {
	ns := serve(t, -1)
	fa, ea := startFleet(t, ns.ClientURL(), "ra")
	pol, _ := routing.NewPolicy(routing.PolicySpec{Type: "round_robin"})
	var ds []*routing.Decision
	for i := range 30 {
		req := prompt(ea, uint64(i), 8)
		req.Policy = pol
		d, err := ea.Decide(req, true)
		if err != nil {
			t.Fatal(err)
		}
		d.Lease().End(ea.Now())
		ds = append(ds, d)
	}
	fb, eb := startFleet(t, ns.ClientURL(), "rb")
	for _, d := range ds {
		name := d.Chosen().Replica.Name
		if got, want := matchOn(eb, name, d.Blocks), matchOn(ea, name, d.Blocks); got != want || want == 0 {
			t.Fatalf("after the warm start the newcomer holds %d tokens on %s, the peer %d", got, name, want)
		}
	}
	if st := fb.Stats(); st.SnapshotsLoaded != 1 || st.SnapshotBlocks == 0 {
		t.Fatalf("newcomer %+v", st)
	}
	if st := fa.Stats(); st.SnapshotsServed != 1 {
		t.Fatalf("peer %+v", st)
	}
}

// TestPeerGoneTakesItsLoad: the requests in flight of a router that dies
// stop counting on its peers after PeerTimeout.
func TestPeerGoneTakesItsLoad(t *testing.T) {
	ns := serve(t, -1)
	fa, ea := startFleet(t, ns.ClientURL(), "ra")
	fb, eb := startFleet(t, ns.ClientURL(), "rb")
	testwait.Until(t, "peers", func() bool { return fb.Stats().Peers == 1 })
	req := prompt(ea, 5, 6)
	req.Policy, _ = routing.NewPolicy(routing.PolicySpec{Type: "semantic"})
	d, err := ea.Decide(req, true)
	if err != nil {
		t.Fatal(err)
	}
	rb, _ := eb.Pool().Get(d.Chosen().Replica.Name)
	testwait.Until(t, "load on the peer", func() bool { return rb.Load(time.Now()).InFlight == 1 })
	fa.nc.Close() // dies without a word: no Done will come
	testwait.Until(t, "the dead peer's load to expire", func() bool { return rb.Load(time.Now()).InFlight == 0 })
	if st := fb.Stats(); st.Peers != 0 {
		t.Fatalf("peer still seen: %+v", st)
	}
}

// TestNATSDownThenBack: with NATS down each router routes on its own
// picture and counts what it could not publish; when NATS returns they
// resync: the picture built meanwhile reaches the peer.
func TestNATSDownThenBack(t *testing.T) {
	ns := serve(t, -1)
	port := ns.Addr().(interface{ String() string }).String()
	var p int
	fmt.Sscanf(port[len("127.0.0.1:"):], "%d", &p)
	url := ns.ClientURL()
	fa, ea := startFleet(t, url, "ra")
	fb, eb := startFleet(t, url, "rb")
	testwait.Until(t, "peers", func() bool { return fa.Stats().Peers == 1 && fb.Stats().Peers == 1 })
	ns.Shutdown()
	testwait.Until(t, "disconnected", func() bool { return !fa.Connected() && !fb.Connected() })
	pol, _ := routing.NewPolicy(routing.PolicySpec{Type: "round_robin"})
	var ds []*routing.Decision
	for i := range 12 {
		req := prompt(ea, uint64(100+i), 8)
		req.Policy = pol
		d, err := ea.Decide(req, true)
		if err != nil {
			t.Fatalf("routing with NATS down: %v", err)
		}
		d.Lease().End(ea.Now())
		ds = append(ds, d)
	}
	if st := fa.Stats(); st.DroppedDown == 0 {
		t.Fatalf("nothing counted as dropped while NATS was down: %+v", st)
	}
	serve(t, p)
	testwait.Until(t, "reconnected", func() bool { return fa.Connected() && fb.Connected() })
	testwait.Until(t, "resynced", func() bool {
		for _, d := range ds {
			name := d.Chosen().Replica.Name
			if matchOn(eb, name, d.Blocks) != d.Tokens {
				return false
			}
		}
		return true
	})
}

// TestGapForgetsPeerLoad: a batch lost from a peer (a sequence gap) makes
// the router forget that peer's requests in flight, whose ends it may
// have missed.
func TestGapForgetsPeerLoad(t *testing.T) {
	e := newEngine(t)
	f, err := New(testOptions("nats://127.0.0.1:1", "me"), e)
	if err != nil {
		t.Fatal(err)
	}
	r, _ := e.Pool().Get("a")
	batch := peerBatch
	route := func(req uint64) []byte {
		b := appendStr(appendUv([]byte{recRoute}, req), "a")
		return appendChain(appendUv(appendUv(b, 50), 100), nil, 0)
	}
	f.amu.Lock()
	f.applyBatch(batch(1, route(1), route(2)), "")
	f.amu.Unlock()
	if n := r.Load(time.Now()).InFlight; n != 2 {
		t.Fatalf("in flight %d, want 2", n)
	}
	f.amu.Lock()
	f.applyBatch(batch(3, route(4)), "") // batch 2 lost
	f.amu.Unlock()
	if n := r.Load(time.Now()).InFlight; n != 1 {
		t.Fatalf("in flight %d after a gap, want 1 (only the request after it)", n)
	}
	if st := f.Stats(); st.Gaps != 1 {
		t.Fatalf("gaps %d", st.Gaps)
	}
	f.amu.Lock()
	f.applyBatch(batch(1, route(5)), "") // back to an old sequence: a gap too, and applied
	f.applyBatch(batch(2, route(6)), "")
	f.amu.Unlock()
	if n := r.Load(time.Now()).InFlight; n != 2 {
		t.Fatalf("in flight %d after the sequence went back, want 2 (the requests since)", n)
	}
	if st := f.Stats(); st.Gaps != 2 {
		t.Fatalf("gaps %d", st.Gaps)
	}
	f.amu.Lock()
	f.applyBatch([]byte{version, 200}, "")
	f.amu.Unlock()
	if st := f.Stats(); st.Malformed != 1 {
		t.Fatalf("malformed %d", st.Malformed)
	}
}

// peerBatch is batch seq of records from the peer "peer" (epoch 1).
func peerBatch(seq uint64, recs ...[]byte) []byte {
	b := appendHeader(nil, header{sender: "peer", epoch: 1, seq: seq, count: len(recs)})
	for _, r := range recs {
		b = append(b, r...)
	}
	return b
}

func testLogger() *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	return nil
}

// A router that leaves its fleet (Close) logs no warning that it lost
// NATS: nothing was lost. A server that goes away still warns.
func TestCleanCloseIsNotALoss(t *testing.T) {
	s := serve(t, 0)
	var buf testlog.Buffer
	o := testOptions(s.ClientURL(), "quiet")
	o.Logger = slog.New(slog.NewTextHandler(&buf, nil))
	f, _ := startFleetWith(t, o)
	testwait.Until(t, "connected", f.Connected)
	f.Close()
	testwait.Until(t, "the disconnect heard", func() bool { return !f.Connected() }) // the client tells it after Close returns
	if strings.Contains(buf.String(), "lost NATS") {
		t.Fatalf("a clean close warned:\n%s", buf.String())
	}
	o2 := testOptions(s.ClientURL(), "loud")
	var buf2 testlog.Buffer
	o2.Logger = slog.New(slog.NewTextHandler(&buf2, nil))
	g, _ := startFleetWith(t, o2)
	testwait.Until(t, "connected", g.Connected)
	s.Shutdown()
	testwait.Until(t, "the loss warned", func() bool { return strings.Contains(buf2.String(), "lost NATS") })
}
