package replay

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/matcher"
	"github.com/semroute/semroute/routing"
)

// update rewrites the golden files instead of comparing with them:
//
//	go test ./replay -run Golden -update
//
// Review the diff (git diff replay/testdata/golden) before committing it: a
// changed figure is a changed result of the replay.
var update = flag.Bool("update", false, "rewrite the golden files in testdata/golden")

// goldenTrimmed are the trimmed public traces in testdata/: the first lines
// of ../testdata/traces/<Full>, unchanged (see testdata/README.md).
var goldenTrimmed = []struct{ Trimmed, Full string }{
	{"conversation_head1500.jsonl", "conversation_trace.jsonl"},
	{"synthetic_head1500.jsonl", "synthetic_trace.jsonl"},
}

// TestGoldenTrimmedTracesArePrefixes checks that the trimmed traces are the
// first lines of the public ones, byte for byte, so that the golden files
// below are results on public data.
func TestGoldenTrimmedTracesArePrefixes(t *testing.T) {
	for _, g := range goldenTrimmed {
		part, err := os.ReadFile(filepath.Join("testdata", g.Trimmed))
		if err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(filepath.Join("..", "testdata", "traces", g.Full))
		if err != nil {
			t.Fatal(err)
		}
		head := make([]byte, len(part))
		_, err = io.ReadFull(f, head)
		f.Close()
		if err != nil {
			t.Fatalf("%s: %v", g.Full, err)
		}
		if !bytes.Equal(part, head) {
			t.Errorf("testdata/%s is not the start of ../testdata/traces/%s", g.Trimmed, g.Full)
		}
		if len(part) == 0 || part[len(part)-1] != '\n' {
			t.Errorf("testdata/%s does not end with a whole line", g.Trimmed)
		}
	}
}

// TestGoldenReports replays small traces and compares summary.json,
// summary.md and every runs/<name>.csv with testdata/golden/<case>/, byte
// for byte. Wall-clock times are zeroed first; everything else is
// deterministic.
func TestGoldenReports(t *testing.T) {
	cases := []struct {
		name, trace, format string
		reqs                func(t *testing.T) []Request
		model               func() Config
		runs                func(m Config) []Run
	}{
		{
			// The first 1,500 requests of the conversation trace on the
			// model of docs/replay.md (8 replicas of 1,000,000 tokens, vLLM's
			// eviction order).
			name: "conversation", trace: "testdata/conversation_head1500.jsonl", format: "mooncake",
			reqs: func(t *testing.T) []Request { return goldenMooncake(t, "testdata/conversation_head1500.jsonl") },
			model: func() Config {
				m := Config{Replicas: 8, BudgetTokens: 1_000_000, BlockTokens: 512}
				m.Seed = 1
				return m
			},
			runs: func(Config) []Run { return goldenPolicies("semantic", "round_robin", "llmd", "sglang", "dynamo") },
		},
		{
			// The first 1,500 requests of the synthetic trace on smaller
			// LRU caches.
			name: "synthetic", trace: "testdata/synthetic_head1500.jsonl", format: "mooncake",
			reqs: func(t *testing.T) []Request { return goldenMooncake(t, "testdata/synthetic_head1500.jsonl") },
			model: func() Config {
				m := Config{Replicas: 8, BudgetTokens: 1_000_000, BlockTokens: 512, Eviction: "lru"}
				m.Seed = 1
				return m
			},
			runs: func(Config) []Run {
				return goldenPolicies("semantic", "round_robin", "llmd", "sglang", "dynamo", "random", "semantickv")
			},
		},
		{
			// A generated openai trace (router gentrace --seed 7
			// --sessions 40 --docs 20) with kinds and linked replies, the
			// ablations and the semantic matcher.
			name: "openai", trace: "gentrace seed 7, 40 sessions", format: "openai",
			reqs: goldenOpenAI,
			model: func() Config {
				m := Config{Replicas: 4, BudgetTokens: 25_000, BlockTokens: blockhash.DefaultBlockTokens,
					RecordReplies: true, SharedActive: true, Speedup: 2}
				m.Seed = 1
				m.Matcher = func() routing.Matcher {
					mm, err := matcher.New(matcher.Options{})
					if err != nil {
						panic(err) // default options are valid
					}
					return mm
				}
				return m
			},
			runs: func(m Config) []Run {
				runs := goldenPolicies("semantic", "round_robin", "llmd", "sglang")
				runs = append(runs, Ablations(m.Params["semantic"])...)
				return append(runs, Run{Label: "semantic+matcher", Policy: "semantic", Matcher: true})
			},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			m := c.model()
			sum, err := Replay(c.reqs(t), m, c.runs(m))
			if err != nil {
				t.Fatal(err)
			}
			sum.Trace, sum.Format = c.trace, c.format
			sum.WallSeconds = 0
			for _, r := range sum.all() {
				r.WallSeconds = 0
			}
			got := t.TempDir()
			if err := sum.Write(got); err != nil {
				t.Fatal(err)
			}
			// report.html draws the same figures; it is checked for
			// shape elsewhere (TestMatcherRunAndReport), not byte for byte.
			if err := os.Remove(filepath.Join(got, "report.html")); err != nil {
				t.Fatal(err)
			}
			compareGolden(t, got, filepath.Join("testdata", "golden", c.name))
		})
	}
}

func goldenPolicies(names ...string) []Run {
	var runs []Run
	for _, p := range names {
		runs = append(runs, Run{Policy: p})
	}
	return runs
}

func goldenMooncake(t *testing.T, path string) []Request {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	reqs, err := ReadMooncake(bufio.NewReader(f), 512)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

func goldenOpenAI(t *testing.T) []Request {
	t.Helper()
	var buf bytes.Buffer
	if err := GenerateOpenAI(&buf, GenOptions{Seed: 7, Sessions: 40, Docs: 20}); err != nil {
		t.Fatal(err)
	}
	s, err := blockhash.NewSplitter(blockhash.Options{BlockTokens: blockhash.DefaultBlockTokens})
	if err != nil {
		t.Fatal(err)
	}
	reqs, err := ReadOpenAI(&buf, s)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

// compareGolden compares every file under got with the same path under
// want, and the two file lists; with -update it replaces want by got.
func compareGolden(t *testing.T, got, want string) {
	t.Helper()
	if *update {
		if err := os.RemoveAll(want); err != nil {
			t.Fatal(err)
		}
		if err := os.CopyFS(want, os.DirFS(got)); err != nil {
			t.Fatal(err)
		}
		t.Logf("rewrote %s", want)
		return
	}
	gotFiles, wantFiles := listFiles(t, got), listFiles(t, want)
	if !slices.Equal(gotFiles, wantFiles) {
		t.Errorf("files written %v, golden files %v (go test ./replay -run Golden -update rewrites them)", gotFiles, wantFiles)
	}
	for _, name := range gotFiles {
		if !slices.Contains(wantFiles, name) {
			continue
		}
		g, err := os.ReadFile(filepath.Join(got, name))
		if err != nil {
			t.Fatal(err)
		}
		w, err := os.ReadFile(filepath.Join(want, name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(g, w) {
			t.Errorf("%s differs from %s:\n%s(go test ./replay -run Golden -update rewrites the golden files)",
				name, filepath.Join(want, name), firstDifference(g, w))
		}
	}
}

func listFiles(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := fs.WalkDir(os.DirFS(dir), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			out = append(out, path)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s: %v (go test ./replay -run Golden -update writes the golden files)", dir, err)
	}
	slices.Sort(out)
	return out
}

// firstDifference describes the first line where got and want differ.
func firstDifference(got, want []byte) string {
	g, w := strings.Split(string(got), "\n"), strings.Split(string(want), "\n")
	for i := 0; i < max(len(g), len(w)); i++ {
		var gl, wl string
		if i < len(g) {
			gl = g[i]
		}
		if i < len(w) {
			wl = w[i]
		}
		if gl != wl || i >= len(g) || i >= len(w) {
			return fmt.Sprintf("  line %d\n  got:  %q\n  want: %q\n  (%d lines written, %d golden)\n", i+1, gl, wl, len(g), len(w))
		}
	}
	return "  (no line differs)\n"
}
