package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMain lets the benchmark's child processes run the real command: with
// SEMROUTE_TEST_MAIN=1 the test executable is benchproxy itself, its
// arguments the command line.
func TestMain(m *testing.M) {
	if os.Getenv("SEMROUTE_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runCLI runs benchproxy's command line with args and returns what it
// printed and its error.
func runCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
}

func TestBenchProxyRuns(t *testing.T) {
	t.Setenv("SEMROUTE_TEST_MAIN", "1") // the replica's and the plain proxy's processes run this binary as benchproxy (TestMain)
	profile := filepath.Join(t.TempDir(), "router.pprof")
	// The router is built from this module (go build), as go run
	// ./cmd/benchproxy builds it.
	out, err := runCLI(t, "--sizes", "1024", "--requests", "20", "--rounds", "2", "--duration", "50ms", "--concurrency", "2,4",
		"--throughput-rounds", "1", "--cpuprofile", profile)
	if err != nil {
		t.Fatalf("benchproxy: %v\n%s", err, out)
	}
	for _, want := range []string{"replica", "plain proxy", "router", "stream", "whole", "CPU/req", "1024 B whole: router added p99 ÷ plain proxy's: "} {
		if !strings.Contains(out, want) {
			t.Fatalf("output lacks %q:\n%s", want, out)
		}
	}
	// nginx is measured where it is installed (deploy/bench/install-nginx.sh).
	if bin, _ := findNginx("auto"); bin != "" {
		// (CPU is read in 10 ms ticks: phases this short may show none, and
		// the ratio line needs some.)
		if !strings.Contains(out, " nginx ") {
			t.Fatalf("nginx is installed, the output lacks it:\n%s", out)
		}
	} else if !strings.Contains(out, "nginx: not found") {
		t.Fatalf("nginx is not installed, and the output does not say so:\n%s", out)
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "÷") || strings.HasPrefix(line, "nginx:") {
			continue
		}
		if f := strings.Fields(line); len(f) > 0 && f[len(f)-1] != "0" && f[len(f)-1] != "errors" {
			t.Fatalf("errors in %q", line)
		}
	}
	// The router wrote its CPU profile (router serve --cpuprofile) when it
	// stopped.
	if fi, err := os.Stat(profile); err != nil || fi.Size() == 0 {
		t.Errorf("the router's CPU profile: %v", err)
	}
}

// Bad flags are refused before anything starts.
func TestBenchProxyRefusesBadFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--sizes", "1024,32"}, `--sizes: "32" is not a byte count ≥ 64`},
		{[]string{"--concurrency", "8,0"}, `--concurrency: "0" is not a positive count`},
		{[]string{"--modes", "whole,both"}, `--modes: "both" is neither whole nor stream`},
		{[]string{"--rounds", "0"}, "must be at least 1"},
		{[]string{"--router", filepath.Join(t.TempDir(), "none")}, "--router"},
		{[]string{"--serve-target", "router"}, "want replica or plain"},
	} {
		if _, err := runCLI(t, c.args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want %q", c.args, err, c.want)
		}
	}
}
