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

func TestDiscoveryFollowsDNS(t *testing.T) {
	res := &fakeResolver{hosts: []string{"10.0.0.2", "10.0.0.1"}}
	have := map[string]string{}
	d := NewDiscovery(DiscoveryOptions{Name: "vllm.ns.svc", Port: 8000, Resolver: res},
		func(s Spec) error { have[s.Name] = s.URL; return nil },
		func(name string) error { delete(have, name); return nil })
	ctx := context.Background()
	step := func(want ...string) {
		t.Helper()
		if err := d.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		var got []string
		for n := range have {
			got = append(got, n)
		}
		sort.Strings(got)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("replicas %v, want %v", got, want)
		}
	}
	step("10.0.0.1:8000", "10.0.0.2:8000")
	if have["10.0.0.1:8000"] != "http://10.0.0.1:8000" {
		t.Fatalf("url %q", have["10.0.0.1:8000"])
	}
	res.hosts = []string{"10.0.0.2", "fd00::3"}
	step("10.0.0.2:8000", "[fd00::3]:8000")
	res.err = errors.New("SERVFAIL")
	if err := d.Sync(ctx); err == nil {
		t.Fatal("lookup error not reported")
	}
	step2 := len(have)
	if step2 != 2 {
		t.Fatal("a failed lookup changed the replicas")
	}
	res.err, res.hosts = nil, nil
	step()
}

func TestDiscoverySRV(t *testing.T) {
	res := &fakeResolver{srv: []*net.SRV{{Target: "pod-a.vllm.ns.svc.", Port: 8001}, {Target: "pod-b.vllm.ns.svc.", Port: 8002}}}
	var added []string
	d := NewDiscovery(DiscoveryOptions{Name: "_http._tcp.vllm", SRV: true, Scheme: "https", Resolver: res},
		func(s Spec) error { added = append(added, s.URL); return nil }, func(string) error { return nil })
	if err := d.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	sort.Strings(added)
	if fmt.Sprint(added) != "[https://pod-a.vllm.ns.svc:8001 https://pod-b.vllm.ns.svc:8002]" {
		t.Fatalf("added %v", added)
	}
}
