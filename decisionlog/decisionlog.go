// Package decisionlog writes one JSON line per routing decision, so that
// decisions can be audited and replayed under another policy later.
//
// Writing never blocks routing: Log puts a record in a bounded buffer and a
// single goroutine encodes and writes it; when the buffer is full the record
// is dropped and counted. Files rotate by size (path, path.1, … path.N) and
// are fsynced on an interval. Close writes everything still buffered.
// A Writer is safe for concurrent use.
package decisionlog

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Block is one block of a request.
type Block struct {
	Hash   string `json:"hash"` // 16 hex digits
	Kind   string `json:"kind"`
	Tokens int32  `json:"tokens"`
}

// Candidate is one replica as the policy scored it.
type Candidate struct {
	Replica  string  `json:"replica"`
	Score    float64 `json:"score"`
	Matched  int     `json:"matched_tokens"`
	InFlight int64   `json:"in_flight"`
	Pending  float64 `json:"pending_tokens"`
	Recent   float64 `json:"recent_tokens"`
	// Running, Waiting and KVUsage are the replica's own gauges as last
	// scraped (zero when not scraped).
	Running int64   `json:"running,omitempty"`
	Waiting int64   `json:"waiting,omitempty"`
	KVUsage float64 `json:"kv_usage,omitempty"`
	Reason  string  `json:"reason"`
}

// Outcome is what happened to a routed request.
type Outcome struct {
	// Status is the replica's HTTP status; 0 when none came (an error, or a
	// gRPC decision never released).
	Status int `json:"status"`
	// Error describes a failure without a status.
	Error string `json:"error,omitempty"`
	// TTFTNs and DurationNs are nanoseconds from the decision to the first
	// response byte and to the end.
	TTFTNs       int64 `json:"ttft_ns"`
	DurationNs   int64 `json:"duration_ns"`
	PromptTokens int64 `json:"prompt_tokens"`
	OutputTokens int64 `json:"output_tokens"`
	// CachedTokens is usage.prompt_tokens_details.cached_tokens as the
	// replica reported it.
	CachedTokens int64 `json:"cached_tokens"`
	// Replica is the replica that served the request (it differs from the
	// decision's choice after a failover).
	Replica string `json:"replica"`
	// ReplyBlocks are the assistant reply's blocks the router learned.
	ReplyBlocks []Block `json:"reply_blocks,omitempty"`
}

// Record is one decision line.
type Record struct {
	TimeNs int64  `json:"time_ns"` // unix nanoseconds of the decision
	ID     string `json:"id"`
	Arm    string `json:"arm"`
	Policy string `json:"policy"`
	Model  string `json:"model,omitempty"`
	// Session and Tenant are hashed ("h:" + 16 hex digits) unless the
	// router is configured to log them raw.
	Session string `json:"session,omitempty"`
	Tenant  string `json:"tenant,omitempty"`
	// Key is the routing session key, 16 hex digits.
	Key        string      `json:"key"`
	Tokens     int         `json:"prompt_tokens_estimated"`
	Blocks     []Block     `json:"blocks"`
	Candidates []Candidate `json:"candidates"`
	// Replicas lists every replica of the pool in order, available or not,
	// and Budgets their token budgets in the same order.
	Replicas []string `json:"replicas"`
	Budgets  []int64  `json:"budgets"`
	Chosen   string   `json:"chosen"`
	Outcome  *Outcome `json:"outcome,omitempty"`
	// Text holds the prompt's parts; only when prompt logging is enabled.
	Text []string `json:"text,omitempty"`
}

// Options configure a Writer. Path is required.
type Options struct {
	Path string
	// MaxBytes rotates the file when it grows past this size. Default 256 MiB.
	MaxBytes int64
	// MaxFiles is how many rotated files are kept. Default 5.
	MaxFiles int
	// Buffer is how many records may wait to be written. Default 4096.
	Buffer int
	// FsyncInterval flushes and fsyncs the file this often. Default 1s.
	FsyncInterval time.Duration
}

// Writer writes records to a rotating JSONL file.
type Writer struct {
	o       Options
	ch      chan *Record
	done    chan error
	mu      sync.RWMutex // guards closed against Log racing Close
	closed  bool
	written atomic.Int64
	dropped atomic.Int64
	errs    atomic.Int64

	f    *os.File
	bw   *bufio.Writer
	size int64
}

// Open creates (or appends to) the file at o.Path and starts the writer.
func Open(o Options) (*Writer, error) {
	if o.Path == "" {
		return nil, errors.New("decision log: path is required")
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = 256 << 20
	}
	if o.MaxFiles <= 0 {
		o.MaxFiles = 5
	}
	if o.Buffer <= 0 {
		o.Buffer = 4096
	}
	if o.FsyncInterval <= 0 {
		o.FsyncInterval = time.Second
	}
	w := &Writer{o: o, ch: make(chan *Record, o.Buffer), done: make(chan error, 1)}
	if err := w.open(); err != nil {
		return nil, err
	}
	go w.run()
	return w, nil
}

func (w *Writer) open() error {
	f, err := os.OpenFile(w.o.Path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("decision log: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("decision log: %w", err)
	}
	w.f, w.bw, w.size = f, bufio.NewWriterSize(f, 64<<10), st.Size()
	return nil
}

// Log queues r for writing without blocking; when the buffer is full, or
// the writer is closed, r is dropped and counted.
func (w *Writer) Log(r *Record) {
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.closed {
		w.dropped.Add(1)
		return
	}
	select {
	case w.ch <- r:
	default:
		w.dropped.Add(1)
	}
}

// Written returns the records written so far; Dropped those dropped; Errors
// the write errors.
func (w *Writer) Written() int64 { return w.written.Load() }

// Dropped returns the records dropped because the buffer was full.
func (w *Writer) Dropped() int64 { return w.dropped.Load() }

// Errors returns how many records could not be written.
func (w *Writer) Errors() int64 { return w.errs.Load() }

// Close writes what is buffered, syncs and closes the file. It is safe to
// call more than once.
func (w *Writer) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	close(w.ch)
	w.mu.Unlock()
	return <-w.done
}

func (w *Writer) run() {
	tick := time.NewTicker(w.o.FsyncInterval)
	defer tick.Stop()
	var err error
	for {
		select {
		case r, ok := <-w.ch:
			if !ok {
				err = errors.Join(w.sync(), w.f.Close())
				w.done <- err
				return
			}
			w.write(r)
		case <-tick.C:
			if serr := w.sync(); serr != nil {
				w.errs.Add(1)
			}
		}
	}
}

func (w *Writer) write(r *Record) {
	b, err := json.Marshal(r)
	if err != nil {
		w.errs.Add(1)
		return
	}
	b = append(b, '\n')
	if w.size > 0 && w.size+int64(len(b)) > w.o.MaxBytes {
		if err := w.rotate(); err != nil {
			w.errs.Add(1)
		}
	}
	n, err := w.bw.Write(b)
	w.size += int64(n)
	if err != nil {
		w.errs.Add(1)
		return
	}
	w.written.Add(1)
}

func (w *Writer) sync() error {
	if err := w.bw.Flush(); err != nil {
		return err
	}
	return w.f.Sync()
}

// rotate shifts path.i to path.i+1 (dropping the oldest), moves the current
// file to path.1 and opens a new one.
func (w *Writer) rotate() error {
	if err := errors.Join(w.sync(), w.f.Close()); err != nil {
		return err
	}
	for i := w.o.MaxFiles - 1; i >= 1; i-- {
		_ = os.Rename(fmt.Sprintf("%s.%d", w.o.Path, i), fmt.Sprintf("%s.%d", w.o.Path, i+1))
	}
	if err := os.Rename(w.o.Path, w.o.Path+".1"); err != nil {
		return err
	}
	return w.open()
}

// Read decodes a decision log, one record a line, calling each for every
// record in order.
func Read(r io.Reader, each func(*Record) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	n := 0
	for sc.Scan() {
		n++
		if len(sc.Bytes()) == 0 {
			continue
		}
		var rec Record
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			return fmt.Errorf("decision log line %d: %w", n, err)
		}
		if err := each(&rec); err != nil {
			return fmt.Errorf("decision log line %d: %w", n, err)
		}
	}
	return sc.Err()
}
