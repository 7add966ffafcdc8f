// Command ociimage builds semroute's release image with nothing but Go:
// it cross-compiles cmd/router for each platform and writes an OCI image
// layout whose image index holds one image per platform. Same source,
// version, commit and epoch give the same bytes, so the same digest.
//
//	go run ./internal/ociimage -version v1.2.3 -commit $(git rev-parse HEAD) \
//	    -epoch $(git log -1 --format=%ct) -out bin/image
//
// (make image passes these). Each image is FROM scratch: /etc/passwd and
// /etc/group with the nonroot user 65532, /tmp, and the static binary at
// /router, run as 65532:65532. The binaries are left in -bin as
// router-linux-<arch> (the release's assets).
package main

import (
	"flag"
	"fmt"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

func main() {
	o := options{}
	platforms := "linux/amd64,linux/arm64"
	flag.StringVar(&o.out, "out", "bin/image", "the OCI image layout to write (replaced if it is one)")
	flag.StringVar(&o.binDir, "bin", "bin", "where to leave the binaries, as router-<os>-<arch>")
	flag.StringVar(&o.pkg, "pkg", "./cmd/router", "the package to build")
	flag.StringVar(&o.meta.version, "version", "", "the version: -X main.version, the image's label and the layout's ref name (required)")
	flag.StringVar(&o.meta.commit, "commit", "", "the commit: -X main.commitFlag and the revision label")
	flag.StringVar(&o.meta.source, "source", "https://github.com/semroute/semroute", "the source label")
	flag.StringVar(&platforms, "platforms", platforms, "comma-separated os/arch")
	epoch := flag.String("epoch", os.Getenv("SOURCE_DATE_EPOCH"), "every timestamp in the image, in Unix seconds (default $SOURCE_DATE_EPOCH; make image gives the commit's time)")
	flag.Parse()
	if err := o.parse(platforms, *epoch); err != nil {
		fmt.Fprintln(os.Stderr, "ociimage:", err)
		flag.Usage()
		os.Exit(2)
	}
	if err := run(o, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "ociimage:", err)
		os.Exit(1)
	}
}

type options struct {
	out, binDir, pkg string
	meta             meta
	platforms        []v1.Platform
}

// A token safe inside -ldflags and a label: no spaces or quotes.
var token = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+-]*$`)

func (o *options) parse(platforms, epoch string) error {
	if !token.MatchString(o.meta.version) {
		return fmt.Errorf("-version %q: give one, of letters, digits and . _ + -", o.meta.version)
	}
	if o.meta.commit != "" && !token.MatchString(o.meta.commit) {
		return fmt.Errorf("-commit %q: letters, digits and . _ + - only", o.meta.commit)
	}
	sec, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil || sec < 0 {
		return fmt.Errorf("-epoch %q: give Unix seconds (or set SOURCE_DATE_EPOCH), e.g. $(git log -1 --format=%%ct)", epoch)
	}
	o.meta.epoch = sec
	for _, s := range strings.Split(platforms, ",") {
		p, err := parsePlatform(strings.TrimSpace(s))
		if err != nil {
			return err
		}
		o.platforms = append(o.platforms, p)
	}
	return nil
}

func run(o options, w io.Writer) error {
	var bins []binary
	for _, p := range o.platforms {
		path := filepath.Join(o.binDir, "router-"+p.OS+"-"+p.Architecture)
		fmt.Fprintf(w, "go build %s for %s\n", o.pkg, p)
		if err := goBuild(o.pkg, path, p, o.meta); err != nil {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		bins = append(bins, binary{p, b})
	}
	idx, err := buildIndex(o.meta, bins)
	if err != nil {
		return err
	}
	if err := writeLayout(o.out, idx, o.meta.version); err != nil {
		return err
	}
	return summarize(w, o.out, idx, bins)
}

// ldflags are make build's: stripped, with the version and commit.
func ldflags(m meta) string {
	return fmt.Sprintf("-s -w -X main.version=%s -X main.commitFlag=%s", m.version, m.commit)
}

// goBuild cross-compiles pkg statically. The flags that change the output
// are set here, not taken from the environment (a GOFLAGS or GOAMD64 of
// the caller's would change the binary); -buildvcs=false leaves out the
// checkout's state (untracked files would mark it modified), the commit
// being given by -ldflags instead.
func goBuild(pkg, out string, p v1.Platform, m meta) error {
	cmd := exec.Command("go", "build", "-trimpath", "-buildvcs=false", "-ldflags", ldflags(m), "-o", out, pkg)
	cmd.Env = buildEnv(os.Environ(), p)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build for %s: %w", p, err)
	}
	return nil
}

func buildEnv(env []string, p v1.Platform) []string {
	set := map[string]string{"CGO_ENABLED": "0", "GOOS": p.OS, "GOARCH": p.Architecture,
		"GOAMD64": "v1", "GOARM64": "v8.0", "GOFLAGS": "-mod=readonly"}
	out := make([]string, 0, len(env)+len(set))
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		if _, ok := set[k]; !ok {
			out = append(out, kv)
		}
	}
	for _, k := range []string{"CGO_ENABLED", "GOOS", "GOARCH", "GOAMD64", "GOARM64", "GOFLAGS"} {
		out = append(out, k+"="+set[k])
	}
	return out
}
