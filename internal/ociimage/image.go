package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"embed"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// rootfs holds the files of the base layer that are not made here: the
// Dockerfile copies the same ones.
//
//go:embed rootfs/etc/passwd rootfs/etc/group
var rootfs embed.FS

// The image's run-time settings: the Dockerfile says the same.
const (
	user       = "65532:65532" // nonroot in rootfs/etc/passwd
	binaryPath = "router"      // in the layer; /router in the image
)

var (
	entrypoint = []string{"/router"}
	cmdArgs    = []string{"serve", "--config", "/etc/semroute/router.yaml"}
	// The OpenAI API, the gRPC Route API and the admin API, as the
	// manifests in deploy/ use them.
	ports = []string{"8080/tcp", "9090/tcp", "9091/tcp"}
)

// meta is what the image records of its build.
type meta struct {
	version, commit, source string
	epoch                   int64 // Unix seconds: every timestamp in the image
}

func (m meta) time() time.Time { return time.Unix(m.epoch, 0).UTC() }

// labels are the OCI annotations the image's config carries as labels and
// its index as annotations.
func (m meta) labels() map[string]string {
	l := map[string]string{
		"org.opencontainers.image.title":       "semroute",
		"org.opencontainers.image.description": "KV-cache-aware router for OpenAI-compatible inference replicas",
		"org.opencontainers.image.source":      m.source,
		"org.opencontainers.image.url":         m.source,
		"org.opencontainers.image.version":     m.version,
		"org.opencontainers.image.created":     m.time().Format(time.RFC3339),
	}
	if m.commit != "" {
		l["org.opencontainers.image.revision"] = m.commit
	}
	return l
}

// parsePlatform reads "os/arch", one of the platforms built.
func parsePlatform(s string) (v1.Platform, error) {
	goos, arch, ok := strings.Cut(s, "/")
	if !ok || goos != "linux" || (arch != "amd64" && arch != "arm64") {
		return v1.Platform{}, fmt.Errorf("platform %q: linux/amd64 and linux/arm64 are built", s)
	}
	p := v1.Platform{OS: goos, Architecture: arch}
	if arch == "arm64" {
		p.Variant = "v8" // as Docker and the distroless images label arm64
	}
	return p, nil
}

// binary is the router built for one platform.
type binary struct {
	platform v1.Platform
	data     []byte
}

// buildIndex assembles an image index with one image per binary, in the
// order given.
func buildIndex(m meta, bins []binary) (v1.ImageIndex, error) {
	base, err := baseLayer(m.time())
	if err != nil {
		return nil, err
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, b := range bins {
		img, err := buildImage(m, base, b)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", b.platform, err)
		}
		p := b.platform
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &p}})
	}
	return mutate.Annotations(idx, m.labels()).(v1.ImageIndex), nil
}

// buildImage is one platform's image: the base layer (users, /tmp), the
// same for every platform and version, then the binary's.
func buildImage(m meta, base v1.Layer, b binary) (v1.Image, error) {
	app, err := layer(m.time(), []file{{name: binaryPath, mode: 0o755, data: b.data}})
	if err != nil {
		return nil, err
	}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	created := v1.Time{Time: m.time()}
	img, err = mutate.Append(img,
		mutate.Addendum{Layer: base, History: v1.History{Created: created,
			CreatedBy: "ociimage: /etc/passwd and /etc/group (nonroot 65532), /tmp"}},
		mutate.Addendum{Layer: app, History: v1.History{Created: created,
			CreatedBy: fmt.Sprintf("CGO_ENABLED=0 GOOS=%s GOARCH=%s go build -trimpath -buildvcs=false -ldflags '%s' -o /router", b.platform.OS, b.platform.Architecture, ldflags(m))}})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Variant = b.platform.OS, b.platform.Architecture, b.platform.Variant
	cf.Created = created
	exposed := map[string]struct{}{}
	for _, p := range ports {
		exposed[p] = struct{}{}
	}
	cf.Config = v1.Config{
		User:         user,
		Entrypoint:   entrypoint,
		Cmd:          cmdArgs,
		ExposedPorts: exposed,
		Labels:       m.labels(),
	}
	return mutate.ConfigFile(img, cf)
}

// baseLayer is what scratch lacks for a non-root process: its user and
// group, and a /tmp.
func baseLayer(t time.Time) (v1.Layer, error) {
	files := []file{{name: "etc/", mode: 0o755, dir: true}}
	for _, name := range []string{"etc/group", "etc/passwd"} {
		data, err := rootfs.ReadFile("rootfs/" + name)
		if err != nil {
			return nil, err
		}
		files = append(files, file{name: name, mode: 0o644, data: data})
	}
	files = append(files, file{name: "tmp/", mode: 0o1777, dir: true})
	return layer(t, files)
}

// file is one entry of a layer, owned by root.
type file struct {
	name string
	mode int64
	dir  bool
	data []byte
}

// layer writes files, in the order given, as a gzipped tar whose bytes
// depend on nothing but its arguments: fixed times, owners and format, and
// a gzip header with no name or time.
func layer(t time.Time, files []file) (v1.Layer, error) {
	var gz bytes.Buffer
	zw, err := gzip.NewWriterLevel(&gz, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	tw := tar.NewWriter(zw)
	for _, f := range files {
		h := &tar.Header{Name: f.name, Mode: f.mode, ModTime: t, Format: tar.FormatUSTAR, Typeflag: tar.TypeReg, Size: int64(len(f.data))}
		if f.dir {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	b := gz.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(b)), nil
	}, tarball.WithMediaType(types.OCILayer))
}

// writeLayout replaces dir with an OCI image layout holding idx, named by
// its version. It refuses to remove a directory that is not such a layout.
func writeLayout(dir string, idx v1.ImageIndex, version string) error {
	if _, err := os.Stat(dir); err == nil {
		if _, err := os.Stat(filepath.Join(dir, "oci-layout")); err != nil {
			return fmt.Errorf("%s exists and is not an OCI image layout: not replacing it", dir)
		}
		if err := os.RemoveAll(dir); err != nil {
			return err
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	return p.AppendIndex(idx, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": version}))
}

// summarize prints each image's digest and sizes, then the index's.
func summarize(w io.Writer, dir string, idx v1.ImageIndex, bins []binary) error {
	im, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	for i, d := range im.Manifests {
		img, err := idx.Image(d.Digest)
		if err != nil {
			return err
		}
		m, err := img.Manifest()
		if err != nil {
			return err
		}
		var sizes []string
		var total int64
		for _, l := range m.Layers {
			sizes = append(sizes, mib(l.Size))
			total += l.Size
		}
		fmt.Fprintf(w, "%-15s %s  layers %s = %s compressed; binary %s\n", d.Platform, d.Digest,
			strings.Join(sizes, " + "), mib(total), mib(int64(len(bins[i].data))))
	}
	d, err := idx.Digest()
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "index           %s  in %s\n", d, dir)
	return nil
}

func mib(n int64) string {
	if n < 1<<20 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}
