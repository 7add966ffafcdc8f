//go:build !unix

package router

import "net"

// peekIdle trusts an idle connection where it cannot peek without waiting:
// a close that races the request is sent again (upstream.RoundTrip).
func peekIdle(net.Conn) bool { return true }
