package router

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

type countWrites struct {
	net.Conn
	n *atomic.Int32
}

func (c countWrites) Write(p []byte) (int, error) { c.n.Add(1); return c.Conn.Write(p) }

// TestUpstreamBodyWriteSyscalls: writeRequest means the router's body to go
// out in one write (bodyReader.WriteTo), but ReverseProxy hands the
// transport its body wrapped in a noopCloseReader, which has no WriteTo:
// the body is copied through the 4 KiB bufio.Writer, one write per 4 KiB.
func TestUpstreamBodyWriteSyscalls(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, "{}")
	}))
	defer srv.Close()
	var n atomic.Int32
	std := http.DefaultTransport.(*http.Transport).Clone()
	u := newUpstream(std, 0, 0, maxResponseHeaderBytes, 4)
	u.proxied = false
	d := u.dial
	u.dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return countWrites{c, &n}, nil
	}
	ts, _ := serverFor(t, ServerOptions{Transport: u}, srv.URL)
	prompt := strings.Repeat("a", 40<<10)
	body := `{"model":"m","messages":[{"role":"user","content":"` + prompt + `"}]}`
	resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("a %d-byte request went out in %d writes", len(body), n.Load())
	if n.Load() > 3 {
		t.Errorf("%d writes for one %d KiB request", n.Load(), len(body)>>10)
	}
}
