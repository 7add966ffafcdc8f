package main

import (
	"os"
	"strings"
	"testing"
)

// TestMain lets tests run the real binary: with SEMROUTE_TEST_MAIN=1 the
// test executable is `router` itself, its arguments the command line.
func TestMain(m *testing.M) {
	if os.Getenv("SEMROUTE_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// router serve with no config says so, not what the empty config lacks.
func TestServeWithoutConfigAsksForIt(t *testing.T) {
	t.Setenv("SEMROUTE_CONFIG", "")
	_, err := runCLIErr(t, "serve", "--listen", "127.0.0.1:0")
	if err == nil || !strings.Contains(err.Error(), "give --config FILE") {
		t.Fatalf("serve without --config: %v", err)
	}
}
