package router

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
)

// TestUpstreamReplicaURLWithoutPort: a replica configured without a port
// (http://host, as replica.ParseURL allows: "http(s)://host[:port]", e.g.
// a Kubernetes Service on port 80) is dialled as "host" — "missing port in
// address" — where http.Transport dialled host:80. Every request fails and
// the replica is ejected, while its health checks (through http.Transport)
// say it is fine. Skipped where port 80 cannot be had.
func TestUpstreamReplicaURLWithoutPort(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:80")
	if err != nil {
		t.Skip("cannot listen on port 80:", err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"message":{"content":"hi"}}]}`)
	})}
	go srv.Serve(ln)
	defer srv.Close()
	ts, _ := serverWith(t, ServerOptions{}, nil, "http://127.0.0.1")
	resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("replica http://127.0.0.1 (port 80) not reached: %d %s", resp.StatusCode, b)
	}
}
