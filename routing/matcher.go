package routing

// Matcher is the semantic fallback: it finds a donor request whose content
// is similar to a new request's (the same document under another
// instruction, reordered sections) so the router can prefer the replica that
// served it when the exact prefix match is short. Implementations must be
// safe for concurrent use and bounded in memory and time.
type Matcher interface {
	// Find returns the replica id of the most similar registered donor, if
	// one is similar enough.
	Find(text [][]byte) (replica int, ok bool)
	// Register records a served request as a donor on replica, keyed by its
	// deepest block's hash.
	Register(key uint64, replica int, text [][]byte)
	// Forget drops the donor keyed by key on replica: its blocks were
	// evicted there.
	Forget(replica int, key uint64)
}
