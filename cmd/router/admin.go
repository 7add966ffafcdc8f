package main

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/pprof"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/replica"
)

// adminHandler serves the admin API; every call needs the bearer token
// admin.token, read per call so that a reload rotates it at once.
func (a *app) adminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /admin/replicas", a.adminList)
	mux.HandleFunc("POST /admin/replicas", a.adminAdd)
	mux.HandleFunc("DELETE /admin/replicas/{name}", func(w http.ResponseWriter, r *http.Request) {
		adminResult(w, a.removeReplica(r.PathValue("name")), http.StatusNotFound)
	})
	mux.HandleFunc("POST /admin/replicas/{name}/drain", func(w http.ResponseWriter, r *http.Request) {
		adminResult(w, a.drainReplica(r.PathValue("name"), true), http.StatusNotFound)
	})
	mux.HandleFunc("POST /admin/replicas/{name}/undrain", func(w http.ResponseWriter, r *http.Request) {
		adminResult(w, a.drainReplica(r.PathValue("name"), false), http.StatusNotFound)
	})
	mux.HandleFunc("GET /admin/config", a.adminConfig)
	mux.HandleFunc("GET /admin/agreement", a.adminAgreement)
	if a.cfg.Metrics.Listener == "admin" {
		mux.Handle("GET /metrics", promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{}))
	}
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		want := []byte("Bearer " + a.current.Load().Admin.Token)
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="semroute admin"`)
			writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "a valid bearer token is required"})
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// adminConfig shows the config in force, secrets and replica credentials
// redacted, and the changed keys that wait for a restart.
func (a *app) adminConfig(w http.ResponseWriter, _ *http.Request) {
	c := *a.current.Load()
	redact := func(s *string) {
		if *s != "" {
			*s = "<redacted>"
		}
	}
	redact(&c.Admin.Token)
	redact(&c.GRPC.Token)
	redact(&c.Auth.UpstreamAPIKey)
	c.Replicas = slices.Clone(c.Replicas)
	for i := range c.Replicas {
		if u, err := url.Parse(c.Replicas[i].URL); err == nil {
			c.Replicas[i].URL = replica.PublicURL(u)
		}
	}
	pending := []string{}
	if p := a.pending.Load(); p != nil {
		pending = *p
	}
	writeJSON(w, http.StatusOK, struct {
		Config         configs.Config `json:"config"`
		PendingRestart []string       `json:"pending_restart"`
	}{c, pending})
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
	Source        string  `json:"source"`
	Healthy       bool    `json:"healthy"`
	Draining      bool    `json:"draining"`
	InFlight      int64   `json:"in_flight"`
	PendingTokens float64 `json:"pending_tokens"`
	BudgetTokens  int64   `json:"budget_tokens"`
	// BudgetAssumed: the replica has not reported its budget and none is
	// configured, so BudgetTokens is cache.default_budget_tokens.
	BudgetAssumed bool  `json:"budget_assumed"`
	TrackedBlocks int64 `json:"tracked_blocks"`
	TrackedTokens int64 `json:"tracked_tokens"`
}

func (a *app) adminList(w http.ResponseWriter, _ *http.Request) {
	now := time.Now()
	out := []adminReplica{}
	for _, r := range a.pool.Replicas() {
		st, _ := a.pic.Stats(r.ID)
		l := r.Load(now)
		out = append(out, adminReplica{r.Name, r.PublicURL(), a.members.Owner(r.Name), r.Healthy(now), r.Draining(), l.InFlight, l.PendingTokens,
			st.Budget, r.Budget() == 0, st.Blocks, st.Tokens})
	}
	writeJSON(w, http.StatusOK, out)
}

// adminAdd adds a replica from a JSON object with the config's field
// names (name, url, budget_tokens, weight), validated as the config is.
// The replica stays across reloads of the config file until it is removed
// through this API, or the router restarts.
func (a *app) adminAdd(w http.ResponseWriter, r *http.Request) {
	var rep configs.Replica
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 64<<10))
	dec.DisallowUnknownFields()
	err := dec.Decode(&rep)
	if err == nil && dec.More() {
		err = errors.New("unexpected data after the JSON object")
	} else if err == nil {
		if _, tailErr := dec.Token(); tailErr != io.EOF {
			err = errors.New("unexpected data after the JSON object")
		}
	}
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": "body: " + err.Error()})
		return
	}
	if err := rep.Validate(); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return
	}
	if owner := a.members.Owner(rep.Name); owner != "" && owner != "admin" {
		writeJSON(w, http.StatusConflict, map[string]string{"error": fmt.Sprintf("replica %q comes from %s", rep.Name, owner)})
		return
	}
	a.admin.Put(rep.Spec())
	if err := a.members.Reconcile(r.Context(), a.admin); err != nil {
		a.admin.Delete(rep.Name)
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok",
		"note": "kept across reloads of the config file until removed here; add it to the file to keep it across restarts"})
}

// reload loads the config file again and applies what can change without a
// restart (see liveKeys). Changed keys that need a restart are logged,
// counted (result restart_required) and listed under pending_restart in
// GET /admin/config; the rest of the new config still applies. An invalid
// config is refused, logged and counted; the old one keeps serving.
func (a *app) reload() error {
	pending, err := a.applyFile()
	result := "ok"
	switch {
	case err != nil:
		result = "failed"
		a.log.Error("config reload refused; the previous config keeps serving", "path", a.path, "err", err)
	case len(pending) > 0:
		result = "restart_required"
		a.log.Warn("config reloaded; some changes take effect only after a restart", "path", a.path, "pending_restart", pending)
	default:
		a.log.Info("config reloaded", "path", a.path)
	}
	a.reloads.WithLabelValues(result).Inc()
	return err
}

// liveKeys are the config keys (and key prefixes, ending in ".") a reload
// applies while serving. Every other key changed in the file waits for a
// restart.
var liveKeys = []string{
	"replicas", "admin.token", "grpc.token", "limits.",
	"routing.policy.", "routing.load_weight", "routing.recent_weight", "routing.spill_factor",
	"routing.spill_margin_tokens", "routing.seed", "routing.arms",
}

func isLive(key string) bool {
	for _, k := range liveKeys {
		if key == k || (strings.HasSuffix(k, ".") && strings.HasPrefix(key, k)) {
			return true
		}
	}
	return false
}

// applyFile applies the config file's live keys and returns the changed
// keys that wait for a restart (compared with the config the router
// started with).
func (a *app) applyFile() ([]string, error) {
	newViper := a.viper
	if newViper == nil {
		newViper = configs.NewViper
	}
	cfg, err := configs.Load(newViper(), a.path)
	if err != nil {
		return nil, err
	}
	if err := cfg.CheckServable(); err != nil {
		return nil, err
	}
	arms, err := armsFor(cfg)
	if err != nil {
		return nil, err
	}
	var pending []string
	for _, k := range configs.Diff(a.cfg, cfg) {
		if !isLive(k) {
			pending = append(pending, k)
		}
	}
	if a.cfg.GRPCListen != "" && cfg.Limits.MaxBodyBytes > a.cfg.Limits.MaxBodyBytes {
		pending = append(pending, "limits.max_body_bytes (the gRPC message size)")
	}
	old := a.current.Load()
	// The replicas first: if they cannot all be applied, the old list is
	// put back and nothing else of the file applies.
	a.file.Set(specsOf(cfg.Replicas))
	if err := a.members.Reconcile(a.ctx, a.file); err != nil {
		a.file.Set(specsOf(old.Replicas))
		_ = a.members.Reconcile(a.ctx, a.file)
		return nil, err
	}
	if err := a.core.SetArms(arms); err != nil { // armsFor checked them: not reached
		return nil, err
	}
	lim := limitsOf(cfg.Limits)
	if cfg.Limits.MaxJSONValuesInFlight == old.Limits.MaxJSONValuesInFlight {
		lim.Parse.Budget = a.server.CurrentLimits().Parse.Budget // parses in flight hold values in it
	}
	a.server.SetLimits(lim)
	next := *old
	next.Replicas, next.Limits = cfg.Replicas, cfg.Limits
	next.Routing = mergeLiveRouting(old.Routing, cfg.Routing) // the others keep their running values
	next.Admin.Token, next.GRPC.Token = cfg.Admin.Token, cfg.GRPC.Token
	a.current.Store(&next)
	a.pending.Store(&pending)
	return pending, nil
}

// mergeLiveRouting returns the running routing section with the live keys
// of the new one.
func mergeLiveRouting(old, cur configs.RoutingConfig) configs.RoutingConfig {
	old.Policy, old.LoadWeight, old.RecentWeight = cur.Policy, cur.LoadWeight, cur.RecentWeight
	old.SpillFactor, old.SpillMarginTokens, old.Seed, old.Arms = cur.SpillFactor, cur.SpillMarginTokens, cur.Seed, cur.Arms
	return old
}

// removeReplica takes a replica out of the pool now; its requests in
// flight finish, then its cache picture is dropped. One added through this
// API is gone for good; one from the file or DNS comes back when its source
// next names it (a reload, a DNS change).
func (a *app) removeReplica(name string) error {
	listed := a.admin.Delete(name) // the admin API no longer names it, whoever owns it
	if a.members.Owner(name) == "admin" {
		return a.members.Reconcile(a.ctx, a.admin)
	}
	if err := a.members.Remove(name); err != nil && !listed {
		return err
	}
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
