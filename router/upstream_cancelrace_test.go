package router

import (
	"bufio"
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// cancelAtDeadline is a connection that, the first time a future read
// deadline is set on it, first cancels the request and lets the context's
// AfterFunc (SetDeadline in the past) run: the interleaving of a client
// that leaves just after the request is written.
type cancelAtDeadline struct {
	net.Conn
	once   sync.Once
	cancel context.CancelFunc
}

func (c *cancelAtDeadline) SetReadDeadline(t time.Time) error {
	if t.After(time.Now()) {
		c.once.Do(func() {
			c.cancel()
			time.Sleep(50 * time.Millisecond) // the AfterFunc moves the deadline to the past
		})
	}
	return c.Conn.SetReadDeadline(t)
}

// TestUpstreamCancelLostToFirstByteDeadline: exchange sets the first-byte
// read deadline after the write without looking at the context again. A
// cancel whose AfterFunc ran in between (deadline moved to the past) is
// undone by the new deadline: the read waits for the replica's answer or
// the first-byte timeout (default 300 s) although the client has gone, and
// the replica keeps generating for nobody.
func TestUpstreamCancelLostToFirstByteDeadline(t *testing.T) {
	for _, size := range []int{100, 100 << 10} { // the write in line, and beside the read
		done := make(chan struct{})
		s := newScripted(t, true, func(c net.Conn, _ *bufio.Reader, req *http.Request, i int) bool {
			select { // a long non-streamed generation
			case <-time.After(3 * time.Second):
			case <-done:
			}
			c.Write([]byte("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"))
			return true
		})
		t.Cleanup(func() { close(done) }) // before the replica's own cleanup waits for it
		u := testUpstream(t)              // first byte 5 s
		ctx, cancel := context.WithCancel(context.Background())
		d := u.dial
		u.dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &cancelAtDeadline{Conn: c, cancel: cancel}, nil
		}
		req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/x", strings.NewReader(strings.Repeat("x", size)))
		start := time.Now()
		resp, err := u.RoundTrip(req)
		if err == nil {
			resp.Body.Close()
		}
		took := time.Since(start)
		t.Logf("body %d: cancelled at once; RoundTrip returned after %v: err=%v", size, took.Round(time.Millisecond), err)
		if took > time.Second || !errors.Is(err, context.Canceled) {
			t.Errorf("body %d: the cancel was lost: %v after %v", size, err, took)
		}
		cancel()
	}
}
