package tokenizer

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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
	a := answerReader{r: bufio.NewReaderSize(r, 16<<10)}
	return a.read(limit)
}

type answerReader struct{ r *bufio.Reader }

func (a *answerReader) read(limit int) (ids []int32, count int, err error) {
	count = -1
	if c, err := a.next(); err != nil || c != '{' {
		return nil, 0, errAnswer
	}
	seen := map[string]bool{}
	for first := true; ; first = false {
		c, err := a.next()
		if err != nil {
			return nil, 0, errAnswer
		}
		if c == '}' && first {
			break
		}
		if err := a.member(c, seen, limit, &ids, &count); err != nil {
			return nil, 0, err
		}
		if c, err = a.next(); err != nil || (c != ',' && c != '}') {
			return nil, 0, errAnswer
		}
		if c == '}' {
			break
		}
	}
	if !seen["tokens"] {
		return nil, 0, errAnswer
	}
	return ids, count, nil
}

// member reads one member of the answer, whose key's opening quote c was
// read: tokens into ids, count into count, any other skipped.
func (a *answerReader) member(c byte, seen map[string]bool, limit int, ids *[]int32, count *int) error {
	key, err := a.key(c)
	if err != nil {
		return err
	}
	if seen[key] {
		return fmt.Errorf("tokenizer: /tokenize answer gives %s more than once", key)
	}
	seen[key] = true
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
	raw := []byte{'"'}
	escaped := false
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
			escaped = true
		} else if b == '"' {
			break
		}
	}
	var k string
	if err := json.Unmarshal(raw, &k); err != nil { // escapes, as the engine's JSON reader takes them
		return "", errAnswer
	}
	if c, err := a.next(); err != nil || c != ':' {
		return "", errAnswer
	}
	return k, nil
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
	for {
		id, end, err := a.id(c)
		if err != nil {
			return nil, err
		}
		if len(ids) == limit {
			return nil, fmt.Errorf("tokenizer: /tokenize answered more than the limit of %d tokens", limit)
		}
		ids = append(ids, int32(id))
		if end == ']' {
			return ids, nil
		}
		if c, err = a.next(); err != nil { // past the comma
			return nil, errAnswer
		}
	}
}

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
			return 0, 0, fmt.Errorf("tokenizer: /tokenize answered an id over 2^32")
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
