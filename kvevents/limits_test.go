package kvevents

import (
	"errors"
	"runtime"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/semroute/semroute/internal/testwait"
	"github.com/tinylib/msgp/msgp"
)

// storedHeader is a batch of one BlockStored up to its token_ids, whose
// array header the caller appends.
func storedHeader(t testing.TB) []byte {
	return unhex(t, `92 00 91 95 ab "BlockStored" 90 c0`)
}

// allocated is the bytes the heap gave out while f ran.
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// A list longer than its bound is refused from its header, whatever it
// declares and however many of its elements really follow: as a
// *LimitError naming the bound, not ErrMalformed, having allocated nothing
// for the list.
func TestLimitsRefusedFromTheHeader(t *testing.T) {
	withTokens := func(n int) []byte { // n token ids really there, one byte each
		p := msgp.AppendArrayHeader(storedHeader(t), uint32(n))
		p = append(p, make([]byte, n)...)
		return append(p, 0x10) // block_size
	}
	for _, tc := range []struct {
		name    string
		payload []byte
		limit   Limit
		n       int64
	}{
		// 1<<30 token ids declared in a few bytes.
		{"tokens declared", msgp.AppendArrayHeader(storedHeader(t), 1<<30), LimitTokens, 1 << 30},
		// 512k token ids there (the old limit, 1M, let them through).
		{"tokens present", withTokens(1 << 19), LimitTokens, 1 << 19},
		{"tokens one past", withTokens(DefaultMaxTokensPerEvent + 1), LimitTokens, DefaultMaxTokensPerEvent + 1},
		{"tokens in a map event", msgp.AppendArrayHeader(unhex(t, `92 00 91 84 a4 "type" ab "BlockStored"
			ac "block_hashes" 90 a9 "token_ids"`), 1<<30), LimitTokens, 1 << 30},
		{"blocks", msgp.AppendArrayHeader(unhex(t, `92 00 91 92 ac "BlockRemoved"`), 1<<30), LimitBlocks, 1 << 30},
		{"blocks one past", append(msgp.AppendArrayHeader(unhex(t, `92 00 91 92 ac "BlockRemoved"`), DefaultMaxBlocksPerEvent+1),
			make([]byte, DefaultMaxBlocksPerEvent+1)...), LimitBlocks, DefaultMaxBlocksPerEvent + 1},
		{"events", msgp.AppendArrayHeader(unhex(t, `92 00`), 1<<30), LimitEvents, 1 << 30},
		{"events in a map batch", msgp.AppendArrayHeader(unhex(t, `82 a2 "ts" 00 a6 "events"`), DefaultMaxEventsPerBatch+1),
			LimitEvents, DefaultMaxEventsPerBatch + 1},
		{"message", append(unhex(t, `93 00 90 c4 ff`), make([]byte, DefaultMaxMessageBytes)...), LimitMessageBytes, DefaultMaxMessageBytes + 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var d Decoder
			d.Decode(benchPayload(ShapeArray)) // a Decoder in use
			var err error
			bytes := allocated(func() { _, err = d.Decode(tc.payload) })
			var le *LimitError
			if !errors.As(err, &le) || le.Limit != tc.limit || le.N != tc.n || errors.Is(err, ErrMalformed) {
				t.Fatalf("err = %v, want a LimitError of %v for %d", err, tc.limit, tc.n)
			}
			if bytes > 16<<10 {
				t.Fatalf("refusing a %d-byte payload allocated %d bytes", len(tc.payload), bytes)
			}
			if _, err := Decode(tc.payload); !errors.As(err, &le) {
				t.Fatalf("Decode: %v", err)
			}
		})
	}
}

// Limits set on a Decoder are exact bounds: a list as long as its bound
// decodes, one element more is refused.
func TestDecoderLimits(t *testing.T) {
	lim := Limits{MaxMessageBytes: 400, MaxEventsPerBatch: 2, MaxBlocksPerEvent: 3, MaxTokensPerEvent: 6}
	stored := func(blocks, tokens int) Event {
		return Event{Kind: BlockStored, BlockHashes: make([]uint64, blocks), TokenIDs: make([]uint32, tokens), BlockSize: 2}
	}
	for _, tc := range []struct {
		name  string
		b     Batch
		limit Limit // NumLimits: within the limits
	}{
		{"at every bound", Batch{Events: []Event{stored(3, 6), stored(3, 6)}}, NumLimits},
		{"one event too many", Batch{Events: []Event{stored(1, 2), stored(1, 2), stored(1, 2)}}, LimitEvents},
		{"one block too many", Batch{Events: []Event{stored(4, 6)}}, LimitBlocks},
		{"one token too many", Batch{Events: []Event{stored(3, 7)}}, LimitTokens},
		{"too long", Batch{Events: []Event{{Kind: BlockRemoved, Medium: string(make([]byte, 200))},
			{Kind: BlockRemoved, Medium: string(make([]byte, 200))}}}, LimitMessageBytes},
	} {
		for _, s := range []Shape{ShapeArray, ShapeMixed, ShapeMap} {
			d := Decoder{Limits: lim}
			_, err := d.Decode(EncodeShape(nil, tc.b, s))
			var le *LimitError
			switch {
			case tc.limit == NumLimits && err != nil:
				t.Errorf("%s, shape %d: %v", tc.name, s, err)
			case tc.limit != NumLimits && (!errors.As(err, &le) || le.Limit != tc.limit):
				t.Errorf("%s, shape %d: err = %v, want a LimitError of %v", tc.name, s, err, tc.limit)
			}
		}
	}
}

// A Decoder lets go of the memory a huge batch made it grow, and keeps
// that of ordinary ones.
func TestDecoderLetsGoOfAHugeBatch(t *testing.T) {
	held := func(d *Decoder) int {
		n := 0
		for _, e := range d.events[:cap(d.events)] {
			n += 4 * cap(e.TokenIDs)
		}
		return n
	}
	var huge Batch
	for range 8 {
		huge.Events = append(huge.Events, Event{Kind: BlockStored, BlockHashes: []uint64{1}, TokenIDs: make([]uint32, 200_000), BlockSize: 200_000})
	}
	var d Decoder
	if _, err := d.Decode(EncodeShape(nil, huge, ShapeArray)); err != nil {
		t.Fatal(err)
	}
	if held(&d) < 6<<20 {
		t.Fatalf("the huge batch took %d bytes of token ids", held(&d))
	}
	small := benchPayload(ShapeArray)
	for range 2 {
		if _, err := d.Decode(small); err != nil {
			t.Fatal(err)
		}
	}
	if n := held(&d); n > maxRetained {
		t.Fatalf("%d bytes of token ids kept after the huge batch", n)
	}
	if n := testing.AllocsPerRun(10, func() { d.Decode(small) }); n != 0 {
		t.Fatalf("an ordinary batch after it allocates %v times", n)
	}
}

// tokensBatch is a batch of one BlockStored of n token ids (one byte of
// msgpack each) in one block, whose hash is id.
func tokensBatch(id uint64, n int) Batch {
	return Batch{TS: float64(id), DPRank: intp(0), Events: []Event{
		{Kind: BlockStored, BlockHashes: []uint64{id}, TokenIDs: make([]uint32, n), BlockSize: int64(n), Medium: "GPU"},
	}}
}

// Over a real socket, each message past one of the Limits is counted by
// the bound it passed and skipped, live or replayed, without a gap or a
// reset: the batches around them are applied in order. A message past
// MaxMessageBytes never reaches zmq4 whole: the transport elides it (the
// message of a long topic is one the Decoder alone would have read).
func TestOverLimitSkipped(t *testing.T) {
	lim := Limits{MaxMessageBytes: 64 << 10, MaxEventsPerBatch: 4, MaxBlocksPerEvent: 8, MaxTokensPerEvent: 1024}
	r := newRig(t, PublisherOptions{ReplayEndpoint: "tcp://127.0.0.1:0"}, SubscriberOptions{Limits: lim})
	publishRaw := func(b Batch) {
		t.Helper()
		if _, err := r.pub.PublishRaw(EncodeShape(nil, b, ShapeArray)); err != nil {
			t.Fatal(err)
		}
	}
	r.publish(t, 1) // seq 0
	big := EncodeShape(nil, tokensBatch(2, 1000), ShapeArray)
	big[0]++ // a fourth field, one the Decoder skips: 60 KiB of bytes
	big = msgp.AppendBytes(big, make([]byte, 60<<10))
	if _, err := (&Decoder{Limits: lim}).Decode(big); err != nil {
		t.Fatalf("the long-topic message's payload alone: %v", err)
	}
	publishRaw(tokensBatch(2, 100<<10)) // seq 1: a 100 KiB payload
	r.pub.SkipSeq(1)                    // seq 2: sent by hand, with a topic of 8 KiB
	if err := r.pub.pub.SendMulti(zmq4.NewMsgFrom(make([]byte, 8<<10), seqBytes(2), big)); err != nil {
		t.Fatal(err)
	}
	var many Batch
	for range 5 {
		many.Events = append(many.Events, batchFor(3).Events[0])
	}
	publishRaw(many) // seq 3
	wide := batchFor(4)
	wide.Events[0].BlockHashes = make([]uint64, 9)
	publishRaw(wide)                    // seq 4
	publishRaw(tokensBatch(5, 1025))    // seq 5
	r.pub.Drop(tokensBatch(6, 100<<10)) // seq 6: lost, and past the limit in replay too
	r.publish(t, 7)                     // seq 7: shows the gap
	r.waitApplied(t, 2)
	seqs, first, resets := r.col.snapshot()
	st := r.sub.Stats()
	want := [NumLimits]uint64{LimitMessageBytes: 3, LimitEvents: 1, LimitBlocks: 1, LimitTokens: 1}
	if !equal(seqs, []uint64{0, 7}) || !equal(first, []uint64{1, 7}) || len(resets) != 0 {
		t.Fatalf("seqs %v first %v resets %v", seqs, first, resets)
	}
	if st.OverLimit != want || st.Received != 7 || st.Applied != 2 || st.Gaps != 1 || st.Resets != 0 || st.Malformed != 0 {
		t.Fatalf("stats %+v, want OverLimit %v", st, want)
	}
}

// A Listener bounds the messages of every engine that dials it as they
// arrive: past its MaxMessageBytes a batch is counted and skipped by its
// Subscriber (whose own Limits would have read it), and the engine's
// connection and the batches after it go on.
func TestListenerBoundsMessages(t *testing.T) {
	l, err := ListenLimits("tcp://127.0.0.1:0", Limits{MaxMessageBytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	pub, err := NewPublisher(PublisherOptions{Connect: l.Addr(), Topic: "kv@a"})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	col := &collector{}
	sub, err := NewSubscriber(SubscriberOptions{Listener: l, Topic: "kv@a", OnBatch: col.onBatch, OnReset: col.onReset})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	testwait.Until(t, "the subscription", pub.Subscribed)
	for _, b := range []Batch{batchFor(1), tokensBatch(2, 100<<10), batchFor(3)} {
		if _, err := pub.Publish(b); err != nil {
			t.Fatal(err)
		}
	}
	testwait.Until(t, "the batches", func() bool { s, _, _ := col.snapshot(); return len(s) == 2 })
	seqs, first, resets := col.snapshot()
	st := sub.Stats()
	if !equal(seqs, []uint64{0, 2}) || !equal(first, []uint64{1, 3}) || len(resets) != 0 ||
		st.OverLimit[LimitMessageBytes] != 1 || st.Gaps != 0 || st.Malformed != 0 {
		t.Fatalf("seqs %v first %v resets %v stats %+v", seqs, first, resets, st)
	}
}
