// Package router is the router's front doors: the HTTP server (a reverse
// proxy that streams, fails over before the first byte, bounds every
// request and learns the assistant's reply when the response completes),
// the gRPC Route API, and the Core they share (A/B arms, decisions held for
// Release, the decision log and per-request metrics). Where a request goes
// is decided by package routing.
//
// Core and Server are safe for concurrent use.
package router
