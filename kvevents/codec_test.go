package kvevents

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/tinylib/msgp/msgp"
)

func intp(v int) *int { return &v }

// sample is a batch with every field of every kind used.
func sample() Batch {
	return Batch{
		TS:     1789095808.8378847,
		DPRank: intp(3),
		Events: []Event{
			{Kind: BlockStored, BlockHashes: []uint64{1, math.MaxUint64, 1 << 40}, ParentHash: 77, HasParent: true,
				TokenIDs: []uint32{0, 127, 128, 65536, math.MaxUint32}, BlockSize: 16, LoraID: 5, HasLoraID: true,
				Medium: "GPU", LoraName: "adapter-a", ExtraKeys: []byte{0x91, 0xc0}, GroupIdx: 1, HasGroupIdx: true,
				SpecKind: "sliding_window", SlidingWindow: 4096, HasSlidingWindow: true},
			{Kind: BlockStored, BlockHashes: []uint64{9}, TokenIDs: []uint32{1, 2}, BlockSize: 2},
			{Kind: BlockStored, BlockHashes: []uint64{}, TokenIDs: []uint32{}, BlockSize: 16, HasGroupIdx: true},
			{Kind: BlockRemoved, BlockHashes: []uint64{1, 2, 3}, Medium: "CPU", GroupIdx: 2, HasGroupIdx: true},
			{Kind: BlockRemoved, BlockHashes: []uint64{4}},
			{Kind: AllBlocksCleared},
		},
	}
}

// same compares two batches, nil and empty slices alike, NaN equal to NaN.
func same(a, b Batch) bool {
	if math.Float64bits(a.TS) != math.Float64bits(b.TS) && !(math.IsNaN(a.TS) && math.IsNaN(b.TS)) {
		return false
	}
	if (a.DPRank == nil) != (b.DPRank == nil) || (a.DPRank != nil && *a.DPRank != *b.DPRank) {
		return false
	}
	if len(a.Events) != len(b.Events) {
		return false
	}
	for i := range a.Events {
		x, y := a.Events[i], b.Events[i]
		if !bytes.Equal(x.ExtraKeys, y.ExtraKeys) || (x.ExtraKeys == nil) != (y.ExtraKeys == nil) {
			return false
		}
		if len(x.BlockHashes) != len(y.BlockHashes) || len(x.TokenIDs) != len(y.TokenIDs) {
			return false
		}
		if len(x.BlockHashes) > 0 && !reflect.DeepEqual(x.BlockHashes, y.BlockHashes) ||
			len(x.TokenIDs) > 0 && !reflect.DeepEqual(x.TokenIDs, y.TokenIDs) {
			return false
		}
		x.ExtraKeys, y.ExtraKeys = nil, nil
		x.BlockHashes, y.BlockHashes = nil, nil
		x.TokenIDs, y.TokenIDs = nil, nil
		if !reflect.DeepEqual(x, y) {
			return false
		}
	}
	return true
}

func TestRoundTripShapes(t *testing.T) {
	for _, tc := range []struct {
		name  string
		shape Shape
	}{{"array", ShapeArray}, {"mixed", ShapeMixed}, {"map", ShapeMap}} {
		t.Run(tc.name, func(t *testing.T) {
			want := sample()
			p := EncodeShape(nil, want, tc.shape)
			got, err := Decode(p)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if !same(got, want) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, want)
			}
			var d Decoder
			for range 3 { // reuse must give the same answer
				got, err = d.Decode(p)
				if err != nil || !same(got, want) {
					t.Fatalf("Decoder.Decode: %v\n got %+v", err, got)
				}
			}
			want.DPRank = nil
			if got, err := Decode(EncodeShape(nil, want, tc.shape)); err != nil || !same(got, want) {
				t.Fatalf("without dp rank: %v %+v", err, got)
			}
		})
	}
	if !bytes.Equal(Encode(sample(), true), EncodeShape(nil, sample(), ShapeArray)) ||
		!bytes.Equal(Encode(sample(), false), EncodeShape(nil, sample(), ShapeMap)) {
		t.Fatal("Encode differs from EncodeShape")
	}
}

// unhex reads hex with spaces, newlines, "quoted ASCII" and // comments
// (to the end of the line) between.
func unhex(t testing.TB, s string) []byte {
	t.Helper()
	var out []byte
	parts := strings.Split(s, "\"")
	for i, part := range parts {
		if i%2 == 1 {
			out = append(out, part...)
			continue
		}
		var lines []string
		for _, l := range strings.Split(part, "\n") {
			l, _, _ = strings.Cut(l, "//")
			lines = append(lines, l)
		}
		h := strings.Join(strings.Fields(strings.Join(lines, " ")), "")
		b, err := hex.DecodeString(h)
		if err != nil {
			t.Fatalf("bad hex %q: %v", h, err)
		}
		out = append(out, b...)
	}
	return out
}

// The golden payloads are written by hand from msgspec's rules (see
// EncodeShape): this is the batch vLLM 0.26.0 printed in
// volcano-sh/kthena#1535, [1789095808.8378847, [{'type': 'BlockStored',
// 'block_hashes': [15760518052499183552], 'parent_block_hash': None,
// 'token_ids': [...16 ids], 'block_size': 16, 'lora_id': None, 'medium':
// 'GPU', 'lora_name': None, 'extra_keys': [None], 'group_idx': 0,
// 'kv_cache_spec_kind': 'full_attention'}], 0], in each shape.
func kthenaBatch() Batch {
	return Batch{TS: 1789095808.8378847, DPRank: intp(0), Events: []Event{{
		Kind: BlockStored, BlockHashes: []uint64{15760518052499183552},
		TokenIDs:  []uint32{151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667},
		BlockSize: 16, Medium: "GPU", ExtraKeys: []byte{0x91, 0xc0}, HasGroupIdx: true, SpecKind: "full_attention",
	}}}
}

const goldenTokens = `
	dc 00 10  // token_ids: array16 of 16 (msgspec uses fixarray only up to 15)
	ce 00 02 50 5c  cd 03 68  cc c6  cd 23 68  cd 01 76  cd 01 17  cd 1a 42  cd 01 3b
	cd 15 f0  1e  ce 00 02 50 5d  cc c6  ce 00 02 50 5c  ce 00 01 2d 23  cc c6  ce 00 02 50 73`

var goldens = map[Shape]string{
	ShapeArray: `
	93  // batch: array of 3
	cb 41 da a8 db e0 35 9f e7  // ts float64
	91  // events: array of 1
	9b ab "BlockStored"  // event: array of 1+10 (window omitted), tag first
	91 cf da b8 9b aa 7b 58 57 c0  // block_hashes: [uint64]
	c0` + goldenTokens + `
	10  // block_size 16
	c0  a3 "GPU"  c0  // lora_id None, medium, lora_name None
	91 c0  // extra_keys [None]
	00  // group_idx 0
	ae "full_attention"
	00  // data_parallel_rank 0`,
	ShapeMixed: `
	93 cb 41 da a8 db e0 35 9f e7 91
	8b a4 "type" ab "BlockStored"  // event: map of 11 entries
	ac "block_hashes" 91 cf da b8 9b aa 7b 58 57 c0
	b1 "parent_block_hash" c0
	a9 "token_ids"` + goldenTokens + `
	aa "block_size" 10
	a7 "lora_id" c0
	a6 "medium" a3 "GPU"
	a9 "lora_name" c0
	aa "extra_keys" 91 c0
	a9 "group_idx" 00
	b2 "kv_cache_spec_kind" ae "full_attention"
	00`,
	ShapeMap: `
	83 a2 "ts" cb 41 da a8 db e0 35 9f e7  // batch: map of 3
	a6 "events" 91
	8b a4 "type" ab "BlockStored"
	ac "block_hashes" 91 cf da b8 9b aa 7b 58 57 c0
	b1 "parent_block_hash" c0
	a9 "token_ids"` + goldenTokens + `
	aa "block_size" 10
	a7 "lora_id" c0
	a6 "medium" a3 "GPU"
	a9 "lora_name" c0
	aa "extra_keys" 91 c0
	a9 "group_idx" 00
	b2 "kv_cache_spec_kind" ae "full_attention"
	b2 "data_parallel_rank" 00`,
}

func TestGolden(t *testing.T) {
	for shape, g := range goldens {
		want := unhex(t, g)
		if got := EncodeShape(nil, kthenaBatch(), shape); !bytes.Equal(got, want) {
			t.Errorf("shape %d: Encode\n got %x\nwant %x", shape, got, want)
		}
		b, err := Decode(want)
		if err != nil || !same(b, kthenaBatch()) {
			t.Errorf("shape %d: Decode(golden) = %+v, %v", shape, b, err)
		}
	}
	// The first vLLM version: [ts, [["BlockStored", hashes, parent, tokens,
	// block_size, lora_id], ["BlockRemoved", hashes], ["AllBlocksCleared"]]]
	// with Python hash() values, negative ones included, and no dp rank.
	old := unhex(t, `
	92 cb 3f f8 00 00 00 00 00 00 93
	96 ab "BlockStored" 92 d3 80 00 00 00 00 00 00 00 fb  d0 9c  93 01 02 03  10  c0
	92 ac "BlockRemoved" 91 fb
	91 b0 "AllBlocksCleared"`)
	b, err := Decode(old)
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{TS: 1.5, Events: []Event{
		{Kind: BlockStored, BlockHashes: []uint64{1 << 63, math.MaxUint64 - 4}, ParentHash: math.MaxUint64 - 99,
			HasParent: true, TokenIDs: []uint32{1, 2, 3}, BlockSize: 16},
		{Kind: BlockRemoved, BlockHashes: []uint64{math.MaxUint64 - 4}},
		{Kind: AllBlocksCleared},
	}}
	if !same(b, want) {
		t.Fatalf("old shape:\n got %+v\nwant %+v", b, want)
	}
}

// Hashes sent as bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) read as the
// int vLLM would have sent: the last 8 bytes, big-endian.
func TestBytesHashes(t *testing.T) {
	p := unhex(t, `92 00 91 93 ac "BlockRemoved"
		93 c4 20 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 01 02 03 04 05 06 07 08
		   c4 02 01 02
		   c4 00
		c0`)
	b, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := b.Events[0].BlockHashes, []uint64{0x0102030405060708, 0x0102, 0}; !reflect.DeepEqual(got, want) {
		t.Fatalf("hashes %x, want %x", got, want)
	}
	if b.TS != 0 {
		t.Fatalf("int ts read as %v", b.TS)
	}
}

// Fields a future vLLM adds are skipped in both shapes; a map may hold its
// keys in any order.
func TestUnknownFieldsAndOrder(t *testing.T) {
	p := unhex(t, `93 cb 3f f8 00 00 00 00 00 00 92
		96 ac "BlockRemoved" 91 01 a3 "GPU" 02 81 01 92 c0 c0 a1 "x"
		84 a6 "medium" a3 "CPU" a8 "locality" a5 "local" a4 "type" ac "BlockRemoved" ac "block_hashes" 91 05
		07`)
	b, err := Decode(p)
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{TS: 1.5, DPRank: intp(7), Events: []Event{
		{Kind: BlockRemoved, BlockHashes: []uint64{1}, Medium: "GPU", GroupIdx: 2, HasGroupIdx: true},
		{Kind: BlockRemoved, BlockHashes: []uint64{5}, Medium: "CPU"},
	}}
	if !same(b, want) {
		t.Fatalf("got %+v\nwant %+v", b, want)
	}
}

func TestMalformed(t *testing.T) {
	for _, tc := range []struct{ name, hex string }{
		{"empty", ``},
		{"not a container", `a3 "abc"`},
		{"short batch", `91 00`},
		{"truncated", `92 cb 3f f8`},
		{"trailing bytes", `92 00 90 00`},
		{"unknown tag", `92 00 91 91 a4 "Nope"`},
		{"no tag", `92 00 91 90`},
		{"tag not a string", `92 00 91 91 01`},
		{"missing required", `92 00 91 93 ab "BlockStored" 90 c0`},
		{"hash a string", `92 00 91 92 ac "BlockRemoved" 91 a1 "x"`},
		{"token negative", `92 00 91 95 ab "BlockStored" 90 c0 91 ff 10`},
		{"token too big", `92 00 91 95 ab "BlockStored" 90 c0 91 cf 00 00 00 01 00 00 00 00 10`},
		{"block size overflow", `92 00 91 95 ab "BlockStored" 90 c0 90 cf 80 00 00 00 00 00 00 00`},
		{"count past the bytes", `92 00 dc 01 00`},
		{"hashes past the bytes", `92 00 91 92 ac "BlockRemoved" dc 01 00 01`},
		{"tokens past the bytes", `92 00 91 95 ab "BlockStored" 90 c0 dc 01 00 10`},
		{"map without type", `92 00 91 81 a6 "medium" c0`},
		{"map two tags", `92 00 91 82 a4 "type" ac "BlockRemoved" a4 "type" ac "BlockRemoved"`},
		{"map duplicate field", `92 00 91 83 a4 "type" ac "BlockRemoved" ac "block_hashes" 90 ac "block_hashes" 90`},
		{"batch map two events", `83 a2 "ts" 00 a6 "events" 90 a6 "events" 90`},
		{"batch map two ts", `83 a2 "ts" 00 a6 "events" 90 a2 "ts" 00`},
		{"map missing required", `92 00 91 81 a4 "type" ab "BlockStored"`},
		{"batch map no events", `81 a2 "ts" 00`},
		{"deep nesting truncated", strings.Repeat("91 ", 10000)},
		{"dp rank a string", `93 00 90 a1 "x"`},
		{"medium too long", `92 00 91 93 ac "BlockRemoved" 90 da 01 01` + strings.Repeat(" 41", 257)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(unhex(t, tc.hex))
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want ErrMalformed", err)
			}
		})
	}
	// Deep nesting inside a skipped field is fine when complete: no recursion.
	deep := append(unhex(t, `92 00 91 92 b0 "AllBlocksCleared"`), bytes.Repeat([]byte{0x91}, 100000)...)
	if _, err := Decode(append(deep, 0xc0)); err != nil {
		t.Fatalf("deep skipped value: %v", err)
	}
}

// Every sized int reads the same at the end of the bytes (readIntNearEnd)
// as before more of them (readInt alone), and is short without all of its
// own bytes.
func TestReadIntNearEnd(t *testing.T) {
	for c := byte(0xcc); c <= 0xd3; c++ {
		w := 1 << (c & 3)
		p := append([]byte{c, 0xfe}, bytes.Repeat([]byte{0xdc}, w-1)...)
		var want uint64 // big-endian, sign-extended for int8 to int64
		for _, b := range p[1:] {
			want = want<<8 | uint64(b)
		}
		if c >= 0xd0 {
			s := 64 - 8*w
			want = uint64(int64(want<<s) >> s)
		}
		for k := range p {
			if _, _, err := readInt(p[:k], "x"); !errors.Is(err, ErrMalformed) {
				t.Errorf("%x: err = %v, want short", p[:k], err)
			}
		}
		for _, extra := range [][]byte{nil, {1}, bytes.Repeat([]byte{1}, 9)} {
			v, rest, err := readInt(append(p, extra...), "x")
			if err != nil || v != want || len(rest) != len(extra) {
				t.Errorf("%x + %d bytes: %#x, %d left, %v; want %#x, %d left", p, len(extra), v, len(rest), err, want, len(extra))
			}
		}
	}
}

func TestDecoderDoesNotAllocate(t *testing.T) {
	p := benchPayload(ShapeArray)
	var d Decoder
	if _, err := d.Decode(p); err != nil {
		t.Fatal(err)
	}
	if n := testing.AllocsPerRun(100, func() { _, _ = d.Decode(p) }); n != 0 {
		t.Fatalf("Decoder.Decode allocates %v times per batch", n)
	}
}

// capturedPayloads are the batches of the third-party captures in
// testdata/thirdparty (see its README): the last frame of each message.
func capturedPayloads(t testing.TB) [][]byte {
	names, err := filepath.Glob(filepath.Join("..", "testdata", "thirdparty", "*.bin"))
	if err != nil || len(names) == 0 {
		t.Fatalf("no captures: %v", err)
	}
	var payloads [][]byte
	for _, name := range names {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		var last []byte
		for len(b) >= 4 && int(binary.BigEndian.Uint32(b)) <= len(b)-4 {
			n := binary.BigEndian.Uint32(b)
			last, b = b[4:4+n], b[4+n:]
		}
		if len(last) > 0 { // not a replay's end marker
			payloads = append(payloads, last)
		}
	}
	return payloads
}

// fuzzLimits are small Limits FuzzDecode holds a Decoder to.
var fuzzLimits = Limits{MaxMessageBytes: 512, MaxEventsPerBatch: 3, MaxBlocksPerEvent: 4, MaxTokensPerEvent: 16}

// within reports whether a batch of a payload of n bytes keeps to lim.
func within(b Batch, n int, lim Limits) bool {
	if n > lim.MaxMessageBytes || len(b.Events) > lim.MaxEventsPerBatch {
		return false
	}
	for _, e := range b.Events {
		if len(e.BlockHashes) > lim.MaxBlocksPerEvent || len(e.TokenIDs) > lim.MaxTokensPerEvent {
			return false
		}
	}
	return true
}

// FuzzDecode: Decode never panics, holds to the reference reading, allocates
// in proportion to the payload, and Decode(Encode(x)) == x in every shape for
// whatever decodes; a Decoder of small Limits reads the same batch when it
// keeps to them and refuses it with a *LimitError when not.
func FuzzDecode(f *testing.F) {
	for _, s := range []Shape{ShapeArray, ShapeMixed, ShapeMap} {
		f.Add(EncodeShape(nil, sample(), s))
		f.Add(EncodeShape(nil, kthenaBatch(), s))
	}
	for _, p := range capturedPayloads(f) {
		f.Add(p)
	}
	f.Add(unhex(f, goldens[ShapeArray]))
	f.Add(unhex(f, `93 cb 3f f8 00 00 00 00 00 00 92
		96 ac "BlockRemoved" 91 01 a3 "GPU" 02 81 01 92 c0 c0 a1 "x"
		84 a6 "medium" a3 "CPU" a8 "locality" a5 "local" a4 "type" ac "BlockRemoved" ac "block_hashes" 91 05 07`))
	f.Fuzz(func(t *testing.T, p []byte) {
		small := Decoder{Limits: fuzzLimits}
		sb, smallErr := small.Decode(p)
		b, err := Decode(p)
		if err != nil {
			if smallErr == nil {
				t.Fatalf("the small Limits read what the defaults refuse (%v): %x", err, p)
			}
			return
		}
		var le *LimitError
		switch {
		case within(b, len(p), fuzzLimits) && (smallErr != nil || !same(sb, b)):
			t.Fatalf("within the small Limits: %+v, %v\nwant %+v", sb, smallErr, b)
		case !within(b, len(p), fuzzLimits) && !errors.As(smallErr, &le):
			t.Fatalf("past the small Limits: err = %v, want a LimitError", smallErr)
		}
		// The reference only reads what Decode accepted: msgp's generic
		// reader allocates what a header declares, so on hostile input it
		// is slow where Decode refuses at once.
		ref, refErr := refDecode(p)
		var typeErr msgp.TypeError
		if errors.As(refErr, &typeErr) {
			// msgp's generic reader takes only string map keys; a map with
			// other keys can only sit in a skipped field or in extra_keys.
			return
		}
		if refErr != nil {
			t.Fatalf("Decode accepted what the reference refuses (%v): %x", refErr, p)
		}
		if !sameIgnoringRaw(b, ref) {
			t.Fatalf("Decode and the reference differ on %x:\n%+v\n%+v", p, b, ref)
		}
		var elems int
		for _, e := range b.Events {
			elems += len(e.BlockHashes) + len(e.TokenIDs) + len(e.ExtraKeys)
			if cap(e.BlockHashes) > len(p) || cap(e.TokenIDs) > len(p) {
				t.Fatalf("allocation out of proportion: caps %d, %d for %d bytes", cap(e.BlockHashes), cap(e.TokenIDs), len(p))
			}
		}
		if elems+len(b.Events) > len(p) {
			t.Fatalf("%d elements from %d bytes", elems+len(b.Events), len(p))
		}
		for _, s := range []Shape{ShapeArray, ShapeMixed, ShapeMap} {
			again, err := Decode(EncodeShape(nil, b, s))
			if err != nil || !same(again, b) {
				t.Fatalf("shape %d: Decode(Encode(x)) = %+v, %v\nwant %+v", s, again, err, b)
			}
		}
		var d Decoder
		d.Decode(EncodeShape(nil, sample(), ShapeArray)) // dirty its memory first
		if again, err := d.Decode(p); err != nil || !same(again, b) {
			t.Fatalf("Decoder.Decode differs: %+v, %v", again, err)
		}
	})
}

// realistic is a batch of 16 BlockStored events of 16 blocks of 16 tokens,
// as a busy engine publishes after a step with 16 prefills.
func realistic() Batch {
	var b Batch
	b.TS = 1789095808.8378847
	b.DPRank = intp(0)
	seed := uint64(0x9e3779b97f4a7c15)
	for e := range 16 {
		ev := Event{Kind: BlockStored, BlockSize: 16, Medium: "GPU", HasGroupIdx: true, SpecKind: "full_attention"}
		if e > 0 {
			ev.HasParent, ev.ParentHash = true, seed
		}
		for range 16 {
			seed = seed*6364136223846793005 + 1442695040888963407
			ev.BlockHashes = append(ev.BlockHashes, seed)
			for range 16 {
				seed = seed*6364136223846793005 + 1442695040888963407
				ev.TokenIDs = append(ev.TokenIDs, uint32(seed>>47)) // ids up to 131071
			}
		}
		b.Events = append(b.Events, ev)
	}
	return b
}

func benchPayload(s Shape) []byte { return EncodeShape(nil, realistic(), s) }

func BenchmarkDecode(b *testing.B) {
	for _, tc := range []struct {
		name  string
		shape Shape
	}{{"array", ShapeArray}, {"mixed", ShapeMixed}, {"map", ShapeMap}} {
		p := benchPayload(tc.shape)
		blocks := 0
		for _, e := range realistic().Events {
			blocks += len(e.BlockHashes)
		}
		b.Run(tc.name+"/Decoder", func(b *testing.B) {
			var d Decoder
			b.SetBytes(int64(len(p)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := d.Decode(p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(blocks*b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
		b.Run(tc.name+"/Decode", func(b *testing.B) {
			b.SetBytes(int64(len(p)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Decode(p); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(blocks*b.N)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

func BenchmarkEncode(b *testing.B) {
	batch := realistic()
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		buf = EncodeShape(buf[:0], batch, ShapeArray)
	}
}
