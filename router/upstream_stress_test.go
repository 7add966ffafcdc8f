package router

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestUpstreamChurn hammers the transport with concurrent requests of small
// and large bodies, random cancels, random early closes from another
// goroutine, a sweep every millisecond, and a replica that misbehaves at
// random; then checks that no goroutine or socket is left.
func TestUpstreamChurn(t *testing.T) {
	g0 := runtime.NumGoroutine()
	f0 := fds(t)
	s := newScripted(t, false, func(c net.Conn, br *bufio.Reader, req *http.Request, i int) bool {
		switch rand.IntN(8) {
		case 0: // early answer, body unread, close
			io.WriteString(c, "HTTP/1.1 413 X\r\nContent-Length: 3\r\n\r\nbig")
			return false
		case 1: // close without answer
			io.Copy(io.Discard, req.Body)
			return false
		case 2: // slow stream
			io.Copy(io.Discard, req.Body)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
			for range 5 {
				time.Sleep(time.Millisecond)
				if _, err := io.WriteString(c, "5\r\nhello\r\n"); err != nil {
					return false
				}
			}
			io.WriteString(c, "0\r\n\r\n")
			return true
		case 3: // partial body then close
			io.Copy(io.Discard, req.Body)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
			return false
		default:
			n, _ := io.Copy(io.Discard, req.Body)
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(fmt.Sprint(n)), fmt.Sprint(n))
			return true
		}
	})
	u := testUpstream(t)
	u.sweepEvery = time.Millisecond
	small := strings.Repeat("s", 1000)
	large := strings.Repeat("L", 200<<10)
	var wg sync.WaitGroup
	for w := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 60 {
				body := small
				if (w+i)%3 == 0 {
					body = large
				}
				ctx, cancel := context.WithCancel(context.Background())
				if rand.IntN(4) == 0 {
					time.AfterFunc(time.Duration(rand.IntN(3000))*time.Microsecond, cancel)
				}
				req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/x", strings.NewReader(body))
				resp, err := u.RoundTrip(req)
				if err != nil {
					cancel()
					continue
				}
				if rand.IntN(4) == 0 {
					go resp.Body.Close() // from another goroutine, mid-read
				}
				b, err := io.ReadAll(resp.Body)
				if err == nil && resp.StatusCode == 200 && string(b) != fmt.Sprint(len(body)) && string(b) != strings.Repeat("hello", 5) {
					t.Errorf("wrong answer %q for a body of %d", b, len(body))
				}
				resp.Body.Close()
				cancel()
			}
		}()
	}
	wg.Wait()
	u.CloseIdleConnections()
	s.closeAll()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		if runtime.NumGoroutine() <= g0+4 && fds(t) <= f0+4 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("goroutines %d -> %d, fds %d -> %d, conns %d", g0, runtime.NumGoroutine(), f0, fds(t), s.conns.Load())
	u.mu.Lock()
	idle := 0
	for _, l := range u.idle {
		idle += len(l)
	}
	u.mu.Unlock()
	if idle != 0 {
		t.Errorf("%d idle connections still pooled after CloseIdleConnections", idle)
	}
	if n := runtime.NumGoroutine(); n > g0+4 {
		buf := make([]byte, 1<<20)
		t.Errorf("goroutines leaked: %d -> %d\n%s", g0, n, buf[:runtime.Stack(buf, true)])
	}
}
