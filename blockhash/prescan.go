package blockhash

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"unicode/utf8"

	"github.com/valyala/fastjson"
)

// DefaultMaxDepth is the nesting depth a request body may reach when
// Limits.MaxDepth is zero. Depth counts arrays and objects together: the
// body object is depth 1, and an OpenAI chat body needs 5 (body, messages,
// a message, its content parts, an image part's image_url); tool schemas
// nest a few levels more.
const DefaultMaxDepth = 64

// maxDepthCeiling is the deepest limit honoured. fastjson refuses values
// nested deeper than fastjson.MaxDepth, counting the scalar innermost as a
// level of its own; a larger Limits.MaxDepth is taken as this one.
const maxDepthCeiling = fastjson.MaxDepth - 1

// maxDepth is the nesting limit that l sets: Limits.MaxDepth, or
// DefaultMaxDepth when that is zero or negative, at most maxDepthCeiling.
func (l Limits) maxDepth() int {
	switch d := l.MaxDepth; {
	case d <= 0:
		return DefaultMaxDepth
	case d > maxDepthCeiling:
		return maxDepthCeiling
	default:
		return d
	}
}

// prescan is one linear, allocation-free pass over a body, in place of
// fastjson's validator. It checks the lexical JSON (every byte outside
// strings, string escapes and control characters, numbers, the literals)
// and the nesting of arrays and objects (counted together) against
// maxDepth, and leaves the structure (brackets matched, commas and colons
// in place) to fastjson's parser, which checks it as it builds the values.
// fastjson's validator cost more than linear time and memory on two
// inputs, which prescan refuses before fastjson sees them:
//
//   - Deep nesting. fastjson recurses once per level and wraps the inner
//     error once or twice per level, so the error for n unclosed brackets
//     costs O(n²) time and bytes (20,000 "[" took 13 s and made a 920 KB
//     message). prescan answers at the first level past the limit, having
//     read no further than that opening bracket.
//   - A value starting with t, f or n that is not true, false or null.
//     fastjson's error quotes the whole rest of the body, and every level
//     around it copies that again: at depth 64, a 16 MiB body would make
//     more than a hundred copies of a string up to four times its size.
//
// It accepts exactly the lexically valid JSON (RFC 8259) nested at most
// maxDepth deep; with fastjson's parser after it, exactly what
// encoding/json's json.Valid accepts (FuzzNestingLimit holds it to that),
// which is what Python's json.loads accepts but for NaN and Infinity
// (refused, as fastjson's validator refused them). It is stricter than
// fastjson's validator about raw control characters in strings, which
// that let through before an escape. Its reading of string boundaries (a
// quote ends a string unless escaped) agrees with fastjson's parser wherever
// the body is valid up to that point, so the parser never recurses deeper
// than maxDepth+1.
//
// Strings are read 8 bytes at a time, to the next quote, backslash or
// control character.
func prescan(data []byte, maxDepth int) error {
	_, err := scan(data, maxDepth, math.MaxInt)
	return err
}

// scan is prescan that also counts the body's values (strings, keys
// included, numbers, literals, arrays and objects) and refuses the body at
// the first value past maxValues. It returns the count.
func scan(data []byte, maxDepth, maxValues int) (int, error) {
	depth, values := 0, 0
	for i := 0; i < len(data); {
		c := byteClass[data[i]]
		if c > classSpace && c != classClose {
			if values++; values > maxValues {
				return values, inputErr("", "JSON has more values than the limit of %d (at byte %d)", maxValues, i)
			}
		}
		switch c {
		case classSpace:
			i++
		case classQuote:
			j, err := skipString(data, i)
			if err != nil {
				return values, err
			}
			i = j
		case classOpen:
			depth++
			if depth > maxDepth {
				return values, inputErr("", "JSON nesting is deeper than the limit of %d (at byte %d)", maxDepth, i)
			}
			i++
		case classClose:
			depth--
			i++
		case classNumber:
			j := skipNumber(data, i)
			if j < 0 {
				return values, inputErr("", "invalid JSON: malformed number at byte %d", i)
			}
			i = j
		case classTrue, classFalse, classNull:
			lit := literals[c]
			if !literalAt(data, i, lit) {
				return values, badLiteral(i)
			}
			i += len(lit)
		default:
			return values, inputErr("", "invalid JSON: unexpected %s at byte %d", byteName(data[i]), i)
		}
	}
	return values, nil
}

// literals are the literal each literal class starts.
var literals = [...]string{classTrue: "true", classFalse: "false", classNull: "null"}

// The classes of bytes outside strings; any other byte is invalid there.
const (
	classBad    = iota
	classSpace  // whitespace, comma, colon: nothing to check
	classQuote  // a string starts
	classOpen   // [ or {
	classClose  // ] or }
	classNumber // - or a digit
	classTrue   // t
	classFalse  // f
	classNull   // n
)

var byteClass = [256]uint8{
	' ': classSpace, '\t': classSpace, '\n': classSpace, '\r': classSpace, ',': classSpace, ':': classSpace,
	'"': classQuote, '[': classOpen, '{': classOpen, ']': classClose, '}': classClose,
	'-': classNumber, '0': classNumber, '1': classNumber, '2': classNumber, '3': classNumber, '4': classNumber,
	'5': classNumber, '6': classNumber, '7': classNumber, '8': classNumber, '9': classNumber,
	't': classTrue, 'f': classFalse, 'n': classNull,
}

const ones, highs = 0x0101010101010101, 0x8080808080808080

// skipString checks the string whose opening quote is data[i] and returns
// the index after its closing quote.
func skipString(data []byte, i int) (int, error) {
	j := i + 1
	for {
		j = stringStop(data, j)
		if j >= len(data) {
			return 0, inputErr("", "invalid JSON: unterminated string at byte %d", i)
		}
		switch c := data[j]; {
		case c == '"':
			return j + 1, nil
		case c == '\\':
			if j+1 >= len(data) {
				return 0, inputErr("", "invalid JSON: unterminated string at byte %d", i)
			}
			switch data[j+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				j += 2
			case 'u':
				if len(data)-j < 6 || !isHex(data[j+2]) || !isHex(data[j+3]) || !isHex(data[j+4]) || !isHex(data[j+5]) {
					return 0, inputErr("", "invalid JSON: invalid escape at byte %d", j)
				}
				j += 6
			default:
				return 0, inputErr("", "invalid JSON: invalid escape at byte %d", j)
			}
		default:
			return 0, inputErr("", "invalid JSON: control character %s in a string at byte %d", byteName(c), j)
		}
	}
}

// stringStop is the index of the first quote, backslash or byte below 0x20
// in data from j on, or len(data). Eight bytes at a time: in each of the
// three masks, the lowest set bit is exact (a borrow can only set bits
// above it), so the lowest of their union is the first such byte.
func stringStop(data []byte, j int) int {
	for ; j+8 <= len(data); j += 8 {
		x := binary.LittleEndian.Uint64(data[j:])
		q, b := x^('"'*ones), x^('\\'*ones)
		m := (q-ones)&^q | (b-ones)&^b | (x-0x20*ones)&^x
		if m &= highs; m != 0 {
			return j + bits.TrailingZeros64(m)/8
		}
	}
	for ; j < len(data); j++ {
		if c := data[j]; c == '"' || c == '\\' || c < 0x20 {
			return j
		}
	}
	return j
}

// skipNumber checks the number starting at data[i] against JSON's grammar,
// -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, and returns the index
// after it, or -1. The number must not run on into a byte fastjson's parser
// would read as more of it (a digit, ., e, E, + or -): fastjson takes all
// of those as one number, and in valid JSON a number is followed by none.
func skipNumber(data []byte, i int) int {
	if i = skipInt(data, i); i < 0 {
		return -1
	}
	n := len(data)
	if i < n && data[i] == '.' {
		if i = skipSomeDigits(data, i+1); i < 0 {
			return -1
		}
	}
	if i < n && (data[i] == 'e' || data[i] == 'E') {
		if i = skipExponent(data, i+1); i < 0 {
			return -1
		}
	}
	if i < n && numberByte(data[i]) {
		return -1 // a number runs on where JSON's grammar ends it
	}
	return i
}

// skipInt skips a number's sign and integer part at data[i:] (a zero, or
// digits not starting with one): −1 if there is none.
func skipInt(data []byte, i int) int {
	if data[i] == '-' {
		i++
	}
	switch {
	case i >= len(data):
		return -1
	case data[i] == '0':
		return i + 1
	case '1' <= data[i] && data[i] <= '9':
		return skipDigits(data, i+1)
	}
	return -1
}

// skipExponent skips an exponent's sign and digits after its e.
func skipExponent(data []byte, i int) int {
	if i < len(data) && (data[i] == '+' || data[i] == '-') {
		i++
	}
	return skipSomeDigits(data, i)
}

// numberByte reports whether c may appear in a JSON number.
func numberByte(c byte) bool {
	return '0' <= c && c <= '9' || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-'
}

// skipSomeDigits is skipDigits for at least one digit: −1 when there is
// none at i.
func skipSomeDigits(data []byte, i int) int {
	if j := skipDigits(data, i); j > i {
		return j
	}
	return -1
}

func skipDigits(data []byte, i int) int {
	for i < len(data) && '0' <= data[i] && data[i] <= '9' {
		i++
	}
	return i
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

func literalAt(data []byte, i int, lit string) bool {
	return len(data)-i >= len(lit) && string(data[i:i+len(lit)]) == lit
}

// byteName is c quoted as a character if ASCII, else in hex.
func byteName(c byte) string {
	if c < utf8.RuneSelf {
		return strconv.QuoteRune(rune(c))
	}
	return fmt.Sprintf("byte 0x%02X", c)
}

func badLiteral(i int) error {
	return inputErr("", "invalid JSON: unexpected value at byte %d (not true, false or null)", i)
}

// maxErrMsg bounds an InputError's Msg in bytes, and maxErrQuote the part
// of it that quotes the input (fastjson's error text, an unknown role).
const (
	maxErrMsg   = 256
	maxErrQuote = 200
)

// clip cuts s to at most n bytes, on a UTF-8 boundary, marking a cut
// with "…" (counted in the n bytes).
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := cutAt(s, n-len("…"))
	return s[:i] + "…"
}

// clipMiddle cuts s to at most n bytes by dropping a middle part, on UTF-8
// boundaries, marking the cut with "…": for fastjson's errors, which wrap
// the innermost error in one prefix a level and end with the place.
func clipMiddle(s string, n int) string {
	if len(s) <= n {
		return s
	}
	keep := n - len("…")
	head := cutAt(s, keep/3)
	tail := len(s) - (keep - head)
	for tail < len(s) && !utf8.RuneStart(s[tail]) {
		tail++
	}
	return s[:head] + "…" + s[tail:]
}

// cutAt is the largest i <= n (and <= len(s)) that does not split a UTF-8
// sequence of s.
func cutAt[S ~string | ~[]byte](s S, n int) int {
	if n >= len(s) {
		return len(s)
	}
	if n < 0 {
		return 0
	}
	i := n
	for i > 0 && i > n-utf8.UTFMax && !utf8.RuneStart(s[i]) {
		i--
	}
	if !utf8.RuneStart(s[i]) {
		return n // not UTF-8 here anyway: cut anywhere
	}
	return i
}

// quoted is b in Go quotes, cut after about n bytes and then marked "…".
func quoted(b []byte, n int) string {
	if len(b) <= n {
		return strconv.Quote(string(b))
	}
	return strconv.Quote(string(b[:cutAt(b, n)])) + "…"
}
