package apikey

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func writeKeys(t *testing.T, path string, lines ...string) {
	t.Helper()
	if err := os.WriteFile(path, []byte("keys:\n"+strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestCheckMapsKeysToTenants(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys.yaml")
	writeKeys(t, path,
		fmt.Sprintf("  - {name: a, tenant: acme, sha256: %s}", Hash("sk-acme")),
		fmt.Sprintf("  - {name: b, tenant: globex, sha256: \"sha256:%s\"}", strings.ToUpper(Hash("sk-globex"))))
	s, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	if k, ok := s.Check("sk-acme"); !ok || k.Tenant != "acme" || k.Name != "a" {
		t.Fatalf("sk-acme: %+v %v", k, ok)
	}
	if k, ok := s.Check("sk-globex"); !ok || k.Tenant != "globex" {
		t.Fatalf("sk-globex: %+v %v", k, ok)
	}
	for _, bad := range []string{"", "sk-acm", "sk-acme ", Hash("sk-acme")} {
		if _, ok := s.Check(bad); ok {
			t.Errorf("%q accepted", bad)
		}
	}
	if n := len(s.Tenants()); n != 2 {
		t.Errorf("%d tenants", n)
	}
	var zero Set
	if _, ok := zero.Check("sk-acme"); ok {
		t.Error("the zero set accepted a key")
	}
}

func TestBadFiles(t *testing.T) {
	dir := t.TempDir()
	for i, c := range []struct{ body, want string }{
		{"keys:\n  - {tenant: a, sha256: abc}\n", "64 hex digits"},
		{fmt.Sprintf("keys:\n  - {sha256: %s}\n", Hash("x")), "tenant"},
		{fmt.Sprintf("keys:\n  - {tenant: a, sha256: %s}\n  - {tenant: b, sha256: %s}\n", Hash("x"), Hash("x")), "the same key twice"},
		{fmt.Sprintf("keys:\n  - {tenant: a, key: x, sha256: %s}\n", Hash("x")), "field key not found"},
		{"nope: 1\n", "field nope not found"},
	} {
		path := filepath.Join(dir, fmt.Sprint(i))
		if err := os.WriteFile(path, []byte(c.body), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := Load(path); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: err %v, want %q", c.body, err, c.want)
		}
	}
	if _, err := Load(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing file loaded")
	}
}

// Watch follows the file: a new key works after the change; a broken
// file, a missing one or an empty list leaves no key accepted (it fails
// closed), and a valid file again restores its keys.
func TestWatchFollowsTheFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys.yaml")
	writeKeys(t, path, fmt.Sprintf("  - {tenant: acme, sha256: %s}", Hash("old")))
	s, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	changed, failed := make(chan struct{}, 8), make(chan error, 8)
	go s.Watch(ctx, time.Millisecond, func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}, func(err error) {
		select {
		case failed <- err:
		default:
		}
	})
	writeKeys(t, path, fmt.Sprintf("  - {tenant: acme, sha256: %s}", Hash("new")))
	<-changed
	if _, ok := s.Check("new"); !ok {
		t.Fatal("the new key is refused after the change")
	}
	if _, ok := s.Check("old"); ok {
		t.Fatal("the removed key is accepted after the change")
	}
	if err := os.WriteFile(path, []byte("keys: [broken"), 0o600); err != nil {
		t.Fatal(err)
	}
	<-failed
	if _, ok := s.Check("new"); ok {
		t.Fatal("a broken file kept the keys before it (a rotation with a typo would keep the revoked key)")
	}
	writeKeys(t, path, fmt.Sprintf("  - {tenant: acme, sha256: %s}", Hash("new")))
	<-changed
	if _, ok := s.Check("new"); !ok {
		t.Fatal("the key is refused after the file is valid again")
	}
	if err := os.WriteFile(path, []byte("keys: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	<-changed
	if _, ok := s.Check("new"); ok {
		t.Fatal("an empty list did not revoke every key")
	}
	writeKeys(t, path, fmt.Sprintf("  - {tenant: acme, sha256: %s}", Hash("new")))
	<-changed
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	for len(failed) > 0 { // errors from before the removal
		<-failed
	}
	<-failed
	if _, ok := s.Check("new"); ok {
		t.Fatal("a missing file kept a key")
	}
}
