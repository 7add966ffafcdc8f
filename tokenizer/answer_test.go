package tokenizer

import (
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"testing"
	"testing/iotest"
)

// readAnswer reads what encoding/json reads of a TokenizeResponse, and
// refuses what it cannot take whole.
func TestReadAnswer(t *testing.T) {
	for _, c := range []struct {
		in    string
		ids   []int32
		count int
		bad   bool
	}{
		{in: `{"count":3,"max_model_len":8192,"tokens":[1,2,3]}`, ids: []int32{1, 2, 3}, count: 3},
		{in: ` { "tokens" : [ 7 , 4294967295 ,0 ] , "count" : 3 } `, ids: []int32{7, -1, 0}, count: 3},
		{in: `{"tokens":[],"count":0}`, ids: []int32{}, count: 0},
		{in: `{"tokens":[5]}`, ids: []int32{5}, count: -1},
		{in: `{"count":2,"tokens":[5,6],"token_strs":["a\"]",{"x":[1,{"y":null}]},true,-1.5e3]}`, ids: []int32{5, 6}, count: 2},
		{in: `{"tok\u0065ns":[9],"count":1}`, ids: []int32{9}, count: 1},
		{in: `{"tokens":[1],"tokens":[2]}`, bad: true},
		{in: `{"tokens":[4294967296]}`, bad: true},
		{in: `{"tokens":[-1]}`, bad: true},
		{in: `{"tokens":[1.5]}`, bad: true},
		{in: `{"tokens":[1,]}`, bad: true},
		{in: `{"tokens":[1]`, bad: true},
		{in: `{"count":3}`, bad: true},
		{in: `[1,2]`, bad: true},
		{in: `{"count":2,"tokens":[1,2],"x":` + strings.Repeat("[", 70) + strings.Repeat("]", 70) + `}`, bad: true},
		{in: `{"tokens":[1,2,3,4,5,6,7,8,9,10,11]}`, bad: true}, // over the limit of 10
		{in: `{"count":11,"tokens":[1]}`, bad: true},
	} {
		ids, count, err := readAnswer(strings.NewReader(c.in), 10)
		if c.bad {
			if err == nil {
				t.Errorf("%s: read as %v", c.in, ids)
			}
			continue
		}
		if err != nil || count != c.count || fmt.Sprint(ids) != fmt.Sprint(c.ids) {
			t.Errorf("%s: %v count %d (%v), want %v count %d", c.in, ids, count, err, c.ids, c.count)
		}
	}
}

// FuzzReadAnswer: whatever readAnswer takes, encoding/json reads alike.
func FuzzReadAnswer(f *testing.F) {
	f.Add(`{"count":3,"max_model_len":8192,"tokens":[1,2,3]}`)
	f.Add(`{"tokens":[7,4294967295],"token_strs":["a","b"]}`)
	f.Add(`{"tokens":[],"x":{"y":[true,null,"\\"]}}`)
	f.Add(`{"count":4,"tokens":[ 12 ,345,6789 , 0]}`)
	f.Add(`{"tokens":[1,2,]}`)
	f.Fuzz(func(t *testing.T, in string) {
		ids, count, err := readAnswer(strings.NewReader(in), 1000)
		// Read in pieces (ids across the buffer's end), the same.
		for _, r := range []io.Reader{iotest.OneByteReader(strings.NewReader(in)), iotest.HalfReader(strings.NewReader(in))} {
			pids, pcount, perr := readAnswer(r, 1000)
			if (perr == nil) != (err == nil) || pcount != count || !slices.Equal(pids, ids) {
				t.Fatalf("%q: %v %d %v, in pieces %v %d %v", in, ids, count, err, pids, pcount, perr)
			}
		}
		if err != nil {
			return
		}
		var ref struct {
			Tokens []uint32 `json:"tokens"`
		}
		if jerr := json.Unmarshal([]byte(in), &ref); jerr != nil {
			if strings.Contains(jerr.Error(), "invalid character") && !json.Valid([]byte(in)) {
				return // a number or literal the router skips unchecked, as it does not read it
			}
			t.Fatalf("%q: read %v, encoding/json: %v", in, ids, jerr)
		}
		if len(ref.Tokens) != len(ids) {
			t.Fatalf("%q: %v, encoding/json %v", in, ids, ref.Tokens)
		}
		for i := range ids {
			if uint32(ids[i]) != ref.Tokens[i] {
				t.Fatalf("%q: %v, encoding/json %v", in, ids, ref.Tokens)
			}
		}
	})
}

// A long answer costs its ids and a small buffer, not a decoder's copy of
// it and reflection's growth (a 15 MiB prompt's 3.9 M ids cost 157 MiB
// through encoding/json): at most the ids' bytes and 1 MiB.
func TestReadAnswerCostsItsIDs(t *testing.T) {
	const n = 1 << 20
	var b strings.Builder
	b.WriteString(`{"count":1048576,"max_model_len":2000000,"tokens":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, 100000+i%50000)
	}
	b.WriteString(`]}`)
	answer := b.String()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ids, _, err := readAnswer(strings.NewReader(answer), 2*n)
	runtime.ReadMemStats(&after)
	if err != nil || len(ids) != n {
		t.Fatalf("%d ids, %v", len(ids), err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 4*n+1<<20 {
		t.Fatalf("reading %d ids (%d bytes of JSON) allocated %d bytes, want at most %d", n, len(answer), alloc, 4*n+1<<20)
	}
}
