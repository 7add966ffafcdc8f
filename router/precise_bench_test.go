package router

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/metrics"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
	"github.com/semroute/semroute/tokenizer"
)

// BenchmarkBodiesInFlight measures the router's heap while 32 chat bodies
// of 15 MiB each are in flight at once, in approximate and in precise mode
// (each body also sent to /tokenize): peak-MB is the highest heap in use
// sampled during a round over the heap before it, alloc-MB the bytes
// allocated per round. The replica and its /tokenize read and drop what
// they are sent, and answer a few bytes, so the heap is the router's (and
// the client's few buffers). Run alone:
//
//	go test -run XXX -bench BodiesInFlight -benchtime 3x ./router
func BenchmarkBodiesInFlight(b *testing.B) {
	const (
		clients = 32
		size    = 15 << 20
	)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Path == "/tokenize" {
			_, _ = io.WriteString(w, `{"count":64,"tokens":[`+strings.Repeat("7,", 63)+`7]}`)
			return
		}
		_, _ = io.WriteString(w, `{"choices":[],"usage":{"prompt_tokens":64,"completion_tokens":1}}`)
	}))
	defer up.Close()
	msg := strings.Repeat("a sentence of ordinary prose, ", size/16/30)
	var body bytes.Buffer
	body.WriteString(`{"model":"m","max_tokens":1,"messages":[`)
	for i := range 16 {
		fmt.Fprintf(&body, `{"role":"user","content":"%d %s"},`, i, msg)
	}
	body.Truncate(body.Len() - 1)
	body.WriteString(`]}`)

	for _, precise := range []bool{false, true} {
		name := "approximate"
		if precise {
			name = "precise"
		}
		b.Run(name, func(b *testing.B) {
			e, err := routing.New(routing.Options{Replicas: []replica.Spec{{Name: "r0", URL: up.URL}}})
			if err != nil {
				b.Fatal(err)
			}
			rr, _ := routing.NewPolicy(routing.PolicySpec{Type: "round_robin"})
			co := CoreOptions{Engine: e, Arms: []Arm{{Name: "default", Policy: rr, Weight: 1}}}
			if precise {
				tok, err := tokenizer.New(tokenizer.Options{URL: up.URL, Timeout: time.Minute})
				if err != nil {
					b.Fatal(err)
				}
				co.Tokenizer, co.BlockTokens = tok, 16
			}
			core, err := NewCore(co)
			if err != nil {
				b.Fatal(err)
			}
			srv, err := NewServer(ServerOptions{Core: core, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err != nil {
				b.Fatal(err)
			}
			ts := httptest.NewServer(srv)
			defer ts.Close()
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
			var peak, alloc float64
			for i := 0; i < b.N; i++ {
				// Each round's bodies differ, so no answer comes from the tokenizer's cache.
				bodies := make([][]byte, clients)
				for j := range bodies {
					bodies[j] = bytes.Clone(body.Bytes())
					copy(bodies[j][len(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"`):], fmt.Sprintf("%03d-%06d", j, i))
				}
				runtime.GC()
				base, allocBase := heapInUse(), heapAllocated()
				stop, top := sampleHeap()
				var wg sync.WaitGroup
				for j := range clients {
					wg.Add(1)
					go func() {
						defer wg.Done()
						req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, ts.URL+"/v1/chat/completions", bytes.NewReader(bodies[j]))
						req.Header.Set("Content-Type", "application/json")
						resp, err := client.Do(req)
						if err != nil {
							b.Error(err)
							return
						}
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						if resp.StatusCode != 200 {
							b.Errorf("status %d", resp.StatusCode)
						}
					}()
				}
				wg.Wait()
				close(stop)
				peak = max(peak, float64(<-top-base)/(1<<20))
				alloc += float64(heapAllocated()-allocBase) / (1 << 20)
			}
			b.ReportMetric(peak, "peak-MB")
			b.ReportMetric(alloc/float64(b.N), "alloc-MB/round")
			b.ReportMetric(float64(clients*body.Len())/(1<<20), "bodies-MB")
		})
	}
}

// heapInUse is the bytes of heap objects now, live or not yet collected.
func heapInUse() uint64 { return readMetric("/memory/classes/heap/objects:bytes") }

// heapAllocated is the bytes allocated on the heap so far.
func heapAllocated() uint64 { return readMetric("/gc/heap/allocs:bytes") }

func readMetric(name string) uint64 {
	s := []metrics.Sample{{Name: name}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// sampleHeap samples the heap in use every 200µs until stop is closed,
// then sends the highest sample.
func sampleHeap() (stop chan struct{}, top chan uint64) {
	stop, top = make(chan struct{}), make(chan uint64, 1)
	go func() {
		var hi uint64
		t := time.NewTicker(200 * time.Microsecond)
		defer t.Stop()
		for {
			hi = max(hi, heapInUse())
			select {
			case <-stop:
				top <- hi
				return
			case <-t.C:
			}
		}
	}()
	return stop, top
}
