// Package router is the router's front doors and the core they share.
//
// The doors: the HTTP server (a reverse proxy that streams, fails over
// before the first byte, bounds every request and learns the assistant's
// reply when the response completes), the gRPC Route API, and the endpoint
// picker of Envoy's ext_proc protocol. Each only translates its protocol:
// every request is admitted (Core.Admit) and placed (Core.Place) by the
// Core, which the replay runs too, in virtual time. The Core keeps the A/B
// arms, the router's queue (Deferrals), the gRPC decisions awaiting
// Release (Unreleased), the decision log and per-request metrics. Where a
// request goes is decided by package routing.
//
// Core and Server are safe for concurrent use.
package router
