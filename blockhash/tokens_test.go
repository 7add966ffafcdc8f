package blockhash

import "testing"

func TestAppendTokenBlocks(t *testing.T) {
	ids := make([]int32, 65)
	for i := range ids {
		ids[i] = int32(i)
	}
	r := &Request{Parts: []Part{
		{Role: RoleSystem, Base: KindSystem, Text: make([]byte, 100)},
		{Role: RoleUser, Base: KindUserQuery, Text: make([]byte, 100)},
	}}
	bl, tail := AppendTokenBlocks(nil, TokenSeed(""), ids, 16, r)
	if len(bl) != 4 || tail != 1 {
		t.Fatalf("%d blocks, %d left over; want 4 full blocks of the first 64 ids and 1", len(bl), tail)
	}
	if bl[0].Kind != KindSystem || bl[1].Kind != KindSystem || bl[2].Kind != KindUserQuery || bl[3].Kind != KindUserQuery {
		t.Fatalf("kinds %v %v %v %v: want system twice, then user query", bl[0].Kind, bl[1].Kind, bl[2].Kind, bl[3].Kind)
	}
	// 64 ids: the block ending on the last token is no cache block.
	bl, tail = AppendTokenBlocks(nil, TokenSeed(""), ids[:64], 16, nil)
	if len(bl) != 3 || tail != 16 {
		t.Fatalf("%d blocks, %d left over; want 3 and 16", len(bl), tail)
	}
	// Keys chain as events derive them: block by block from the seed.
	h := TokenSeed("")
	for i := range bl {
		h = TokenBlockHash(h, []uint32{uint32(16 * i), uint32(16*i + 1), uint32(16*i + 2), uint32(16*i + 3),
			uint32(16*i + 4), uint32(16*i + 5), uint32(16*i + 6), uint32(16*i + 7), uint32(16*i + 8), uint32(16*i + 9),
			uint32(16*i + 10), uint32(16*i + 11), uint32(16*i + 12), uint32(16*i + 13), uint32(16*i + 14), uint32(16*i + 15)})
		if bl[i].Hash != h {
			t.Fatalf("block %d key differs from the chain over uint32 ids", i)
		}
	}
	if TokenSeed("") == TokenSeed("adapter") {
		t.Fatal("an adapter's blocks share the base model's keys")
	}
}
