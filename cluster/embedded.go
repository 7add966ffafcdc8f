package cluster

import (
	"cmp"
	"errors"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// Account is a user of a NATS server this process runs (Serve). It may
// publish and subscribe only on its fleet's subjects (Prefix.>, Prefix
// "semroute" when empty) and on reply inboxes (_INBOX.>), which warm
// starts use: a credential holder can take part in that fleet's routing
// (and so steer it, within the bounds a peer's records have), and
// nothing else on the server.
type Account struct{ User, Password, Prefix string }

// Permissions returns what an account of a fleet with prefix may do on a
// NATS server: the same rule for the embedded server and the one
// deploy/k8s/nats.yaml configures.
func Permissions(prefix string) *server.Permissions {
	subjects := []string{cmp.Or(prefix, "semroute") + ".>", "_INBOX.>"}
	return &server.Permissions{
		Publish:   &server.SubjectPermission{Allow: subjects},
		Subscribe: &server.SubjectPermission{Allow: subjects},
	}
}

// Serve starts a NATS server inside this process, listening on host:port
// (port 0: a free one), for the demo and tests; production fleets run
// their own NATS. With accounts, only they may connect, each limited to
// its fleet's subjects (Permissions); with none, anyone may (tests of
// cluster.insecure). It returns once the server accepts connections; its
// ClientURL is what Options.URLs takes. Shut it down with Shutdown.
func Serve(host string, port int, accounts ...Account) (*server.Server, error) {
	o := &server.Options{Host: host, Port: port, NoLog: true, NoSigs: true, MaxPayload: 8 << 20}
	for _, a := range accounts {
		o.Users = append(o.Users, &server.User{Username: a.User, Password: a.Password, Permissions: Permissions(a.Prefix)})
	}
	s, err := server.NewServer(o)
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
