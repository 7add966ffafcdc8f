package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/semroute/semroute/cluster"
	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/routing"
)

// newFleet returns the router's membership of the fleet cfg describes, not
// yet started; nil when cfg has no NATS URLs (a router alone).
func newFleet(cfg configs.ClusterConfig, ej replica.Ejection, eng *routing.Engine, log *slog.Logger) (*cluster.Fleet, error) {
	if len(cfg.URLs) == 0 {
		return nil, nil
	}
	id := cfg.ID
	if id == "" {
		host, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("config: cluster.id is empty and the host name is unknown: %w", err)
		}
		id = host
	}
	o := cluster.Options{URLs: cfg.URLs, ID: id, Prefix: cfg.Prefix, Credentials: cfg.Credentials, NkeySeed: cfg.NkeySeed,
		User: cfg.User, Password: cfg.Password, Token: cfg.Token, Insecure: cfg.Insecure, Ejection: ej,
		FlushInterval: cfg.FlushInterval, BufferBytes: cfg.BufferBytes, PeerTimeout: cfg.PeerTimeout, Logger: log}
	if cfg.CAFile != "" || cfg.CertFile != "" {
		t := &tls.Config{MinVersion: tls.VersionTLS12}
		if cfg.CAFile != "" {
			pem, err := os.ReadFile(cfg.CAFile)
			if err != nil {
				return nil, fmt.Errorf("config: cluster.ca_file: %w", err)
			}
			t.RootCAs = x509.NewCertPool()
			if !t.RootCAs.AppendCertsFromPEM(pem) {
				return nil, errors.New("config: cluster.ca_file: no certificate in it")
			}
		}
		if cfg.CertFile != "" {
			c, err := tls.LoadX509KeyPair(cfg.CertFile, cfg.KeyFile)
			if err != nil {
				return nil, fmt.Errorf("config: cluster.cert_file: %w", err)
			}
			t.Certificates = []tls.Certificate{c}
		}
		o.TLS = t
	}
	f, err := cluster.New(o, eng)
	if err != nil {
		return nil, fmt.Errorf("config: cluster: %w", err)
	}
	return f, nil
}

// fleetMetrics exports a fleet member's counters.
type fleetMetrics struct{ f *cluster.Fleet }

var (
	descFleetRecords   = prometheus.NewDesc("semroute_fleet_records_total", "Picture and load records, by direction: published to the fleet, applied from peers.", []string{"direction"}, nil)
	descFleetDropped   = prometheus.NewDesc("semroute_fleet_records_dropped_total", "Records not published, by reason: buffer_full (cluster.buffer_bytes), nats_down.", []string{"reason"}, nil)
	descFleetBatches   = prometheus.NewDesc("semroute_fleet_batches_published_total", "Batches published (one NATS message each).", nil, nil)
	descFleetBytes     = prometheus.NewDesc("semroute_fleet_bytes_published_total", "Bytes of batches published.", nil, nil)
	descFleetErrors    = prometheus.NewDesc("semroute_fleet_errors_total", "Peers' records not applied, by kind: malformed (batch), gap (batches lost from a peer: its requests in flight are forgotten), unresolved (a prefix this picture does not know, or an unknown replica), refused (a sender past the 64 peers tracked), clamped (a record's work or cool-down past what a router sends), stale (a peer's request forgotten after 5 minutes in flight).", []string{"kind"}, nil)
	descFleetSnapshots = prometheus.NewDesc("semroute_fleet_snapshots_total", "Warm-start snapshots, by direction: served to a peer, loaded from one.", []string{"direction"}, nil)
	descFleetSnapBlock = prometheus.NewDesc("semroute_fleet_snapshot_blocks_total", "Blocks stored from peers' snapshots.", nil, nil)
	descFleetPeers     = prometheus.NewDesc("semroute_fleet_peers", "Peers heard from within cluster.peer_timeout.", nil, nil)
	descFleetConnected = prometheus.NewDesc("semroute_fleet_connected", "1 while connected to NATS; 0 while routing on this router's picture alone.", nil, nil)
	descFleetReady     = prometheus.NewDesc("semroute_fleet_ready", "1 once the warm start is over.", nil, nil)
	descFleetChains    = prometheus.NewDesc("semroute_fleet_chains_total", "Records of stored Responses API conversations, by direction: shared with peers, received from them, dropped (NATS down, or over 1 MiB).", []string{"direction"}, nil)
	descFleetLag       = prometheus.NewDesc("semroute_fleet_sync_lag_seconds", "Time from a record's making to its batch's delivery back through NATS, for the last batch this router published (its own clock only).", nil, nil)
)

// Describe implements prometheus.Collector.
func (m fleetMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descFleetRecords, descFleetDropped, descFleetBatches, descFleetBytes, descFleetErrors,
		descFleetSnapshots, descFleetSnapBlock, descFleetPeers, descFleetConnected, descFleetReady, descFleetLag, descFleetChains} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m fleetMetrics) Collect(ch chan<- prometheus.Metric) {
	st := m.f.Stats()
	counter := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(d *prometheus.Desc, v float64) { ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v) }
	counter(descFleetRecords, st.Published, "published")
	counter(descFleetRecords, st.Applied, "applied")
	counter(descFleetDropped, st.DroppedFull, "buffer_full")
	counter(descFleetDropped, st.DroppedDown, "nats_down")
	counter(descFleetBatches, st.Batches)
	counter(descFleetBytes, st.Bytes)
	counter(descFleetErrors, st.Malformed, "malformed")
	counter(descFleetErrors, st.Gaps, "gap")
	counter(descFleetErrors, st.Unresolved, "unresolved")
	counter(descFleetErrors, st.Refused, "refused")
	counter(descFleetErrors, st.Clamped, "clamped")
	counter(descFleetErrors, st.Stale, "stale")
	counter(descFleetSnapshots, st.SnapshotsServed, "served")
	counter(descFleetSnapshots, st.SnapshotsLoaded, "loaded")
	counter(descFleetSnapBlock, st.SnapshotBlocks)
	counter(descFleetChains, st.ChainsShared, "shared")
	counter(descFleetChains, st.ChainsReceived, "received")
	counter(descFleetChains, st.ChainsDropped, "dropped")
	gauge(descFleetPeers, float64(st.Peers))
	gauge(descFleetConnected, b2f(st.Connected))
	gauge(descFleetReady, b2f(m.f.Ready()))
	gauge(descFleetLag, float64(st.LagNanos)/1e9)
}

// fleetReady is the server's readiness hook: nil without a fleet.
func fleetReady(f *cluster.Fleet) func() bool {
	if f == nil {
		return nil
	}
	return f.Ready
}
