package main

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// The image is built for the host's architecture from a stand-in binary
// (building the router is the slow part and has nothing to check here):
// written twice, the layouts are the same to the byte; read back, the
// image runs the binary as nonroot with the router's entrypoint and
// labels.
func TestLayoutIsReproducibleAndNonRoot(t *testing.T) {
	p, err := parsePlatform("linux/" + runtime.GOARCH)
	if err != nil {
		t.Skipf("no image for this host: %v", err)
	}
	m := meta{version: "v1.2.3", commit: "0123456789abcdef0123456789abcdef01234567", source: "https://github.com/semroute/semroute", epoch: 1767225600}
	bin := binary{p, []byte("\x7fELF stand-in for the router")}

	dirs := []string{filepath.Join(t.TempDir(), "a"), filepath.Join(t.TempDir(), "b")}
	var digests []v1.Hash
	for _, dir := range dirs {
		idx, err := buildIndex(m, []binary{bin})
		if err != nil {
			t.Fatal(err)
		}
		if err := writeLayout(dir, idx, m.version); err != nil {
			t.Fatal(err)
		}
		d, err := idx.Digest()
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, d)
	}
	if digests[0] != digests[1] {
		t.Fatalf("same inputs, digests %s and %s", digests[0], digests[1])
	}
	a, b := tree(t, dirs[0]), tree(t, dirs[1])
	if !reflect.DeepEqual(a, b) {
		t.Fatalf("same inputs, different layouts:\n%v\n%v", keys(a), keys(b))
	}

	// Another version is another image.
	other := m
	other.version = "v1.2.4"
	idx, err := buildIndex(other, []binary{bin})
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := idx.Digest(); d == digests[0] {
		t.Fatal("another version, the same digest")
	}

	// Read back as a client would: index.json → the image index → the image.
	top, err := layout.ImageIndexFromPath(dirs[0])
	if err != nil {
		t.Fatal(err)
	}
	tm, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(tm.Manifests) != 1 || tm.Manifests[0].Digest != digests[0] || tm.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "v1.2.3" {
		t.Fatalf("index.json: %+v", tm.Manifests)
	}
	ii, err := top.ImageIndex(digests[0])
	if err != nil {
		t.Fatal(err)
	}
	im, err := ii.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].Platform == nil || im.Manifests[0].Platform.Architecture != runtime.GOARCH || im.Manifests[0].Platform.OS != "linux" {
		t.Fatalf("image index: %+v", im.Manifests)
	}
	if im.Annotations["org.opencontainers.image.version"] != "v1.2.3" {
		t.Fatalf("index annotations %v", im.Annotations)
	}
	img, err := ii.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	c := cf.Config
	if c.User != "65532:65532" || !slices.Equal(c.Entrypoint, []string{"/router"}) ||
		!slices.Equal(c.Cmd, []string{"serve", "--config", "/etc/semroute/router.yaml"}) {
		t.Fatalf("user %q entrypoint %q cmd %q", c.User, c.Entrypoint, c.Cmd)
	}
	for _, port := range []string{"8080/tcp", "9090/tcp", "9091/tcp"} {
		if _, ok := c.ExposedPorts[port]; !ok {
			t.Errorf("port %s not exposed: %v", port, c.ExposedPorts)
		}
	}
	for k, v := range map[string]string{
		"org.opencontainers.image.source":   "https://github.com/semroute/semroute",
		"org.opencontainers.image.version":  "v1.2.3",
		"org.opencontainers.image.revision": "0123456789abcdef0123456789abcdef01234567",
		"org.opencontainers.image.created":  "2026-01-01T00:00:00Z",
	} {
		if c.Labels[k] != v {
			t.Errorf("label %s = %q, want %q", k, c.Labels[k], v)
		}
	}
	if cf.OS != "linux" || cf.Architecture != runtime.GOARCH || cf.Created.Unix() != m.epoch {
		t.Errorf("config os %s arch %s created %v", cf.OS, cf.Architecture, cf.Created)
	}
	for _, h := range cf.History {
		if h.Created.Unix() != m.epoch {
			t.Errorf("history %q created %v", h.CreatedBy, h.Created)
		}
	}

	// The files: the binary at /router, nonroot's user and group, /tmp,
	// every one owned by root with the epoch's time.
	files := map[string]*tar.Header{}
	contents := map[string]string{}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			files[h.Name], contents[h.Name] = h, string(body)
			if h.Uid != 0 || h.Gid != 0 || h.ModTime.Unix() != m.epoch {
				t.Errorf("%s: uid %d gid %d time %v", h.Name, h.Uid, h.Gid, h.ModTime)
			}
		}
		rc.Close()
	}
	if h := files["router"]; h == nil || h.Mode != 0o755 || contents["router"] != string(bin.data) {
		t.Errorf("/router: %+v", h)
	}
	if h := files["tmp/"]; h == nil || h.Typeflag != tar.TypeDir || h.Mode != 0o1777 {
		t.Errorf("/tmp: %+v", h)
	}
	if !strings.Contains(contents["etc/passwd"], "\nnonroot:x:65532:65532:") || !strings.Contains(contents["etc/group"], "\nnonroot:x:65532:") {
		t.Errorf("/etc/passwd:\n%s/etc/group:\n%s", contents["etc/passwd"], contents["etc/group"])
	}
}

// writeLayout replaces a layout, never another directory.
func TestWriteLayoutRefusesToReplaceOtherDirectories(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "keep"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	p, _ := parsePlatform("linux/amd64")
	idx, err := buildIndex(meta{version: "v0", epoch: 0}, []binary{{p, []byte("stand-in")}})
	if err != nil {
		t.Fatal(err)
	}
	if err := writeLayout(dir, idx, "v0"); err == nil {
		t.Fatal("replaced a directory that is not a layout")
	}
	if _, err := os.Stat(filepath.Join(dir, "keep")); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "image")
	for range 2 { // written, then replaced
		if err := writeLayout(out, idx, "v0"); err != nil {
			t.Fatal(err)
		}
	}
}

// The build's environment: the platform's knobs are the tool's, not the
// caller's.
func TestBuildEnvOverridesTheCallers(t *testing.T) {
	p, _ := parsePlatform("linux/arm64")
	env := buildEnv([]string{"HOME=/root", "GOARCH=386", "GOFLAGS=-buildvcs=true -race", "CGO_ENABLED=1", "GOAMD64=v3"}, p)
	want := []string{"HOME=/root", "CGO_ENABLED=0", "GOOS=linux", "GOARCH=arm64", "GOAMD64=v1", "GOARM64=v8.0", "GOFLAGS=-mod=readonly"}
	if !slices.Equal(env, want) {
		t.Fatalf("env %q, want %q", env, want)
	}
	if p.Variant != "v8" {
		t.Fatalf("arm64 variant %q", p.Variant)
	}
	for _, bad := range []string{"linux", "windows/amd64", "linux/riscv64", ""} {
		if _, err := parsePlatform(bad); err == nil {
			t.Errorf("platform %q accepted", bad)
		}
	}
}

// tree maps every file under dir to its bytes.
func tree(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(path)
		rel, _ := filepath.Rel(dir, path)
		out[rel] = b
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func keys(m map[string][]byte) []string {
	var k []string
	for name := range m {
		k = append(k, name)
	}
	slices.Sort(k)
	return k
}

// The flags that end up inside -ldflags and labels are checked first.
func TestOptionsParse(t *testing.T) {
	for _, c := range []struct {
		version, commit, epoch string
		ok                     bool
	}{
		{"v1.2.3", "abc123", "1767225600", true},
		{"dbc92a1-dirty", "", "0", true},
		{"", "abc", "1", false},
		{"v1 -X main.x=y", "abc", "1", false},
		{"v1", "a'b", "1", false},
		{"v1", "abc", "", false},
		{"v1", "abc", "-5", false},
	} {
		o := options{meta: meta{version: c.version, commit: c.commit}}
		err := o.parse("linux/amd64,linux/arm64", c.epoch)
		if (err == nil) != c.ok {
			t.Errorf("version %q commit %q epoch %q: %v", c.version, c.commit, c.epoch, err)
		}
		if err == nil && len(o.platforms) != 2 {
			t.Errorf("platforms %v", o.platforms)
		}
	}
}
