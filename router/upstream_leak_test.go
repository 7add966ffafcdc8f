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

// TestUpstreamFirstByteTimeoutLeaksAddresses: with http.Transport a replica
// that does not answer within FirstByte gave the client "net/http: timeout
// awaiting response headers"; the router's transport gives it the raw read
// error, "read tcp <router ip:port>-><replica ip:port>: i/o timeout".
func TestUpstreamFirstByteTimeoutLeaksAddresses(t *testing.T) {
	url := rawOne(t, func(c net.Conn, br *bufio.Reader, req *http.Request) { time.Sleep(time.Second) })
	ts, _ := serverFor(t, ServerOptions{Timeouts: limits.Timeouts{FirstByte: 200 * time.Millisecond}}, url)
	resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("%d %s", resp.StatusCode, b)
	if strings.Contains(string(b), strings.TrimPrefix(url, "http://")) {
		t.Errorf("the client is told the replica's address: %s", b)
	}
}
