package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
)

func TestSIGTERMFinishesStreamsAndRefusesNewConnections(t *testing.T) {
	cmd := exec.Command(os.Args[0], "demo", "--listen", "127.0.0.1:0", "--sim-inter-token", "40ms")
	cmd.Env = append(os.Environ(), "SEMROUTE_TEST_MAIN=1")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	addr := ""
	sc := bufio.NewScanner(stdout)
	re := regexp.MustCompile(`at http://(127\.0\.0\.1:\d+)`)
	for sc.Scan() {
		if m := re.FindStringSubmatch(sc.Text()); m != nil {
			addr = m[1]
			break
		}
	}
	go func() {
		for sc.Scan() {
		}
	}()
	if addr == "" {
		t.Fatalf("the demo printed no address; stderr:\n%s", stderr.String())
	}
	// Five streams of 40 tokens (about 1.6 s each), all under way.
	const streams = 5
	var wg sync.WaitGroup
	results := make(chan string, streams)
	started := make(chan struct{}, streams)
	for i := 0; i < streams; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b, _ := json.Marshal(map[string]any{"model": "sim-model", "stream": true, "max_tokens": 40,
				"messages": []map[string]string{{"role": "user", "content": "long answer please"}}})
			resp, err := http.Post("http://"+addr+"/v1/chat/completions", "application/json", bytes.NewReader(b))
			if err != nil {
				results <- "request: " + err.Error()
				started <- struct{}{}
				return
			}
			defer resp.Body.Close()
			rd := bufio.NewScanner(resp.Body)
			chunks, first := 0, true
			for rd.Scan() {
				line := rd.Text()
				if strings.HasPrefix(line, "data: {") {
					chunks++
					if first {
						started <- struct{}{}
						first = false
					}
				}
				if line == "data: [DONE]" {
					if chunks == 40 {
						results <- "ok"
					} else {
						results <- "short"
					}
					return
				}
			}
			results <- "cut"
		}()
	}
	for i := 0; i < streams; i++ {
		<-started
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// New connections are refused soon after.
	testwait.Until(t, "new connections refused after SIGTERM", func() bool {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			var op *net.OpError
			if !errors.As(err, &op) {
				t.Fatalf("dial: %v", err)
			}
			return true
		}
		c.Close()
		return false
	})
	wg.Wait()
	close(results)
	for r := range results {
		if r != "ok" {
			t.Fatalf("a stream in flight at SIGTERM ended %q", r)
		}
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the process did not exit after its streams finished")
	}
}
