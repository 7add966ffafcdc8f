package main

import (
	"runtime/debug"
	"testing"
)

// stamp: the -ldflags values win; without them, `go install ...@version`
// still reports the module version and, where the toolchain recorded one,
// the commit.
func TestStampFallsBackToBuildInfo(t *testing.T) {
	vcs := func(rev string) []debug.BuildSetting {
		return []debug.BuildSetting{{Key: "-trimpath", Value: "true"}, {Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: rev}}
	}
	for _, c := range []struct {
		name                 string
		ldVersion, ldCommit  string
		bi                   *debug.BuildInfo
		wantVersion, wantRev string
	}{
		{"ldflags win", "v1.2.3", "0123456789abcdef0123456789abcdef01234567",
			&debug.BuildInfo{Main: debug.Module{Version: "v9.9.9"}, Settings: vcs("ffffffffffffffffffffffffffffffffffffffff")},
			"v1.2.3", "0123456789abcdef0123456789abcdef01234567"},
		{"go install @tag", "dev", "",
			&debug.BuildInfo{Main: debug.Module{Path: "github.com/semroute/semroute", Version: "v1.2.3"}},
			"v1.2.3", "unknown"},
		{"go install @commit", "dev", "",
			&debug.BuildInfo{Main: debug.Module{Version: "v0.0.0-20261128193000-dbc92a1e0f42"}},
			"v0.0.0-20261128193000-dbc92a1e0f42", "dbc92a1e0f42"},
		{"pseudo-version after a pre-release tag", "dev", "",
			&debug.BuildInfo{Main: debug.Module{Version: "v1.3.0-rc.1.0.20261128193000-dbc92a1e0f42"}},
			"v1.3.0-rc.1.0.20261128193000-dbc92a1e0f42", "dbc92a1e0f42"},
		{"build in a dirty checkout", "dev", "",
			&debug.BuildInfo{Main: debug.Module{Version: "v1.2.4-0.20261128193000-dbc92a1e0f42+dirty"}, Settings: vcs("dbc92a1e0f42aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")},
			"v1.2.4-0.20261128193000-dbc92a1e0f42+dirty", "dbc92a1e0f42aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"},
		{"build without vcs stamping", "dev", "",
			&debug.BuildInfo{Main: debug.Module{Version: "(devel)"}},
			"dev", "unknown"},
		{"ldflags commit, module version", "dev", "abc123",
			&debug.BuildInfo{Main: debug.Module{Version: "v1.2.3"}, Settings: vcs("ffff")},
			"v1.2.3", "abc123"},
		{"no build info", "dev", "", nil, "dev", "unknown"},
		{"empty ldflags version", "", "", nil, "dev", "unknown"},
	} {
		ver, rev := stamp(c.ldVersion, c.ldCommit, c.bi)
		if ver != c.wantVersion || rev != c.wantRev {
			t.Errorf("%s: stamp = %q, %q; want %q, %q", c.name, ver, rev, c.wantVersion, c.wantRev)
		}
	}
}
