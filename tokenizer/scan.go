package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
)

// errNotJSONObject is a body that is not a JSON object, or not valid JSON
// as far as topLevel reads it.
var errNotJSONObject = errors.New("tokenizer: the request body is not a JSON object")

// dupError is a body that gives a field read for /tokenize more
// than once.
type dupError struct{ Field string }

func (e *dupError) Error() string {
	return "tokenizer: the request body gives " + e.Field + " more than once"
}

// topLevel sets raw[i] to the bytes of the value of the key names[i] in
// the JSON object data (nil when the object lacks it), in one linear pass
// that allocates nothing unless a key is escaped. Keys match exactly,
// case-sensitively, after unescaping, as Python's json.loads and the
// router's parser match them. A key of names given twice is a
// *dupError. Values are skipped, not decoded: data is expected to be
// valid JSON (the router has parsed it); topLevel checks only what it
// needs to find where each value ends, and never reads past data.
func topLevel(data []byte, names []string, raw [][]byte) error {
	clear(raw)
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' {
		return errNotJSONObject
	}
	if i = skipSpace(data, i+1); i < len(data) && data[i] == '}' {
		return nil
	}
	for {
		key, val, end, ok := member(data, i)
		if !ok {
			return errNotJSONObject
		}
		if k := keyIndex(key, names); k >= 0 {
			if raw[k] != nil {
				return &dupError{Field: names[k]}
			}
			raw[k] = val
		}
		if i = skipSpace(data, end); i >= len(data) {
			return errNotJSONObject
		}
		switch data[i] {
		case ',':
			i = skipSpace(data, i+1)
		case '}':
			return nil
		default:
			return errNotJSONObject
		}
	}
}

// member reads the object member at data[i:], `"key": value`: its quoted
// key, its value's bytes and where the value ends; ok is false where data
// is not such a member.
func member(data []byte, i int) (key, val []byte, end int, ok bool) {
	if i >= len(data) || data[i] != '"' {
		return nil, nil, 0, false
	}
	if end = stringEnd(data, i); end < 0 {
		return nil, nil, 0, false
	}
	key = data[i:end] // quoted
	if i = skipSpace(data, end); i >= len(data) || data[i] != ':' {
		return nil, nil, 0, false
	}
	i = skipSpace(data, i+1)
	if end = valueEnd(data, i); end < 0 {
		return nil, nil, 0, false
	}
	return key, data[i:end], end, true
}

// maxEscapedName bounds the length of a quoted key, escapes and all, that
// can unescape to one of the names read (at most 22 bytes, 6 for each
// byte escaped as \uXXXX).
const maxEscapedName = 2 + 6*24

// keyIndex returns the index in names of the quoted key q, or -1.
func keyIndex(q []byte, names []string) int {
	key := q[1 : len(q)-1]
	if bytes.IndexByte(key, '\\') >= 0 {
		if len(q) > maxEscapedName {
			return -1
		}
		var s string
		if json.Unmarshal(q, &s) != nil {
			return -1
		}
		key = []byte(s)
	}
	for i, n := range names {
		if string(key) == n {
			return i
		}
	}
	return -1
}

// skipSpace returns the index of the first byte at or after i that is not
// JSON white space.
func skipSpace(data []byte, i int) int {
	for i < len(data) {
		switch data[i] {
		case ' ', '\t', '\r', '\n':
			i++
		default:
			return i
		}
	}
	return i
}

// stringEnd returns the index just past the JSON string whose opening
// quote is at i, or -1 if it does not end. A quote ends the string unless
// an odd run of backslashes precedes it.
func stringEnd(data []byte, i int) int {
	for j := i + 1; j < len(data); {
		q := bytes.IndexByte(data[j:], '"')
		if q < 0 {
			return -1
		}
		q += j
		bs := 0
		for k := q - 1; k > i && data[k] == '\\'; k-- {
			bs++
		}
		if bs%2 == 0 {
			return q + 1
		}
		j = q + 1
	}
	return -1
}

// valueEnd returns the index just past the JSON value starting at i, or -1
// if it does not end within data.
func valueEnd(data []byte, i int) int {
	if i >= len(data) {
		return -1
	}
	switch data[i] {
	case '"':
		return stringEnd(data, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(data); j++ {
			switch data[j] {
			case '"':
				e := stringEnd(data, j)
				if e < 0 {
					return -1
				}
				j = e - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
		return -1
	case ',', '}', ']', ':':
		return -1
	}
	j := i // a number or a literal: up to the next delimiter
	for j < len(data) {
		switch data[j] {
		case ',', '}', ']', ' ', '\t', '\r', '\n':
			return j
		}
		j++
	}
	return j
}
