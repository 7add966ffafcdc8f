// Package testlog is a log destination for tests whose loggers are
// written from other goroutines.
package testlog

import (
	"bytes"
	"sync"
)

// Buffer keeps what is written to it. Safe for concurrent use; the zero
// value is empty and ready.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write implements io.Writer.
func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
