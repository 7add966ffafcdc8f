package main

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/semroute/semroute/configs"
)

// grpcCreds returns the gRPC server's transport credentials: TLS from the
// certificate and key files, mTLS when a client CA is given (clients must
// present a certificate it signed), else plaintext.
func grpcCreds(c configs.GRPCConfig) (grpc.ServerOption, error) {
	if c.TLSCertFile == "" {
		return grpc.Creds(insecure.NewCredentials()), nil
	}
	cert, err := tls.LoadX509KeyPair(c.TLSCertFile, c.TLSKeyFile)
	if err != nil {
		return nil, fmt.Errorf("grpc.tls_cert_file: %w", err)
	}
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if c.TLSClientCAFile != "" {
		pem, err := os.ReadFile(c.TLSClientCAFile)
		if err != nil {
			return nil, fmt.Errorf("grpc.tls_client_ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("grpc.tls_client_ca_file %s: no PEM certificate in it", c.TLSClientCAFile)
		}
		tc.ClientCAs, tc.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return grpc.Creds(credentials.NewTLS(tc)), nil
}
