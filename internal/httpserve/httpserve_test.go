package httpserve

import (
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"
)

// A server answers at its URL until stopped; Stop is idempotent.
func TestServeAndStop(t *testing.T) {
	s, err := Serve("127.0.0.1:0", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }),
		slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(s.URL(), "http://127.0.0.1:") || s.URL() != "http://"+s.Addr {
		t.Fatalf("URL %q, Addr %q", s.URL(), s.Addr)
	}
	resp, err := http.Get(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "ok" {
		t.Fatalf("answer %q", b)
	}
	http.DefaultClient.CloseIdleConnections()
	if err := s.Stop(time.Second); err != nil {
		t.Fatal(err)
	}
	if err := s.Stop(time.Second); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if _, err := http.Get(s.URL()); err == nil {
		t.Fatal("a stopped server answered")
	}
}

// Serve fails on an address it cannot listen on, naming it.
func TestServeListenError(t *testing.T) {
	s, err := Serve("127.0.0.1:0", http.NotFoundHandler(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop(time.Second)
	if _, err := Serve(s.Addr, http.NotFoundHandler(), slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), s.Addr) {
		t.Fatalf("serving twice on %s: %v", s.Addr, err)
	}
}
