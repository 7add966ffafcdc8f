package simreplica

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/semroute/semroute/internal/testwait"
)

// schedStep is one step of a scheduler script: what a request does, and
// the admissions and preemptions it brings about, in order.
type schedStep struct {
	do       string // arrive, prefilled, grow, leave
	q        string // the request's name
	priority int    // arrive
	tokens   int    // arrive, grow
	want     string // the events, space-separated: "admit a preempt b"
	refused  bool   // grow: the request itself was preempted
}

// runScript plays steps on a scheduler of maxRunning requests and
// numBlocks blocks of 4 tokens, checking each step's events.
func runScript(t *testing.T, maxRunning, numBlocks int, steps []schedStep) {
	t.Helper()
	p := newPriorityScheduler(maxRunning, numBlocks, 4)
	seqs := map[string]*seq{}
	names := map[*seq]string{}
	adms := map[string]*admission{} // each request's last admission, stale once it is preempted
	var events []string
	p.trace = func(ev string, q *seq) {
		events = append(events, ev+" "+names[q])
		if ev == "admit" {
			adms[names[q]] = q.cur
		}
	}
	for i, st := range steps {
		events = events[:0]
		q := seqs[st.q]
		ok := true
		switch st.do {
		case "arrive":
			q = &seq{priority: st.priority}
			seqs[st.q], names[q] = q, st.q
			p.arrive(q, st.tokens)
		case "prefilled":
			ok = p.prefilled(adms[st.q])
		case "grow":
			ok = p.grow(adms[st.q], st.tokens)
		case "leave":
			p.leave(q)
		default:
			t.Fatalf("step %d: unknown step %q", i, st.do)
		}
		if got := strings.Join(events, " "); got != st.want {
			t.Fatalf("step %d (%s %s): events %q, want %q", i, st.do, st.q, got, st.want)
		}
		if ok == st.refused {
			t.Fatalf("step %d (%s %s): reported %v", i, st.do, st.q, ok)
		}
	}
	var held int64
	for _, q := range p.running {
		held += q.blocks
	}
	if held+p.free != int64(numBlocks) {
		t.Fatalf("blocks held %d + free %d != %d", held, p.free, numBlocks)
	}
}

// TestPrioritySchedulerOrder plays vLLM's priority policy step by step:
// the order requests are admitted in, what stops admission, and which
// running request a full KV cache preempts.
func TestPrioritySchedulerOrder(t *testing.T) {
	cases := []struct {
		name                  string
		maxRunning, numBlocks int
		steps                 []schedStep
	}{{
		name: "waiting requests go by priority, then arrival", maxRunning: 1, numBlocks: 100,
		steps: []schedStep{
			{do: "arrive", q: "a", priority: 0, tokens: 8, want: "admit a"},
			{do: "arrive", q: "b", priority: 5, tokens: 8},
			{do: "arrive", q: "c", priority: -1, tokens: 8},
			{do: "arrive", q: "d", priority: 0, tokens: 8},
			{do: "arrive", q: "e", priority: -1, tokens: 8},
			{do: "prefilled", q: "a"}, // one running at most
			{do: "leave", q: "a", want: "admit c"},
			{do: "leave", q: "c", want: "admit e"},
			{do: "leave", q: "e", want: "admit d"},
			{do: "leave", q: "d", want: "admit b"},
		},
	}, {
		name: "one prefill at a time", maxRunning: 4, numBlocks: 100,
		steps: []schedStep{
			{do: "arrive", q: "a", tokens: 8, want: "admit a"},
			{do: "arrive", q: "b", priority: 1, tokens: 8},
			{do: "arrive", q: "c", priority: -1, tokens: 8},
			{do: "prefilled", q: "a", want: "admit c"},
			{do: "prefilled", q: "c", want: "admit b"},
		},
	}, {
		name: "a head the KV cache cannot hold stops admission", maxRunning: 4, numBlocks: 4,
		steps: []schedStep{
			{do: "arrive", q: "a", tokens: 8, want: "admit a"}, // 2 blocks
			{do: "prefilled", q: "a"},
			{do: "arrive", q: "big", priority: -1, tokens: 12}, // 3 blocks: 2 free
			{do: "arrive", q: "small", priority: 0, tokens: 4}, // would fit, but waits behind big
			{do: "leave", q: "a", want: "admit big"},
			{do: "prefilled", q: "big", want: "admit small"},
		},
	}, {
		name: "a full cache preempts the least important running request", maxRunning: 4, numBlocks: 4,
		steps: []schedStep{
			{do: "arrive", q: "low", priority: 1, tokens: 8, want: "admit low"},
			{do: "prefilled", q: "low"},
			{do: "arrive", q: "high", priority: -1, tokens: 8, want: "admit high"},
			{do: "prefilled", q: "high"},
			{do: "grow", q: "high", tokens: 8},                                     // no new block
			{do: "grow", q: "high", tokens: 9, want: "preempt low"},                // a third block, none free
			{do: "grow", q: "high", tokens: 16},                                    // the fourth, freed by low
			{do: "arrive", q: "mid", priority: 0, tokens: 4},                       // waits: no block free
			{do: "leave", q: "high", want: "admit mid"},                            // mid before low
			{do: "prefilled", q: "mid", want: "admit low"},                         // low again, for its 8 tokens
			{do: "grow", q: "low", tokens: 13, want: "preempt low", refused: true}, // two more blocks, one free: low is the least important
		},
	}, {
		name: "between equals the latest arrival is preempted, itself too", maxRunning: 4, numBlocks: 4,
		steps: []schedStep{
			{do: "arrive", q: "first", tokens: 8, want: "admit first"},
			{do: "prefilled", q: "first"},
			{do: "arrive", q: "second", tokens: 8, want: "admit second"},
			{do: "prefilled", q: "second"},
			{do: "grow", q: "second", tokens: 9, want: "preempt second", refused: true},
			{do: "grow", q: "second", tokens: 10, refused: true}, // its admission is over
			{do: "leave", q: "first", want: "admit second"},
		},
	}, {
		name: "priority beats arrival in the choice of a victim", maxRunning: 4, numBlocks: 4,
		steps: []schedStep{
			{do: "arrive", q: "old", priority: 5, tokens: 8, want: "admit old"},
			{do: "prefilled", q: "old"},
			{do: "arrive", q: "new", priority: 0, tokens: 8, want: "admit new"},
			{do: "prefilled", q: "new"},
			{do: "grow", q: "new", tokens: 9, want: "preempt old"},
		},
	}, {
		name: "a preempted prefill loses its turn and its blocks", maxRunning: 4, numBlocks: 4,
		steps: []schedStep{
			{do: "arrive", q: "a", priority: -1, tokens: 8, want: "admit a"},
			{do: "prefilled", q: "a"},
			{do: "arrive", q: "b", priority: 1, tokens: 8, want: "admit b"}, // computing its prompt
			{do: "arrive", q: "c", priority: 2, tokens: 4},                  // waits for the prefill turn
			{do: "grow", q: "a", tokens: 9, want: "preempt b"},              // b waits again, before c, for 2 blocks: 1 free
			{do: "prefilled", q: "b", refused: true},                        // its prefill is lost
			{do: "leave", q: "a", want: "admit b"},
		},
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { runScript(t, tc.maxRunning, tc.numBlocks, tc.steps) })
	}
}

// TestPrioritySchedulerLeave checks that a request leaving, waiting or
// running, gives back what it held, and that its preemption wakes it.
func TestPrioritySchedulerLeave(t *testing.T) {
	p := newPriorityScheduler(1, 4, 4)
	a, b := &seq{}, &seq{priority: 1}
	p.arrive(a, 8)
	p.arrive(b, 8)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, ok := p.resume(ctx, b); ok {
		t.Fatal("b resumed while a runs and ctx ended")
	}
	p.leave(b) // waiting
	if p.waiting.Len() != 0 || b.state != seqIdle {
		t.Fatalf("b left but waits: %d waiting, state %d", p.waiting.Len(), b.state)
	}
	adm, ok := p.resume(context.Background(), a)
	if !ok || adm != a.cur {
		t.Fatal("a is running but did not resume")
	}
	if !p.grow(adm, 16) || p.free != 0 {
		t.Fatalf("a grew to 16 tokens: free %d", p.free)
	}
	p.leave(a)
	p.leave(a) // twice: nothing
	select {
	case <-adm.stop:
	default:
		t.Fatal("a's admission was not stopped when it left")
	}
	if p.free != 4 || len(p.running) != 0 || p.prefiller != nil {
		t.Fatalf("after a left: free %d, running %d, prefiller %v", p.free, len(p.running), p.prefiller)
	}
	if p.grow(adm, 20) || p.prefilled(adm) {
		t.Fatal("an ended admission grew or prefilled")
	}
}

// schedTrace records a server's admissions and preemptions, each request
// named by its priority.
type schedTrace struct {
	mu     sync.Mutex
	events []string
}

func traceScheduler(r *Running) *schedTrace {
	tr := &schedTrace{}
	r.prio.mu.Lock()
	defer r.prio.mu.Unlock()
	r.prio.trace = func(ev string, q *seq) {
		tr.mu.Lock()
		tr.events = append(tr.events, fmt.Sprintf("%s %d", ev, q.priority))
		tr.mu.Unlock()
	}
	return tr
}

func (tr *schedTrace) String() string {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return strings.Join(tr.events, ", ")
}

// waitFor waits until the trace is want.
func (tr *schedTrace) waitFor(t *testing.T, want string) {
	t.Helper()
	testwait.Value(t, want, func() (string, bool) { s := tr.String(); return s, s == want })
}

// post sends body to r's path under ctx in the background; the result
// comes on the channel: the status, or 0 when the request failed.
func post(ctx context.Context, r *Running, path, body string) <-chan int {
	done := make(chan int, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.URL+path, strings.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- 0
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	return done
}

// gated is a priority replica whose requests take no time but for their
// output tokens after the first, an hour each: a request of max_tokens 2
// runs until it is cancelled, one of max_tokens 1 ends once admitted.
func gated(t *testing.T, o Options) *Running {
	o.Scheduling, o.Tokenizer = SchedulingPriority, TokenizerBytes
	o.Overhead, o.PrefillPerToken, o.InterToken = -1, -1, time.Hour
	return start(t, o)
}

// TestPriorityReplicaAdmitsByPriority: while one request runs, three wait;
// they are admitted by their body's priority, lowest first, whatever
// their order of arrival.
func TestPriorityReplicaAdmitsByPriority(t *testing.T) {
	r := gated(t, Options{MaxRunning: 1})
	tr := traceScheduler(r)
	ctx, cancel := context.WithCancel(context.Background())
	first := post(ctx, r, "/v1/completions", `{"model":"sim-model","prompt":"first","max_tokens":2,"priority":3}`)
	tr.waitFor(t, "admit 3")
	var rest []<-chan int
	for _, p := range []int{5, -1, 0} {
		body := fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":"p%d"}],"max_tokens":1,"priority":%d}`, p, p)
		rest = append(rest, post(context.Background(), r, "/v1/chat/completions", body))
		testwait.Until(t, "the request of priority "+strconv.Itoa(p)+" waiting", func() bool {
			r.prio.mu.Lock()
			defer r.prio.mu.Unlock()
			return r.prio.waiting.Len() == len(rest)
		})
	}
	cancel() // the first leaves: the others run one by one
	if code := <-first; code != 0 {
		t.Fatalf("the cancelled request answered %d", code)
	}
	for i, ch := range rest {
		if code := <-ch; code != http.StatusOK {
			t.Fatalf("request %d: %d", i, code)
		}
	}
	tr.waitFor(t, "admit 3, admit -1, admit 0, admit 5")
}

// TestPriorityReplicaPreemptsTheLeastImportant: a request of priority 1
// holds its blocks while a request of priority -1 arrives and fills the
// KV cache; the next block either needs preempts the one of priority 1,
// which runs again, recomputed, once the other has left.
func TestPriorityReplicaPreemptsTheLeastImportant(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) { preemptsTheLeastImportant(t, stream) })
	}
}

func preemptsTheLeastImportant(t *testing.T, stream bool) {
	const bs = 4
	low := fmt.Sprintf(`{"model":"sim-model","prompt":"llllllllllllllllllllllll","max_tokens":4,"priority":1,"stream":%v}`, stream)
	high := fmt.Sprintf(`{"model":"sim-model","prompt":"hhhhhhhhhhhhhhhhhhhhhhhh","max_tokens":4,"priority":-1,"stream":%v}`, stream)
	n := promptTokens(t, `{"model":"sim-model","prompt":"llllllllllllllllllllllll","max_tokens":1}`)
	if n%bs != 0 {
		t.Fatalf("the prompts are %d tokens, want a multiple of %d", n, bs)
	}
	// Room for low's prompt and first output token, and for high's prompt:
	// the block high's first output token needs is not free.
	r := gated(t, Options{BlockSize: bs, NumBlocks: (n+1+bs-1)/bs + n/bs})
	tr := traceScheduler(r)
	lowCtx, cancelLow := context.WithCancel(context.Background())
	lowDone := post(lowCtx, r, "/v1/completions", low)
	tr.waitFor(t, "admit 1")
	highCtx, cancelHigh := context.WithCancel(context.Background())
	highDone := post(highCtx, r, "/v1/completions", high)
	tr.waitFor(t, "admit 1, admit -1, preempt 1")
	cancelHigh()
	tr.waitFor(t, "admit 1, admit -1, preempt 1, admit 1")
	cancelLow()
	<-highDone
	<-lowDone
	testwait.Value(t, "both requests cancelled, every block free", func() (string, bool) {
		st, m := r.Stats(), metricValues(t, r)
		return fmt.Sprintf("%+v %v", st, m), st.Cancelled == 2 && m["vllm:kv_cache_usage_perc"] == "0" &&
			m["vllm:num_requests_running"] == "0" && m["vllm:num_requests_waiting"] == "0"
	})
}

// promptTokens returns the prompt tokens of a completions body on a
// replica with the bytes tokenizer.
func promptTokens(t *testing.T, body string) int {
	t.Helper()
	r := start(t, Options{Overhead: -1, PrefillPerToken: -1, InterToken: -1, Tokenizer: TokenizerBytes})
	code, u, b := call(t, r, "/v1/completions", body)
	if code != http.StatusOK {
		t.Fatalf("%d %s", code, b)
	}
	return u.Prompt
}

// TestPriorityField: a priority replica refuses a priority that is not an
// integer, as vLLM's request models do; an fcfs replica does not read it.
func TestPriorityField(t *testing.T) {
	o := Options{Overhead: -1, PrefillPerToken: -1, InterToken: -1, OutputTokens: 2, Tokenizer: TokenizerBytes}
	fcfs := start(t, o)
	o.Scheduling = SchedulingPriority
	prio := start(t, o)
	for _, tc := range []struct {
		priority string
		want     int // on the priority replica; the fcfs one answers 200
	}{{"0", 200}, {"-7", 200}, {"12", 200}, {"null", 200}, {`"high"`, 400}, {"1.5", 400}, {"true", 400}} {
		body := `{"model":"sim-model","prompt":"x","priority":` + tc.priority + `}`
		if code, _, b := call(t, prio, "/v1/completions", body); code != tc.want {
			t.Errorf("priority %s on the priority replica: %d %s", tc.priority, code, b)
		}
		if code, _, b := call(t, fcfs, "/v1/completions", body); code != 200 {
			t.Errorf("priority %s on the fcfs replica: %d %s", tc.priority, code, b)
		}
	}
	// The Messages API has no priority in vLLM: not read.
	if code, _, b := call(t, prio, "/v1/messages", `{"model":"sim-model","max_tokens":2,"messages":[{"role":"user","content":"x"}],"priority":"high"}`); code != 200 {
		t.Errorf("messages with a priority: %d %s", code, b)
	}
	if _, err := New(Options{Scheduling: "lifo"}); err == nil {
		t.Error("scheduling lifo was accepted")
	}
}

// TestPriorityReplicaAnswersThroughPreemptions: requests of several
// priorities on a KV cache too small for them all preempt one another
// over and over; each gets the whole answer, the same as on an fcfs
// replica, streamed or not, and the replica ends with nothing held.
func TestPriorityReplicaAnswersThroughPreemptions(t *testing.T) {
	o := Options{Overhead: -1, PrefillPerToken: time.Microsecond, InterToken: time.Millisecond, Tokenizer: TokenizerBytes,
		BlockSize: 4, NumBlocks: 24}
	fcfs := start(t, o)
	o.Scheduling = SchedulingPriority
	r := start(t, o)
	var preempted atomic.Int64
	r.prio.mu.Lock()
	r.prio.trace = func(ev string, _ *seq) {
		if ev == "preempt" {
			preempted.Add(1)
		}
	}
	r.prio.mu.Unlock()
	const n = 8
	bodies := make([]string, n)
	for i := range bodies {
		bodies[i] = fmt.Sprintf(`{"model":"sim-model","prompt":"request %d of several","max_tokens":40,"priority":%d,"stream":%v}`, i, i%3-1, i%2 == 0)
	}
	answer := func(r *Running, body string) string {
		resp, err := http.Post(r.URL+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Sprintf("%d %s", resp.StatusCode, b)
		}
		return text(b)
	}
	got := make([]string, n)
	var wg sync.WaitGroup
	for i := range bodies {
		wg.Add(1)
		go func() { defer wg.Done(); got[i] = answer(r, bodies[i]) }()
	}
	wg.Wait()
	for i, body := range bodies {
		if want := answer(fcfs, body); got[i] != want {
			t.Errorf("request %d answered %q, on the fcfs replica %q", i, got[i], want)
		}
	}
	t.Logf("%d preemptions", preempted.Load())
	testwait.Value(t, "every block free", func() (map[string]string, bool) {
		m := metricValues(t, r)
		return m, m["vllm:kv_cache_usage_perc"] == "0" && m["vllm:num_requests_running"] == "0" && m["vllm:num_requests_waiting"] == "0"
	})
}

// text returns the generated text of a completions answer, whole or
// streamed.
func text(b []byte) string {
	var sb strings.Builder
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimPrefix(line, "data: ")
		var ans struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if json.Unmarshal([]byte(line), &ans) == nil {
			for _, c := range ans.Choices {
				sb.WriteString(c.Text)
			}
		}
	}
	return sb.String()
}
