package router

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	pb "github.com/semroute/semroute/api/proto/semroute/v1"
	"github.com/semroute/semroute/blockhash"
	"github.com/semroute/semroute/limits"
)

// cannedTransport answers every request in memory.
type cannedTransport struct{}

func (cannedTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil { // read and close it, as a RoundTripper must
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
	}
	body := `{"choices":[{"message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":3,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`
	return &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"application/json"}},
		Body: io.NopCloser(strings.NewReader(body)), Request: r}, nil
}

// FuzzRoutedHandler: any body, on either endpoint, gets 200 or an
// OpenAI-style 4xx error, and never a panic or a 5xx.
func FuzzRoutedHandler(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`), true)
	f.Add([]byte(`{"model":"m","prompt":[1,2,3],"max_tokens":5}`), false)
	f.Add([]byte(`{"model":"m","tools":[{"type":"function"}],"messages":[{"role":"tool","content":[{"type":"text","text":"x"}]}]}`), true)
	f.Add([]byte("\xff\xfe"), true)
	fx := newFixture(f, 3, "semantic")
	core, err := NewCore(CoreOptions{Engine: fx.e, Arms: fx.arms()})
	if err != nil {
		f.Fatal(err)
	}
	srv, err := NewServer(ServerOptions{Core: core, Transport: cannedTransport{}, RecordReplies: true,
		Limits: limits.Request{MaxBodyBytes: 1 << 16, Parse: blockhash.Limits{MaxMessages: 64}}})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		path := "/v1/completions"
		if chat {
			path = "/v1/chat/completions"
		}
		req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		srv.ServeHTTP(w, req)
		switch {
		case w.Code == 200:
		case w.Code >= 400 && w.Code < 500:
			var e struct {
				Error struct{ Message, Type, Code string } `json:"error"`
			}
			if json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Message == "" || e.Error.Code == "" {
				t.Fatalf("%d with a body that is not an OpenAI error: %s", w.Code, w.Body.Bytes())
			}
		default:
			t.Fatalf("status %d for %q", w.Code, body)
		}
		for _, r := range fx.e.Pool().Replicas() {
			if l := r.Load(fx.now); l.InFlight != 0 {
				t.Fatalf("load left behind: %+v", l)
			}
		}
	})
}

// FuzzReplyCapture: any response bytes, in any read sizes, are passed
// through unchanged and never panic the reply and usage reader.
func FuzzReplyCapture(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n"), true, uint8(3))
	f.Add([]byte(`{"choices":[{"message":{"content":"x","tool_calls":[{"index":2,"function":{"name":"f"}}]}}],"usage":{}}`), false, uint8(1))
	f.Fuzz(func(t *testing.T, body []byte, sse bool, step uint8) {
		c := &replyCapture{rc: io.NopCloser(&chunked{b: body, step: int(step%16) + 1}), sse: sse, limit: 256}
		out, err := io.ReadAll(c)
		if err != nil || !bytes.Equal(out, body) {
			t.Fatalf("passed through %q (%v), want %q", out, err, body)
		}
		c.reply()
		c.tokens()
	})
}

type chunked struct {
	b    []byte
	step int
}

func (c *chunked) Read(p []byte) (int, error) {
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), c.step)], c.b)
	c.b = c.b[n:]
	return n, nil
}

// FuzzGRPCRequest: any RouteRequest translates into a request Admit
// parses, or returns an error.
func FuzzGRPCRequest(f *testing.F) {
	f.Add("m", []byte(`{"model":"m","prompt":"x"}`), "user", "hello", "system", uint8(0))
	f.Add("", []byte("{"), "", "", "weird", uint8(3))
	lim := limits.Request{Parse: blockhash.Limits{MaxMessages: 8}}.WithDefaults()
	f.Fuzz(func(t *testing.T, model string, body []byte, role, content, kind string, form uint8) {
		in := &pb.RouteRequest{Model: model}
		switch form % 5 {
		case 0:
			in.Input = &pb.RouteRequest_OpenaiBody{OpenaiBody: body}
		case 1:
			in.Input = &pb.RouteRequest_Messages{Messages: &pb.ChatMessages{Messages: []*pb.ChatMessage{{Role: role, Content: content}}}}
		case 2:
			in.Input = &pb.RouteRequest_Prompt{Prompt: content}
		case 3:
			in.Input = &pb.RouteRequest_Blocks{Blocks: &pb.Blocks{Blocks: []*pb.Block{{Text: content, Kind: kind}}}}
		case 4:
			ids := make([]int32, len(body))
			for i, b := range body {
				ids[i] = int32(b)
			}
			in.Input = &pb.RouteRequest_TokenIds{TokenIds: &pb.TokenIds{Ids: ids}}
		}
		a, err := arrival(in, &lim)
		if err != nil {
			return
		}
		r, err := parseArrival(a, &lim)
		if err == nil && (r == nil || len(r.Parts) == 0) {
			t.Fatal("a request without parts converted without error")
		}
	})
}
