package main

// A hostile (or broken) replica whose streamed reply is built to make the
// router's reply capture expensive: just over a megabyte of tool-call
// arguments in 20-byte deltas, and 100,000 distinct tool-call indexes. The client must
// get every byte, the request must end 200, and the router must neither
// learn the over-cap reply nor hold on to memory for it.

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
)

// hostileSent is what the fake replica wrote for one response: its length
// and SHA-256.
type hostileSent struct {
	n   int64
	sum [32]byte
}

// hostileReplica serves /v1/chat/completions as an event stream whose shape
// the request's X-Test-Reply header picks:
//
//	args     one tool call, 1,100,000 bytes of arguments in 20-byte deltas
//	         (past the router's default 1 MiB reply cap)
//	indexes  100,000 tool calls, index 0, 1, 2, …, each a name and "{}"
//	small    one tool call of 2,000 bytes of arguments (a reply to learn)
//	cut      small, without the closing [DONE] (a reply not to learn)
func hostileReplica(t *testing.T, sent chan<- hostileSent) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions" {
			http.NotFound(w, r)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		h := sha256.New()
		cw := &countWriter{w: io.MultiWriter(w, h)}
		bw := bufio.NewWriterSize(cw, 16<<10)
		chunk := func(toolCall string) {
			fmt.Fprintf(bw, `data: {"id":"chatcmpl-h","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[{"index":0,"delta":{"tool_calls":[%s]},"finish_reason":null}]}`+"\n\n", toolCall)
		}
		args := func(total int) {
			chunk(`{"index":0,"id":"call_0","type":"function","function":{"name":"lookup","arguments":""}}`)
			piece := `{\"q\":\"` + strings.Repeat("z", 12) + `\"}` // 20 bytes once unescaped
			for i := 0; i*20 < total; i++ {
				chunk(`{"index":0,"function":{"arguments":"` + piece + `"}}`)
			}
		}
		mode := r.Header.Get("X-Test-Reply")
		switch mode {
		case "args":
			args(1_100_000)
		case "indexes":
			for i := 0; i < 100_000; i++ {
				chunk(`{"index":` + strconv.Itoa(i) + `,"id":"call_` + strconv.Itoa(i) + `","type":"function","function":{"name":"f","arguments":"{}"}}`)
			}
		case "small", "cut":
			args(2_000)
		default:
			t.Errorf("unknown reply shape %q", mode)
		}
		fmt.Fprint(bw, `data: {"id":"chatcmpl-h","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[],"usage":{"prompt_tokens":600,"completion_tokens":50000}}`+"\n\n")
		if mode != "cut" {
			fmt.Fprint(bw, "data: [DONE]\n\n")
		}
		_ = bw.Flush()
		var s hostileSent
		s.n = cw.n
		copy(s.sum[:], h.Sum(nil))
		sent <- s
	}))
	t.Cleanup(srv.Close)
	return srv
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// heapObjects samples the bytes of live and not yet swept heap objects.
func heapObjects() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// requestsFinished is how many routed requests the router has finished
// with status code, from its metrics.
func requestsFinished(t *testing.T, base, code string) int {
	t.Helper()
	n := 0
	for _, l := range strings.Split(scrapeURL(t, base), "\n") {
		if !strings.HasPrefix(l, "semroute_requests_total{") || !strings.Contains(l, `code="`+code+`"`) {
			continue
		}
		v, err := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
		if err != nil {
			t.Fatalf("metric line %q: %v", l, err)
		}
		n += int(v)
	}
	return n
}

func TestHostileReplicaToolCallRepliesBounded(t *testing.T) {
	sent := make(chan hostileSent, 1)
	rep := hostileReplica(t, sent)
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	writeConfig(t, cfg, fmt.Sprintf("health: {check_interval: 1h}\nreplicas:\n  - {name: hostile, url: %q}\n", rep.URL))
	r := serveConfig(t, cfg)
	base := r.http.URL()
	replica, _ := r.app.pool.Get("hostile")
	blocks := func() int64 {
		st, _ := r.app.pic.Stats(replica.ID)
		return st.Blocks
	}
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)

	// Every request has the same prompt, so its blocks are in the picture
	// after the first, and any later growth is a learned reply.
	body := chat([2]string{"system", text("hostile", 600)}, [2]string{"user", "call the tool"})
	body["stream"] = true
	// The fake replica always ends with a usage chunk: ask for it, so that the
	// client gets every byte the replica sent (the router strips a usage chunk
	// only when it asked for one the client did not).
	body["stream_options"] = map[string]any{"include_usage": true}
	payload, _ := json.Marshal(body)
	finished := 0
	// send streams one response through the router and checks that the
	// client got it whole and that the router finished it with 200. It
	// returns the peak of the process's heap objects while it ran.
	send := func(mode string) uint64 {
		t.Helper()
		var peak atomic.Uint64
		stop := make(chan struct{})
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(2 * time.Millisecond)
			defer tick.Stop()
			for {
				if h := heapObjects(); h > peak.Load() {
					peak.Store(h)
				}
				select {
				case <-stop:
					return
				case <-tick.C:
				}
			}
		}()
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(payload))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Test-Reply", mode)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", mode, err)
		}
		h := sha256.New()
		tail := &tailWriter{}
		n, err := io.Copy(io.MultiWriter(h, tail), resp.Body)
		resp.Body.Close()
		close(stop)
		wg.Wait()
		s := <-sent
		if err != nil || resp.StatusCode != http.StatusOK || n != s.n || !bytes.Equal(h.Sum(nil), s.sum[:]) {
			t.Fatalf("%s: status %d, got %d bytes (err %v), the replica sent %d; same bytes: %v",
				mode, resp.StatusCode, n, err, s.n, bytes.Equal(h.Sum(nil), s.sum[:]))
		}
		if done := bytes.HasSuffix(tail.b, []byte("data: [DONE]\n\n")); done != (mode != "cut") {
			t.Fatalf("%s: stream ends %q", mode, tail.b)
		}
		// The router counts a request once it has finished with it, after
		// learning (or not) its reply.
		finished++
		testwait.Until(t, mode+": the router to finish the request with 200", func() bool { return requestsFinished(t, base, "200") >= finished })
		t.Logf("%s: %d bytes streamed whole; peak heap objects %.1f MB", mode, n, float64(peak.Load())/1e6)
		return peak.Load()
	}

	// A reply not learned (no [DONE]) puts only the prompt in the picture.
	send("cut")
	prompt := blocks()
	if prompt == 0 {
		t.Fatal("nothing tracked after a request")
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	before := ms.HeapInuse

	const peakBound = 256 << 20
	for _, mode := range []string{"args", "indexes"} {
		var a0, a1 runtime.MemStats
		runtime.ReadMemStats(&a0)
		peak := send(mode)
		runtime.ReadMemStats(&a1)
		// Everything in this process (replica, router, client) allocates
		// tens of MB for the ~12-25 MB stream; keeping tool calls as
		// growing strings allocated about 25 GB for the arguments alone.
		if alloc := a1.TotalAlloc - a0.TotalAlloc; alloc > 1<<30 {
			t.Errorf("%s: %d MB allocated for one stream: collecting the reply is not linear", mode, alloc>>20)
		}
		if got := blocks(); got != prompt {
			t.Fatalf("%s: the picture went from %d to %d blocks: the over-cap reply was learned", mode, prompt, got)
		}
		if peak > peakBound {
			t.Errorf("%s: heap objects peaked at %d MB while streaming", mode, peak>>20)
		}
		runtime.GC()
		runtime.ReadMemStats(&ms)
		t.Logf("%s: heap in use after GC %.1f MB (%.1f MB before)", mode, float64(ms.HeapInuse)/1e6, float64(before)/1e6)
		if ms.HeapInuse > before+64<<20 {
			t.Errorf("%s: heap in use %d MB after the request and a GC, %d MB before", mode, ms.HeapInuse>>20, before>>20)
		}
	}

	// A reply within the cap is still learned: the picture grows.
	send("small")
	if got := blocks(); got <= prompt {
		t.Fatalf("a 2 KB tool call reply was not learned: %d blocks, %d for the prompt", got, prompt)
	}
}

// tailWriter keeps the last 64 bytes written to it.
type tailWriter struct{ b []byte }

func (w *tailWriter) Write(p []byte) (int, error) {
	w.b = append(w.b, p...)
	if len(w.b) > 64 {
		w.b = append(w.b[:0], w.b[len(w.b)-64:]...)
	}
	return len(p), nil
}
