package router

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestUpstreamIdleTotalUnbounded: the idle connections kept over all
// replicas are bounded (maxTotal; 256 per replica would otherwise make
// 12,800 for 50 replicas). After a burst of 64 concurrent requests to each
// of 8 replicas, with the total cap at 100, count the connections left
// idle. http.Transport (MaxIdleConns 100) is logged beside it.
func TestUpstreamIdleTotalUnbounded(t *testing.T) {
	const replicas, per, total = 8, 64, 100
	for _, which := range []string{"upstream", "http.Transport"} {
		t.Run(which, func(t *testing.T) {
			var idle atomic.Int32
			var gate sync.WaitGroup
			gate.Add(replicas * per)
			var urls []string
			for range replicas {
				srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					io.Copy(io.Discard, r.Body)
					gate.Done()
					gate.Wait() // every request holds its connection until all arrived
					w.Write([]byte("ok"))
				}))
				srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
					switch s {
					case http.StateIdle:
						idle.Add(1)
					case http.StateActive:
						// a new connection goes New -> Active; an idle one Idle -> Active
					}
				}
				srv.Start()
				t.Cleanup(srv.Close)
				urls = append(urls, srv.URL)
			}
			var rt http.RoundTripper
			if which == "upstream" {
				u := testUpstream(t)
				u.maxIdle, u.maxTotal = maxIdlePerReplica, total
				rt = u
			} else {
				tr := http.DefaultTransport.(*http.Transport).Clone()
				tr.MaxIdleConnsPerHost = maxIdlePerReplica
				t.Cleanup(tr.CloseIdleConnections)
				rt = tr
			}
			var wg sync.WaitGroup
			for _, u := range urls {
				for range per {
					wg.Add(1)
					go func() {
						defer wg.Done()
						req, _ := http.NewRequest("POST", u+"/x", strings.NewReader("x"))
						resp, err := rt.RoundTrip(req)
						if err != nil {
							t.Error(err)
							return
						}
						io.ReadAll(resp.Body)
						resp.Body.Close()
					}()
				}
			}
			wg.Wait()
			time.Sleep(200 * time.Millisecond)
			// Idle on the replica side and still open on ours: count ours.
			open := 0
			switch x := rt.(type) {
			case *upstream:
				x.mu.Lock()
				for _, l := range x.idle {
					open += len(l)
				}
				x.mu.Unlock()
			case *http.Transport:
				open = fds(t) // rough; logged only
			}
			t.Logf("%s: connections kept idle after the burst: %d (replica side went idle %d times, fds %d)", which, open, idle.Load(), fds(t))
			if which == "upstream" && open > total {
				t.Errorf("%d idle connections kept over %d replicas, more than the cap of %d", open, replicas, total)
			}
		})
	}
}
