package cachemodel

import (
	"cmp"
	"slices"

	"github.com/semroute/semroute/blockhash"
)

// Chain appends to dst the chain of blocks that ends at the block keyed
// key, from the chain's first block, as the picture knows it (whichever
// replicas hold it), and reports whether the picture knows the block. A
// router of a fleet rebuilds from it the prefix a peer named by its last
// key (package cluster).
func (m *Model) Chain(key uint64, dst []blockhash.Block) ([]blockhash.Block, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	n := m.nodes.get(key)
	if n == nil {
		return dst, false
	}
	from := len(dst)
	for ; n != nil; n = n.parent {
		dst = append(dst, blockhash.Block{Hash: n.hash, Tokens: int32(n.tokens), Kind: n.kind})
	}
	slices.Reverse(dst[from:])
	return dst, true
}

// Walk calls fn with every block replica id holds in GPU or CPU memory
// (not those only routed there and pending, nor dead ones), each block's
// parent before it, so that Store can rebuild the picture elsewhere (a
// fleet's warm start). fn runs under the model's read lock: it must not
// call the model.
func (m *Model) Walk(id int, fn func(parent uint64, hasParent bool, b blockhash.Block, cpu bool)) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if !m.valid(id) {
		return
	}
	type held struct {
		n   *node
		cpu bool
	}
	var all []held
	m.nodes.each(func(n *node) {
		if i, ok := m.find(n, int32(id)); ok {
			if f := m.at(n, i).flags; f&(fGPU|fCPU) != 0 {
				all = append(all, held{n, f&fGPU == 0})
			}
		}
	})
	slices.SortFunc(all, func(a, b held) int { return cmp.Compare(a.n.depth, b.n.depth) })
	for _, h := range all {
		var parent uint64
		if h.n.parent != nil {
			parent = h.n.parent.hash
		}
		fn(parent, h.n.parent != nil, blockhash.Block{Hash: h.n.hash, Tokens: int32(h.n.tokens), Kind: h.n.kind}, h.cpu)
	}
}
