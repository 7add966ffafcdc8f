// Package routing decides where each request goes: it turns a parsed
// request into blocks, matches them against the cache picture of every
// replica, asks a routing Policy to score every available replica, ranks
// the scores (lowest cost first, ties broken by rendezvous hashing of the
// session key with the replica name), and records the request's blocks on
// the chosen replica.
//
// It serves nothing: the HTTP and gRPC front ends (package router) and the
// replay simulator (package replay) drive the same Engine. It imports no
// server, RPC, tracing or metrics package.
//
// An Engine is safe for concurrent use. Policies are called concurrently and
// must be safe for that.
package routing
