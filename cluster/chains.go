package cluster

import (
	"github.com/nats-io/nats.go"
)

// Conversations of stored responses.
//
// A router that saw a Responses API response answered keeps the
// conversation the engine stored for it, to route a request continuing it
// on its whole prompt (router/chains.go). A continuation may reach any
// router of the fleet, so each shares what it keeps: an opaque record
// (the router's encoding) published on <prefix>.chains as the response
// ends, which every peer hands its router (OnChain). A record carries
// conversation text: it crosses the fleet's NATS, which Options require
// to be authenticated unless Insecure. It is a prediction's input only:
// a record forged or lost makes a continuation's prediction wrong or
// unknown, never sends it elsewhere (its id names its replica and tenant).

// hdrSender names the router that published a record on the chains
// subject: a router skips its own.
const hdrSender = "Semroute-Sender"

// MaxChainRecord bounds a record shared, in bytes: a larger one is not
// shared (its continuation, at a peer, is routed on its new input).
const MaxChainRecord = 1 << 20

// OnChain sets the function given each peer's record of a stored
// response's conversation (ShareChain). Call it before Start; fn is called
// from one goroutine at a time, and must not keep rec.
func (f *Fleet) OnChain(fn func(rec []byte)) { f.onChain = fn }

// ShareChain publishes rec, this router's record of a stored response's
// conversation, to its peers. It drops (and counts) what it cannot send:
// NATS is down, or rec is over MaxChainRecord.
func (f *Fleet) ShareChain(rec []byte) {
	if len(rec) > MaxChainRecord || f.nc == nil || !f.connected.Load() {
		f.chainsDropped.Add(1)
		return
	}
	m := &nats.Msg{Subject: f.chains, Data: rec, Header: nats.Header{hdrSender: []string{f.o.ID}}}
	if err := f.nc.PublishMsg(m); err != nil {
		f.chainsDropped.Add(1)
		return
	}
	f.chainsShared.Add(1)
}

// onChainMsg hands a peer's record to the router.
func (f *Fleet) onChainMsg(m *nats.Msg) {
	if m.Header.Get(hdrSender) == f.o.ID || len(m.Data) > MaxChainRecord {
		return
	}
	f.chainsReceived.Add(1)
	f.onChain(m.Data)
}
