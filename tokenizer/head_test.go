package tokenizer

import (
	"bufio"
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestReadHead: an answer's status, framing and keeping, as net/http
// reads them, and what it refuses.
func TestReadHead(t *testing.T) {
	for _, c := range []struct {
		in      string
		want    head
		bad     bool
		rest    string // what follows the head
		comment string
	}{
		{in: "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n", want: head{status: 200, length: 12}},
		{in: "HTTP/1.1 200 OK\nContent-Length: 3\n\nabc", want: head{status: 200, length: 3}, rest: "abc", comment: "bare LF"},
		{in: "HTTP/1.1 200\r\ncontent-length:  7 \r\n\r\n", want: head{status: 200, length: 7}},
		{in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n", want: head{status: 200, length: -1, chunked: true}},
		{in: "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: Keep-Alive, close\r\n\r\n", want: head{status: 200, length: 5, close: true}},
		{in: "HTTP/1.1 200 OK\r\n\r\n", want: head{status: 200, length: -1, close: true}, comment: "to the connection's end"},
		{in: "HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\n", want: head{status: 200, length: 5, close: true}},
		{in: "HTTP/1.0 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\n", want: head{status: 200, length: 5}},
		{in: "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n", want: head{status: 200, length: 1}},
		{in: "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\n\r\n", want: head{status: 503, length: 2}},
		{in: "HTTP/1.1 101 Switching Protocols\r\n\r\n", bad: true},
		{in: "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", bad: true},
		{in: "HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", bad: true},
		{in: "HTTP/1.1 200 OK\r\nContent-Length : 5\r\n\r\n", bad: true},
		{in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", bad: true},
		{in: "HTTP/1.1 200 OK\r\nX: a\r\n folded\r\n\r\n", bad: true},
		{in: "HTTP/1.1 20 OK\r\n\r\n", bad: true},
		{in: "HTTP/2 200 OK\r\n\r\n", bad: true},
		{in: "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n", bad: true, comment: "cut"},
		{in: "HTTP/1.1 200 OK\r\nX-Long: " + strings.Repeat("a", 5000) + "\r\nContent-Length: 1\r\n\r\n", bad: true, comment: "a line past the buffer"},
	} {
		br := bufio.NewReader(strings.NewReader(c.in))
		h, err := readHead(br)
		if c.bad {
			if err == nil {
				t.Errorf("%q: read as %+v", c.in, h)
			}
			continue
		}
		if err != nil || h != c.want {
			t.Errorf("%q (%s): %+v %v, want %+v", c.in, c.comment, h, err, c.want)
			continue
		}
		if rest, _ := io.ReadAll(br); string(rest) != c.rest {
			t.Errorf("%q: %q left, want %q", c.in, rest, c.rest)
		}
	}
}

// FuzzReadHead: a head readHead takes is one net/http takes, with the
// same status and, for a 200, the same framing and keeping.
func FuzzReadHead(f *testing.F) {
	f.Add("HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n")
	f.Add("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
	f.Add("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n")
	f.Add("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
	f.Fuzz(func(t *testing.T, in string) {
		h, err := readHead(bufio.NewReader(strings.NewReader(in)))
		if err != nil {
			return
		}
		br := bufio.NewReader(strings.NewReader(in))
		var resp *http.Response
		for {
			resp, err = http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("%q: read as %+v, net/http: %v", in, h, err)
			}
			if resp.StatusCode >= 200 || resp.StatusCode < 100 {
				break
			}
		}
		if resp.StatusCode != h.status {
			t.Fatalf("%q: status %d, net/http %d", in, h.status, resp.StatusCode)
		}
		if h.status != 200 {
			return // the call reads no other's body, nor keeps its connection
		}
		chunked := len(resp.TransferEncoding) == 1 && resp.TransferEncoding[0] == "chunked"
		if chunked != h.chunked || !chunked && resp.ContentLength != h.length || resp.Close != h.close {
			t.Fatalf("%q: %+v, net/http length %d, encoding %v, close %v", in, h, resp.ContentLength, resp.TransferEncoding, resp.Close)
		}
	})
}
