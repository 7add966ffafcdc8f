// Package apikey checks the API keys clients present to the router, and
// maps each to a tenant.
//
// Keys are stored hashed (SHA-256, hex), in a YAML file an operator writes
// or mounts from a Kubernetes Secret:
//
//	keys:
//	  - {name: team-a, tenant: acme, sha256: 2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824}
//
// `router hashkey` prints a key's hash. A Set follows its file: Watch
// reads it again when its content changes. It fails closed: a file read
// again that is missing or invalid leaves no key accepted (a rotation
// with a typo must not keep the key it meant to revoke), and an empty
// list revokes every key.
package apikey

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"go.yaml.in/yaml/v3"
)

// Key is one client key: its SHA-256 (hex), the tenant its requests
// count for, and a name for logs.
type Key struct {
	Name   string `yaml:"name"`
	Tenant string `yaml:"tenant"`
	SHA256 string `yaml:"sha256"`
	// MaxPriority, if set, is the highest priority the key's requests may
	// have (flow control's objectives): the ceiling of whatever priority a
	// request ends with, the default (0) included. Nil: any.
	MaxPriority *int `yaml:"max_priority"`
}

// MaxKeys bounds a file's keys; MaxFileBytes its size.
const (
	MaxKeys      = 100_000
	MaxFileBytes = 16 << 20
)

// Hash returns key's SHA-256, hex, as a file stores it.
func Hash(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:])
}

// keys is one file's content.
type keys struct {
	by  map[[sha256.Size]byte]Key
	sum [sha256.Size]byte // of the file's bytes
}

// Set is the keys of a file. Safe for concurrent use; the zero value
// holds no key.
type Set struct {
	path string
	cur  atomic.Pointer[keys]
}

// Load reads the keys of the file at path.
func Load(path string) (*Set, error) {
	s := &Set{path: path}
	if _, err := s.read(); err != nil {
		return nil, err
	}
	return s, nil
}

// parse reads a keys file's content.
func parse(b []byte) (*keys, error) {
	var f struct {
		Keys []Key `yaml:"keys"`
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("api keys: %w", err)
	}
	if len(f.Keys) > MaxKeys {
		return nil, fmt.Errorf("api keys: %d keys, more than %d", len(f.Keys), MaxKeys)
	}
	k := &keys{by: make(map[[sha256.Size]byte]Key, len(f.Keys)), sum: sha256.Sum256(b)}
	for i, key := range f.Keys {
		raw, err := hex.DecodeString(strings.TrimPrefix(strings.ToLower(key.SHA256), "sha256:"))
		if err != nil || len(raw) != sha256.Size {
			return nil, fmt.Errorf("api keys: keys[%d] (%q): sha256 must be 64 hex digits (router hashkey prints them)", i, key.Name)
		}
		if key.Tenant == "" || len(key.Tenant) > 128 {
			return nil, fmt.Errorf("api keys: keys[%d] (%q): a tenant of 1 to 128 bytes is required", i, key.Name)
		}
		var h [sha256.Size]byte
		copy(h[:], raw)
		if _, dup := k.by[h]; dup {
			return nil, fmt.Errorf("api keys: keys[%d] (%q): the same key twice", i, key.Name)
		}
		k.by[h] = key
	}
	return k, nil
}

// Reload reads the file again and reports whether its keys changed. On
// an error the set holds no key (it fails closed).
func (s *Set) Reload() (changed bool, err error) {
	changed, err = s.read()
	if err != nil {
		s.cur.Store(&keys{by: map[[sha256.Size]byte]Key{}})
	}
	return changed, err
}

// read reads the file and, if its content changed and is valid, takes its
// keys.
func (s *Set) read() (changed bool, err error) {
	f, err := os.Open(s.path)
	if err != nil {
		return false, fmt.Errorf("api keys: %w", err)
	}
	defer f.Close()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(io.LimitReader(f, MaxFileBytes+1)); err != nil {
		return false, fmt.Errorf("api keys: %w", err)
	}
	if buf.Len() > MaxFileBytes {
		return false, fmt.Errorf("api keys: %s is larger than %d bytes", s.path, MaxFileBytes)
	}
	if old := s.cur.Load(); old != nil && old.sum == sha256.Sum256(buf.Bytes()) {
		return false, nil
	}
	k, err := parse(buf.Bytes())
	if err != nil {
		return false, err
	}
	s.cur.Store(k)
	return true, nil
}

// Check returns the key whose hash is presented's, if the set holds it.
// Its time depends on the presented key's length alone, not on how much
// of it matches a stored one.
func (s *Set) Check(presented string) (Key, bool) {
	k := s.cur.Load()
	if k == nil || presented == "" {
		return Key{}, false
	}
	key, ok := k.by[sha256.Sum256([]byte(presented))]
	return key, ok
}

// Tenants returns the tenants the set's keys name, each once.
func (s *Set) Tenants() []string {
	k := s.cur.Load()
	if k == nil {
		return nil
	}
	seen := map[string]bool{}
	var out []string
	for _, key := range k.by {
		if !seen[key.Tenant] {
			seen[key.Tenant] = true
			out = append(out, key.Tenant)
		}
	}
	return out
}

// Watch reads the file again every interval until ctx ends, calling
// changed after a change and failed after an error (no key is accepted
// until the file is valid again). A Kubernetes Secret mounted as a volume
// changes its file in place this way.
func (s *Set) Watch(ctx context.Context, interval time.Duration, changed func(), failed func(error)) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		ok, err := s.Reload()
		switch {
		case err != nil && failed != nil:
			failed(err)
		case ok && changed != nil:
			changed()
		}
	}
}
