package router

import (
	"io"
	"time"
)

// idleBody passes a response body through and calls onIdle when a Read
// waits longer than d for the replica. The timer runs only while a Read is
// in progress: a client slow to take the bytes does not count as silence.
type idleBody struct {
	rc   io.ReadCloser
	d    time.Duration
	wait time.Duration // the next Read's limit: first's until bytes come, then d
	t    *time.Timer
}

// newIdleBody returns rc cut off by onIdle after d of silence, or, until
// its first bytes, after the longer of d and first.
func newIdleBody(rc io.ReadCloser, d, first time.Duration, onIdle func()) *idleBody {
	b := &idleBody{rc: rc, d: d, wait: max(d, first), t: time.AfterFunc(time.Hour, onIdle)}
	b.t.Stop()
	return b
}

func (b *idleBody) Read(p []byte) (int, error) {
	b.t.Reset(b.wait)
	n, err := b.rc.Read(p)
	b.t.Stop()
	if n > 0 {
		b.wait = b.d
	}
	return n, err
}

// Close stops the timer and closes the body.
func (b *idleBody) Close() error {
	b.t.Stop()
	return b.rc.Close()
}
