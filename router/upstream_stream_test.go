package router

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestUpstreamStreamFlushTrailers: a streamed answer (chunked SSE with a
// trailer, usage chunk stripped): each event reaches the client before the
// replica sends the next, the usage chunk is not seen, the trailer is.
func TestUpstreamStreamFlushTrailers(t *testing.T) {
	for _, which := range []string{"upstream", "http.Transport"} {
		t.Run(which, func(t *testing.T) {
			next := make(chan struct{})
			url := rawOne(t, func(c net.Conn, br *bufio.Reader, req *http.Request) {
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTrailer: X-End\r\nTransfer-Encoding: chunked\r\n\r\n")
				chunk := func(s string) { io.WriteString(c, strings.ToUpper(strconvHex(len(s)))+"\r\n"+s+"\r\n") }
				for i := range 3 {
					chunk("data: {\"choices\":[{\"delta\":{\"content\":\"" + string(rune('a'+i)) + "\"}}]}\n\n")
					select {
					case <-next:
					case <-time.After(2 * time.Second):
						return
					}
				}
				chunk("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\n")
				chunk("data: [DONE]\n\n")
				io.WriteString(c, "0\r\nX-End: yes\r\n\r\n")
			})
			o := ServerOptions{}
			if which == "http.Transport" {
				o.Transport = http.DefaultTransport.(*http.Transport).Clone()
			}
			ts, _ := serverFor(t, o, url)
			resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json",
				strings.NewReader(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}`))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			br := bufio.NewReader(resp.Body)
			for i := range 3 {
				line, err := br.ReadString('\n')
				if err != nil || !strings.Contains(line, string(rune('a'+i))) {
					t.Fatalf("event %d: %q %v", i, line, err)
				}
				br.ReadString('\n')
				next <- struct{}{}
			}
			rest, _ := io.ReadAll(br)
			if strings.Contains(string(rest), "usage") || !strings.Contains(string(rest), "[DONE]") {
				t.Errorf("rest %q", rest)
			}
			if resp.Trailer.Get("X-End") != "yes" {
				t.Errorf("trailer %v", resp.Trailer)
			}
		})
	}
}

func strconvHex(n int) string {
	const d = "0123456789abcdef"
	if n == 0 {
		return "0"
	}
	var b []byte
	for n > 0 {
		b = append([]byte{d[n%16]}, b...)
		n /= 16
	}
	return string(b)
}
