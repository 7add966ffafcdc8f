package main

import (
	"crypto/x509"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/crypto/x509roots/fallback/bundle"
)

// In an image with no CA bundle (FROM scratch) the router still trusts
// Mozilla's roots: the test binary, which links what the router links, is
// run again with SSL_CERT_FILE and SSL_CERT_DIR pointing at nothing, and
// there a public root verifies with the system pool.
func TestFallbackRootsWithoutSystemRoots(t *testing.T) {
	if os.Getenv("SEMROUTE_ROOTS_CHILD") == "1" {
		verifyBundledRoot(t)
		return
	}
	empty := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestFallbackRootsWithoutSystemRoots$", "-test.count=1")
	cmd.Env = append(os.Environ(), "SEMROUTE_ROOTS_CHILD=1",
		"SSL_CERT_FILE="+filepath.Join(empty, "none.pem"), "SSL_CERT_DIR="+empty)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("with no system roots: %v\n%s", err, out)
	}
}

func verifyBundledRoot(t *testing.T) {
	for r := range bundle.Roots() {
		if r.Constraint != nil {
			continue
		}
		c, err := x509.ParseCertificate(r.Certificate)
		if err != nil {
			t.Fatal(err)
		}
		// A self-signed root is its own chain; Verify with no Roots uses
		// the system pool, here the fallback.
		if _, err := c.Verify(x509.VerifyOptions{CurrentTime: c.NotBefore.Add(c.NotAfter.Sub(c.NotBefore) / 2)}); err != nil {
			t.Fatalf("%s: %v", c.Subject, err)
		}
		return
	}
	t.Fatal("the bundle has no unconstrained root")
}
