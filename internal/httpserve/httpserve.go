// Package httpserve serves an http.Handler on a socket with the router's
// server settings (its timeouts and header cap), and stops it gracefully:
// the router's listeners (`router serve`, the demo's front) and the plain
// proxy the benchmark (cmd/benchproxy) measures beside the router, so that
// the two are served alike.
package httpserve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Server is an HTTP server on a socket. Stop is safe to call more than
// once and from several goroutines.
type Server struct {
	srv     *http.Server
	Addr    string // host:port actually bound
	done    chan error
	once    sync.Once
	stopErr error
}

// Serve starts h on addr ("127.0.0.1:0" picks a port). The server's own
// errors (a bad request line, a handler's panic) are logged to log at
// level warn.
func Serve(addr string, h http.Handler, log *slog.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", addr, err)
	}
	s := &Server{
		srv: &http.Server{
			Handler:           h,
			ReadHeaderTimeout: 10 * time.Second,
			ReadTimeout:       60 * time.Second, // headers and body: a slow upload cannot hold a connection
			IdleTimeout:       120 * time.Second,
			// The router answers headers over limits.max_header_bytes with
			// an OpenAI-style 431; this is the hard cap above that.
			MaxHeaderBytes: 1 << 20,
			ErrorLog:       slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		},
		Addr: ln.Addr().String(),
		done: make(chan error, 1),
	}
	go func() {
		err := s.srv.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		s.done <- err
	}()
	return s, nil
}

// Stop shuts the server down gracefully, waiting up to grace for requests
// in flight, then closes what is left.
func (s *Server) Stop(grace time.Duration) error {
	s.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), grace)
		defer cancel()
		if err := s.srv.Shutdown(ctx); err != nil {
			_ = s.srv.Close()
		}
		s.stopErr = <-s.done
	})
	return s.stopErr
}

// URL returns the server's base URL, "http://host:port" (the wildcard
// [::] as 127.0.0.1).
func (s *Server) URL() string { return "http://" + strings.Replace(s.Addr, "[::]", "127.0.0.1", 1) }
