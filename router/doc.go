// Package router decides where each request goes and forwards it there.
//
// The routing core (Engine) turns a parsed request into blocks, matches them
// against the cache model, asks the routing Policy to score every available
// replica, ranks the scores (lowest cost first, ties broken by rendezvous
// hashing of the session key with the replica name), and records the
// request's blocks on the chosen replica. The HTTP Server wraps the core with
// an httputil.ReverseProxy that streams, fails over before the first byte,
// and learns the assistant's reply when the response completes.
//
// Engine and Server are safe for concurrent use. Policies are called
// concurrently and must be safe for that.
package router
