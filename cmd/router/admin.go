package main

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/pprof"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/router"
)

// adminHandler serves the admin API; every call needs the bearer token.
func (a *app) adminHandler(token string) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /admin/replicas", a.adminList)
	mux.HandleFunc("POST /admin/replicas", a.adminAdd)
	mux.HandleFunc("DELETE /admin/replicas/{name}", func(w http.ResponseWriter, r *http.Request) {
		adminResult(w, a.removeReplica(r.PathValue("name")), http.StatusNotFound)
	})
	mux.HandleFunc("POST /admin/replicas/{name}/drain", func(w http.ResponseWriter, r *http.Request) {
		adminResult(w, a.drainReplica(r.PathValue("name")), http.StatusNotFound)
	})
	mux.HandleFunc("GET /admin/config", func(w http.ResponseWriter, _ *http.Request) {
		c := *a.current.Load()
		c.Admin.Token = "<redacted>"
		writeJSON(w, http.StatusOK, c)
	})
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	want := []byte("Bearer " + token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="semroute admin"`)
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "a valid bearer token is required"})
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

func adminResult(w http.ResponseWriter, err error, status int) {
	if err != nil {
		writeJSON(w, status, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

type adminReplica struct {
	Name          string  `json:"name"`
	URL           string  `json:"url"`
	Healthy       bool    `json:"healthy"`
	Draining      bool    `json:"draining"`
	InFlight      int64   `json:"in_flight"`
	PendingTokens float64 `json:"pending_tokens"`
	BudgetTokens  int64   `json:"budget_tokens"`
	TrackedBlocks int64   `json:"tracked_blocks"`
	TrackedTokens int64   `json:"tracked_tokens"`
}

func (a *app) adminList(w http.ResponseWriter, _ *http.Request) {
	now := time.Now()
	out := []adminReplica{}
	for _, r := range a.pool.Replicas() {
		st, _ := a.cache.Stats(r.ID)
		l := r.Load(now)
		out = append(out, adminReplica{r.Name, r.URL.String(), r.Healthy(now), r.Draining(), l.InFlight, l.PendingTokens,
			r.Budget(), st.Blocks, st.Tokens})
	}
	writeJSON(w, http.StatusOK, out)
}

func (a *app) adminAdd(w http.ResponseWriter, r *http.Request) {
	var rep configs.Replica
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rep); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "body: " + err.Error()})
		return
	}
	adminResult(w, a.addReplica(rep), http.StatusBadRequest)
}

// reload loads the config file again and applies what can change without a
// restart: the replicas, the routing policy and its parameters, and the
// arms. An invalid config is refused, logged and counted; the old one keeps
// serving.
func (a *app) reload() error {
	err := a.applyFile()
	result := "ok"
	if err != nil {
		result = "failed"
		a.log.Error("config reload refused; the previous config keeps serving", "path", a.path, "err", err)
	} else {
		a.log.Info("config reloaded", "path", a.path)
	}
	a.reloads.WithLabelValues(result).Inc()
	return err
}

func (a *app) applyFile() error {
	cfg, err := configs.Load(configs.NewViper(), a.path)
	if err != nil {
		return err
	}
	if len(cfg.Replicas) == 0 && cfg.Discovery.DNSName == "" {
		return fmt.Errorf("config: replicas: at least one replica is required")
	}
	pol, arms, err := policiesFor(cfg)
	if err != nil {
		return err
	}
	if len(arms) == 0 {
		arms = []router.Arm{{Name: "default", Policy: pol, Weight: 1}}
	}
	old := a.current.Load()
	if err := a.core.SetArms(arms); err != nil {
		return err
	}
	// Replicas: add the new, remove the gone, replace the changed.
	want := map[string]configs.Replica{}
	for _, r := range cfg.Replicas {
		want[r.Name] = r
	}
	have := map[string]configs.Replica{}
	for _, r := range old.Replicas {
		have[r.Name] = r
	}
	for _, cur := range a.pool.Replicas() {
		if _, dns := a.discovered.Load(cur.Name); dns {
			continue // DNS discovery manages it
		}
		w, keep := want[cur.Name]
		if !keep || have[cur.Name] != w {
			if err := a.removeReplica(cur.Name); err != nil {
				return err
			}
		}
	}
	for _, r := range cfg.Replicas {
		if _, ok := a.pool.Get(r.Name); ok {
			continue
		}
		if err := a.addReplica(r); err != nil {
			return fmt.Errorf("add replica %s: %w", r.Name, err)
		}
	}
	next := *old
	next.Replicas, next.Routing = cfg.Replicas, cfg.Routing
	a.current.Store(&next)
	return nil
}

// watch returns a loop that reloads the config whenever its file changes.
// It watches the directory, since editors replace files by renaming.
func (a *app) watch(ctx context.Context) (func(), error) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, err
	}
	if err := w.Add(filepath.Dir(a.path)); err != nil {
		w.Close()
		return nil, fmt.Errorf("watch %s: %w", a.path, err)
	}
	name := filepath.Clean(a.path)
	return func() {
		defer w.Close()
		var debounce <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if filepath.Clean(ev.Name) == name && ev.Op&(fsnotify.Write|fsnotify.Create|fsnotify.Rename) != 0 {
					debounce = time.After(100 * time.Millisecond)
				}
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				a.log.Warn("config watch", "err", err)
			case <-debounce:
				debounce = nil
				_ = a.reload()
			}
		}
	}, nil
}
