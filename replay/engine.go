package replay

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"strings"

	lru "github.com/hashicorp/golang-lru/v2/simplelru"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/cachemodel"
	"github.com/semroute/semroute/internal/enginereuse"
)

// Picture modes: how the router's cache picture (its cachemodel.Model)
// learns what the engines hold, in a run that simulates each engine's own
// KV cache apart from that picture (Run.Picture).
const (
	// PictureApproximate: the picture learns only from the router's own
	// routing (a routed prompt is taken as cached where it went, evicted by
	// the picture's budget and policy), as the live router does for a
	// replica that reports neither KV events nor cached tokens.
	PictureApproximate = "approximate"
	// PictureFeedback: as approximate, and after each prefill the cached
	// tokens the engine found correct the picture (routing.Engine.Feedback),
	// as the live router does from usage.prompt_tokens_details.cached_tokens.
	PictureFeedback = "feedback"
	// PictureEvents: the engine's own cache changes feed the picture, as
	// vLLM's KV events do: every replica is event-driven, a block the engine
	// caches is stored (cachemodel.Model.Store), a block it evicts removed
	// (Remove), and routed blocks count only while pending (PendingTTL).
	PictureEvents = "events"
)

// PictureModes are the picture modes, in the order reports list them.
var PictureModes = []string{PictureApproximate, PictureFeedback, PictureEvents}

// checkPicture validates a Run.Picture; "" (PictureFeedback) is valid.
func checkPicture(p string) error {
	if p == "" {
		return nil
	}
	for _, m := range PictureModes {
		if p == m {
			return nil
		}
	}
	return fmt.Errorf("unknown picture mode %q (have %s)", p, strings.Join(PictureModes, ", "))
}

// ParsePictures reads a comma-separated list of picture modes (a --picture
// value), refusing unknown and repeated ones. An empty list is nil.
func ParsePictures(s string) ([]string, error) {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if err := checkPicture(p); err != nil {
			return nil, err
		}
		for _, q := range out {
			if q == p {
				return nil, fmt.Errorf("picture mode %q listed twice", p)
			}
		}
		out = append(out, p)
	}
	return out, nil
}

// cacheSink hears an engine's cache changes as KV events would carry them.
type cacheSink interface {
	// stored: the engine cached blocks, a chain after the block keyed
	// parent (hasParent false: blocks[0] starts a prompt).
	stored(rep int, parent uint64, hasParent bool, blocks []blockhash.Block, now int64)
	// removed: the engine evicted block key.
	removed(rep int, key uint64)
}

// engineCaches are the simulated engines' own KV caches: what each replica
// really holds, kept apart from the router's picture of it. An engine, as
// vLLM's does:
//
//   - looks a request's prompt up in its cache when it schedules the
//     prefill, not when the router routes it, and caches the prompt's
//     blocks then;
//   - never evicts a block a running request holds (pinned until the
//     request finishes; vLLM evicts only from its free queue);
//   - caches the full blocks of the tokens it generates, chained after the
//     prompt: the trace's reply blocks where it shows them, otherwise one
//     block of BlockTokens per whole block of output, under a key no prompt
//     shares (the trace has no tokens to key them by), so they only take
//     room;
//   - evicts under the replica's budget and the model's eviction policy
//     (the same the picture is told: the picture errs by what it does not
//     see, not by a wrong budget).
//
// The engine keys blocks with the trace's block hashes, the same keys the
// router's picture uses, so the events mode hands the picture the keys
// directly. (The live router keys an engine's events from the token ids
// they carry, kvsync.Applier; a trace has no token ids and needs none.)
type engineCaches struct {
	m       *Config
	cache   *cachemodel.Model
	running map[int]cachemodel.Pins // by request: the blocks its engine holds while it runs
	gone    []goneBlock             // evictions heard by OnEvict, not yet passed on
	sink    cacheSink               // the events mode's picture; nil otherwise
	match   []cachemodel.Match
	all     []blockhash.Block
	evict   int64 // blocks evicted
	// segs are blending engines' segment stores (Config.Reuse), one a
	// replica, keyed by the blocks' segment keys; nil for prefix engines.
	// share is the share of a reused segment's tokens not computed again.
	// Both are the engines' own (package enginereuse), apart from the
	// router's segment picture.
	segs  []*enginereuse.Store
	share float64
	// donors are donor engines' providers (Config.Reuse), one a replica:
	// every finished prompt's sample, found by similarity, and its blocks
	// by key; nil for other engines.
	donors      []*enginereuse.Donors
	donorBlocks *lru.LRU[donorAt, []blockhash.Block] // as many as donors; one leaving forgets the other
	samples     map[int]enginereuse.Sample           // by running request: its text's sample, to register when it ends
}

type donorAt struct {
	rep int
	key uint64
}

type goneBlock struct {
	rep int
	key uint64
}

func newEngineCaches(m *Config, budgets []int64) (*engineCaches, error) {
	inner, err := m.evictionPolicy()
	if err != nil {
		return nil, err
	}
	e := &engineCaches{m: m, running: map[int]cachemodel.Pins{}}
	e.cache = cachemodel.New(cachemodel.Options{
		Policy:  inner,
		OnEvict: func(rep int, key uint64) { e.gone = append(e.gone, goneBlock{rep, key}) },
	})
	e.share = 1 - cmp.Or(m.Reuse.Recompute, enginereuse.DefaultRecompute)
	if m.Reuse.Donor() {
		e.donorBlocks, _ = lru.NewLRU(donorsPerEngine*len(budgets), func(at donorAt, _ []blockhash.Block) { e.donors[at.rep].Forget(0, at.key) })
		e.samples = map[int]enginereuse.Sample{}
	}
	for r, b := range budgets {
		id, err := e.cache.AddReplica(fmt.Sprintf("engine-%d", r), b)
		if err != nil {
			return nil, err
		}
		if id != r {
			return nil, fmt.Errorf("engine cache: replica %d got id %d", r, id)
		}
		if m.Reuse.Blend() {
			st, err := enginereuse.NewStore(int(cmp.Or(m.Reuse.BudgetTokens, b)), 1)
			if err != nil {
				return nil, err
			}
			e.segs = append(e.segs, st)
		}
		if m.Reuse.Donor() {
			ds, err := enginereuse.NewDonors(m.Reuse.MinSimilarity, donorsPerEngine)
			if err != nil {
				return nil, err
			}
			e.donors = append(e.donors, ds)
		}
	}
	return e, nil
}

// donorsPerEngine bounds each donor engine's provider.
const donorsPerEngine = 4096

// held returns how many of blocks, from the first, replica rep holds.
func (e *engineCaches) held(rep int, blocks []blockhash.Block) cachemodel.Match {
	e.match = e.cache.Match(blocks, nil, e.match)
	return e.match[rep]
}

// serve schedules request i's prompt on replica rep at now: it returns
// the tokens and blocks the engine found cached, then caches the prompt's
// blocks, pinned while the request runs (an engine does not evict a
// running request's blocks).
//
// A blending engine (Config.Reuse) also reuses every block past the prefix
// that its segment store holds, computing its recompute share again, and
// then keeps the prompt's segments. A donor engine reuses, in place of
// its own prefix, what it holds of the most similar prompt it finished
// (by req.Text; none without), as simreplica.Donor does; a donor it holds
// nothing of is forgotten.
func (e *engineCaches) serve(i, rep int, req *Request, now int64) (tokens, nblocks int) {
	blocks := req.Blocks
	hit := e.held(rep, blocks)
	tokens = hit.Tokens
	if e.segs != nil {
		st, beyond := e.segs[rep], 0
		for _, b := range blocks[hit.Blocks:] {
			if b.Seg != 0 && st.Has(b.Seg) {
				beyond += int(b.Tokens)
			}
		}
		tokens += int(float64(beyond) * e.share)
		for _, b := range blocks {
			if b.Seg != 0 {
				st.Put(b.Seg, int(b.Tokens))
			}
		}
	}
	if e.donors != nil && req.Text != nil {
		sm := enginereuse.NewSample(req.Text)
		e.samples[i] = sm
		tokens = max(tokens, e.donorTokens(rep, sm, req.Tokens))
	}
	_, e.running[i] = e.cache.Commit(rep, blocks, now)
	e.tell(rep, blocks, hit.Blocks, now)
	return tokens, hit.Blocks
}

// donorTokens returns the tokens replica rep's engine takes from its most
// similar donor for a prompt of tokens tokens whose text sm samples: what
// it holds of the donor's blocks from the first, up to the prompt's tokens.
func (e *engineCaches) donorTokens(rep int, sm enginereuse.Sample, tokens int) int {
	key, found := e.donors[rep].Find(0, sm)
	if !found {
		return 0
	}
	at := donorAt{rep, key}
	donor, _ := e.donorBlocks.Get(at)
	held := e.held(rep, donor).Tokens
	if held == 0 {
		e.donorBlocks.Remove(at) // and the index forgets it
		return 0
	}
	return min(held, tokens)
}

// finish ends request i on replica rep at now: the full blocks of its
// output are cached after its prompt, and every block is freed. A donor
// engine registers the prompt, sampled by serve, as a donor.
func (e *engineCaches) finish(i, rep int, req *Request, output []blockhash.Block, now int64) {
	prompt := req.Blocks
	if sm, ok := e.samples[i]; ok {
		delete(e.samples, i)
		if len(prompt) > 0 {
			at := donorAt{rep, prompt[len(prompt)-1].Hash}
			e.donorBlocks.Add(at, prompt)
			e.donors[rep].Put(0, at.key, sm)
		}
	}
	all := append(append(e.all[:0], prompt...), output...)
	e.all = all
	if len(output) > 0 {
		before := e.held(rep, all).Blocks
		e.cache.Extend(rep, all, len(prompt), now)
		e.tell(rep, all, before, now)
	}
	e.cache.Done(rep, all, e.running[i], now)
	delete(e.running, i)
}

// tell passes what the last change did to the sink, in the order an engine
// reports it: the blocks it evicted to make room, then the blocks of chain
// it now holds from index from on (blocks before it it held already).
func (e *engineCaches) tell(rep int, chain []blockhash.Block, from int, now int64) {
	gone := e.gone
	e.gone = e.gone[:0]
	e.evict += int64(len(gone))
	if e.sink == nil {
		return
	}
	for _, g := range gone {
		e.sink.removed(g.rep, g.key)
	}
	to := e.held(rep, chain).Blocks
	if to <= from {
		return
	}
	var parent uint64
	if from > 0 {
		parent = chain[from-1].Hash
	}
	e.sink.stored(rep, parent, from > 0, chain[from:to], now)
}

// outputBlocks returns the blocks an engine caches for request i's output:
// its reply's, when the trace shows it, else one block of blockTokens per
// whole block of output tokens, keyed after the prompt and the request's
// index so that no other request shares them.
func outputBlocks(req *Request, i, blockTokens int) []blockhash.Block {
	if req.Reply != nil {
		return req.Reply
	}
	n := req.Output / max(blockTokens, 1)
	if n == 0 {
		return nil
	}
	h := blockhash.Seed("replay-output")
	if len(req.Blocks) > 0 {
		h = req.Blocks[len(req.Blocks)-1].Hash
	}
	out := make([]blockhash.Block, n)
	var id [16]byte
	binary.LittleEndian.PutUint64(id[:8], uint64(i))
	for j := range out {
		binary.LittleEndian.PutUint64(id[8:], uint64(j))
		h = blockhash.ChainHash(h, blockhash.RoleAssistant, id[:])
		out[j] = blockhash.Block{Hash: h, Tokens: int32(blockTokens), Kind: blockhash.KindAssistantHistory}
	}
	return out
}
