// Command kvcapture records an engine's KV event messages and replay replies
// as they are on the wire, for testdata/thirdparty (see its README.md):
//
//	go run ./internal/tools/kvcapture OUT_DIR BIND_ENDPOINT REPLAY_ENDPOINT SECONDS
//
// It binds a SUB at BIND_ENDPOINT (the engine dials it), saves every live
// message for SECONDS, then asks REPLAY_ENDPOINT for everything from
// sequence 0 and saves each reply. Each file holds the frames as a 4-byte
// big-endian length and the bytes.
package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"time"

	"github.com/go-zeromq/zmq4"
)

func main() {
	out := os.Args[1]
	bind := os.Args[2]
	replay := os.Args[3]
	n := 0
	sub := zmq4.NewSub(context.Background())
	sub.SetOption(zmq4.OptionSubscribe, "")
	if err := sub.Listen(bind); err != nil {
		panic(err)
	}
	go func() {
		for {
			m, err := sub.Recv()
			if err != nil {
				return
			}
			seq := binary.BigEndian.Uint64(m.Frames[1])
			fmt.Printf("live topic=%q seq=%d payload=%d bytes\n", m.Frames[0], seq, len(m.Frames[2]))
			os.WriteFile(fmt.Sprintf("%s/live-%03d.bin", out, n), encodeFrames(m.Frames), 0o644)
			n++
		}
	}()
	time.Sleep(time.Duration(mustAtoi(os.Args[4])) * time.Second)
	d := zmq4.NewDealer(context.Background())
	if err := d.Dial(replay); err != nil {
		panic(err)
	}
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], 0)
	d.SendMulti(zmq4.NewMsgFrom([]byte{}, b[:]))
	for i := 0; ; i++ {
		m, err := d.Recv()
		if err != nil {
			panic(err)
		}
		fmt.Printf("replay frames=%d\n", len(m.Frames))
		os.WriteFile(fmt.Sprintf("%s/replay-%03d.bin", out, i), encodeFrames(m.Frames), 0o644)
		if len(m.Frames) >= 2 && len(m.Frames[len(m.Frames)-2]) == 8 && binary.BigEndian.Uint64(m.Frames[len(m.Frames)-2]) == ^uint64(0) {
			break
		}
	}
}

// encodeFrames: each frame as a 4-byte big-endian length and its bytes.
func encodeFrames(fs [][]byte) []byte {
	var out []byte
	for _, f := range fs {
		out = binary.BigEndian.AppendUint32(out, uint32(len(f)))
		out = append(out, f...)
	}
	return out
}

func mustAtoi(s string) int {
	var n int
	fmt.Sscan(s, &n)
	return n
}
