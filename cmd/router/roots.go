package main

// The release image is FROM scratch (make image, the Dockerfile): it has no
// /etc/ssl/certs, yet the router verifies the TLS peers it dials (NATS,
// engines, OTLP collectors, the Kubernetes API). This import carries
// Mozilla's root set, pinned by go.sum, and registers it with
// x509.SetFallbackRoots: crypto/x509 uses it only when the system has no
// roots. A bundle mounted where Go looks (/etc/ssl/certs/ca-certificates.crt,
// or SSL_CERT_FILE / SSL_CERT_DIR) replaces it entirely, and a config's own
// CA file (cluster.ca_file) is used as before.
import _ "golang.org/x/crypto/x509roots/fallback"
