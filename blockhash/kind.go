package blockhash

import (
	"bytes"
	"fmt"
)

// Kind is the semantic type of a block. It weights matched tokens when the
// router scores replicas and lets eviction policies value blocks; it is never
// part of a block's hash.
type Kind uint8

// The kinds. KindOther is the zero value.
const (
	KindOther            Kind = iota // anything not classified below, e.g. a completions prompt
	KindSystem                       // system or developer message
	KindTools                        // top-level tool (function) schemas
	KindRetrievedContext             // a long document pasted into a user turn (RAG context)
	KindCode                         // a block that is mostly source code
	KindToolOutput                   // a tool (or function) result message
	KindAssistantHistory             // an earlier assistant reply, including its tool calls
	KindUserHistory                  // an earlier user turn
	KindUserQuery                    // the last user turn: the new question
	NumKinds                         // the number of kinds; not a kind
)

var kindNames = [NumKinds]string{
	KindOther:            "other",
	KindSystem:           "system",
	KindTools:            "tools",
	KindRetrievedContext: "retrieved_context",
	KindCode:             "code",
	KindToolOutput:       "tool_output",
	KindAssistantHistory: "assistant_history",
	KindUserHistory:      "user_history",
	KindUserQuery:        "user_query",
}

// String returns the kind's configuration name, e.g. "retrieved_context".
func (k Kind) String() string {
	if k < NumKinds {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// ParseKind returns the kind whose String is name.
func ParseKind(name string) (Kind, error) {
	for k, n := range kindNames {
		if n == name {
			return Kind(k), nil
		}
	}
	return 0, fmt.Errorf("unknown block kind %q", name)
}

// Heuristics, applied per block (see classify):
//
//   - A block of a system/developer message is KindSystem; of the tool schemas
//     KindTools; of a tool message KindToolOutput; of an assistant message
//     KindAssistantHistory. These follow from the role alone.
//   - In a user message or a completions prompt, a block that looks like code is
//     KindCode: it is inside a ``` fence, or at least 1 in 12 of its bytes is one
//     of {};=<>()[] and it has at least three line breaks.
//   - In a user message that is long (at least longDocTokens estimated tokens) or
//     that carries a document marker (<document, <context, "Context:",
//     "Document:", "[doc", "Source:"), every block but the last is
//     KindRetrievedContext: the pasted document comes first and the question last.
//     Each content part of a message is judged apart (Part.Segs), and one of
//     at least a block followed by another part is a document whole.
//   - Otherwise a block of the last user message is KindUserQuery, of an earlier
//     user message KindUserHistory, and of a completions prompt KindOther.
const longDocTokens = 512

var docMarkers = [][]byte{
	[]byte("<document"), []byte("<context"), []byte("Context:"),
	[]byte("Document:"), []byte("[doc"), []byte("Source:"),
}

func looksLikeDocument(text []byte, estTokens int) bool {
	if estTokens >= longDocTokens {
		return true
	}
	for _, m := range docMarkers {
		if bytes.Contains(text, m) {
			return true
		}
	}
	return false
}

// looksLikeCode reports whether a block is mostly code. inFence says whether a
// ``` fence opened earlier in the same part is still open at the block's start.
func looksLikeCode(b []byte, inFence bool) bool {
	return inFence || bytes.Contains(b, fence) || symbolDense(b)
}

// symbolDense reports the second test of looksLikeCode: at least three line
// breaks, and at least 1 in 12 bytes one of {};=<>()[].
func symbolDense(b []byte) bool {
	if bytes.Count(b, newline) < 3 {
		return false
	}
	// Four counters, so that the loop is not one chain of dependent adds.
	var s0, s1, s2, s3 int
	i := 0
	for ; i+4 <= len(b); i += 4 {
		s0 += int(codeSymbol[b[i]])
		s1 += int(codeSymbol[b[i+1]])
		s2 += int(codeSymbol[b[i+2]])
		s3 += int(codeSymbol[b[i+3]])
	}
	for ; i < len(b); i++ {
		s0 += int(codeSymbol[b[i]])
	}
	return (s0+s1+s2+s3)*12 >= len(b)
}

// codeSymbol is 1 for the bytes that mark code: {};=<>()[]
var codeSymbol = func() (t [256]uint8) {
	for _, c := range []byte("{};=<>()[]") {
		t[c] = 1
	}
	return t
}()

var newline = []byte{'\n'}

var fence = []byte("```")
