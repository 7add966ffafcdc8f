package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testnet"
	"github.com/semroute/semroute/internal/testwait"
)

// rawReplica serves health checks itself and hands every other request to
// serve (n counts them from 0 over all connections); false closes.
func rawReplica(t *testing.T, readBody bool, serve func(c net.Conn, req *http.Request, body []byte, n int) bool) (string, *atomic.Int32) {
	var n atomic.Int32
	addr, _ := testnet.Serve(t, func(c net.Conn) {
		defer c.Close()
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			if !strings.HasPrefix(req.URL.Path, "/v1/") || req.Method == "GET" {
				io.Copy(io.Discard, req.Body)
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"data\":[]}")
				continue
			}
			var b []byte
			if readBody {
				b, _ = io.ReadAll(req.Body)
			}
			if !serve(c, req, b, int(n.Add(1))-1) {
				return
			}
		}
	})
	return "http://" + addr, &n
}

func routerOver(t *testing.T, url string) *running {
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("health: {check_interval: 1h, scrape_interval: 0s}\nreplicas:\n  - {name: s, url: %q}\n", url))
	return serveConfig(t, cfg)
}

// E1: one client's response is delivered to another client. The replica
// answers client A with more bytes than its Content-Length; client B's
// request, on the pooled connection, gets the surplus.
func TestUpstreamHostileE2EResponseToTheWrongClient(t *testing.T) {
	url, _ := rawReplica(t, true, func(c net.Conn, req *http.Request, body []byte, n int) bool {
		if n == 0 {
			leak := `{"secret":"for A: ` + string(body) + `"}`
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"+
				"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(leak), leak)
			return true
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n{\"for\":\"you\"}")
		return true
	})
	r := routerOver(t, url)
	_, a, _ := rawPost(t, r.http.URL(), "/v1/embeddings", []byte(`{"input":"A's private text"}`))
	_, b, _ := rawPost(t, r.http.URL(), "/v1/embeddings", []byte(`{"input":"B"}`))
	t.Logf("A got %s\nB got %s", a, b)
	if strings.Contains(string(b), "private") {
		t.Errorf("client B received client A's data: %s", b)
	}
}

// E2: the POST is sent twice to the replica by the router's transport when
// a reused connection dies after the replica has read the request.
func TestUpstreamHostileE2EDuplicatePOST(t *testing.T) {
	url, n := rawReplica(t, true, func(c net.Conn, req *http.Request, body []byte, n int) bool {
		if n == 0 {
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
			return true
		}
		return false // it has read the request whole: it works on it, then the connection is reset
	})
	r := routerOver(t, url)
	rawPost(t, r.http.URL(), "/v1/embeddings", []byte(`{"input":"warm"}`))
	code, b, _ := rawPost(t, r.http.URL(), "/v1/embeddings", []byte(`{"input":"once"}`))
	t.Logf("%d %s; replica got %d POSTs for the second request", code, b, n.Load()-1)
	if n.Load() != 2 {
		t.Errorf("the second POST reached the replica %d times", n.Load()-1)
	}
}

// E3: the replica answers 413 before reading a large body and closes, as a
// body-size limit in front of vLLM does: its side at once (a FIN), the
// connection, unread, once the client has its answer (a close before that
// would reset the connection and could take the unread answer with it, a
// race of the kernel's, not the router's). The client should see the 413.
func TestUpstreamHostileE2EEarlyAnswerLost(t *testing.T) {
	answered := make(chan struct{})
	url, _ := rawReplica(t, false, func(c net.Conn, req *http.Request, body []byte, n int) bool {
		io.WriteString(c, "HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: 25\r\n\r\n{\"error\":\"body too big\"}\n")
		c.(*net.TCPConn).CloseWrite()
		select {
		case <-answered:
		case <-time.After(testwait.Deadline):
		}
		return false
	})
	r := routerOver(t, url)
	big := `{"input":"` + strings.Repeat("x", 8<<20) + `"}`
	code, b, _ := rawPost(t, r.http.URL(), "/v1/embeddings", []byte(big))
	close(answered)
	t.Logf("%d %s", code, b)
	if code != 413 {
		t.Errorf("client got %d, want the replica's 413", code)
	}
}

// E4: the replica answers early and keeps the connection, not reading the
// rest of the body: the request hangs until the client leaves.
func TestUpstreamHostileE2EEarlyAnswerHangs(t *testing.T) {
	done := make(chan struct{})
	url, _ := rawReplica(t, false, func(c net.Conn, req *http.Request, body []byte, n int) bool {
		io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
		<-done
		return false
	})
	t.Cleanup(func() { close(done) }) // before rawReplica's cleanup waits for the handler

	r := routerOver(t, url)
	big := `{"input":"` + strings.Repeat("x", 8<<20) + `"}`
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", r.http.URL()+"/v1/embeddings", strings.NewReader(big))
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err == nil {
		resp.Body.Close()
		t.Logf("%d after %v", resp.StatusCode, time.Since(start))
		if resp.StatusCode != 400 {
			t.Errorf("client got %d, want the replica's 400", resp.StatusCode)
		}
		return
	}
	t.Errorf("no answer after %v: %v", time.Since(start), err)
	rep, _ := r.app.pool.Get("s")
	released := testwait.Within(testwait.Deadline, func() bool { return rep.Load(time.Now()).InFlight == 0 })
	t.Logf("after the client left: %+v (load released: %v)", rep.Load(time.Now()), released)
}

// E5: a replica answers 101 to a request that asked for no upgrade: the
// client gets a 502 (then 503s: the failing replica is ejected), and the
// connection to the replica is closed.
func TestUpstreamHostileE2E101Leak(t *testing.T) {
	url, _ := rawReplica(t, true, func(c net.Conn, req *http.Request, body []byte, n int) bool {
		io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
		return true // keeps it open
	})
	r := routerOver(t, url)
	count := func() int { es, _ := os.ReadDir("/proc/self/fd"); return len(es) }
	before := count()
	for range 50 {
		if code, _, _ := rawPost(t, r.http.URL(), "/v1/embeddings", []byte(`{}`)); code != http.StatusBadGateway && code != http.StatusServiceUnavailable {
			t.Fatalf("a replica's unasked 101 reached the client as %d, want 502 or 503", code)
		}
	}
	testwait.Value(t, fmt.Sprint("at most 10 fds more than the ", before, " before 50 answers of 101"), func() (int, bool) {
		after := count()
		return after, after-before <= 10
	})
}
