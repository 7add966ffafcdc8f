package kvevents

import (
	"errors"
	"fmt"
	"math"

	"github.com/tinylib/msgp/msgp"
)

// This file keeps a slow reference reading of a payload: msgp's generic
// decoder turns it into Go values (map[string]any, []any, int64, uint64,
// float64, string, []byte, nil), and plain code reads the batch out of them
// by the rules of the package doc. FuzzDecode holds Decode to it: a payload
// Decode accepts reads the same both ways (ExtraKeys compared by presence:
// the reference keeps no raw bytes).

var errRef = errors.New("reference: malformed")

func refErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errRef, fmt.Sprintf(format, args...))
}

func refDecode(p []byte) (Batch, error) {
	v, rest, err := msgp.ReadIntfBytes(p)
	if err != nil {
		return Batch{}, err
	}
	if len(rest) != 0 {
		return Batch{}, refErr("trailing bytes")
	}
	var b Batch
	var ts, events, dp any
	var haveDP bool
	switch v := v.(type) {
	case []any:
		if len(v) < 2 {
			return b, refErr("short batch")
		}
		ts, events = v[0], v[1]
		if len(v) > 2 {
			dp, haveDP = v[2], true
		}
	case map[string]any:
		var ok1, ok2 bool
		ts, ok1 = v["ts"]
		events, ok2 = v["events"]
		if !ok1 || !ok2 {
			return b, refErr("no ts or events")
		}
		dp, haveDP = v["data_parallel_rank"]
	default:
		return b, refErr("batch %T", v)
	}
	switch ts := ts.(type) {
	case float64:
		b.TS = ts
	case float32:
		b.TS = float64(ts)
	case int64:
		b.TS = float64(ts)
	case uint64:
		b.TS = float64(ts)
	default:
		return b, refErr("ts %T", ts)
	}
	if haveDP && dp != nil {
		r, ok := refSigned(dp)
		if !ok || r < math.MinInt32 || r > math.MaxInt32 {
			return b, refErr("dp rank %v", dp)
		}
		ri := int(r)
		b.DPRank = &ri
	}
	list, ok := events.([]any)
	if !ok {
		return b, refErr("events %T", events)
	}
	for _, ev := range list {
		e, err := refEvent(ev)
		if err != nil {
			return b, err
		}
		b.Events = append(b.Events, e)
	}
	return b, nil
}

func refSigned(v any) (int64, bool) {
	switch v := v.(type) {
	case int64:
		return v, true
	case uint64:
		return int64(v), v <= math.MaxInt64
	}
	return 0, false
}

func refHash(v any) (uint64, bool) {
	switch v := v.(type) {
	case int64:
		return uint64(v), true
	case uint64:
		return v, true
	case []byte:
		var h uint64
		for _, c := range v { // keeps the last 8 bytes
			h = h<<8 | uint64(c)
		}
		return h, true
	}
	return 0, false
}

func refEvent(v any) (Event, error) {
	var e Event
	var names []string
	fields := map[string]any{}
	switch v := v.(type) {
	case []any:
		if len(v) == 0 {
			return e, refErr("empty event")
		}
		tag, _ := v[0].(string)
		switch tag {
		case "BlockStored":
			names = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
				"lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
		case "BlockRemoved":
			names = []string{"block_hashes", "medium", "group_idx"}
		case "AllBlocksCleared":
		default:
			return e, refErr("tag %v", v[0])
		}
		fields["type"] = tag
		for i, x := range v[1:] {
			if i < len(names) {
				fields[names[i]] = x
			}
		}
	case map[string]any:
		fields = v
	default:
		return e, refErr("event %T", v)
	}
	switch fields["type"] {
	case "BlockStored":
		e.Kind = BlockStored
	case "BlockRemoved":
		e.Kind = BlockRemoved
	case "AllBlocksCleared":
		return Event{Kind: AllBlocksCleared}, nil
	default:
		return e, refErr("tag %v", fields["type"])
	}
	hs, ok := fields["block_hashes"].([]any)
	if !ok {
		return e, refErr("block_hashes")
	}
	for _, h := range hs {
		x, ok := refHash(h)
		if !ok {
			return e, refErr("hash %T", h)
		}
		e.BlockHashes = append(e.BlockHashes, x)
	}
	str := func(name string) (string, error) {
		switch s := fields[name].(type) {
		case nil:
			return "", nil
		case string:
			return s, nil
		}
		return "", refErr("%s %T", name, fields[name])
	}
	opt := func(name string) (int64, bool, error) {
		if fields[name] == nil {
			return 0, false, nil
		}
		x, ok := refSigned(fields[name])
		if !ok {
			return 0, false, refErr("%s %v", name, fields[name])
		}
		return x, true, nil
	}
	var err error
	if e.Medium, err = str("medium"); err != nil {
		return e, err
	}
	if e.GroupIdx, e.HasGroupIdx, err = opt("group_idx"); err != nil {
		return e, err
	}
	if e.Kind == BlockRemoved {
		return e, nil
	}
	for _, name := range []string{"parent_block_hash", "token_ids", "block_size"} {
		if _, ok := fields[name]; !ok {
			return e, refErr("no %s", name)
		}
	}
	if p := fields["parent_block_hash"]; p != nil {
		if e.ParentHash, e.HasParent = refHash(p); !e.HasParent {
			return e, refErr("parent %T", p)
		}
	}
	ts, ok := fields["token_ids"].([]any)
	if !ok {
		return e, refErr("token_ids")
	}
	for _, tv := range ts {
		x, ok := refSigned(tv)
		if !ok || x < 0 || x > math.MaxUint32 {
			return e, refErr("token %v", tv)
		}
		e.TokenIDs = append(e.TokenIDs, uint32(x))
	}
	if e.BlockSize, ok = refSigned(fields["block_size"]); !ok {
		return e, refErr("block_size")
	}
	if e.LoraID, e.HasLoraID, err = opt("lora_id"); err != nil {
		return e, err
	}
	if e.LoraName, err = str("lora_name"); err != nil {
		return e, err
	}
	if e.SpecKind, err = str("kv_cache_spec_kind"); err != nil {
		return e, err
	}
	if e.SlidingWindow, e.HasSlidingWindow, err = opt("kv_cache_spec_sliding_window"); err != nil {
		return e, err
	}
	if fields["extra_keys"] != nil {
		e.ExtraKeys = []byte{} // present; the bytes are not compared
	}
	return e, nil
}

func sameIgnoringRaw(a, b Batch) bool {
	strip := func(x Batch) Batch {
		y := x
		y.Events = make([]Event, len(x.Events))
		for i, e := range x.Events {
			if e.ExtraKeys != nil {
				e.ExtraKeys = []byte{}
			}
			y.Events[i] = e
		}
		return y
	}
	return same(strip(a), strip(b))
}
