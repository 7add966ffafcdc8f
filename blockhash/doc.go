// Package blockhash turns an OpenAI request body into an ordered list of typed
// blocks with chained content hashes and token estimates.
//
// The order is the one chat templates render: tool schemas, then the system
// prompt, then the conversation in order. Each part (one message, the tool
// schemas, or one prompt string) is cut into blocks of BlockTokens estimated
// tokens, where one token is estimated as BytesPerToken bytes. Block i's key is
//
//	Hash_i = xxhash(Hash_{i-1} ‖ role marker ‖ bytes_i),  Hash_{-1} = xxhash(model)
//
// so a block's hash names its whole prefix: changing one message leaves every
// earlier block's hash unchanged and changes every later one. The Kind of a
// block is metadata for weighting and eviction and is never part of the hash.
//
// Everything here is a pure function of its inputs and safe for concurrent use;
// a Splitter holds only its options.
package blockhash
