package cluster

import (
	"errors"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Serve starts a NATS server inside this process, listening on host:port
// (port 0: a free one), for the demo and tests; production fleets run
// their own NATS. It returns once the server accepts connections; its
// ClientURL is what Options.URLs takes. Shut it down with Shutdown.
func Serve(host string, port int) (*server.Server, error) {
	s, err := server.NewServer(&server.Options{Host: host, Port: port, NoLog: true, NoSigs: true, MaxPayload: 8 << 20})
	if err != nil {
		return nil, err
	}
	go s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		return nil, errors.New("cluster: embedded NATS server did not start")
	}
	return s, nil
}
