//go:build unix

package connpool

import (
	"errors"
	"net"
	"syscall"
)

// PeekIdle reports whether c, an idle connection, has nothing to read: a
// peek that does not wait finds no bytes and no end of stream. A c that
// is not a syscall.Conn (net.Pipe, a TLS wrapper) cannot be peeked at and
// is trusted. It does not wait; it is a system call, and (with Go 1.26)
// 4 small allocations: the raw connection and the peek's closure.
func PeekIdle(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	var buf [1]byte
	var perr error
	err = rc.Read(func(fd uintptr) bool {
		// Bytes, or 0 for the end of the stream, mean the connection is
		// not idle and open; only "would block" does.
		_, _, perr = syscall.Recvfrom(int(fd), buf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return true
	})
	return err == nil && (errors.Is(perr, syscall.EAGAIN) || errors.Is(perr, syscall.EWOULDBLOCK))
}
