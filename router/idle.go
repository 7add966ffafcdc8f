package router

import (
	"io"
	"time"
)

// idleBody passes a response body through and calls onIdle when a Read
// waits longer than d for the replica. The timer runs only while a Read is
// in progress: a client slow to take the bytes does not count as silence.
type idleBody struct {
	rc io.ReadCloser
	d  time.Duration
	t  *time.Timer
}

// newIdleBody returns rc cut off by onIdle after d of silence.
func newIdleBody(rc io.ReadCloser, d time.Duration, onIdle func()) *idleBody {
	b := &idleBody{rc: rc, d: d, t: time.AfterFunc(time.Hour, onIdle)}
	b.t.Stop()
	return b
}

func (b *idleBody) Read(p []byte) (int, error) {
	b.t.Reset(b.d)
	n, err := b.rc.Read(p)
	b.t.Stop()
	return n, err
}

// Close stops the timer and closes the body.
func (b *idleBody) Close() error {
	b.t.Stop()
	return b.rc.Close()
}
