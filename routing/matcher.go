package routing

// Matcher is the donor index, with the three calls of the engines' semantic
// KV providers (SGLang's SemanticPrefixProvider, PR 20806; Dynamo's
// SemanticKvCacheProvider, PR 7520): find a similar donor, register a
// donor, forget it on eviction. A donor is a served request whose content is
// similar to a new request's (the same document under another instruction,
// reordered sections). A replica whose engine reuses donors
// (replica.ReuseDonor) is credited with its donor's tokens discounted by
// their similarity; with EngineOptions.PreferDonor, prefix engines' replicas
// holding a donor are preferred when the exact prefix match is short.
// Implementations must be safe for concurrent use and bounded in memory and
// time.
type Matcher interface {
	// Sketch summarises a request's text for Donors and Register: made
	// once per request, a new slice. Sketches of different models (the
	// request's model name; "" for none) must never be found similar: one
	// model's KV cache is no donor for another's.
	Sketch(model string, text [][]byte) []uint64
	// Donors calls each, replica by replica, with the replica's most
	// similar registered donor to the text sketch summarises that is
	// similar enough: its key, the prompt tokens it was registered with
	// and its similarity in [0, 1].
	Donors(sketch []uint64, each func(replica int, key uint64, tokens int, similarity float64))
	// Register records a served request of tokens prompt tokens, summarised
	// by sketch (which the matcher may keep), as a donor on replica, keyed
	// by its deepest block's hash.
	Register(key uint64, replica, tokens int, sketch []uint64)
	// Forget drops the donor keyed by key on replica: its blocks were
	// evicted there (the picture's eviction model, or the engine's KV
	// events).
	Forget(replica int, key uint64)
}
