package main

import (
	"os"
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
