// Package numbered makes the chat request bodies of the router's CPU
// benchmarks (benchproxy, router's BenchmarkPreciseCPU): copies of one
// body, each numbered at the start of its prompt, so that every prompt is
// new to a cache, as the router meets them in the worst case (nothing
// cached, every prompt tokenized, every block recorded).
package numbered

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync/atomic"
)

// Digits is the width of the number at the start of each body's prompt;
// numbers past 10^Digits wrap.
const Digits = 12

// Bodies hands out copies of one chat body, each numbered. The zero value
// is not usable: make one with New.
//
// Safe for concurrent use.
type Bodies struct {
	tmpl []byte
	at   int // the offset of the number
	n    atomic.Uint64
}

// New returns the bodies of a chat request for model "sim-model" of at
// most size bytes (about size: the prompt is cut to fit), streamed or not,
// asking for 8 tokens, whose one user message is the number and lorem
// ipsum.
func New(size int, stream bool) *Bodies {
	pad := strings.Repeat("lorem ipsum dolor sit amet ", size/27+1)
	for {
		b, _ := json.Marshal(map[string]any{"model": "sim-model", "stream": stream, "max_tokens": 8,
			"messages": []map[string]string{{"role": "user", "content": strings.Repeat("0", Digits) + " " + pad}}})
		if len(b) <= size {
			return &Bodies{tmpl: b, at: bytes.Index(b, []byte(`"content":"`)) + len(`"content":"`)}
		}
		pad = pad[:len(pad)-(len(b)-size)]
	}
}

// Len returns the size of each body in bytes.
func (g *Bodies) Len() int { return len(g.tmpl) }

// Next returns a new copy, numbered one past the last one handed out
// (the first is 1).
func (g *Bodies) Next() []byte {
	b := bytes.Clone(g.tmpl)
	v := g.n.Add(1)
	for i := g.at + Digits - 1; i >= g.at; i-- {
		b[i] = byte('0' + v%10)
		v /= 10
	}
	return b
}
