package router

import (
	"bytes"
	"errors"
	"io"
	"sync"
	"testing"
	"time"
)

// TestBodyReferences: the buffer is given back only when the handler and
// every reader are done with it, once, and a reader closed (by a transport
// or by the handler) reads nothing more.
func TestBodyReferences(t *testing.T) {
	b := newBody(5)
	copy(b.b, "hello")
	r1, r2 := b.reader(), b.reader()
	if got := b.refs.Load(); got != 3 {
		t.Fatalf("refs = %d, want 3 (handler and two readers)", got)
	}
	got, err := io.ReadAll(r1)
	if err != nil || string(got) != "hello" {
		t.Fatalf("read %q, %v", got, err)
	}
	var w bytes.Buffer
	if n, err := r2.WriteTo(&w); err != nil || n != 5 || w.String() != "hello" {
		t.Fatalf("WriteTo = %d, %v, %q", n, err, w.String())
	}
	b.release()
	r1.Close()
	r1.Close() // a second close (the transport's, then the handler's) drops nothing more
	if got := b.refs.Load(); got != 1 {
		t.Fatalf("refs = %d after the handler and one reader let go, want 1", got)
	}
	r2.Close()
	if got := b.refs.Load(); got != 0 {
		t.Fatalf("refs = %d after everyone let go, want 0", got)
	}
	if _, err := r1.Read(make([]byte, 1)); !errors.Is(err, errBodyClosed) {
		t.Fatalf("read after close: %v, want errBodyClosed", err)
	}
	if _, err := r2.WriteTo(io.Discard); !errors.Is(err, errBodyClosed) {
		t.Fatalf("WriteTo after close: %v, want errBodyClosed", err)
	}
}

// TestBodyReadRacingClose: reads racing a close either finish reading the
// real bytes or fail; run with -race, they never touch the buffer after
// it went back.
func TestBodyReadRacingClose(t *testing.T) {
	for range 200 {
		b := newBody(64 << 10)
		for i := range b.b {
			b.b[i] = 'x'
		}
		r := b.reader()
		b.release()
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := make([]byte, 4096)
			for {
				n, err := r.Read(p)
				if bytes.Count(p[:n], []byte("x")) != n {
					t.Error("read bytes that are not the body's")
					return
				}
				if err != nil {
					return
				}
			}
		}()
		r.Close()
		// Whoever takes the buffer next overwrites it.
		nb := newBody(64 << 10)
		for i := range nb.b {
			nb.b[i] = 'y'
		}
		wg.Wait()
		nb.release()
	}
}

// blockingWriter blocks each Write until release is closed.
type blockingWriter struct {
	started, release chan struct{}
	got              []byte
}

func (w *blockingWriter) Write(p []byte) (int, error) {
	close(w.started)
	<-w.release
	w.got = append(w.got, p...)
	return len(p), nil
}

// TestBodyCloseDuringWrite: Close does not wait for a write to the network
// to finish (a replica that stops reading must not hold the handler), and
// the buffer goes back only when the write is done with it.
func TestBodyCloseDuringWrite(t *testing.T) {
	b := newBody(3)
	copy(b.b, "abc")
	r := b.reader()
	b.release()
	w := &blockingWriter{started: make(chan struct{}), release: make(chan struct{})}
	done := make(chan error)
	go func() { _, err := r.WriteTo(w); done <- err }()
	<-w.started
	closed := make(chan struct{})
	go func() { r.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close waited for the write")
	}
	if got := b.refs.Load(); got != 1 {
		t.Fatalf("refs = %d while the write still holds the buffer, want 1", got)
	}
	close(w.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if string(w.got) != "abc" || b.refs.Load() != 0 {
		t.Fatalf("wrote %q, refs %d; want \"abc\", 0", w.got, b.refs.Load())
	}
}

// TestReadAllGrowsToTheDeclaredLength: a body read as it arrives ends in a
// buffer of its declared length (so that it can go back to the pool), and
// one of unknown length in at most twice its size.
func TestReadAllGrowsToTheDeclaredLength(t *testing.T) {
	for _, size := range []int{100, 64 << 10, 100 << 10, 960 << 10, 3 << 20} {
		data := bytes.Repeat([]byte("x"), size)
		b := newBody(bodyPrealloc)
		if err := b.readAll(bytes.NewReader(data), int64(size)); err != nil || !bytes.Equal(b.b, data) {
			t.Fatalf("%d bytes declared: %v", size, err)
		}
		if size > bodyPrealloc && cap(b.b) != size {
			t.Fatalf("%d bytes declared: buffer of %d", size, cap(b.b))
		}
		u := newBody(bodyPrealloc)
		if err := u.readAll(bytes.NewReader(data), -1); err != nil || !bytes.Equal(u.b, data) || cap(u.b) > 2*max(size, bodyPrealloc) {
			t.Fatalf("%d bytes of unknown length: %v, buffer of %d", size, err, cap(u.b))
		}
	}
	short := newBody(bodyPrealloc)
	if err := short.readAll(bytes.NewReader([]byte("abc")), 10); err != io.ErrUnexpectedEOF {
		t.Fatalf("a short body: %v", err)
	}
}

// TestBodyHoldsAgainstItsGauge: a body read as it arrives holds its bytes
// (in doubling steps from bodyPrealloc) against its gauge, is refused the
// step that would pass the limit, and gives everything back with its last
// reference, however its read ended.
func TestBodyHoldsAgainstItsGauge(t *testing.T) {
	var g bodyGauge
	data := bytes.Repeat([]byte("x"), 200<<10)

	b := newBody(bodyPrealloc)
	b.count(&g, 1<<20)
	if err := b.readAll(bytes.NewReader(data), -1); err != nil || !bytes.Equal(b.b, data) {
		t.Fatalf("%v, %d bytes", err, len(b.b))
	}
	if held := g.Load(); held != 256<<10 || int(held) < len(b.b) {
		t.Fatalf("%d bytes held for a body of %d, want %d", held, len(b.b), 256<<10)
	}
	r := b.reader()
	b.release()
	if g.Load() != 256<<10 {
		t.Fatal("the bytes were given back while a reader holds the body")
	}
	r.Close()
	if g.Load() != 0 {
		t.Fatalf("%d bytes held after the last reference", g.Load())
	}

	// Of unknown length, the step from 128 KiB to 256 KiB does not fit in
	// 200 KiB.
	b = newBody(bodyPrealloc)
	b.count(&g, 200<<10)
	var busy *bodiesInFlightError
	if err := b.readAll(bytes.NewReader(data), -1); !errors.As(err, &busy) || busy.limit != 200<<10 {
		t.Fatalf("past the limit: %v", err)
	}
	if g.Load() != 128<<10 {
		t.Fatalf("%d bytes held by the refused body, want %d", g.Load(), 128<<10)
	}
	b.release()
	if g.Load() != 0 {
		t.Fatalf("%d bytes held after the refused body's release", g.Load())
	}
}
