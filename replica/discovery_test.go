package replica

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sort"
	"testing"
)

type fakeResolver struct {
	hosts []string
	srv   []*net.SRV
	err   error
}

func (f *fakeResolver) LookupHost(context.Context, string) ([]string, error) { return f.hosts, f.err }
func (f *fakeResolver) LookupSRV(context.Context, string, string, string) (string, []*net.SRV, error) {
	return "", f.srv, f.err
}

// member is a membership over an empty pool whose replicas join without a
// cache; retired collects the replicas retired.
func member(t *testing.T, precedence ...string) (*Membership, *Pool, chan string) {
	t.Helper()
	pool, err := NewPool(nil, Options{}, ids())
	if err != nil {
		t.Fatal(err)
	}
	retired := make(chan string, 16)
	m := NewMembership(pool, MembershipOptions{
		Add:        func(s Spec) (*Replica, error) { return pool.Add(s, ids()) },
		Retire:     func(r *Replica) { retired <- r.Name },
		Precedence: precedence,
	})
	return m, pool, retired
}

func names(p *Pool) string {
	var got []string
	for _, r := range p.Replicas() {
		got = append(got, r.Name)
	}
	sort.Strings(got)
	return fmt.Sprint(got)
}

func TestDNSSourceFollowsDNS(t *testing.T) {
	res := &fakeResolver{hosts: []string{"10.0.0.2", "10.0.0.1"}}
	d := NewDNS(DNSOptions{Name: "vllm.ns.svc", Port: 8000, Resolver: res})
	m, pool, retired := member(t)
	ctx := context.Background()
	step := func(want string) {
		t.Helper()
		if err := m.Reconcile(ctx, d); err != nil {
			t.Fatal(err)
		}
		if got := names(pool); got != want {
			t.Fatalf("replicas %v, want %v", got, want)
		}
	}
	step("[10.0.0.1:8000 10.0.0.2:8000]")
	if r, _ := pool.Get("10.0.0.1:8000"); r.URL.String() != "http://10.0.0.1:8000" || m.Owner(r.Name) != "dns" {
		t.Fatalf("url %v, owner %q", r.URL, m.Owner(r.Name))
	}
	res.hosts = []string{"10.0.0.2", "fd00::3"}
	step("[10.0.0.2:8000 [fd00::3]:8000]")
	if got := <-retired; got != "10.0.0.1:8000" {
		t.Fatalf("retired %s", got)
	}
	res.err = errors.New("SERVFAIL")
	if err := m.Reconcile(ctx, d); err == nil {
		t.Fatal("lookup error not reported")
	}
	if got := names(pool); got != "[10.0.0.2:8000 [fd00::3]:8000]" {
		t.Fatalf("a failed lookup changed the replicas: %s", got)
	}
	res.err, res.hosts = nil, nil
	step("[]")
}

func TestDNSSourceSRV(t *testing.T) {
	res := &fakeResolver{srv: []*net.SRV{{Target: "pod-a.vllm.ns.svc.", Port: 8001}, {Target: "pod-b.vllm.ns.svc.", Port: 8002}}}
	specs, err := NewDNS(DNSOptions{Name: "_http._tcp.vllm", SRV: true, Scheme: "https", Resolver: res}).Specs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var urls []string
	for _, s := range specs {
		urls = append(urls, s.URL)
	}
	if fmt.Sprint(urls) != "[https://pod-a.vllm.ns.svc:8001 https://pod-b.vllm.ns.svc:8002]" {
		t.Fatalf("specs %v", urls)
	}
}

// TestMembershipSourcesAndPrecedence: each source adds, replaces and
// removes only what it owns; a stronger source takes a name from a weaker
// one; Remove takes out any replica until its source names it again.
func TestMembershipSourcesAndPrecedence(t *testing.T) {
	m, pool, retired := member(t, "config", "admin", "dns")
	ctx := context.Background()
	file := NewStatic("config", []Spec{{Name: "a", URL: "http://a"}, {Name: "b", URL: "http://b"}})
	admin := NewStatic("admin", nil)
	mustReconcile := func(src Source) {
		t.Helper()
		if err := m.Reconcile(ctx, src); err != nil {
			t.Fatal(err)
		}
	}
	mustReconcile(file)
	admin.Put(Spec{Name: "c", URL: "http://c"})
	admin.Put(Spec{Name: "a", URL: "http://other-a"}) // the file owns a: ignored
	mustReconcile(admin)
	if got := names(pool); got != "[a b c]" {
		t.Fatalf("replicas %s", got)
	}
	if a, _ := pool.Get("a"); a.URL.Host != "a" || m.Owner("a") != "config" || m.Owner("c") != "admin" {
		t.Fatal("a weaker source took a replica")
	}
	// The file drops b, changes a, and names c: c moves to the file.
	file.Set([]Spec{{Name: "a", URL: "http://a2"}, {Name: "c", URL: "http://c2"}})
	mustReconcile(file)
	if got := names(pool); got != "[a c]" {
		t.Fatalf("replicas %s", got)
	}
	if c, _ := pool.Get("c"); c.URL.Host != "c2" || m.Owner("c") != "config" {
		t.Fatal("the stronger source did not take c")
	}
	got := map[string]bool{}
	for range 3 { // b removed, a and c replaced
		got[<-retired] = true
	}
	if !got["a"] || !got["b"] || !got["c"] {
		t.Fatalf("retired %v", got)
	}
	// A drained replica stays drained across a reconcile that keeps it.
	a, _ := pool.Get("a")
	a.Drain()
	mustReconcile(file)
	if a2, _ := pool.Get("a"); a2 != a || !a2.Draining() {
		t.Fatal("an unchanged replica was replaced or undrained")
	}
	if err := m.Remove("a"); err != nil || m.Owner("a") != "" {
		t.Fatalf("remove: %v", err)
	}
	if err := m.Remove("a"); err == nil {
		t.Fatal("removed twice")
	}
	mustReconcile(file)
	if m.Owner("a") != "config" {
		t.Fatal("the file did not name a again")
	}
}

// TestMembershipHandsOverALetGoReplica: a replica the admin API added, then
// the file took over and later dropped, is the admin API's again.
func TestMembershipHandsOverALetGoReplica(t *testing.T) {
	m, pool, _ := member(t, "config", "admin", "dns")
	ctx := context.Background()
	admin := NewStatic("admin", []Spec{{Name: "r1", URL: "http://10.0.0.1:8000"}})
	file := NewStatic("config", nil)
	for _, src := range []Source{admin, file} {
		if err := m.Reconcile(ctx, src); err != nil {
			t.Fatal(err)
		}
	}
	file.Set([]Spec{{Name: "r1", URL: "http://10.0.0.2:8000"}})
	if err := m.Reconcile(ctx, file); err != nil || m.Owner("r1") != "config" {
		t.Fatalf("the file did not take r1: %v", err)
	}
	file.Set(nil)
	if err := m.Reconcile(ctx, file); err != nil {
		t.Fatal(err)
	}
	r, ok := pool.Get("r1")
	if !ok || m.Owner("r1") != "admin" || r.URL.Host != "10.0.0.1:8000" {
		t.Fatalf("r1 after the file dropped it: present %v, owner %q", ok, m.Owner("r1"))
	}
	// A drain follows the name across a hand-over.
	if err := m.SetDraining("r1", true); err != nil {
		t.Fatal(err)
	}
	file.Set([]Spec{{Name: "r1", URL: "http://10.0.0.3:8000"}})
	if err := m.Reconcile(ctx, file); err != nil {
		t.Fatal(err)
	}
	if r, _ := pool.Get("r1"); m.Owner("r1") != "config" || !r.Draining() {
		t.Fatal("the drain was lost when the file took r1")
	}
	if err := m.SetDraining("r1", false); err != nil {
		t.Fatal(err)
	}
	if r, _ := pool.Get("r1"); r.Draining() {
		t.Fatal("undrain did not take")
	}
}
