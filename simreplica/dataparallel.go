package simreplica

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/semroute/semroute/kvevents"
)

// HeaderDataParallelRank names the rank a request goes to, as vLLM's
// OpenAI server reads it (serving_engine.py, _get_data_parallel_rank).
const HeaderDataParallelRank = "X-data-parallel-rank"

// DataParallel is one engine of data-parallel ranks behind one address, as
// vLLM serves with --data-parallel-size N and its own load balancing: each
// rank is a Server with its own KV cache, scheduler and KV events; a
// request naming a rank in HeaderDataParallelRank runs there (one out of
// range gets 400), another on the rank with the fewest requests in
// flight, as vLLM's balancer counts them. /metrics shows every rank's,
// each labelled engine="<rank>"; the other endpoints are rank 0's. The
// Responses API's stored responses are the API server's: every rank's.
// Safe for concurrent use.
type DataParallel struct {
	ranks   []*Server
	metrics http.Handler
}

// NewDataParallel starts an engine of size ranks, each a Server of o with
// its rank set. The KV events of rank k are at o.KVEvents' addresses with
// their ports k higher (a zero port stays free: each rank takes its own),
// as vLLM offsets them.
func NewDataParallel(o Options, size int) (*DataParallel, error) {
	if size < 1 {
		return nil, fmt.Errorf("simreplica: data-parallel size %d", size)
	}
	d := &DataParallel{}
	gather := make(prometheus.Gatherers, 0, size)
	for k := range size {
		ro := o
		ro.DataParallelRank, ro.DataParallelSize = k, size
		if o.KVEvents != nil {
			ev := *o.KVEvents
			ev.Endpoint, ev.Connect, ev.ReplayEndpoint = kvevents.RankEndpoint(ev.Endpoint, k), kvevents.RankEndpoint(ev.Connect, k), kvevents.RankEndpoint(ev.ReplayEndpoint, k)
			ro.KVEvents = &ev
		}
		s, err := New(ro)
		if err != nil {
			return nil, errors.Join(err, d.Close())
		}
		if k > 0 {
			s.responses = d.ranks[0].responses // vLLM's API server keeps them, for every rank
		}
		d.ranks = append(d.ranks, s)
		gather = append(gather, s.reg)
	}
	d.metrics = promhttp.HandlerFor(gather, promhttp.HandlerOpts{})
	return d, nil
}

// Rank returns rank k's Server.
func (d *DataParallel) Rank(k int) *Server { return d.ranks[k] }

// Size is the number of ranks.
func (d *DataParallel) Size() int { return len(d.ranks) }

// ServeHTTP implements http.Handler.
func (d *DataParallel) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/metrics" && r.Method == http.MethodGet {
		d.metrics.ServeHTTP(w, r)
		return
	}
	if !strings.HasPrefix(r.URL.Path, "/v1/") || r.Method != http.MethodPost {
		d.ranks[0].ServeHTTP(w, r)
		return
	}
	k := d.leastBusy()
	if v := r.Header.Get(HeaderDataParallelRank); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n >= len(d.ranks) {
			writeJSON(w, http.StatusBadRequest, map[string]any{"error": map[string]any{"type": "BadRequestError", "code": http.StatusBadRequest,
				"message": fmt.Sprintf("data_parallel_rank %q is out of range [0, %d).", v, len(d.ranks))}})
			return
		}
		k = n
	}
	d.ranks[k].ServeHTTP(w, r)
}

// leastBusy is the rank with the fewest requests admitted and not ended.
func (d *DataParallel) leastBusy() int {
	best, load := 0, int64(-1)
	for k, s := range d.ranks {
		st := s.Stats()
		if n := st.Requests - st.Completed - st.Cancelled; load < 0 || n < load {
			best, load = k, n
		}
	}
	return best
}

// Close closes every rank's KV events.
func (d *DataParallel) Close() error {
	var errs []error
	for _, s := range d.ranks {
		errs = append(errs, s.Close())
	}
	return errors.Join(errs...)
}

// RunningDataParallel is a data-parallel engine serving on a socket.
type RunningDataParallel struct {
	*DataParallel
	URL string // http://host:port
	srv *http.Server
}

// StartDataParallel serves a new engine of size ranks (NewDataParallel)
// on addr ("127.0.0.1:0" picks a port).
func StartDataParallel(o Options, size int, addr string) (*RunningDataParallel, error) {
	d, err := NewDataParallel(o, size)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("listen %s: %w", addr, err), d.Close())
	}
	srv := &http.Server{Handler: d, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return &RunningDataParallel{DataParallel: d, URL: "http://" + ln.Addr().String(), srv: srv}, nil
}

// Shutdown stops serving gracefully (http.Server.Shutdown).
func (r *RunningDataParallel) Shutdown(ctx context.Context) error { return r.srv.Shutdown(ctx) }

// Close stops serving at once and closes every rank's KV events.
func (r *RunningDataParallel) Close() error {
	return errors.Join(r.srv.Close(), r.DataParallel.Close())
}
