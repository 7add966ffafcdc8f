package router

import (
	"bytes"
	"io"
	"slices"

	"github.com/valyala/fastjson"

	"github.com/semroute/semroute/blockhash"
)

// includeUsage is what withIncludeUsage adds to a streamed request's body.
const includeUsage = `"stream_options":{"include_usage":true}`

// withIncludeUsage returns a copy of a JSON object body that asks the
// replica to end its stream with a usage chunk: the router reads the
// engine's prompt and cached tokens from it. The body must not have a
// stream_options key already (the client's choice is left alone).
func withIncludeUsage(b []byte) *body {
	i := bytes.IndexByte(b, '{') // the parser accepted an object: the first byte that is not space
	rest := bytes.TrimLeft(b[i+1:], " \t\r\n")
	n := len(b) + len(includeUsage) + 1
	out := newBody(n)
	w := append(out.b[:0], b[:i+1]...)
	w = append(w, includeUsage...)
	if len(rest) > 0 && rest[0] != '}' {
		w = append(w, ',')
	}
	w = append(w, b[i+1:]...)
	out.b = w
	return out
}

// maxHeldEvent bounds the bytes usageStripper holds while it waits for the
// end of an event; past it, it passes that event through as it comes (no
// usage chunk is that large) and looks at the events after it again.
const maxHeldEvent = 64 << 10

// usageStripper passes an event stream through but for its usage chunk
// (choices empty, usage set), which the replica sent because the router
// asked for it and the client did not: the client sees the stream it would
// have seen. It hands events on whole, as the replica flushed them.
type usageStripper struct {
	rc  io.ReadCloser
	in  []byte // bytes read and not yet handed on: the current event
	out []byte // whole events ready to hand on
	// passing: the current event grew past maxHeldEvent and is passed
	// through up to its end; in keeps only its last bytes, where the end
	// may straddle the next read.
	passing bool
	// scanned is how much of in was searched for an event's end already.
	scanned int
	err     error // the upstream's error, returned once out is drained
	p       fastjson.Parser
	lim     blockhash.Limits // bounds each event parsed (blockhash.Admit)
}

func newUsageStripper(rc io.ReadCloser, lim blockhash.Limits) *usageStripper {
	return &usageStripper{rc: rc, lim: lim}
}

// stripRead is the room a read from the replica is given: events are
// small, and the slices the stripper reads into grow as it needs.
const stripRead = 4 << 10

// readInto reads from the replica into the spare room of *dst, growing it
// first when it has little.
func (s *usageStripper) readInto(dst *[]byte) error {
	b := *dst
	if cap(b)-len(b) < stripRead/2 {
		b = slices.Grow(b, stripRead)
	}
	n, err := s.rc.Read(b[len(b):cap(b)])
	*dst = b[:len(b)+n]
	return err
}

func (s *usageStripper) Read(p []byte) (int, error) {
	for len(s.out) == 0 {
		if s.err != nil {
			if len(s.in) > 0 { // a last event without its blank line
				if !s.passing && s.usageChunk(s.in) {
					s.in = nil
					continue
				}
				s.out, s.in = s.in, nil
				break
			}
			return 0, s.err
		}
		s.err = s.readInto(&s.in)
		s.split()
	}
	n := copy(p, s.out)
	s.out = s.out[n:]
	if len(s.out) == 0 {
		s.out = nil
	}
	return n, nil
}

// push is Read for a front end handed the stream in chunks (ext_proc):
// it takes the next bytes, eof saying the stream ended with them, and
// returns what the client gets of what was pushed so far (whole events
// only, but at the end).
func (s *usageStripper) push(p []byte, eof bool) []byte {
	s.in = append(s.in, p...)
	s.split()
	if eof && len(s.in) > 0 {
		if !s.usageChunk(s.in) {
			s.out = append(s.out, s.in...)
		}
		s.in = nil
	}
	out := s.out
	s.out = nil
	return out
}

// split moves every whole event of s.in to s.out, dropping a usage chunk.
// It scans each byte once: s.scanned is where the last look stopped.
func (s *usageStripper) split() {
	for {
		end := eventEnd(s.in, s.scanned)
		if end < 0 {
			if s.passing || len(s.in) > maxHeldEvent {
				s.passing = true
				keep := min(len(s.in), 3)
				s.out = append(s.out, s.in[:len(s.in)-keep]...)
				s.in = append(s.in[:0], s.in[len(s.in)-keep:]...)
			}
			s.scanned = max(len(s.in)-3, 0) // a blank line may straddle the next read
			return
		}
		if ev := s.in[:end]; s.passing || !s.usageChunk(ev) {
			s.out = append(s.out, ev...)
		}
		s.passing = false
		s.in, s.scanned = s.in[end:], 0
	}
}

// eventEnd returns the index just after the first blank line in b at or
// after from (an event's end: "\n\n", "\r\r", "\r\n\r\n", or a mix, as
// the event-stream format allows), or -1.
func eventEnd(b []byte, from int) int {
	for i := from; i < len(b); {
		j := bytes.IndexAny(b[i:], "\r\n")
		if j < 0 {
			return -1
		}
		i += j
		// One line ending at i; a second right after it ends the event.
		next := i + 1
		if b[i] == '\r' && next < len(b) && b[next] == '\n' {
			next++
		}
		if next >= len(b) {
			return -1
		}
		if b[next] == '\n' {
			return next + 1
		}
		if b[next] == '\r' {
			if next+1 < len(b) && b[next+1] == '\n' {
				return next + 2
			}
			if next+1 >= len(b) {
				return -1 // "\r\r" or the start of "\r\n": wait for one more byte
			}
			return next + 1
		}
		i = next
	}
	return -1
}

// usageChunk reports whether ev is a data event whose JSON has no choices
// and a usage object.
func (s *usageStripper) usageChunk(ev []byte) bool {
	if !bytes.Contains(ev, []byte(`"usage"`)) {
		return false
	}
	data, ok := bytes.CutPrefix(bytes.TrimSpace(ev), []byte("data:"))
	if !ok {
		return false
	}
	data = bytes.TrimSpace(data)
	release, err := blockhash.Admit(data, s.lim)
	defer release()
	if err != nil {
		return false
	}
	v, err := s.p.ParseBytes(data)
	if err != nil {
		return false
	}
	ch := v.Get("choices")
	u := v.Get("usage")
	return ch != nil && ch.Type() == fastjson.TypeArray && len(ch.GetArray()) == 0 && u != nil && u.Type() == fastjson.TypeObject
}

// Close closes the upstream body.
func (s *usageStripper) Close() error { return s.rc.Close() }
