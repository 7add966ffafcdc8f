package cachemodel

import (
	"fmt"
	"math/rand"
	"sort"
	"sync"
	"testing"

	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/eviction"
)

// chain makes n blocks of one token each, chained from seed, all of kind k.
func chain(seed string, n int, k blockhash.Kind) []blockhash.Block {
	h := blockhash.Seed(seed)
	out := make([]blockhash.Block, n)
	for i := range out {
		h = blockhash.ChainHash(h, 'u', []byte{byte(i)})
		out[i] = blockhash.Block{Hash: h, Tokens: 1, Kind: k}
	}
	return out
}

// extend returns base[:n] followed by m new blocks.
func extend(base []blockhash.Block, n, m int, tag string) []blockhash.Block {
	out := append([]blockhash.Block{}, base[:n]...)
	h := out[n-1].Hash
	for i := 0; i < m; i++ {
		h = blockhash.ChainHash(h, 'u', []byte(tag+fmt.Sprint(i)))
		out = append(out, blockhash.Block{Hash: h, Tokens: 1, Kind: base[0].Kind})
	}
	return out
}

func newModel(t testing.TB, budgets ...int64) *Model {
	t.Helper()
	m := New(Options{})
	for i, b := range budgets {
		if _, err := m.AddReplica(fmt.Sprint("r", i), b); err != nil {
			t.Fatal(err)
		}
	}
	return m
}

func TestMatchPrefixOnly(t *testing.T) {
	m := newModel(t, 0, 0, 0)
	a := chain("a", 10, blockhash.KindSystem)
	m.Record(0, a, 1)
	m.Record(1, extend(a, 5, 3, "b"), 1)
	got := m.Match(a, nil, nil)
	want := []int{10, 5, 0}
	for id, w := range want {
		if got[id].Blocks != w || got[id].Tokens != w {
			t.Errorf("replica %d: %+v, want %d blocks", id, got[id], w)
		}
	}
	// A hole at block 1 ends the match even though later blocks are cached.
	holed := append([]blockhash.Block{}, a...)
	holed[1].Hash ^= 1
	if got := m.Match(holed, nil, nil); got[0].Blocks != 1 || got[1].Blocks != 1 {
		t.Errorf("after a miss: %+v", got)
	}
	if got := m.Match(chain("z", 3, 0), nil, nil); got[0].Blocks != 0 {
		t.Errorf("unrelated chain matched: %+v", got)
	}
}

func TestMatchWeighted(t *testing.T) {
	m := newModel(t, 0)
	a := chain("a", 4, blockhash.KindSystem)
	a[2].Kind, a[3].Kind = blockhash.KindUserQuery, blockhash.KindUserQuery
	a[3].Tokens = 10
	m.Record(0, a, 1)
	w := UnitWeights()
	w[blockhash.KindSystem] = 2
	w[blockhash.KindUserQuery] = 0.5
	got := m.Match(a, w, nil)[0]
	if got.Tokens != 13 || got.Weighted != 2+2+0.5+5 {
		t.Fatalf("got %+v, want 13 tokens, 9.5 weighted", got)
	}
}

func TestEvictionLRUOfLeaves(t *testing.T) {
	m := newModel(t, 10)
	a, b, c := chain("a", 5, 0), chain("b", 5, 0), chain("c", 5, 0)
	m.Record(0, a, 1)
	m.Record(0, b, 2)
	if n := m.Record(0, c, 3); n != 5 {
		t.Fatalf("evicted %d, want 5", n)
	}
	if got := m.Match(a, nil, nil)[0].Blocks; got != 0 {
		t.Errorf("a still holds %d blocks", got)
	}
	for _, ch := range [][]blockhash.Block{b, c} {
		if got := m.Match(ch, nil, nil)[0].Blocks; got != 5 {
			t.Errorf("chain lost blocks: %d", got)
		}
	}
	st, _ := m.Stats(0)
	if st.Blocks != 10 || st.Tokens != 10 || st.Evictions != 5 {
		t.Errorf("stats %+v", st)
	}
	// Touching b makes c the oldest: a new chain evicts c's tail first.
	m.Record(0, b, 4)
	m.Record(0, chain("d", 2, 0), 5)
	if got := m.Match(c, nil, nil)[0].Blocks; got != 3 {
		t.Errorf("c holds %d blocks, want 3 (tail evicted first)", got)
	}
	if got := m.Match(b, nil, nil)[0].Blocks; got != 5 {
		t.Errorf("b holds %d blocks, want 5", got)
	}
}

func TestSharedPrefixSurvivesSiblingEviction(t *testing.T) {
	m := newModel(t, 7)
	a := chain("a", 4, 0)
	x := extend(a, 2, 2, "x") // shares blocks 0,1 with a
	m.Record(0, x, 1)
	m.Record(0, a, 2) // 6 distinct blocks
	m.Record(0, chain("n", 3, 0), 3)
	// 9 > 7: x's tail (2 blocks, oldest leaf chain) goes; shared head stays.
	if got := m.Match(a, nil, nil)[0].Blocks; got != 4 {
		t.Errorf("a holds %d, want 4", got)
	}
	if got := m.Match(x, nil, nil)[0].Blocks; got != 2 {
		t.Errorf("x holds %d, want 2", got)
	}
}

func TestOversizedRequestKeepsHead(t *testing.T) {
	m := newModel(t, 4)
	a := chain("a", 10, 0)
	m.Record(0, a, 1)
	if got := m.Match(a, nil, nil)[0].Blocks; got != 4 {
		t.Fatalf("holds %d, want the first 4", got)
	}
}

func TestClearRemoveAndReuseIDs(t *testing.T) {
	m := newModel(t, 0, 0)
	a := chain("a", 3, 0)
	m.Record(0, a, 1)
	m.Record(1, a, 1)
	m.Clear(0)
	if got := m.Match(a, nil, nil); got[0].Blocks != 0 || got[1].Blocks != 3 {
		t.Fatalf("after Clear: %+v", got)
	}
	m.RemoveReplica(1)
	if m.nodes.len() != 0 {
		t.Fatalf("%d nodes left with no holder", m.nodes.len())
	}
	id, _ := m.AddReplica("new", 0)
	if id != 1 {
		t.Fatalf("id %d, want the freed id 1", id)
	}
	if _, err := m.AddReplica("bad", -1); err == nil {
		t.Fatal("negative budget accepted")
	}
	m.Record(7, a, 1) // unknown id: ignored
	m.SetBudget(0, 2)
	m.Record(0, a, 2)
	if st, _ := m.Stats(0); st.Tokens != 2 {
		t.Fatalf("after SetBudget: %+v", st)
	}
}

func TestMatchDoesNotAllocate(t *testing.T) {
	m := newModel(t, 0, 0, 0, 0)
	a := chain("a", 100, 0)
	for id := 0; id < 4; id++ {
		m.Record(id, a[:25*(id+1)], 1)
	}
	out := make([]Match, 4)
	if n := testing.AllocsPerRun(100, func() { out = m.Match(a, nil, out) }); n != 0 {
		t.Fatalf("Match allocates %v per call", n)
	}
	for id := 0; id < 4; id++ {
		if out[id].Blocks != 25*(id+1) {
			t.Errorf("replica %d matched %d", id, out[id].Blocks)
		}
	}
}

func TestConcurrentUse(t *testing.T) {
	m := newModel(t, 200, 200, 200)
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(g)))
			var out []Match
			for i := 0; i < 2000; i++ {
				c := chain(fmt.Sprint(rng.Intn(20)), 1+rng.Intn(30), 0)
				out = m.Match(c, nil, out)
				m.Record(rng.Intn(3), c, int64(i))
			}
		}(g)
	}
	wg.Wait()
	for id := 0; id < 3; id++ {
		if st, _ := m.Stats(id); st.Tokens > 200 {
			t.Errorf("replica %d over budget: %+v", id, st)
		}
	}
}

// refModel is a per-replica map of blocks with O(n) LRU-of-leaves eviction.
type refModel struct {
	budget int
	held   []map[uint64]refBlock
}

type refBlock struct {
	parent   uint64
	depth    int
	lastUsed int64
}

func (r *refModel) record(id int, bl []blockhash.Block, now int64) {
	h := r.held[id]
	var parent uint64
	for i, b := range bl {
		h[b.Hash] = refBlock{parent: parent, depth: i, lastUsed: now}
		parent = b.Hash
	}
	for r.budget > 0 && len(h) > r.budget {
		hasChild := map[uint64]bool{}
		for _, b := range h {
			hasChild[b.parent] = true
		}
		var leaves []uint64
		for k := range h {
			if !hasChild[k] {
				leaves = append(leaves, k)
			}
		}
		sort.Slice(leaves, func(i, j int) bool {
			a, b := h[leaves[i]], h[leaves[j]]
			if a.lastUsed != b.lastUsed {
				return a.lastUsed < b.lastUsed
			}
			if a.depth != b.depth {
				return a.depth > b.depth
			}
			return leaves[i] < leaves[j]
		})
		delete(h, leaves[0])
	}
}

func (r *refModel) match(id int, bl []blockhash.Block) int {
	for i, b := range bl {
		if _, ok := r.held[id][b.Hash]; !ok {
			return i
		}
	}
	return len(bl)
}

// FuzzAgainstReference drives the model and the reference with the same
// records and compares every replica's match after each step.
func FuzzAgainstReference(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
	f.Add([]byte{0, 0, 0, 255, 17, 33, 1, 1, 1, 200, 2, 9})
	var bases [4][]blockhash.Block
	for i := range bases {
		bases[i] = chain(fmt.Sprint("base", i), 8, 0)
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		const replicas, budget = 3, 12
		m := New(Options{})
		ref := &refModel{budget: budget}
		for i := 0; i < replicas; i++ {
			m.AddReplica(fmt.Sprint(i), budget)
			ref.held = append(ref.held, map[uint64]refBlock{})
		}
		var out []Match
		for i := 0; i+2 < len(ops); i += 3 {
			id := int(ops[i]) % replicas
			base := bases[ops[i+1]%4]
			keep := 1 + int(ops[i+1]/4)%8
			bl := base[:keep]
			if extra := int(ops[i+2] % 4); extra > 0 {
				bl = extend(base, keep, extra, fmt.Sprint(ops[i+2]/4%3))
			}
			now := int64(i / 3)
			m.Record(id, bl, now)
			ref.record(id, bl, now)
			for _, probe := range bases {
				out = m.Match(probe, nil, out)
				for r := 0; r < replicas; r++ {
					if want := ref.match(r, probe); out[r].Blocks != want {
						t.Fatalf("step %d replica %d: matched %d, reference %d", i/3, r, out[r].Blocks, want)
					}
				}
			}
		}
	})
}

func BenchmarkMatch(b *testing.B) {
	for _, replicas := range []int{8, 64, 1024} {
		for _, blocks := range []int{16, 128, 2048} {
			b.Run(fmt.Sprintf("replicas=%d/blocks=%d", replicas, blocks), func(b *testing.B) {
				m := New(Options{})
				req := chain("req", blocks, blockhash.KindSystem)
				for r := 0; r < replicas; r++ {
					m.AddReplica(fmt.Sprint(r), 0)
					m.Record(r, extend(req, 1+r*blocks/replicas, 4, fmt.Sprint(r)), 1)
				}
				out := make([]Match, replicas)
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					out = m.Match(req, nil, out)
				}
			})
		}
	}
}

func BenchmarkRecord(b *testing.B) {
	for _, blocks := range []int{16, 128, 2048} {
		b.Run(fmt.Sprintf("blocks=%d", blocks), func(b *testing.B) {
			m := New(Options{})
			m.AddReplica("r", int64(blocks)*64)
			chains := make([][]blockhash.Block, 256)
			for i := range chains {
				chains[i] = chain(fmt.Sprint(i), blocks, 0)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				m.Record(0, chains[i%len(chains)], int64(i))
			}
		})
	}
}

func TestReleaseOrdersVLLMEviction(t *testing.T) {
	var evicted []uint64
	m := New(Options{Policy: eviction.NewVLLM, OnEvict: func(_ int, k uint64) { evicted = append(evicted, k) }})
	m.AddReplica("r", 6)
	a, b := chain("a", 3, 0), chain("b", 3, 0)
	m.Record(0, a, 1)
	m.Record(0, b, 2)
	// a's request finished after b's: under vLLM's order b goes first.
	m.Free(0, b, 3)
	m.Free(0, a, 4)
	m.Record(0, chain("c", 3, 0), 5)
	if got := m.Match(b, nil, nil)[0].Blocks; got != 0 {
		t.Fatalf("b holds %d blocks, want 0", got)
	}
	if got := m.Match(a, nil, nil)[0].Blocks; got != 3 {
		t.Fatalf("a holds %d blocks, want 3", got)
	}
	want := []uint64{b[2].Hash, b[1].Hash, b[0].Hash} // tail first
	if fmt.Sprint(evicted) != fmt.Sprint(want) {
		t.Fatalf("OnEvict saw %v, want %v", evicted, want)
	}
	if sz := m.Sizes(nil); len(sz) != 1 || sz[0] != 6 {
		t.Fatalf("Sizes = %v", sz)
	}
}

// refuseKind admits nothing of one kind.
type refuseKind struct {
	eviction.Policy
	k blockhash.Kind
}

func (r refuseKind) Admit(i eviction.Info, _, _ int64) bool { return i.Kind != r.k }

func TestAdmissionStopsTheChain(t *testing.T) {
	m := New(Options{Policy: func() eviction.Policy { return refuseKind{eviction.NewLRU(), blockhash.KindUserQuery} }})
	m.AddReplica("r", 100)
	c := chain("a", 5, blockhash.KindSystem)
	c[3].Kind = blockhash.KindUserQuery
	m.Record(0, c, 1)
	if got := m.Match(c, nil, nil)[0].Blocks; got != 3 {
		t.Fatalf("holds %d blocks, want the 3 before the refused one", got)
	}
	// The last admitted block is a leaf and can be evicted.
	m.SetBudget(0, 1)
	m.Record(0, c[:1], 2)
	if st, _ := m.Stats(0); st.Blocks != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestExtendDoesNotCountThePrefixAgain: extending a recorded chain caches
// the new blocks after it without counting the prefix as used again (heat,
// the fleet's request count) or refreshing its recency; a prefix block the
// replica lost is cached again.
func TestExtendDoesNotCountThePrefixAgain(t *testing.T) {
	m := newModel(t, 0)
	prompt := chain("p", 4, blockhash.KindSystem)
	m.Record(0, prompt, 1)
	all := extend(prompt, 4, 3, "reply")
	m.Extend(0, all, 4, 2)
	if st, _ := m.Stats(0); st.Blocks != 7 {
		t.Fatalf("%d blocks cached, want 7", st.Blocks)
	}
	if got := m.Match(all, nil, nil)[0].Blocks; got != 7 {
		t.Fatalf("the extended chain matches %d blocks", got)
	}
	// One request so far: the prompt is not used twice.
	if hot := m.Hot(prompt, nil, 2, 0, 2); hot.Blocks != 0 {
		t.Fatalf("the prompt counts %d hot blocks after one request", hot.Blocks)
	}
	m.Record(0, prompt, 3)
	if hot := m.Hot(prompt, nil, 2, 0, 3); hot.Blocks != 4 {
		t.Fatalf("after two requests %d hot blocks, want 4", hot.Blocks)
	}
	// A prefix block evicted meanwhile comes back with the extension.
	m.Clear(0)
	m.Extend(0, all, 4, 4)
	if st, _ := m.Stats(0); st.Blocks != 7 {
		t.Fatalf("after a clear, %d blocks cached, want 7", st.Blocks)
	}
}

// TestSizesBudgets: every replica's tracked tokens and budget by id, into
// slices given empty or nil.
func TestSizesBudgets(t *testing.T) {
	m := New(Options{})
	m.AddReplica("a", 100)
	m.AddReplica("b", 0)
	m.Record(1, chain("x", 3, 0), 1)
	sizes, budgets := m.SizesBudgets(nil, nil)
	if fmt.Sprint(sizes, budgets) != "[0 3] [100 0]" {
		t.Fatalf("sizes %v, budgets %v", sizes, budgets)
	}
	if got := m.Sizes(make([]int64, 0, 8)); fmt.Sprint(got) != "[0 3]" {
		t.Fatalf("sizes %v", got)
	}
}
