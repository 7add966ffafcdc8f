package simreplica

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"

	"github.com/semroute/semroute/blockhash"
)

// Tokenizer names, for Options.Tokenizer.
const (
	// TokenizerBytes is the old estimate: the prompt rendered with short
	// role markers ("<|u|>text") and cut every BytesPerToken bytes, one
	// token per piece. Its units agree with a router that estimates
	// BytesPerToken bytes per token, so it cannot show a unit mismatch.
	TokenizerBytes = "bytes"
	// TokenizerWords is a deterministic word-level tokenizer with a
	// Llama-3-style chat template: see Tokenizer. On English prose it
	// makes about 5.5-6 bytes per token, so a router that assumes 4 is
	// visibly wrong against it, as it would be against a real engine.
	TokenizerWords = "words"
)

// The words tokenizer's vocabulary.
const (
	// WordVocabSize is the number of token ids of the words tokenizer:
	// ids are in [1, WordVocabSize).
	WordVocabSize = 50000
	// WordMaxPiece is the most bytes one word token holds: a longer word
	// is cut into pieces of WordMaxPiece bytes.
	WordMaxPiece = 12
	// firstPieceID is the first id a piece of text can hash to; the ones
	// below are special tokens (or reserved).
	firstPieceID = 8
	// bytesVocabSize bounds the bytes tokenizer's ids: chunks hash into
	// [firstPieceID, bytesVocabSize), wide enough that distinct chunks
	// practically never share an id.
	bytesVocabSize = 1<<31 - 1
)

// Special tokens of the words tokenizer, named as in Llama 3. Their text in
// a prompt (as a chat template renders it, or typed by a client, as a
// Hugging Face tokenizer also reads it) is the one token.
const (
	TokenBOS         int32 = 1 // <|begin_of_text|>
	TokenEOS         int32 = 2 // <|end_of_text|>
	TokenStartHeader int32 = 3 // <|start_header_id|>
	TokenEndHeader   int32 = 4 // <|end_header_id|>
	TokenEOT         int32 = 5 // <|eot_id|>
)

var specialText = [...]string{
	TokenBOS:         "<|begin_of_text|>",
	TokenEOS:         "<|end_of_text|>",
	TokenStartHeader: "<|start_header_id|>",
	TokenEndHeader:   "<|end_header_id|>",
	TokenEOT:         "<|eot_id|>",
}

// Tokenizer is the simulated model's tokenizer and chat template: what the
// engine counts, caches and reports in usage, as opposed to the router's
// estimate. It is deterministic (the same text always gives the same ids,
// in every process) and safe for concurrent use.
//
// The words tokenizer pre-tokenizes as GPT-style tokenizers do and then
// gives each piece one id:
//
//   - A special token's text ("<|eot_id|>") is that special token.
//   - A single space before a word or a punctuation mark belongs to it
//     (" hello"); other whitespace (newlines, runs of spaces, tabs) is a
//     token of its own, the run's last space left to the word after it.
//   - A word is a run of letters, digits, '_' and non-ASCII bytes, with
//     connectors inside it ("don't", "doc-0", "3.14", "e.g"), and the
//     closing punctuation right after it (".", ",", ")", "\"", ...):
//     " document." is one token.
//   - Any other mark is a token, a run of the same mark ("----") one
//     token.
//   - A piece of more than WordMaxPiece bytes is cut every WordMaxPiece
//     bytes.
//
// A piece's id is firstPieceID + xxhash64(piece) mod (WordVocabSize -
// firstPieceID): never 0, never a special token, and two pieces may share
// an id as a real vocabulary's rare words share sub-word pieces. Decode
// reverses what this Tokenizer has encoded (for an id pieces share, the
// last one seen).
//
// The bytes tokenizer cuts the text every BytesPerToken bytes, each chunk
// mixing to an id in [8, 2³¹-1) (see chunkID); it cannot decode.
type Tokenizer struct {
	name          string
	bytesPerToken int
	// pieces[id] is the last piece of text encoded to id (words only).
	pieces []atomic.Pointer[string]
}

// NewTokenizer returns the named tokenizer (TokenizerWords or
// TokenizerBytes, "" meaning TokenizerBytes); bytesPerToken is the bytes
// tokenizer's chunk size (≤ 0: 4).
func NewTokenizer(name string, bytesPerToken int) (*Tokenizer, error) {
	if bytesPerToken <= 0 {
		bytesPerToken = 4
	}
	switch name {
	case "", TokenizerBytes:
		return &Tokenizer{name: TokenizerBytes, bytesPerToken: bytesPerToken}, nil
	case TokenizerWords:
		return &Tokenizer{name: TokenizerWords, pieces: make([]atomic.Pointer[string], WordVocabSize)}, nil
	}
	return nil, fmt.Errorf("simreplica: unknown tokenizer %q (want %q or %q)", name, TokenizerWords, TokenizerBytes)
}

// Name returns the tokenizer's name.
func (t *Tokenizer) Name() string { return t.name }

// VocabSize returns one more than the largest id the tokenizer makes.
func (t *Tokenizer) VocabSize() int {
	if t.name == TokenizerWords {
		return WordVocabSize
	}
	return bytesVocabSize
}

// Encode appends the ids of text to dst and returns the extended slice.
// addSpecial puts the BOS token first, as a Hugging Face tokenizer's
// add_special_tokens does (the words tokenizer only; the bytes tokenizer
// has no special tokens).
func (t *Tokenizer) Encode(dst []int32, text []byte, addSpecial bool) []int32 {
	t.each(text, addSpecial, func(id int32, _ []byte) { dst = append(dst, id) })
	return dst
}

// EncodePieces is Encode that also returns each token's text.
func (t *Tokenizer) EncodePieces(text []byte, addSpecial bool) ([]int32, []string) {
	var ids []int32
	var strs []string
	t.each(text, addSpecial, func(id int32, p []byte) {
		ids = append(ids, id)
		strs = append(strs, string(p))
	})
	return ids, strs
}

// Decode returns the text of ids (special tokens included, as vLLM's
// /detokenize gives them). An id the tokenizer has not yet made from text
// decodes as "<unk_ID>". It fails for an id outside the vocabulary, and
// for the bytes tokenizer, which keeps no pieces.
func (t *Tokenizer) Decode(ids []int32) (string, error) {
	if t.name != TokenizerWords {
		return "", fmt.Errorf("the %q tokenizer cannot detokenize", t.name)
	}
	var sb strings.Builder
	for _, id := range ids {
		switch {
		case id <= 0 || int(id) >= len(t.pieces):
			return "", fmt.Errorf("token id %d is out of vocabulary", id)
		case int(id) < len(specialText) && specialText[id] != "":
			sb.WriteString(specialText[id])
		case id < firstPieceID:
			fmt.Fprintf(&sb, "<unk_%d>", id)
		default:
			if p := t.pieces[id].Load(); p != nil {
				sb.WriteString(*p)
			} else {
				fmt.Fprintf(&sb, "<unk_%d>", id)
			}
		}
	}
	return sb.String(), nil
}

// each calls f with every token of text: its id and its text.
func (t *Tokenizer) each(text []byte, addSpecial bool, f func(int32, []byte)) {
	if t.name != TokenizerWords {
		for off := 0; off < len(text); off += t.bytesPerToken {
			c := text[off:min(off+t.bytesPerToken, len(text))]
			f(chunkID(c), c)
		}
		return
	}
	if addSpecial {
		f(TokenBOS, []byte(specialText[TokenBOS]))
	}
	for i := 0; i < len(text); {
		if id, n := special(text[i:]); n > 0 {
			f(id, text[i:i+n])
			i += n
			continue
		}
		j := pieceEnd(text, i)
		t.eachPiece(text[i:j], f)
		i = j
	}
}

// eachPiece calls f with the tokens of one pre-tokenized piece of text: p
// cut every WordMaxPiece bytes, each cut's id learnt for Decode.
func (t *Tokenizer) eachPiece(p []byte, f func(int32, []byte)) {
	for len(p) > 0 {
		n := min(len(p), WordMaxPiece)
		id := pieceID(p[:n], WordVocabSize)
		t.learn(id, p[:n])
		f(id, p[:n])
		p = p[n:]
	}
}

// pieceEnd returns the end of the words tokenizer's piece that starts at
// text[i], which is not a special token: a run of whitespace, or a word or
// a mark with the lone space before it (see Tokenizer).
func pieceEnd(text []byte, i int) int {
	if text[i] == ' ' && i+1 < len(text) && !isSpace(text[i+1]) && !startsSpecial(text[i+1:]) {
		i++ // a lone space before a word or a mark is part of it
	} else if isSpace(text[i]) {
		return spaceEnd(text, i)
	}
	if isWord(text[i]) {
		return wordEnd(text, i+1)
	}
	return markEnd(text, i)
}

// spaceEnd returns the end of the run of whitespace at text[i], less its
// last space when a word or a mark follows: that space goes with it.
func spaceEnd(text []byte, i int) int {
	j := i + 1
	for j < len(text) && isSpace(text[j]) {
		j++
	}
	if j < len(text) && j-1 > i && text[j-1] == ' ' && !startsSpecial(text[j:]) {
		j--
	}
	return j
}

// wordEnd returns the end of the word whose first letter is before
// text[j]: its letters and the connectors between them, then the closing
// punctuation after it.
func wordEnd(text []byte, j int) int {
word:
	for j < len(text) {
		switch {
		case isWord(text[j]):
			j++
		case isConnector(text[j]) && j+1 < len(text) && isWord(text[j+1]):
			j += 2
		default:
			break word
		}
	}
	for j < len(text) && isCloser(text[j]) {
		j++
	}
	return j
}

// markEnd returns the end of the run of the mark at text[i], stopping
// before a special token.
func markEnd(text []byte, i int) int {
	c, j := text[i], i+1
	for j < len(text) && text[j] == c && !startsSpecial(text[j:]) {
		j++
	}
	return j
}

// learn remembers p as the text of id, for Decode. In the usual case (the
// id already holds p) it neither locks nor allocates.
func (t *Tokenizer) learn(id int32, p []byte) {
	slot := &t.pieces[id]
	if old := slot.Load(); old != nil && *old == string(p) {
		return
	}
	s := string(p)
	slot.Store(&s)
}

// pieceID hashes a piece of text to an id in [firstPieceID, vocab).
func pieceID(p []byte, vocab int) int32 {
	return int32(firstPieceID + xxhash.Sum64(p)%uint64(vocab-firstPieceID))
}

func startsSpecial(b []byte) bool { _, n := special(b); return n > 0 }

// chunkID is the bytes tokenizer's id of a chunk: a chunk of up to 8
// bytes (the usual case) is mixed as one integer (splitmix64's finalizer),
// which is several times cheaper than hashing it, a longer one hashed.
func chunkID(c []byte) int32 {
	if len(c) > 8 {
		return pieceID(c, bytesVocabSize)
	}
	var x uint64
	if len(c) == 4 {
		x = uint64(binary.LittleEndian.Uint32(c))
	} else {
		for _, b := range c {
			x = x<<8 | uint64(b)
		}
	}
	z := x + uint64(len(c))*0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	z ^= z >> 31
	// z's high 32 bits scaled into the range: a multiply, not a division.
	return int32(firstPieceID + (z>>32)*(bytesVocabSize-firstPieceID)>>32)
}

// special returns the special token b starts with and its length, or 0, 0.
func special(b []byte) (int32, int) {
	if len(b) < 2 || b[0] != '<' || b[1] != '|' {
		return 0, 0
	}
	for id, s := range specialText {
		if s != "" && bytes.HasPrefix(b, []byte(s)) {
			return int32(id), len(s)
		}
	}
	return 0, 0
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\v' || c == '\f'
}

func isWord(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c >= 0x80
}

// isConnector: marks that join two words into one ("don't", "doc-0", "3.14").
func isConnector(c byte) bool { return c == '\'' || c == '-' || c == '.' }

// isCloser: marks that stay with the word before them ("end.", "(a),").
func isCloser(c byte) bool {
	switch c {
	case '.', ',', ';', ':', '!', '?', ')', ']', '}', '"', '\'':
		return true
	}
	return false
}

// chatOptions are a chat request's template switches, read from its body
// as vLLM reads them.
type chatOptions struct {
	addGenerationPrompt  bool // default true
	continueFinalMessage bool
	addSpecialTokens     bool // default false for chat, true for completions
}

// roleName is the name the chat template writes for a part's role.
func roleName(role byte) string {
	switch role {
	case blockhash.RoleSystem:
		return "system"
	case blockhash.RoleUser:
		return "user"
	case blockhash.RoleAssistant:
		return "assistant"
	case blockhash.RoleTool:
		return "tool"
	case blockhash.RoleTools:
		return "system"
	}
	return "user"
}

// RenderChat appends to dst the prompt text the chat template renders for
// parts (as blockhash.ParseChat orders them: tool schemas, then the
// messages). The words tokenizer's template is Llama 3's:
//
//	<|begin_of_text|>
//	<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>   (each message)
//	<|start_header_id|>assistant<|end_header_id|>\n\n                (add_generation_prompt)
//
// with the tool schemas, if any, as a first system message "Available
// tools: JSON"; continue_final_message leaves the last message open (no
// <|eot_id|>, no generation prompt). The bytes tokenizer's template is the
// old one, each part behind a short marker ("<|u|>text"), whatever the
// switches.
func (t *Tokenizer) RenderChat(dst []byte, parts []blockhash.Part, addGenerationPrompt, continueFinalMessage bool) []byte {
	if t.name != TokenizerWords {
		return renderMarkers(dst, parts)
	}
	n := len(specialText[TokenBOS]) + 64
	for _, p := range parts {
		n += len(p.Text) + len(p.Segs) + 64
	}
	dst = slices.Grow(dst[:0], n)
	dst = append(dst, specialText[TokenBOS]...)
	for i, p := range parts {
		dst = append(dst, specialText[TokenStartHeader]...)
		dst = append(dst, roleName(p.Role)...)
		dst = append(dst, specialText[TokenEndHeader]...)
		dst = append(dst, "\n\n"...)
		if p.Role == blockhash.RoleTools {
			dst = append(dst, "Available tools: "...)
		}
		// A message's text content parts are joined with newlines, as
		// vLLM joins them before the template sees the message.
		from := 0
		for _, at := range p.Segs {
			if a := min(max(int(at), from), len(p.Text)); a > from {
				dst = append(dst, p.Text[from:a]...)
				dst = append(dst, '\n')
				from = a
			}
		}
		dst = append(dst, p.Text[from:]...)
		if continueFinalMessage && i == len(parts)-1 {
			return dst
		}
		dst = append(dst, specialText[TokenEOT]...)
	}
	if addGenerationPrompt {
		dst = append(dst, specialText[TokenStartHeader]...)
		dst = append(dst, "assistant"...)
		dst = append(dst, specialText[TokenEndHeader]...)
		dst = append(dst, "\n\n"...)
	}
	return dst
}

// renderMarkers appends to out[:0] each part behind a short role marker:
// the bytes tokenizer's rendering of any request.
func renderMarkers(out []byte, parts []blockhash.Part) []byte {
	n := 0
	for _, p := range parts {
		n += len(p.Text) + 5
	}
	out = out[:0]
	if cap(out) < n {
		out = make([]byte, 0, n)
	}
	for _, p := range parts {
		out = append(out, "<|"...)
		out = append(out, p.Role)
		out = append(out, "|>"...)
		out = append(out, p.Text...)
	}
	return out
}

// promptIDs appends to ids[:0] the token ids the engine computes for req,
// using buf (returned, grown) for the rendered text: see prompt.
func (t *Tokenizer) promptIDs(ids []int32, buf []byte, req *blockhash.Request, ep blockhash.Endpoint, co chatOptions) ([]int32, []byte) {
	ids = ids[:0]
	if t.name != TokenizerWords { // the hot path of instant replicas: no callback
		buf = renderMarkers(buf, req.Parts)
		for off := 0; off < len(buf); off += t.bytesPerToken {
			ids = append(ids, chunkID(buf[off:min(off+t.bytesPerToken, len(buf))]))
		}
		return ids, buf
	}
	buf = t.prompt(buf, req, ep, co, func(id int32, _ []byte) { ids = append(ids, id) })
	return ids, buf
}

// prompt calls f with each token the engine computes for req, its id and
// its text (nil for a token given as an id), using buf (returned, grown)
// for the rendered text.
//
// Words: a chat request is rendered by the chat template and tokenized
// (BOS added again only if add_special_tokens); a completions request's
// string prompts are tokenized with BOS (unless add_special_tokens is
// false) and its token-id prompts taken as they are, as vLLM takes them.
// Several prompts are one sequence here (vLLM would run one sequence
// each). Bytes: the marker rendering of the whole request, cut every
// BytesPerToken bytes, as before.
func (t *Tokenizer) prompt(buf []byte, req *blockhash.Request, ep blockhash.Endpoint, co chatOptions, f func(int32, []byte)) []byte {
	if t.name != TokenizerWords {
		buf = renderMarkers(buf, req.Parts)
		t.each(buf, false, f)
		return buf
	}
	if ep == blockhash.Chat {
		buf = t.RenderChat(buf, req.Parts, co.addGenerationPrompt, co.continueFinalMessage)
		t.each(buf, co.addSpecialTokens, f)
		return buf
	}
	for _, p := range req.Parts {
		if p.Role == blockhash.RoleTokens {
			for i := 0; i+4 <= len(p.Text); i += 4 {
				f(int32(binary.LittleEndian.Uint32(p.Text[i:])), nil)
			}
			continue
		}
		t.each(p.Text, co.addSpecialTokens, f)
	}
	return buf
}
