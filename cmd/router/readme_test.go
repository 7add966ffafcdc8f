package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// replayTable is one replay table of a markdown file: the command printed
// above it and its rows.
type replayTable struct {
	line int      // 1-based line of the table's header
	args []string // the replay command's arguments, after "go run ./cmd/router"
	gen  []string // a gentrace command the replay's trace comes from, if any
	rows []string // its lines, the header's and the separator's first
}

var headlineRE = regexp.MustCompile(`reaches \*\*([0-9.]+)\*\* \(conversation\) and \*\*([0-9.]+)\*\* \(synthetic\) of the\s+pooled token hit rate with load imbalance \*\*([0-9.]+)\*\* and \*\*([0-9.]+)\*\*`)

// semanticRow returns the cells of the semantic policy's row in the table
// of the named public trace: cell 1 is the policy's name, 3 its share of
// the pooled hit rate, 9 its load imbalance.
func semanticRow(tables []replayTable, trace string) []string {
	for _, tb := range tables {
		if args := strings.Join(tb.args, " "); !strings.Contains(args, trace+"_trace") || strings.Contains(args, "--pd") {
			continue // a disaggregated replay is not the headline's
		}
		for _, r := range tb.rows {
			if strings.HasPrefix(r, "| semantic |") {
				c := strings.Split(r, "|")
				for i := range c {
					c[i] = strings.TrimSpace(c[i])
				}
				return c
			}
		}
	}
	return nil
}

var pdRE = regexp.MustCompile(`prefill choice finds ([0-9.]+)× round robin's cached tokens`)

// pdGain returns, from the disaggregated replay's table (a command with
// --pd), the semantic policy's prefill tokens saved over round robin's.
func pdGain(tables []replayTable) string {
	saved := map[string]float64{}
	for _, tb := range tables {
		if !strings.Contains(strings.Join(tb.args, " "), "--pd") {
			continue
		}
		for _, r := range tb.rows {
			c := strings.Split(r, "|")
			if len(c) > 5 {
				v, _ := strconv.ParseFloat(strings.TrimSpace(c[5]), 64)
				saved[strings.TrimSpace(c[1])] = v
			}
		}
	}
	if saved["round_robin"] == 0 {
		return "no table"
	}
	return strconv.FormatFloat(saved["semantic"]/saved["round_robin"], 'f', 1, 64)
}

var blendRE = regexp.MustCompile(`after any persona\): \*\*([0-9.]+)×\*\* in replay`)

// blendGain returns the semantic policy's prefill tokens saved over the
// best exact-prefix routing's in the blend table (docs/engines.md), as "1.61".
func blendGain(tables []replayTable) string {
	saved := map[string]float64{}
	for _, tb := range tables {
		if !strings.Contains(strings.Join(tb.args, " "), "--reuse blend") {
			continue
		}
		for _, r := range tb.rows {
			c := strings.Split(r, "|")
			if len(c) > 5 {
				v, err := strconv.ParseFloat(strings.TrimSpace(c[5]), 64)
				if err == nil {
					saved[strings.TrimSpace(c[1])] = v
				}
			}
		}
	}
	best := max(saved["semantic-prefix-credit"], saved["llmd"], saved["sglang"])
	if saved["semantic"] == 0 || best == 0 {
		return ""
	}
	return strconv.FormatFloat(saved["semantic"]/best, 'f', 2, 64)
}

var commandRE = regexp.MustCompile("`go run \\./cmd/router ((?:replay|gentrace) [^`]+)`")

// replayTables finds every table of a replay's summary ("| policy | token
// hit rate |") in text with the replay command nearest above it (and the
// gentrace command that made its trace, where the trace is not in
// testdata).
func replayTables(text string) []replayTable {
	lines := strings.Split(text, "\n")
	var out []replayTable
	var replay, gen []string
	for i := 0; i < len(lines); i++ {
		for _, m := range commandRE.FindAllStringSubmatch(lines[i], -1) {
			f := strings.Fields(m[1])
			if f[0] == "gentrace" {
				gen = f
			} else {
				replay = f
			}
		}
		if !strings.HasPrefix(lines[i], "| policy | token hit rate |") || replay == nil {
			continue
		}
		tb := replayTable{line: i + 1, args: replay}
		if gen != nil && !strings.Contains(strings.Join(replay, " "), "testdata/") {
			tb.gen = gen
		}
		for ; i < len(lines) && strings.HasPrefix(lines[i], "|"); i++ {
			tb.rows = append(tb.rows, lines[i])
		}
		out = append(out, tb)
		replay = nil
	}
	return out
}

// docFiles are the files whose replay tables and claims are checked: the
// README and every page of docs/, so that a table moved from one to
// another is still checked.
func docFiles(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob("../../docs/*.md")
	if err != nil || len(pages) == 0 {
		t.Fatalf("no docs/*.md: %v", err)
	}
	return append([]string{"../../README.md"}, pages...)
}

// docName is a file of docFiles as the repository names it.
func docName(f string) string { return strings.TrimPrefix(f, "../../") }

// TestReadmeReplayTablesAreWhatTheirCommandsPrint runs the command above
// each replay table of the README and of every docs/*.md page and checks
// the table is what it prints, row for row, so that the documentation
// cannot drift from the code. After a change meant to move them,
// SEMROUTE_README_UPDATE=1 rewrites them for review (the prose around them
// is the author's to check).
func TestReadmeReplayTablesAreWhatTheirCommandsPrint(t *testing.T) {
	files := docFiles(t)
	texts := map[string]string{}
	var all []replayTable
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(b)
		for _, tb := range replayTables(text) {
			if raceOn && !strings.Contains(strings.Join(tb.args, " "), "synthetic_trace") {
				continue // ten times slower under -race; go test without it checks them all
			}
			dir := t.TempDir()
			local := func(args []string) []string {
				out := make([]string, len(args))
				for i, a := range args {
					switch {
					case i > 0 && args[i-1] == "--out":
						a = filepath.Join(dir, a)
					case i > 0 && args[i-1] == "--trace" && !strings.HasPrefix(a, "testdata/"):
						a = filepath.Join(dir, a)
					case strings.HasPrefix(a, "testdata/"):
						a = filepath.Join("..", "..", a)
					}
					out[i] = a
				}
				return out
			}
			if tb.gen != nil {
				runCLI(t, local(tb.gen)...)
			}
			got := runCLI(t, local(tb.args)...)
			var printed []string
			for _, l := range strings.Split(got, "\n") {
				if strings.HasPrefix(l, "|") {
					printed = append(printed, l)
				}
			}
			if strings.Join(printed, "\n") != strings.Join(tb.rows, "\n") {
				if os.Getenv("SEMROUTE_README_UPDATE") != "" {
					text = strings.Replace(text, strings.Join(tb.rows, "\n"), strings.Join(printed, "\n"), 1)
					continue
				}
				t.Errorf("%s line %d: the table is not what `go run ./cmd/router %s` prints; it prints:\n%s\n(SEMROUTE_README_UPDATE=1 rewrites the tables of the README and docs/)",
					docName(f), tb.line, strings.Join(tb.args, " "), strings.Join(printed, "\n"))
			}
		}
		texts[f] = text
		all = append(all, replayTables(text)...) // as updated, if they were
	}
	if len(all) < 3 {
		t.Fatalf("found %d replay tables in the README and docs/, want at least 3", len(all))
	}
	// Each claim below is checked wherever it is made (the README's
	// headline figures and the page that holds the table), against the
	// tables of every file.
	claims := func(re *regexp.Regexp) (out [][]string, where []string) {
		for _, f := range files {
			for _, m := range re.FindAllStringSubmatch(texts[f], -1) {
				out = append(out, m)
				where = append(where, docName(f))
			}
		}
		return out, where
	}
	// The blend headline: the gain over exact-prefix routing, as the blend
	// table says.
	ms, where := claims(blendRE)
	if ms == nil {
		t.Error("the blend headline (docs/engines.md) is gone")
	}
	for i, m := range ms {
		if g := blendGain(all); g != m[1] {
			t.Errorf("%s: the blend headline says %s× in replay; its table says %s×", where[i], m[1], g)
		}
	}
	// The disaggregated replay: the prefill pool's cached tokens, cache-aware
	// over round robin, as its table says.
	ms, where = claims(pdRE)
	if ms == nil {
		t.Error("the disaggregated replay's claim (docs/prefill-decode.md) is gone")
	}
	for i, m := range ms {
		if g := pdGain(all); g != m[1] {
			t.Errorf("%s says the cache-aware prefill choice finds %s× round robin's cached tokens; its table says %s×", where[i], m[1], g)
		}
	}
	// The headline: the default's share of the pooled hit rate and its
	// imbalance on the two public traces, as their tables say.
	ms, where = claims(headlineRE)
	if ms == nil {
		t.Fatal("the headline on the public traces (docs/replay.md) is gone")
	}
	for j, m := range ms {
		for i, trace := range []string{"conversation", "synthetic"} {
			if raceOn && trace != "synthetic" {
				continue
			}
			row := semanticRow(all, trace)
			if row == nil {
				t.Fatalf("no replay table of the %s trace", trace)
			}
			if row[3] != m[1+i] || row[9] != m[3+i] {
				t.Errorf("%s: the headline says %s of pooled and imbalance %s on the %s trace; its table says %s and %s",
					where[j], m[1+i], m[3+i], trace, row[3], row[9])
			}
		}
	}
	if os.Getenv("SEMROUTE_README_UPDATE") != "" {
		for _, f := range files {
			if err := os.WriteFile(f, []byte(texts[f]), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}
