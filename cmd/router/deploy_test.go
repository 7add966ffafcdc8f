package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/least_request/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/override_host/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	extprocfilterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/replica"
	"github.com/semroute/semroute/router"
)

// The example Envoy configuration is Envoy's API, field for field: it
// decodes into a Bootstrap with every typed config known (an unknown field
// or type fails), passes go-control-plane's validation rules, and its
// ext_proc filter asks for what the endpoint picker needs.
func TestDeployEnvoyConfig(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/envoy/envoy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var doc any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	var b bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(js, &b); err != nil {
		t.Fatalf("not Envoy's bootstrap: %v", err)
	}
	if err := b.ValidateAll(); err != nil {
		t.Fatalf("Envoy's validation rules: %v", err)
	}
	// Every typed config inside, validated too.
	var hcm hcmv3.HttpConnectionManager
	if err := b.GetStaticResources().GetListeners()[0].GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
		t.Fatal(err)
	}
	if err := hcm.ValidateAll(); err != nil {
		t.Fatal(err)
	}
	var ep extprocfilterv3.ExternalProcessor
	if err := hcm.GetHttpFilters()[0].GetTypedConfig().UnmarshalTo(&ep); err != nil {
		t.Fatal(err)
	}
	if err := ep.ValidateAll(); err != nil {
		t.Fatal(err)
	}
	pm := ep.GetProcessingMode()
	if pm.GetRequestBodyMode() != extprocfilterv3.ProcessingMode_FULL_DUPLEX_STREAMED || pm.GetRequestTrailerMode() != extprocfilterv3.ProcessingMode_SEND {
		t.Fatalf("processing mode %v", pm)
	}
	ns := ep.GetMetadataOptions()
	if !contains(ns.GetForwardingNamespaces().GetUntyped(), router.MetadataSubset) || !contains(ns.GetReceivingNamespaces().GetUntyped(), router.MetadataLB) {
		t.Fatalf("metadata namespaces %v", ns)
	}
	for _, c := range b.GetStaticResources().GetClusters() {
		for _, p := range c.GetLoadBalancingPolicy().GetPolicies() {
			m, err := anypb.UnmarshalNew(p.GetTypedExtensionConfig().GetTypedConfig(), proto.UnmarshalOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if v, ok := m.(interface{ ValidateAll() error }); ok {
				if err := v.ValidateAll(); err != nil {
					t.Fatalf("%s: %v", c.GetName(), err)
				}
			}
		}
	}
}

// Every alert rule has a promtool unit test that expects it to fire
// (deploy/prometheus/alerts_test.yaml; .ci/run runs promtool on it).
func TestEveryAlertHasAUnitTest(t *testing.T) {
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	var tests struct {
		RuleFiles []string `yaml:"rule_files"`
		Tests     []struct {
			AlertRuleTest []struct {
				AlertName string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	for f, v := range map[string]any{"../../deploy/prometheus/alerts.yaml": &rules, "../../deploy/prometheus/alerts_test.yaml": &tests} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	if len(tests.RuleFiles) != 1 || tests.RuleFiles[0] != "alerts.yaml" {
		t.Fatalf("the unit tests load %v, want alerts.yaml", tests.RuleFiles)
	}
	fires := map[string]bool{}
	for _, g := range tests.Tests {
		for _, a := range g.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.AlertName] = true
			}
		}
	}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if !fires[r.Alert] {
				t.Errorf("alert %s has no unit test in which it fires", r.Alert)
			}
		}
	}
	if n < 10 {
		t.Fatalf("only %d alerts read", n)
	}
}

// staticSource names fixed replicas, as a discovery source would.
type staticSource []replica.Spec

func (s staticSource) Name() string { return "static" }
func (s staticSource) Specs(context.Context) ([]replica.Spec, error) {
	return append([]replica.Spec(nil), s...), nil
}

// The plain manifests' routers follow every engine's KV events: the
// discovery the router runs (discoveredOf, then replica.Ranks, as the pool
// takes them) turns deploy/k8s/semroute.yaml's discovery.kv_events into
// each discovered pod's own addresses, IPv4 and IPv6, at the ports
// deploy/k8s/vllm.yaml's --kv-events-config binds.
func TestDeployManifestEventsReachEngines(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/k8s/semroute.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var routerYAML string
	dec := yaml.NewDecoder(strings.NewReader(string(raw)))
	for {
		var doc struct {
			Kind string            `yaml:"kind"`
			Data map[string]string `yaml:"data"`
		}
		if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if doc.Kind == "ConfigMap" && doc.Data["router.yaml"] != "" {
			routerYAML = doc.Data["router.yaml"]
		}
	}
	cfg, err := configs.LoadBytes(configs.NewViper(), []byte(routerYAML))
	if err != nil {
		t.Fatal(err)
	}
	engines, err := os.ReadFile("../../deploy/k8s/vllm.yaml")
	if err != nil {
		t.Fatal(err)
	}
	src := discoveredOf(staticSource{{Name: "a", URL: "http://10.1.2.3:8000"}, {Name: "b", URL: "http://[fd00::7]:8000"}}, cfg.Discovery)
	specs, err := src.Specs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	specs = replica.Ranks(specs)
	for i, host := range []string{"10.1.2.3", "[fd00::7]"} {
		ev := specs[i].KVEvents
		pub, replay := strings.TrimPrefix(ev.Endpoint, "tcp://"+host+":"), strings.TrimPrefix(ev.ReplayEndpoint, "tcp://"+host+":")
		if pub == ev.Endpoint || replay == ev.ReplayEndpoint || pub == "" || replay == "" {
			t.Fatalf("engine %s is followed at %+v, not at its own address", host, ev)
		}
		want := fmt.Sprintf(`"endpoint":"tcp://*:%s","replay_endpoint":"tcp://*:%s"`, pub, replay)
		if !strings.Contains(string(engines), want) {
			t.Errorf("vllm.yaml's --kv-events-config does not bind %s", want)
		}
	}
}
