package tokenizer

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
)

// maxAnswerDepth bounds the nesting of the values a /tokenize answer may
// carry beside its tokens (vLLM's token_strs is depth 2).
const maxAnswerDepth = 64

// errAnswer is an answer that is not a TokenizeResponse's JSON.
var errAnswer = errors.New("tokenizer: /tokenize answer is not a JSON object of tokens")

// readAnswer reads a /tokenize answer, vLLM's TokenizeResponse
// ({"count": n, "max_model_len": m, "tokens": [ids…], "token_strs": …}),
// from r in one pass through a small buffer: the ids go straight into the
// int32s returned (each id's 32-bit pattern: ids are unsigned, vLLM's
// below 2^31, but llm-d's simulator (FNV-32a of each word) and other
// engines use all 32 bits, and the pattern keys a block exactly as the
// same id does in a KV event, blockhash.TokenBlockHash), with no decoded copy of the answer and no tree
// of it, and at most limit of them (an answer with more is refused as soon
// as it has, unread further). count is the answer's count, -1 if absent.
// Other members are skipped, to a nesting of maxAnswerDepth. A member
// given twice is refused, as the router's parsers refuse one.
func readAnswer(r io.Reader, limit int) (ids []int32, count int, err error) {
	br := answerBufs.Get().(*bufio.Reader)
	br.Reset(r)
	a := answerReader{r: br}
	ids, count, err = a.read(limit)
	br.Reset(nil) // holds no reader of the call's
	answerBufs.Put(br)
	return ids, count, err
}

// answerBufs are readAnswer's read buffers, one a call in flight.
var answerBufs = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 16<<10) }}

type answerReader struct{ r *bufio.Reader }

func (a *answerReader) read(limit int) (ids []int32, count int, err error) {
	count = -1
	if c, err := a.next(); err != nil || c != '{' {
		return nil, 0, errAnswer
	}
	var seen seenKeys
	for first := true; ; first = false {
		c, err := a.next()
		if err != nil {
			return nil, 0, errAnswer
		}
		if c == '}' && first {
			break
		}
		if err := a.member(c, &seen, limit, &ids, &count); err != nil {
			return nil, 0, err
		}
		if c, err = a.next(); err != nil || (c != ',' && c != '}') {
			return nil, 0, errAnswer
		}
		if c == '}' {
			break
		}
	}
	if !seen.has("tokens") {
		return nil, 0, errAnswer
	}
	return ids, count, nil
}

// seenKeys are the keys of an answer's members read so far: a few.
type seenKeys struct {
	keys []string
	fix  [8]string
}

func (s *seenKeys) has(k string) bool {
	for _, x := range s.keys {
		if x == k {
			return true
		}
	}
	return false
}

func (s *seenKeys) add(k string) {
	if s.keys == nil {
		s.keys = s.fix[:0]
	}
	s.keys = append(s.keys, k)
}

// member reads one member of the answer, whose key's opening quote c was
// read: tokens into ids, count into count, any other skipped.
func (a *answerReader) member(c byte, seen *seenKeys, limit int, ids *[]int32, count *int) error {
	key, err := a.key(c)
	if err != nil {
		return err
	}
	if seen.has(key) {
		return fmt.Errorf("tokenizer: /tokenize answer gives %s more than once", key)
	}
	seen.add(key)
	switch key {
	case "tokens":
		*ids, err = a.tokens(limit, *count)
		return err
	case "count":
		if *count, err = a.count(); err != nil {
			return err
		}
		if *count > limit {
			return fmt.Errorf("tokenizer: /tokenize answered %d tokens, over the limit of %d", *count, limit)
		}
		return nil
	}
	return a.skip(0)
}

// next returns the next byte that is not JSON white space.
func (a *answerReader) next() (byte, error) {
	for {
		c, err := a.r.ReadByte()
		if err != nil {
			return 0, err
		}
		if c != ' ' && c != '\t' && c != '\n' && c != '\r' {
			return c, nil
		}
	}
}

// key reads a member's key, whose opening quote c was read, and its colon.
func (a *answerReader) key(c byte) (string, error) {
	if c != '"' {
		return "", errAnswer
	}
	var buf [258]byte
	raw := append(buf[:0], '"')
	escaped, plain := false, true
	for {
		b, err := a.r.ReadByte()
		if err != nil || len(raw) > 256 {
			return "", errAnswer
		}
		raw = append(raw, b)
		if escaped {
			escaped = false
			continue
		}
		if b == '\\' {
			escaped, plain = true, false
		} else if b == '"' {
			break
		} else if b < 0x20 || b >= 0x80 {
			plain = false
		}
	}
	var k string
	if plain { // printable ASCII, no escape: the key is its bytes
		k = knownKey(raw[1 : len(raw)-1])
	} else if err := json.Unmarshal(bytes.Clone(raw), &k); err != nil { // escapes, as the engine's JSON reader takes them
		return "", errAnswer
	}
	if c, err := a.next(); err != nil || c != ':' {
		return "", errAnswer
	}
	return k, nil
}

// knownKey is b as a string, without a copy for the keys of vLLM's
// TokenizeResponse.
func knownKey(b []byte) string {
	switch string(b) {
	case "tokens":
		return "tokens"
	case "count":
		return "count"
	case "max_model_len":
		return "max_model_len"
	case "token_strs":
		return "token_strs"
	}
	return string(b)
}

// count reads a non-negative integer.
func (a *answerReader) count() (int, error) {
	c, err := a.next()
	if err != nil || c < '0' || c > '9' {
		return 0, errAnswer
	}
	n := int(c - '0')
	for {
		c, err := a.r.ReadByte()
		if err != nil {
			return 0, errAnswer
		}
		if c < '0' || c > '9' {
			_ = a.r.UnreadByte()
			return n, nil
		}
		if n = n*10 + int(c-'0'); n > 1<<40 {
			return 0, errAnswer
		}
	}
}

// tokens reads an array of token ids, unsigned integers below 2^32, at
// most limit of them; count, if not -1, sizes the result.
func (a *answerReader) tokens(limit, count int) ([]int32, error) {
	if c, err := a.next(); err != nil || c != '[' {
		return nil, errAnswer
	}
	ids := make([]int32, 0, max(0, min(count, limit)))
	c, err := a.next()
	if err != nil {
		return nil, errAnswer
	}
	if c == ']' {
		return ids, nil
	}
	_ = a.r.UnreadByte()
	for {
		// The ids whole in the buffer, at once; then one byte by byte
		// (across the buffer's end, or with spaces about it).
		var end bool
		if ids, end, err = a.buffered(ids, limit); err != nil || end {
			return ids, err
		}
		if c, err = a.next(); err != nil {
			return nil, errAnswer
		}
		id, delim, err := a.id(c)
		if err != nil {
			return nil, err
		}
		if len(ids) == limit {
			return nil, errOverLimit(limit)
		}
		ids = append(ids, int32(id))
		if delim == ']' {
			return ids, nil
		}
		if c, err = a.next(); err != nil { // past the comma
			return nil, errAnswer
		}
		_ = a.r.UnreadByte()
	}
}

func errOverLimit(limit int) error {
	return fmt.Errorf("tokenizer: /tokenize answered more than the limit of %d tokens", limit)
}

// buffered appends to ids the ids that the reader's buffer holds whole,
// from its start, each its digits and a comma or the array's closing
// bracket (end, then), as id reads them; it leaves the rest, a byte that
// is neither, or an id that may go on past the buffer, to id.
func (a *answerReader) buffered(ids []int32, limit int) (_ []int32, end bool, err error) {
	buf, _ := a.r.Peek(a.r.Buffered())
	i := 0
	defer func() { _, _ = a.r.Discard(i) }()
	for {
		j, n := i, uint64(0)
		for ; j < len(buf) && buf[j] >= '0' && buf[j] <= '9'; j++ {
			if n = n*10 + uint64(buf[j]-'0'); n > 1<<32-1 {
				return nil, false, errIDOver
			}
		}
		if j == i || j == len(buf) || buf[j] != ',' && buf[j] != ']' {
			return ids, false, nil
		}
		if len(ids) == limit {
			return nil, false, errOverLimit(limit)
		}
		ids = append(ids, int32(uint32(n)))
		i = j + 1
		if buf[j] == ']' {
			return ids, true, nil
		}
	}
}

var errIDOver = errors.New("tokenizer: /tokenize answered an id over 2^32")

// id reads a token id whose first byte c was read, and the delimiter
// after it (a comma, or the array's end), past any space.
func (a *answerReader) id(c byte) (id uint32, end byte, err error) {
	if c < '0' || c > '9' {
		return 0, 0, errAnswer
	}
	n := uint64(c - '0')
	for {
		if c, err = a.r.ReadByte(); err != nil {
			return 0, 0, errAnswer
		}
		if c < '0' || c > '9' {
			break
		}
		if n = n*10 + uint64(c-'0'); n > 1<<32-1 {
			return 0, 0, errIDOver
		}
	}
	if c == ' ' || c == '\t' || c == '\n' || c == '\r' {
		if c, err = a.next(); err != nil {
			return 0, 0, errAnswer
		}
	}
	if c != ',' && c != ']' {
		return 0, 0, errAnswer
	}
	return uint32(n), c, nil
}

// skip reads past one JSON value at nesting depth: strings with their
// escapes, arrays and objects to their end, and anything else (numbers,
// literals) to the next delimiter; it checks the nesting, not the syntax
// of numbers and literals, which the router does not read.
func (a *answerReader) skip(depth int) error {
	c, err := a.next()
	if err != nil {
		return errAnswer
	}
	switch c {
	case '"':
		return a.skipString()
	case '[', '{':
		return a.skipContainer(c, depth)
	}
	for {
		c, err := a.r.ReadByte()
		if err != nil {
			return errAnswer
		}
		switch c {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return a.r.UnreadByte()
		case '"', '[', '{', ':':
			return errAnswer
		}
	}
}

func (a *answerReader) skipString() error {
	for escaped := false; ; {
		c, err := a.r.ReadByte()
		if err != nil {
			return errAnswer
		}
		switch {
		case escaped:
			escaped = false
		case c == '\\':
			escaped = true
		case c == '"':
			return nil
		}
	}
}

// skipContainer skips an array or object whose opening byte open was read.
func (a *answerReader) skipContainer(open byte, depth int) error {
	if depth+1 > maxAnswerDepth {
		return fmt.Errorf("tokenizer: /tokenize answer nested deeper than %d", maxAnswerDepth)
	}
	closing := byte(']')
	if open == '{' {
		closing = '}'
	}
	for first := true; ; first = false {
		c, err := a.next()
		if err != nil {
			return errAnswer
		}
		if c == closing && first {
			return nil
		}
		_ = a.r.UnreadByte()
		if open == '{' {
			if err := a.skipKey(); err != nil {
				return err
			}
		}
		if err := a.skip(depth + 1); err != nil {
			return err
		}
		if c, err = a.next(); err != nil {
			return errAnswer
		}
		if c == closing {
			return nil
		}
		if c != ',' {
			return errAnswer
		}
	}
}

// skipKey reads past an object member's key and its colon.
func (a *answerReader) skipKey() error {
	if c, _ := a.next(); c != '"' || a.skipString() != nil {
		return errAnswer
	}
	if c, err := a.next(); err != nil || c != ':' {
		return errAnswer
	}
	return nil
}
