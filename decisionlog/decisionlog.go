// Package decisionlog writes one JSON line per routing decision, so that
// decisions can be audited and replayed under another policy later.
//
// Writing never blocks routing: Log puts a record in a bounded buffer and a
// single goroutine encodes and writes it; when the buffer is full the record
// is dropped and counted. Files rotate by size (path, path.1, … path.N) and
// are fsynced on an interval. Close writes everything still buffered.
//
// Every record given to Log ends up counted exactly once: written (its whole
// line reached the file), dropped (the buffer was full, or the Writer was
// closed) or failed (it could not be encoded or written). The writer survives
// write errors: it counts and logs them, closes the file and reopens it later,
// and it reopens the path when the path stops naming the open file. See
// Writer.
package decisionlog

import (
	"bufio"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
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
	Replica string `json:"replica"`
	// Tier and Score are the policy's cost: tier first, lower is better.
	Tier    int64   `json:"tier,omitempty"`
	Score   float64 `json:"score"`
	Matched int     `json:"matched_tokens"`
	// Engine is the replica's reuse capability when it is more than the
	// exact prefix ("blend"), and Reuse the tokens past the prefix its
	// engine was expected to reuse.
	Engine   string  `json:"engine,omitempty"`
	Reuse    float64 `json:"reuse_tokens,omitempty"`
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
	// CachedReported says the replica reported CachedTokens (vLLM does
	// only with --enable-prompt-tokens-details); not logged.
	CachedReported bool `json:"-"`
	// Streamed says the answer was streamed: its first byte was its first
	// token, apart from its end; not logged.
	Streamed bool `json:"-"`
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
	// QueueNs is how long the request waited in the router's queue (flow
	// control) before it was decided, nanoseconds; counted in the
	// outcome's TTFT and duration too.
	QueueNs int64 `json:"queue_ns,omitempty"`
	// Stage is a disaggregated request's part: "prefill" (the decision of
	// its prefill replica) or "decode" (of the replica that answered);
	// empty for a request served whole. Pair is the ID of the other
	// part's decision, Prefill the prefill replica's name (on the decode
	// record).
	Stage   string `json:"stage,omitempty"`
	Pair    string `json:"pair,omitempty"`
	Prefill string `json:"prefill_replica,omitempty"`
	// Prefix is the request's prompt tokens by what became of their
	// prefix caching; nil when not classified (no OK answer, no prompt, a
	// disaggregated request's decode part, or a log written before it).
	Prefix *Prefix `json:"prefix,omitempty"`
}

// Prefix is a request's prompt tokens by outcome (routing.PrefixOutcomes,
// which has the rule of each): each prompt token is in one field, so they
// sum to the prompt's tokens. A field at 0 is left out.
type Prefix struct {
	// Hit: found cached on the replica that served (as its engine
	// reported, else as the router predicted).
	Hit int64 `json:"hit,omitempty"`
	// Cold: no candidate replica held them.
	Cold int64 `json:"cold,omitempty"`
	// RoutedAway and RoutedAwayLoad: another candidate held them and the
	// request went elsewhere; Load when the decision says the holder was
	// the more loaded or slower.
	RoutedAway     int64 `json:"routed_away,omitempty"`
	RoutedAwayLoad int64 `json:"routed_away_load,omitempty"`
	// Evicted: predicted cached on the replica that served, not found by
	// its engine. Waited: the same, the request having waited for KV room.
	Evicted int64 `json:"evicted,omitempty"`
	Waited  int64 `json:"waited,omitempty"`
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
	// FsyncInterval writes the records waiting, checks that Path still
	// names the file and fsyncs it this often. Default 1s.
	FsyncInterval time.Duration
	// Logger receives the write errors, at most one line every 10s (nil:
	// slog.Default()).
	Logger *slog.Logger

	// Unexported knobs, for tests; zero means the default.
	openFile   func(path string) (file, error) // default openOS
	now        func() time.Time                // default time.Now
	retry      time.Duration                   // between attempts to reopen; default 1s
	logEvery   time.Duration                   // between error log lines; default 10s
	batchBytes int                             // write when the batch reaches this; default 64 KiB
}

// file is what the writer needs of an open file; *os.File has it. When the
// file is also an io.ReaderAt, a torn last line is detected on opening.
type file interface {
	io.Writer
	Sync() error
	Close() error
	Stat() (os.FileInfo, error)
}

// openOS opens path to append, creating it; read access, when allowed, lets
// the writer check how the file ends.
func openOS(path string) (file, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_RDWR, 0o644)
	if errors.Is(err, fs.ErrPermission) {
		f, err = os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	}
	if err != nil {
		return nil, err
	}
	return f, nil
}

// Writer writes records to a rotating JSONL file.
//
// Counters. Written counts records whose whole line reached the file (the
// operating system accepted the bytes; fsync follows on FsyncInterval).
// Dropped counts records Log refused because the buffer was full or the
// Writer was closed. Failed counts records that could not be encoded or
// written: a write error, a short write, or no open file. Each record given
// to Log is counted once, in one of the three, when the writer is done with
// it; records still in the buffer or in the batch being built are in none
// yet. So written + dropped + failed == records given to Log holds exactly
// once Close has returned, and at quiescence: after Log stops, once the
// buffer has drained and an FsyncInterval tick has written the last batch.
// In between the sum lags: lines are written in batches of up to 64 KiB, and
// at least every FsyncInterval.
//
// Recovery. On a write error (a full disk, a removed directory) the records
// of the batch that reached the file whole count as written and the rest as
// failed; the file is closed, and reopened (created or appended to) when a
// later batch comes, at most once a second; records whose turn to be written
// comes meanwhile count as failed (not dropped). A line cut short by the
// error is never continued: the next write to a file that ends without a
// newline starts with one, so readers see the torn line alone (Read skips
// it). Before every write and on every FsyncInterval tick the writer checks
// that Path still names the open file (os.Stat and os.SameFile); when the
// file was deleted, moved, rotated by someone else or its directory
// replaced, it reopens Path. A failed rotation keeps appending to the current
// file and is tried again a second later; a failed fsync is handled as a
// failed write (the records were already counted). Errors are logged to
// Options.Logger, at most one line every 10 seconds, with how many records
// failed since the last line, the latest error and the path; Close logs what
// is left unreported.
//
// Concurrency. Log, Written, Dropped, Failed and Close may be called from any
// goroutine at any time; Log never blocks on the file. Close waits for the
// buffer to be written; Log after Close counts the record as dropped.
type Writer struct {
	o       Options
	ch      chan *Record
	done    chan error
	mu      sync.RWMutex // guards closed against Log racing Close
	closed  bool
	written atomic.Int64
	dropped atomic.Int64
	failed  atomic.Int64

	// The rest belongs to the run goroutine (and to Open before it starts).
	f        file        // nil while the writer has no usable file
	fi       os.FileInfo // identity of f, from its Stat when opened
	size     int64       // bytes in f
	torn     bool        // f ends in a partial line
	retryAt  time.Time   // no reopening before this
	rotateAt time.Time   // no rotating before this; zero unless a rotation failed
	cause    error       // why the writer has no file
	batch    sliceWriter // encoded records not yet written
	ends     []int       // end offset in batch.b of each record in it
	enc      *json.Encoder

	// Error reporting.
	lastLog    time.Time
	pendFailed int64 // records failed since the last log line
	pendErr    error // the latest error since the last log line
}

// sliceWriter appends what it is given to b.
type sliceWriter struct{ b []byte }

func (s *sliceWriter) Write(p []byte) (int, error) {
	s.b = append(s.b, p...)
	return len(p), nil
}

// Open creates (or appends to) the file at o.Path and starts the writer.
// Defaults of Options.
const (
	DefaultMaxBytes      = 256 << 20 // 256 MiB
	DefaultMaxFiles      = 5
	DefaultBuffer        = 4096
	DefaultFsyncInterval = time.Second
)

func Open(o Options) (*Writer, error) {
	if o.Path == "" {
		return nil, errors.New("decision log: path is required")
	}
	o.MaxBytes = cmp.Or(max(o.MaxBytes, 0), DefaultMaxBytes)
	o.MaxFiles = cmp.Or(max(o.MaxFiles, 0), DefaultMaxFiles)
	o.Buffer = cmp.Or(max(o.Buffer, 0), DefaultBuffer)
	o.FsyncInterval = cmp.Or(max(o.FsyncInterval, 0), DefaultFsyncInterval)
	if o.openFile == nil {
		o.openFile = openOS
	}
	if o.now == nil {
		o.now = time.Now
	}
	if o.retry <= 0 {
		o.retry = time.Second
	}
	if o.logEvery <= 0 {
		o.logEvery = 10 * time.Second
	}
	if o.batchBytes <= 0 {
		o.batchBytes = 64 << 10
	}
	w := &Writer{o: o, ch: make(chan *Record, o.Buffer), done: make(chan error, 1)}
	w.enc = json.NewEncoder(&w.batch)
	if err := w.open(); err != nil {
		return nil, err
	}
	go w.run()
	return w, nil
}

// open opens Path as the current file.
func (w *Writer) open() error {
	f, err := w.o.openFile(w.o.Path)
	if err != nil {
		return fmt.Errorf("decision log: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("decision log: %w", err)
	}
	torn := false
	if fi.Size() > 0 {
		torn = w.torn // when the end cannot be read: what this writer last did
		if ra, ok := f.(io.ReaderAt); ok {
			var last [1]byte
			if _, err := ra.ReadAt(last[:], fi.Size()-1); err == nil {
				torn = last[0] != '\n'
			}
		}
	}
	w.f, w.fi, w.size, w.torn = f, fi, fi.Size(), torn
	return nil
}

// closeFile closes the current file, leaving the writer without one.
func (w *Writer) closeFile() {
	if w.f != nil {
		_ = w.f.Close() // after a write error; what matters was counted
		w.f = nil
	}
}

// Log queues r for writing without blocking; when the buffer is full, or
// the writer is closed, r is dropped and counted. r must not change after.
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

// Written returns how many records were written whole to the file (see
// Writer for the three counters and their invariant).
func (w *Writer) Written() int64 { return w.written.Load() }

// Dropped returns how many records Log dropped because the buffer was full
// or the Writer was closed.
func (w *Writer) Dropped() int64 { return w.dropped.Load() }

// Failed returns how many records could not be encoded or written.
func (w *Writer) Failed() int64 { return w.failed.Load() }

// Errors returns how many records could not be written.
//
// Deprecated: use Failed, which it returns.
func (w *Writer) Errors() int64 { return w.failed.Load() }

// Close writes what is buffered, syncs and closes the file. It is safe to
// call more than once. Before the last write it tries to reopen the file
// even within a second of a failure. It returns the last write, sync or close
// error, if any; records that failed are in Failed.
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
	for {
		select {
		case r, ok := <-w.ch:
			if !ok {
				w.done <- w.finish()
				return
			}
			w.add(r)
		case <-tick.C:
			w.tick()
		}
	}
}

// add encodes r into the batch, writing the batch when it is full or when r
// would take the file past MaxBytes (so that the next write rotates first).
func (w *Writer) add(r *Record) {
	start := len(w.batch.b)
	if err := w.enc.Encode(r); err != nil {
		w.batch.b = w.batch.b[:start]
		w.fail(1, fmt.Errorf("encode: %w", err))
		return
	}
	end := len(w.batch.b)
	if start > 0 && w.rotateAt.IsZero() && w.size+int64(end) > w.o.MaxBytes {
		w.flush(len(w.ends)) // the records before r, which fit
		end -= start
	}
	w.ends = append(w.ends, end)
	if len(w.batch.b) >= w.o.batchBytes {
		w.flush(len(w.ends))
	}
}

// flush writes the first k records of the batch and removes them from it.
func (w *Writer) flush(k int) {
	if k == 0 {
		return
	}
	n := w.ends[k-1]
	w.write(w.batch.b[:n], w.ends[:k])
	rest := copy(w.batch.b, w.batch.b[n:])
	w.batch.b = w.batch.b[:rest]
	m := copy(w.ends, w.ends[k:])
	w.ends = w.ends[:m]
	for i := range w.ends {
		w.ends[i] -= n
	}
	if rest == 0 && cap(w.batch.b) > 4*w.o.batchBytes && cap(w.batch.b) > 1<<20 {
		w.batch.b = nil // after a huge record
	}
}

// ready makes sure the writer has a file that Path names, reopening Path
// when it names another file or none, and after a failure when retrying is
// due. It reports whether there is a file to write to.
func (w *Writer) ready(now time.Time) bool {
	replaced := false
	if w.f != nil {
		if st, err := os.Stat(w.o.Path); err == nil && os.SameFile(st, w.fi) {
			return true
		}
		w.closeFile()
		replaced, w.retryAt = true, time.Time{} // reopen now
	}
	if now.Before(w.retryAt) {
		return false
	}
	if err := w.open(); err != nil {
		w.openFailed(now, err)
		return false
	}
	if replaced {
		w.note(now, errors.New("the path no longer named the open file (removed, moved or replaced); reopened it"))
	}
	return true
}

// openFailed leaves the writer without a file until a retry is due.
func (w *Writer) openFailed(now time.Time, err error) {
	w.retryAt, w.cause = now.Add(w.o.retry), err
	w.note(now, err)
}

// write writes b, the encoded records ending at ends, counting each record
// written or failed.
func (w *Writer) write(b []byte, ends []int) {
	now := w.o.now()
	if !w.fileFor(now, len(b)) {
		w.fail(len(ends), w.cause)
		return
	}
	if w.torn && !w.endTorn(now, len(ends)) {
		return
	}
	n, err := w.f.Write(b)
	if err == nil && n < len(b) {
		err = io.ErrShortWrite
	}
	n = max(n, 0)
	w.size += int64(n)
	whole := wholeRecords(ends, n)
	w.written.Add(int64(whole))
	if err != nil {
		if n > 0 && (whole == 0 || ends[whole-1] != n) {
			w.torn = true
		}
		w.writeFailed(now, len(ends)-whole, err)
	}
}

// fileFor makes sure there is a file to write n bytes to (ready), rotated
// first if they would take it past MaxBytes and rotating is due. It
// reports whether there is one.
func (w *Writer) fileFor(now time.Time, n int) bool {
	if !w.ready(now) {
		return false
	}
	if w.size > 0 && w.size+int64(n) > w.o.MaxBytes && !now.Before(w.rotateAt) {
		return w.rotate(now)
	}
	return true
}

// endTorn ends the torn last line of the file, the part of a record an
// earlier write left, so that the next record starts a line. When that
// fails it counts the batch's records failed and reports false.
func (w *Writer) endTorn(now time.Time, records int) bool {
	if _, err := w.f.Write([]byte{'\n'}); err != nil {
		w.writeFailed(now, records, err)
		return false
	}
	w.size++
	w.torn = false
	return true
}

// wholeRecords returns how many of the records ending at ends the first n
// bytes hold whole.
func wholeRecords(ends []int, n int) int {
	whole := 0
	for whole < len(ends) && ends[whole] <= n {
		whole++
	}
	return whole
}

// writeFailed counts n records failed after a write error on the file, and
// closes it to be reopened later.
func (w *Writer) writeFailed(now time.Time, n int, err error) {
	w.closeFile()
	w.retryAt, w.cause = now.Add(w.o.retry), fmt.Errorf("write: %w", err)
	w.fail(n, w.cause)
}

// rotate shifts path.i to path.i+1 (dropping the oldest), moves the current
// file to path.1 and opens a new one. When the move fails it reopens the
// current file and tries no rotation for a while. It reports whether there
// is a file to write to.
func (w *Writer) rotate(now time.Time) bool {
	if err := errors.Join(w.f.Sync(), w.f.Close()); err != nil {
		w.note(now, fmt.Errorf("rotate: %w", err))
	}
	w.f = nil
	for i := w.o.MaxFiles - 1; i >= 1; i-- {
		_ = os.Rename(fmt.Sprintf("%s.%d", w.o.Path, i), fmt.Sprintf("%s.%d", w.o.Path, i+1))
	}
	if err := os.Rename(w.o.Path, w.o.Path+".1"); err != nil && !errors.Is(err, fs.ErrNotExist) {
		w.rotateAt = now.Add(w.o.retry)
		w.note(now, fmt.Errorf("rotate: %w", err))
	} else {
		w.rotateAt = time.Time{}
	}
	if err := w.open(); err != nil {
		w.openFailed(now, err)
		return false
	}
	return true
}

// tick writes the batch, checks that Path still names the file and fsyncs it.
func (w *Writer) tick() {
	now := w.o.now()
	if len(w.ends) > 0 {
		w.flush(len(w.ends))
	} else if w.f != nil {
		w.ready(now)
	}
	if w.f != nil {
		if err := w.f.Sync(); err != nil {
			w.closeFile()
			w.openFailed(now, fmt.Errorf("fsync: %w", err))
		}
	}
	w.report(now, false)
}

// finish writes what is left, trying to reopen the file at once if needed,
// and closes the file.
func (w *Writer) finish() error {
	w.retryAt = time.Time{}
	before := w.failed.Load()
	w.flush(len(w.ends))
	var err error
	if w.failed.Load() != before && w.cause != nil {
		err = fmt.Errorf("decision log %s: %w", w.o.Path, w.cause)
	}
	w.report(w.o.now(), true)
	if w.f != nil {
		err = errors.Join(err, w.f.Sync(), w.f.Close())
		w.f = nil
	}
	return err
}

// fail counts n records failed because of err.
func (w *Writer) fail(n int, err error) {
	if n <= 0 {
		return
	}
	w.failed.Add(int64(n))
	w.pendFailed += int64(n)
	w.note(w.o.now(), err)
}

// note records err for the next log line and logs it if one is due.
func (w *Writer) note(now time.Time, err error) {
	if err != nil {
		w.pendErr = err
	}
	w.report(now, false)
}

// report logs what failed since the last line, at most once every logEvery
// unless forced.
func (w *Writer) report(now time.Time, force bool) {
	if w.pendFailed == 0 && w.pendErr == nil {
		return
	}
	if !force && !w.lastLog.IsZero() && now.Sub(w.lastLog) < w.o.logEvery {
		return
	}
	l := w.o.Logger
	if l == nil {
		l = slog.Default()
	}
	msg := "decision log: file error"
	if w.pendFailed > 0 {
		msg = "decision log: records not written"
	}
	l.Error(msg, "path", w.o.Path, "failed", w.pendFailed, "error", w.pendErr, "writing", w.f != nil)
	w.lastLog, w.pendFailed, w.pendErr = now, 0, nil
}

// ReadOptions configure ReadWith.
type ReadOptions struct {
	// Warn is told of every line skipped because it does not decode, such
	// as a line torn by a failed write; lines count from 1. Nil logs a
	// warning with slog.Default().
	Warn func(line int, err error)
}

// Read decodes a decision log, one record a line, calling each for every
// record in order. It is ReadWith with default options: lines that do not
// decode are skipped with a warning.
func Read(r io.Reader, each func(*Record) error) error {
	_, err := ReadWith(r, ReadOptions{}, each)
	return err
}

// ReadWith decodes a decision log, one record a line, calling each for every
// record in order, and returns how many lines it skipped. A non-empty line
// that does not decode as a record (a line torn by a write error, or garbage)
// is skipped and passed to o.Warn; when no non-empty line decodes and some do
// not, the input is not a decision log and ReadWith fails. An error from each
// or from reading stops it.
func ReadWith(r io.Reader, o ReadOptions, each func(*Record) error) (skipped int, err error) {
	warn := o.Warn
	if warn == nil {
		warn = func(line int, err error) {
			slog.Warn("decision log: skipping a line that does not decode", "line", line, "error", err)
		}
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	n, decoded := 0, 0
	var first error
	for sc.Scan() {
		n++
		if len(sc.Bytes()) == 0 {
			continue
		}
		var rec Record
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			err = fmt.Errorf("decision log line %d: %w", n, err)
			if first == nil {
				first = err
			}
			skipped++
			warn(n, err)
			continue
		}
		decoded++
		if err := each(&rec); err != nil {
			return skipped, fmt.Errorf("decision log line %d: %w", n, err)
		}
	}
	if err := sc.Err(); err != nil {
		return skipped, err
	}
	if decoded == 0 && skipped > 0 {
		return skipped, fmt.Errorf("not a decision log: no line decodes (%w)", first)
	}
	return skipped, nil
}
