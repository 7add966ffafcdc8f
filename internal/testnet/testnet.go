// Package testnet serves raw TCP connections on 127.0.0.1 for tests that
// play a replica byte by byte.
package testnet

import (
	"net"
	"sync"
	"testing"
)

// Serve listens on a free port of 127.0.0.1 and calls handle with each
// connection accepted, in a goroutine of its own; a nil handle holds the
// connections open, unanswered. At t's cleanup the listener and every
// connection accepted are closed, and Serve waits for the handlers to
// return. It returns the listener's address ("127.0.0.1:port") and a
// func that closes every connection accepted so far.
func Serve(t testing.TB, handle func(net.Conn)) (addr string, closeAll func()) {
	t.Helper()
	if handle == nil {
		return ServeNumbered(t, nil)
	}
	return ServeNumbered(t, func(c net.Conn, _ int) { handle(c) })
}

// ServeNumbered is Serve, with each connection's number, from 1, in the
// order accepted: a script can tell the first connection from the next
// whatever order their handlers run in.
func ServeNumbered(t testing.TB, handle func(c net.Conn, n int)) (addr string, closeAll func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	closeAll = func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	}
	t.Cleanup(func() {
		ln.Close()
		closeAll()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 1; ; n++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			if handle == nil {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				handle(c, n)
			}()
		}
	}()
	return ln.Addr().String(), closeAll
}
