package router

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"net/http"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/semroute/semroute/replica"
)

// Response ids issued by the router.
//
// A Responses API response is stored by the engine that answered it
// (vLLM's response store, in its memory) under the id the answer carries,
// and later requests name it: previous_response_id, GET, DELETE and cancel
// of /v1/responses/{id}. Whose it is, and where it is, must be known
// whenever such a request arrives: after a router restart, after any
// number of newer responses, at any router of a fleet. So the router
// issues the id itself, through vLLM's request_id extra parameter (the
// response's id when set: vLLM's ResponsesRequest.request_id), and the id
// carries what it must prove:
//
//	resp_sr1_<base64url(replica tag 8 | nonce 12 | MAC 16)>
//
// where the tag is the xxhash of the name of the replica the request was
// sent to, and the MAC is HMAC-SHA-256, truncated to 16 bytes, over the
// tag, the nonce and the tenant of the request (the API key's, with keys
// on). An id whose MAC does not match the caller's tenant is another
// tenant's: it never reaches a replica. Nothing here is secret, and nothing
// needs to be: the engine finds a response by its whole id, MAC included,
// so the one string that names a response verifies for one tenant alone,
// and knowing how the MAC is made lets nobody make another string name
// that response. So every router of a fleet, and a router restarted,
// checks an id with no memory and no key to share, and a fleet member's
// word about a response is neither needed nor taken.
//
// Engines that do not take request_id answer with ids of their own; those
// are remembered here (responseIDs.homes), bounded, with their tenant, and
// are refused once forgotten when strict (API keys on).
const respIDPrefix = "resp_sr1_"

const (
	respTagBytes   = 8
	respNonceBytes = 12
	respMACBytes   = 16
	respRawBytes   = respTagBytes + respNonceBytes + respMACBytes
)

// respIDLen is the length of an id the router issues.
var respIDLen = len(respIDPrefix) + base64.RawURLEncoding.EncodedLen(respRawBytes)

// respMACKey keys the MAC of an issued id: a domain separator, not a
// secret (see above).
var respMACKey = []byte("semroute response id v1")

// maxResponseHomes bounds the engines' own response ids remembered (about
// 100 bytes each).
const maxResponseHomes = 1 << 16

// responseHome is where a response is stored, and whose it is: the
// tenant of the request that made it ("" for none).
type responseHome struct{ replica, tenant string }

// responseIDs issues and checks the ids of stored responses. Safe for
// concurrent use; the zero value is not usable (newResponseIDs).
type responseIDs struct {
	// strict refuses an id the router cannot prove is the caller's (one
	// it did not issue and does not remember): set when API keys decide
	// the tenant, since without them the tenant is the client's word.
	strict bool
	// homes remembers where the engines' own ids (from engines that
	// ignore request_id) are stored, the most recent maxResponseHomes,
	// and for which tenant: this router's memory only.
	homes *lru.Cache[string, responseHome]
}

func newResponseIDs(strict bool) *responseIDs {
	c, _ := lru.New[string, responseHome](maxResponseHomes) // a positive size never fails
	return &responseIDs{strict: strict, homes: c}
}

// replicaTag is the tag of replica name in an issued id.
func replicaTag(name string) uint64 { return xxhash.Sum64String(name) }

// mac returns the MAC of an id's tag and nonce for tenant.
func (k *responseIDs) mac(raw []byte, tenant string) []byte {
	m := hmac.New(sha256.New, respMACKey)
	m.Write(raw[:respTagBytes+respNonceBytes])
	m.Write([]byte(tenant))
	return m.Sum(nil)[:respMACBytes]
}

// issue returns a new response id naming the replica called name as the
// response's home and tenant as its owner.
func (k *responseIDs) issue(name, tenant string) string {
	var raw [respRawBytes]byte
	binary.BigEndian.PutUint64(raw[:respTagBytes], replicaTag(name))
	_, _ = rand.Read(raw[respTagBytes : respTagBytes+respNonceBytes])
	copy(raw[respTagBytes+respNonceBytes:], k.mac(raw[:], tenant))
	return respIDPrefix + base64.RawURLEncoding.EncodeToString(raw[:])
}

// open reads id as an id the router issued: ours says it has the form of
// one, valid that its MAC verifies for tenant, tag its home's.
func (k *responseIDs) open(id, tenant string) (tag uint64, ours, valid bool) {
	if len(id) != respIDLen || id[:len(respIDPrefix)] != respIDPrefix {
		return 0, false, false
	}
	var raw [respRawBytes]byte
	if n, err := base64.RawURLEncoding.Decode(raw[:], []byte(id[len(respIDPrefix):])); err != nil || n != respRawBytes {
		return 0, true, false
	}
	if !hmac.Equal(raw[respTagBytes+respNonceBytes:], k.mac(raw[:], tenant)) {
		return 0, true, false
	}
	return binary.BigEndian.Uint64(raw[:respTagBytes]), true, true
}

// remember notes that replica answered the engine's own response id for
// tenant (an id the router did not issue: the engine ignored request_id).
func (k *responseIDs) remember(id, replica, tenant string) {
	if id != "" && len(id) <= 256 && !strings.HasPrefix(id, respIDPrefix) {
		k.homes.Add(id, responseHome{replica, tenant})
	}
}

// errNotYours answers a request about a stored response another tenant
// made, or one the router cannot prove is the caller's: as if it were not
// there.
var errNotYours = apiError{http.StatusNotFound, "invalid_request_error", "response_not_found", "no response with that id"}

// home returns a filter that admits only the replica that stores response
// id, or nil (the request is routed as any other, and a replica that does
// not hold the response answers for itself). A request given it sets
// routing.Request.Home: the replica is used while it drains (it holds the
// response), and while it is down or gone the request is refused as no
// replica can take it (a 503 the client may retry), not sent where the
// response is not. refused says the id is not the caller's: its MAC does
// not verify for tenant, a remembered id is another tenant's, or (strict)
// the router cannot tell.
func (k *responseIDs) home(id, tenant string) (allow func(*replica.Replica) bool, refused bool) {
	if tag, ours, valid := k.open(id, tenant); ours {
		if !valid {
			return nil, true
		}
		return func(r *replica.Replica) bool { return replicaTag(r.Name) == tag }, false
	}
	h, ok := k.homes.Get(id)
	if !ok {
		return nil, k.strict
	}
	if h.tenant != tenant && (k.strict || h.tenant != "") {
		return nil, true
	}
	return func(r *replica.Replica) bool { return r.Name == h.replica }, false
}

// withRequestID returns a copy of b, a Responses request body without a
// top-level request_id, with request_id set to id: the last key, so that
// the body stays the client's byte for byte before it.
func withRequestID(b []byte, id string) *body {
	end := bytes.LastIndexByte(b, '}') // the parser accepted an object: its last byte that is not space
	inner := bytes.TrimRight(b[:end], " \t\r\n")
	out := newBody(len(b) + len(id) + 20)
	w := append(out.b[:0], inner...)
	if inner[len(inner)-1] != '{' {
		w = append(w, ',')
	}
	w = append(w, `"request_id":`...)
	w = strconv.AppendQuote(w, id) // base64url and the prefix: nothing to escape
	w = append(w, b[end:]...)
	out.b = w
	return out
}
