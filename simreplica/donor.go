package simreplica

import (
	"cmp"
	"fmt"
	"slices"
	"sync"

	lru "github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/semroute/semroute/internal/enginereuse"
)

// Donor makes a replica reuse the KV of an earlier prompt similar to a
// new one (a donor), as an engine does with SGLang's SemanticPrefixProvider
// (PR 20806) or a semantic KV provider behind Dynamo (PR 7520): when the
// prefix cache holds less of a prompt than of the most similar finished
// prompt, the donor's blocks are looked up in the prefix cache and what it
// holds of them, from the first, is used in place of the prompt's own
// prefix (the engine repairs positions; what the output loses is the
// engine's business, not the router's). A donor is found on a miss past
// the prefix, as SGLang's fuzzy-match backend (PR 31057) does, not only on
// a miss from the first token (PR 20806). The tokens taken from the donor
// are reported in usage's cached_tokens and in
// vllm:external_prefix_cache_hits_total, as a KV connector's are; time to
// first token follows the tokens computed.
//
// A donor is taken only for a prompt of the same model (base or adapter).
// The replica's provider measures similarity as the reference providers
// do, with the Jaccard similarity of the rendered prompts' 5-word shingles,
// here sampled one in four (package enginereuse, apart from the router's
// own estimate of it). A donor whose first block is evicted is forgotten.
type Donor struct {
	// MinSimilarity is the least similarity of a donor reused, in (0, 1];
	// zero means the default, 0.5.
	MinSimilarity float64
	// MaxDonors bounds the finished prompts remembered, least recently
	// used first out; zero means 4,096.
	MaxDonors int
}

// DefaultMinSimilarity is Donor.MinSimilarity's default, this simulated
// engine's own (enginereuse.DefaultMinSimilarity), set apart from what the
// router assumes.
const DefaultMinSimilarity = enginereuse.DefaultMinSimilarity

// donorStore is a replica's donors: their samples in the engine's own
// provider and their block keys. Safe for concurrent use.
type donorStore struct {
	d *enginereuse.Donors

	mu   sync.Mutex
	keys *lru.LRU[uint64, donorEntry] // donor key (its deepest block's) → its blocks' keys
}

// donorEntry is a donor's blocks' keys and the model it was served under
// (its index: 0 the base model, 1 + i adapter i), the provider's
// namespace: a donor is never taken for another model's prompt.
type donorEntry struct {
	keys  []uint64
	model int
}

func newDonorStore(d Donor) (*donorStore, error) {
	if !(d.MinSimilarity >= 0 && d.MinSimilarity <= 1) || d.MaxDonors < 0 {
		return nil, fmt.Errorf("simreplica: Donor.MinSimilarity %v must be in [0, 1] and MaxDonors %d ≥ 0", d.MinSimilarity, d.MaxDonors)
	}
	n := cmp.Or(d.MaxDonors, 4096)
	ds, err := enginereuse.NewDonors(d.MinSimilarity, n)
	if err != nil {
		return nil, err
	}
	s := &donorStore{d: ds}
	s.keys, _ = lru.NewLRU(n, func(key uint64, e donorEntry) { ds.Forget(e.model, key) }) // n > 0
	return s, nil
}

// find returns the sample of prompt, a prompt of model (its index), and
// the key and block keys of its most similar donor of the same model, or
// nil keys. The keys are the store's: read them, do not keep them past the
// request.
func (s *donorStore) find(prompt []byte, model int) (sample enginereuse.Sample, key uint64, keys []uint64) {
	sample = enginereuse.NewSample([][]byte{prompt})
	key, found := s.d.Find(model, sample)
	if !found {
		return sample, 0, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, _ := s.keys.Get(key)
	return sample, key, e.keys
}

// forget drops the donor keyed by key.
func (s *donorStore) forget(key uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys.Remove(key) // the eviction callback forgets its sample
}

// put registers a finished prompt of model (its index), its sample
// (find's; kept) and its blocks' keys, as a donor. A prompt without a full
// block is none.
func (s *donorStore) put(sample enginereuse.Sample, model int, keys []uint64) {
	if len(keys) == 0 {
		return
	}
	key := keys[len(keys)-1]
	s.mu.Lock()
	s.keys.Add(key, donorEntry{slices.Clone(keys), model})
	s.mu.Unlock()
	s.d.Put(model, key, sample)
}

func (s *donorStore) clear() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys.Purge()
}

// donorReuse returns the tokens of a prompt of tokens tokens, of which the
// prefix cache holds cached, that the donor keyed by key (its blocks' keys
// are keys; none: no donor) gives past them: what the cache holds of the
// donor from its first block, up to the prompt's last token, which an
// engine always computes. A donor the cache holds nothing of is forgotten.
func (s *Server) donorReuse(key uint64, keys []uint64, tokens, cached int) int {
	if keys == nil {
		return 0
	}
	n := s.heldFrom(keys)
	if n == 0 {
		s.donor.forget(key)
		return 0
	}
	bs := s.o.BlockSize
	return max(min(n*bs, (tokens-1)/bs*bs)-cached, 0)
}
