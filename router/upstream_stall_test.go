package router

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/semroute/semroute/limits"
)

// TestUpstreamFailoverDrainStalls: the first replica answers 503 with a
// Content-Length and then goes silent. failover drains up to 64 KiB of that
// body before moving on, with no deadline: neither the first-byte timeout
// (cleared once headers are in) nor the idle timeout (modifyResponse has
// not wrapped the body yet) bounds it. The request hangs until the client
// leaves although a second, healthy replica is there. The failed answer is
// now closed undrained.
func TestUpstreamFailoverDrainStalls(t *testing.T) {
	for _, which := range []string{"upstream", "http.Transport"} {
		t.Run(which, func(t *testing.T) {
			done := make(chan struct{})
			bad := rawOne(t, func(c net.Conn, br *bufio.Reader, req *http.Request) {
				io.WriteString(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\n{")
				select {
				case <-time.After(5 * time.Second):
				case <-done:
				}
			})
			t.Cleanup(func() { close(done) })
			good := rawOne(t, func(c net.Conn, br *bufio.Reader, req *http.Request) {
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
			})
			o := ServerOptions{Timeouts: limits.Timeouts{FirstByte: 500 * time.Millisecond, Idle: 500 * time.Millisecond}}
			if which == "http.Transport" {
				o.Transport = http.DefaultTransport.(*http.Transport).Clone()
			}
			ts, _ := serverFor(t, o, bad, good)
			c := &http.Client{Timeout: 3 * time.Second}
			start := time.Now()
			resp, err := c.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
			if err != nil {
				t.Fatalf("no answer after %v (idle and first-byte timeouts are 0.5 s): %v", time.Since(start).Round(time.Millisecond), err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Errorf("%d after %v, want the healthy replica's 200", resp.StatusCode, time.Since(start))
			}
		})
	}
}
