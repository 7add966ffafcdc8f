package tokenizer

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http/httputil"
)

// head is what a call reads of an answer's headers: its status, how its
// body ends, and whether its connection ends with it.
type head struct {
	status  int
	length  int64 // Content-Length; -1 when the body is chunked or ends with the connection
	chunked bool
	close   bool // the connection ends after this answer
}

var errHead = errors.New("tokenizer: /tokenize answer's status line or headers malformed")

// readHead reads an answer's status line and headers, past interim
// answers (1xx but 101), reading what net/http reads for the same
// purposes: the status; the body's end by Transfer-Encoding: chunked
// (which overrides a Content-Length), else Content-Length (given twice,
// the same), else the connection's end; and the connection's keeping
// (Connection: close, or HTTP/1.0 without keep-alive, ends it). Other
// headers are skipped unread: net/http's ReadResponse made a map of them
// all, a third of a call's own CPU but for its system calls.
func readHead(br *bufio.Reader) (head, error) {
	for {
		h, keepAlive := head{length: -1}, false
		line, err := readLine(br)
		if err != nil {
			return h, err
		}
		// HTTP/1.x SSS[ reason]
		if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[7] != '0' && line[7] != '1' ||
			line[8] != ' ' || len(line) > 12 && line[12] != ' ' {
			return h, errHead
		}
		for _, c := range line[9:12] {
			if c < '0' || c > '9' {
				return h, errHead
			}
			h.status = h.status*10 + int(c-'0')
		}
		http10 := line[7] == '0'
		for {
			line, err := readLine(br)
			if err != nil {
				return h, err
			}
			if len(line) == 0 {
				break
			}
			i := bytes.IndexByte(line, ':')
			if i <= 0 || !token(line[:i]) { // no name, a folded line, or a name net/http refuses
				return h, errHead
			}
			name, value := line[:i], bytes.Trim(line[i+1:], " \t")
			for _, c := range value {
				if c < ' ' && c != '\t' || c == 0x7f { // as net/http refuses
					return h, errHead
				}
			}
			switch {
			case bytes.EqualFold(name, []byte("Content-Length")):
				n, ok := parseLength(value)
				if !ok || h.length >= 0 && h.length != n {
					return h, errHead
				}
				h.length = n
			case bytes.EqualFold(name, []byte("Transfer-Encoding")) && !http10: // as net/http, which reads it from HTTP/1.1 on
				if !bytes.EqualFold(value, []byte("chunked")) || h.chunked {
					return h, fmt.Errorf("tokenizer: /tokenize answer's Transfer-Encoding %q not read", value)
				}
				h.chunked = true
			case bytes.EqualFold(name, []byte("Connection")):
				for tok := range bytes.SplitSeq(value, []byte(",")) {
					tok = bytes.Trim(tok, " \t")
					h.close = h.close || bytes.EqualFold(tok, []byte("close"))
					keepAlive = keepAlive || bytes.EqualFold(tok, []byte("keep-alive"))
				}
			}
		}
		switch {
		case h.status == 101:
			return h, errors.New("tokenizer: /tokenize switched protocols unasked")
		case h.status >= 100 && h.status < 200:
			continue
		}
		if h.chunked {
			h.length = -1
		}
		h.close = h.close || http10 && !keepAlive || !h.chunked && h.length < 0
		return h, nil
	}
}

// token reports whether name is an HTTP token, as a header's name must be.
func token(name []byte) bool {
	for _, c := range name {
		if c <= ' ' || c >= 0x7f || bytes.IndexByte([]byte(`"(),/:;<=>?@[\]{}`), c) >= 0 {
			return false
		}
	}
	return true
}

// readLine reads one line of headers, without its end (CRLF, or LF as
// net/http takes it). A line longer than br's buffer is refused: no
// header a call reads is that long, and a replica's /tokenize sends no
// other.
func readLine(br *bufio.Reader) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	switch {
	case err == bufio.ErrBufferFull:
		return nil, errHead
	case err == io.EOF && len(line) > 0:
		return nil, io.ErrUnexpectedEOF
	case err != nil:
		return nil, err
	}
	line = line[:len(line)-1]
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	return line, nil
}

// parseLength reads a Content-Length: decimal digits, below 2^62.
func parseLength(v []byte) (int64, bool) {
	if len(v) == 0 || len(v) > 18 {
		return 0, false
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

// body returns the reader of the answer's body, whose head h was read
// from pc, and done, which reads what is left of it, a few KiB at most
// (a new line after the object; a chunked answer's last chunk and
// trailers) and reports whether the body was read to its end, so that
// the connection can serve the next call.
func (pc *conn) body(h head) (r io.Reader, done func() bool) {
	switch {
	case h.chunked:
		cr := httputil.NewChunkedReader(pc.br)
		return cr, func() bool { return drain(cr) && trailers(pc.br) }
	case h.length >= 0:
		pc.lr = io.LimitedReader{R: pc.br, N: h.length}
		return &pc.lr, func() bool { return pc.lr.N == 0 || drain(&pc.lr) }
	}
	return pc.br, func() bool { return false }
}

// drain reads r to its end, if it comes within maxAnswerTail bytes.
func drain(r io.Reader) bool {
	var buf [512]byte
	for n := 0; n <= maxAnswerTail; {
		k, err := r.Read(buf[:])
		n += k
		if err == io.EOF {
			return n <= maxAnswerTail
		}
		if err != nil {
			return false
		}
	}
	return false
}

// trailers reads a chunked body's trailer fields and its final line.
func trailers(br *bufio.Reader) bool {
	for range 64 {
		line, err := readLine(br)
		if err != nil {
			return false
		}
		if len(line) == 0 {
			return true
		}
	}
	return false
}
