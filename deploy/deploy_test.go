// Package deploy holds the Kubernetes manifests and the Helm chart; its
// test renders the chart with Helm's own engine, as `helm template` does,
// and checks every object it and the plain manifests make against the
// Kubernetes API's types, strictly, offline.
package deploy

import (
	"bufio"
	"bytes"
	"cmp"
	stdjson "encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/strvals"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/semroute/semroute/configs"
	"github.com/semroute/semroute/replica"
)

// createSecret finds the Secrets a manifest's comments tell to make.
var createSecret = regexp.MustCompile(`kubectl create secret generic ([a-z0-9-]+)`)

// customKinds are the objects of APIs outside Kubernetes' own that the
// manifests make; they are checked as YAML objects with these kinds.
var customKinds = map[string]bool{"ServiceMonitor": true, "InferencePool": true, "InferenceObjective": true, "InferenceModel": true,
	"HTTPRoute": true, "Gateway": true, "Certificate": true, "Issuer": true}

// strict decodes Kubernetes objects by their API types, refusing unknown
// and duplicate fields, as `kubectl apply --validate=strict` would.
var strict = json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme.Scheme, scheme.Scheme, json.SerializerOptions{Yaml: true, Strict: true})

// objects decodes a multi-document YAML stream strictly, returning the
// objects by kind/name; source names the stream in errors.
func objects(t *testing.T, source string, stream []byte) map[string]runtime.Object {
	t.Helper()
	out := map[string]runtime.Object{}
	rd := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(stream)))
	for {
		doc, err := rd.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", source, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		var u unstructured.Unstructured
		if err := utilyaml.Unmarshal(doc, &u.Object); err != nil {
			t.Fatalf("%s: %v\n%s", source, err, doc)
		}
		key := u.GetKind() + "/" + u.GetName()
		if customKinds[u.GetKind()] {
			out[key] = &u
			continue
		}
		obj, _, err := strict.Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("%s: %s: %v", source, key, err)
		}
		out[key] = obj
	}
	return out
}

func stripComments(doc []byte) []byte {
	var b bytes.Buffer
	for _, l := range bytes.Split(doc, []byte("\n")) {
		if !bytes.HasPrefix(bytes.TrimSpace(l), []byte("#")) {
			b.Write(l)
			b.WriteByte('\n')
		}
	}
	return b.Bytes()
}

// restricted checks a pod template against the "restricted" Pod Security
// Standard: non-root, no privilege escalation, every capability dropped,
// the runtime's seccomp profile.
func restricted(t *testing.T, where string, spec corev1.PodSpec) {
	t.Helper()
	psc := spec.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("%s: the pod's securityContext is not restricted (runAsNonRoot, seccompProfile RuntimeDefault): %+v", where, psc)
	}
	for _, c := range append(spec.InitContainers, spec.Containers...) {
		sc := c.SecurityContext
		if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Capabilities == nil ||
			len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" {
			t.Errorf("%s: container %s is not restricted (allowPrivilegeEscalation false, capabilities drop ALL): %+v", where, c.Name, sc)
		}
	}
}

// renderErr renders the chart as `helm template semroute
// deploy/helm/semroute --namespace llm -f values.yaml --set s1 --set s2...`
// does: values (YAML, as a -f file) then sets (as --set gives them,
// strings parsed as Helm parses them), coalesced with the chart's own,
// checked against values.schema.json (ToRenderValues calls
// chartutil.ValidateAgainstSchema, as helm install and template do), and
// the templates executed.
func renderErr(values string, sets ...string) (map[string]string, error) {
	c, err := loader.Load("helm/semroute") // afresh: rendering must not see another render's values
	if err != nil {
		return nil, err
	}
	vals, err := chartutil.ReadValues([]byte(values))
	if err != nil {
		return nil, err
	}
	for _, s := range sets {
		if err := strvals.ParseInto(s, vals); err != nil {
			return nil, err
		}
	}
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: "semroute", Namespace: "llm", IsInstall: true}, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	return engine.Render(c, rv)
}

// render is renderErr, failing the test on an error.
func render(t *testing.T, values string, sets ...string) map[string]string {
	t.Helper()
	out, err := renderErr(values, sets...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// renderedObjects renders the chart and decodes every object it makes.
func renderedObjects(t *testing.T, values string, sets ...string) map[string]runtime.Object {
	t.Helper()
	files := render(t, values, sets...)
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	all := map[string]runtime.Object{}
	for _, n := range names {
		if strings.HasSuffix(n, "NOTES.txt") {
			continue
		}
		for k, v := range objects(t, n, []byte(files[n])) {
			all[k] = v
		}
	}
	return all
}

// routerConfig checks that the ConfigMap's router.yaml is a config the
// router accepts, with the variables the Deployment sets from Secrets,
// and returns it.
func routerConfig(t *testing.T, objs map[string]runtime.Object) *configs.Config {
	t.Helper()
	d := objs["Deployment/semroute-semroute"].(*appsv1.Deployment)
	for _, e := range d.Spec.Template.Spec.Containers[0].Env {
		if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
			t.Setenv(e.Name, "from-"+e.ValueFrom.SecretKeyRef.Name)
		}
	}
	cm, ok := objs["ConfigMap/semroute-semroute"].(*corev1.ConfigMap)
	if !ok {
		t.Fatalf("no ConfigMap among %v", keys(objs))
	}
	cfg, err := configs.LoadBytes(configs.NewViper(), []byte(cm.Data["router.yaml"]))
	if err != nil {
		t.Fatalf("the chart's router.yaml is refused: %v\n%s", err, cm.Data["router.yaml"])
	}
	if err := cfg.CheckServable(); err != nil {
		t.Fatalf("the chart's router.yaml cannot serve: %v", err)
	}
	return cfg
}

func keys(m map[string]runtime.Object) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// The chart's defaults: one router finding the Service vllm's endpoints
// and dialing each engine's KV events, with the RBAC that reads them,
// restricted pods, the image of the chart's appVersion, a decision log on a
// bounded volume, a config the router accepts.
func TestHelmChartDefaults(t *testing.T) {
	objs := renderedObjects(t, "")
	for _, k := range []string{"Deployment/semroute-semroute", "Service/semroute-semroute", "ServiceAccount/semroute-semroute", "Role/semroute-semroute", "RoleBinding/semroute-semroute", "ConfigMap/semroute-semroute"} {
		if objs[k] == nil {
			t.Errorf("the chart makes no %s (it makes %v)", k, keys(objs))
		}
	}
	d := deployment(objs)
	restricted(t, "chart", d.Spec.Template.Spec)
	c, err := loader.Load("helm/semroute")
	if err != nil {
		t.Fatal(err)
	}
	if img, want := d.Spec.Template.Spec.Containers[0].Image, "ghcr.io/semroute/semroute:"+c.Metadata.AppVersion; img != want || c.Metadata.AppVersion != "0.1.0" {
		t.Errorf("image %s, want %s (appVersion 0.1.0)", img, want)
	}
	cfg := routerConfig(t, objs)
	if cfg.Discovery.Kubernetes.Service != "vllm" || cfg.Routing.Policy.Type != "semantic" {
		t.Errorf("config: discovery %+v, policy %q", cfg.Discovery.Kubernetes, cfg.Routing.Policy.Type)
	}
	if ev := cfg.Discovery.KVEvents; ev != (configs.KVEventsConfig{Endpoint: "tcp://{host}:5557", ReplayEndpoint: "tcp://{host}:5558"}) {
		t.Errorf("KV events %+v, want vllm.yaml's ports dialed on every engine", ev)
	}
	if v := volume(d.Spec.Template.Spec, "decisions"); v == nil || v.EmptyDir == nil || v.EmptyDir.SizeLimit == nil || v.EmptyDir.SizeLimit.String() != "1792Mi" {
		t.Errorf("the decision log's volume is not limited to (5 + 2) × 256 MiB: %+v", v)
	}
	if objs["PodDisruptionBudget/semroute-semroute"] != nil {
		t.Error("a PodDisruptionBudget for one router blocks every drain")
	}
	notes := render(t, "")["semroute/templates/NOTES.txt"]
	for _, w := range []string{"the Service vllm's endpoints", "dialing each at port 5557 (replay 5558)", "docs/kubernetes.md"} {
		if !strings.Contains(notes, w) {
			t.Errorf("NOTES.txt does not say %q:\n%s", w, notes)
		}
	}
}

// A fleet of three behind a gateway: NATS, the endpoint picker with TLS,
// the admin API, API keys, an InferencePool, a disruption budget and
// anti-affinity; the secrets it makes.
func TestHelmChartFleet(t *testing.T) {
	objs := renderedObjects(t, `
replicaCount: 3
antiAffinity: required
discovery: {inferencePool: qwen-pool}
nats: {url: "tls://nats.llm.svc:4222", passwordSecret: {name: semroute-nats}, caSecret: nats-tls}
grpc: {enabled: true, extProcWithoutToken: true, tls: {enabled: true, secretName: semroute-grpc-tls}}
admin: {enabled: true}
auth: {apiKeysSecret: semroute-keys, upstreamKeySecret: {name: vllm-key}}
serviceMonitor: {enabled: true}
config: {flow_control: {enabled: true}}
`)
	for _, k := range []string{"PodDisruptionBudget/semroute-semroute", "Secret/semroute-semroute-grpc", "Secret/semroute-semroute-admin", "ServiceMonitor/semroute-semroute"} {
		if objs[k] == nil {
			t.Errorf("the fleet makes no %s (it makes %v)", k, keys(objs))
		}
	}
	d := deployment(objs)
	restricted(t, "chart fleet", d.Spec.Template.Spec)
	if a := d.Spec.Template.Spec.Affinity; a == nil || a.PodAntiAffinity == nil || len(a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) != 1 {
		t.Errorf("no required anti-affinity: %+v", a)
	}
	env := map[string]bool{}
	for _, e := range d.Spec.Template.Spec.Containers[0].Env {
		env[e.Name] = e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil
	}
	for _, n := range []string{"SEMROUTE_GRPC_TOKEN", "SEMROUTE_ADMIN_TOKEN", "SEMROUTE_AUTH_UPSTREAM_API_KEY", "SEMROUTE_CLUSTER_PASSWORD"} {
		if !env[n] {
			t.Errorf("%s does not come from a Secret: %v", n, env)
		}
	}
	cfg := routerConfig(t, objs)
	if cfg.GRPCListen == "" || cfg.GRPC.TLSCertFile == "" || !cfg.GRPC.ExtProcWithoutToken || cfg.Auth.APIKeysFile == "" ||
		cfg.Discovery.Kubernetes.InferencePool != "qwen-pool" || len(cfg.Cluster.URLs) != 1 || cfg.Admin.Listen == "" || !cfg.FlowControl.Enabled {
		t.Errorf("config: %+v", cfg)
	}
	checkGRPCService(t, objs, chartVariant{grpc: true, tls: true})
}

// discoveryModes are the chart's ways to find the engines, as --set gives
// them, and what the router's config must then say.
var discoveryModes = []struct {
	name string
	sets []string
	kube bool // through the Kubernetes API
	want func(configs.DiscoveryConfig) bool
}{
	{"service by default", nil, true, func(d configs.DiscoveryConfig) bool { return d.Kubernetes.Service == "vllm" }},
	{"service", []string{"discovery.service=engines", "discovery.portName=http"}, true, func(d configs.DiscoveryConfig) bool {
		return d.Kubernetes.Service == "engines" && d.Kubernetes.PortName == "http"
	}},
	{"selector", []string{"discovery.selector=app=vllm", "discovery.port=8001"}, true, func(d configs.DiscoveryConfig) bool {
		return d.Kubernetes.Selector == "app=vllm" && d.Port == 8001
	}},
	// What the operator typed: the default Service does not linger beside it.
	{"inferencePool", []string{"discovery.inferencePool=pool1"}, true, func(d configs.DiscoveryConfig) bool {
		return d.Kubernetes.InferencePool == "pool1" && d.Kubernetes.PoolAPI == "v1"
	}},
	{"inferencePool v1alpha2 elsewhere", []string{"discovery.inferencePool=pool1", "discovery.poolAPI=v1alpha2", "discovery.namespace=models"}, true, func(d configs.DiscoveryConfig) bool {
		return d.Kubernetes.InferencePool == "pool1" && d.Kubernetes.PoolAPI == "v1alpha2" && d.Kubernetes.Namespace == "models"
	}},
	{"dns", []string{"discovery.dnsName=vllm.llm.svc.cluster.local"}, false, func(d configs.DiscoveryConfig) bool {
		return d.DNSName == "vllm.llm.svc.cluster.local" && !d.SRV
	}},
	{"dns srv", []string{"discovery.dnsName=_http._tcp.vllm.llm.svc.cluster.local", "discovery.srv=true"}, false, func(d configs.DiscoveryConfig) bool {
		return d.DNSName == "_http._tcp.vllm.llm.svc.cluster.local" && d.SRV
	}},
}

// chartVariant is a set of values rendered with every discovery mode,
// alone and in a fleet, and what it should make.
type chartVariant struct {
	name       string
	sets       []string
	grpc, tls  bool
	eventsOff  bool
	replayPort int // 0: 5558; -1: none
	dp         int // data-parallel ranks; 0: 1
	noLog      bool
}

var chartVariants = []chartVariant{
	{name: "plain"},
	{name: "api keys, no decision log", sets: []string{"auth.apiKeysSecret=semroute-keys", "auth.upstreamKeySecret.name=vllm-key", "decisionLog.enabled=false"}, noLog: true},
	{name: "grpc tls, admin", sets: []string{"grpc.enabled=true", "grpc.tls.enabled=true", "grpc.tls.secretName=semroute-grpc-tls", "admin.enabled=true"}, grpc: true, tls: true},
	{name: "grpc mtls, no replay", sets: []string{"grpc.enabled=true", "grpc.tokenSecret.create=false", "grpc.tls.enabled=true", "grpc.tls.secretName=semroute-grpc-tls", "grpc.tls.requireClientCert=true", "discovery.kvEvents.replayPort=0"}, grpc: true, tls: true, replayPort: -1},
	{name: "endpoint picker", sets: []string{"grpc.enabled=true", "grpc.extProcWithoutToken=true"}, grpc: true},
	{name: "events off", sets: []string{"discovery.kvEvents.enabled=false"}, eventsOff: true},
	{name: "data parallel", sets: []string{"discovery.dataParallelSize=4", "discovery.kvEvents.replayPort=5600"}, replayPort: 5600, dp: 4},
}

// Every discovery mode, alone and in a fleet of three over NATS, with API
// keys, gRPC with TLS or mTLS, the endpoint picker, KV events on and off,
// data-parallel engines: valid objects, restricted pods, a config the
// router accepts finding the engines the one way asked, the RBAC that way
// needs and no more, KV events dialed at vLLM's ports, the gRPC Service's
// appProtocol following TLS, a bounded decision log.
func TestHelmChartDiscoveryModes(t *testing.T) {
	fleets := []struct {
		name string
		sets []string
	}{
		{"alone", nil},
		{"fleet", []string{"replicaCount=3", "nats.url=tls://nats.llm.svc:4222", "nats.passwordSecret.name=semroute-nats", "nats.caSecret=nats-tls"}},
	}
	for _, m := range discoveryModes {
		for _, f := range fleets {
			for _, v := range chartVariants {
				t.Run(m.name+"/"+f.name+"/"+v.name, func(t *testing.T) {
					sets := append(append(append([]string{}, m.sets...), f.sets...), v.sets...)
					objs := renderedObjects(t, "", sets...)
					d := deployment(objs)
					spec := d.Spec.Template.Spec
					restricted(t, "chart", spec)
					cfg := routerConfig(t, objs)
					dc := cfg.Discovery
					if !m.want(dc) || len(discoveryWays(dc)) != 1 {
						t.Errorf("discovery %+v (ways %v), not only %s", dc, discoveryWays(dc), m.name)
					}
					checkRBAC(t, objs, m.kube, dc)
					if got := spec.AutomountServiceAccountToken != nil && *spec.AutomountServiceAccountToken; got != m.kube {
						t.Errorf("automountServiceAccountToken %v; the Kubernetes API read: %v", got, m.kube)
					}
					checkEvents(t, cfg, v)
					checkGRPCService(t, objs, v)
					if log := volume(spec, "decisions"); v.noLog != (log == nil) || v.noLog != (cfg.DecisionLog.Path == "") {
						t.Errorf("decision log %q, volume %+v", cfg.DecisionLog.Path, log)
					} else if log != nil && (log.EmptyDir == nil || log.EmptyDir.SizeLimit == nil ||
						log.EmptyDir.SizeLimit.Value() < int64(cfg.DecisionLog.MaxFiles+1)*cfg.DecisionLog.MaxBytes) {
						t.Errorf("the decision log's volume cannot hold %d files of %d bytes: %+v", cfg.DecisionLog.MaxFiles+1, cfg.DecisionLog.MaxBytes, log.EmptyDir)
					}
					fleet := f.sets != nil
					if (objs["PodDisruptionBudget/semroute-semroute"] != nil) != fleet || (len(cfg.Cluster.URLs) == 1) != fleet || *d.Spec.Replicas != map[bool]int32{false: 1, true: 3}[fleet] {
						t.Errorf("fleet %v: replicas %d, cluster %v, PodDisruptionBudget %v", fleet, *d.Spec.Replicas, cfg.Cluster.URLs, objs["PodDisruptionBudget/semroute-semroute"] != nil)
					}
					if v.grpc != (cfg.GRPCListen != "") || v.tls != (cfg.GRPC.TLSCertFile != "") {
						t.Errorf("grpc_listen %q, tls %q", cfg.GRPCListen, cfg.GRPC.TLSCertFile)
					}
				})
			}
		}
	}
}

// discoveryWays lists the ways d finds the engines.
func discoveryWays(d configs.DiscoveryConfig) []string {
	var out []string
	for name, v := range map[string]string{"service": d.Kubernetes.Service, "selector": d.Kubernetes.Selector, "inferencePool": d.Kubernetes.InferencePool, "dns": d.DNSName} {
		if v != "" {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out
}

// checkRBAC checks that the Role exists only when discovery reads the
// Kubernetes API, in the namespace it reads, and grants what that way
// reads: a Service's EndpointSlices, or pods (and an InferencePool).
func checkRBAC(t *testing.T, objs map[string]runtime.Object, kube bool, d configs.DiscoveryConfig) {
	t.Helper()
	role, _ := objs["Role/semroute-semroute"].(*rbacv1.Role)
	binding, _ := objs["RoleBinding/semroute-semroute"].(*rbacv1.RoleBinding)
	if (role != nil) != kube || (binding != nil) != kube {
		t.Errorf("Role %v, RoleBinding %v; the Kubernetes API read: %v", role != nil, binding != nil, kube)
	}
	if role == nil {
		return
	}
	ns := cmp.Or(d.Kubernetes.Namespace, "llm") // the release's
	if role.Namespace != ns || binding.Namespace != ns {
		t.Errorf("Role in %q, RoleBinding in %q, discovery reads %q", role.Namespace, binding.Namespace, ns)
	}
	var got []string
	for _, r := range role.Rules {
		for _, res := range r.Resources {
			got = append(got, r.APIGroups[0]+"/"+res)
		}
	}
	want := []string{"/pods"}
	switch {
	case d.Kubernetes.Service != "":
		want = []string{"discovery.k8s.io/endpointslices"}
	case d.Kubernetes.InferencePool != "" && d.Kubernetes.PoolAPI == "v1alpha2":
		want = append(want, "inference.networking.x-k8s.io/inferencepools")
	case d.Kubernetes.InferencePool != "":
		want = append(want, "inference.networking.k8s.io/inferencepools")
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("the Role grants %v, discovery reads %v", got, want)
	}
}

// checkEvents checks that the router runs in a tokenizer mode that uses KV
// events and dials, at each engine's address, the ports vLLM binds, rank
// by rank, none shared; or follows none when they are off.
func checkEvents(t *testing.T, cfg *configs.Config, v chartVariant) {
	t.Helper()
	if cfg.Tokenizer.Mode == "estimate" {
		t.Errorf("tokenizer.mode estimate ignores KV events")
	}
	ev := cfg.Discovery.KVEvents
	if v.eventsOff {
		if ev != (configs.KVEventsConfig{}) {
			t.Errorf("KV events off, yet %+v", ev)
		}
		return
	}
	if ev.Listen != "" || ev.Topic != "" {
		t.Errorf("KV events %+v: the routers dial (listen works for one router only) and take vLLM's topic, \"\"", ev)
	}
	n := max(v.dp, 1)
	if cfg.Discovery.DataParallelSize != max(v.dp, 1) {
		t.Errorf("data_parallel_size %d, want %d", cfg.Discovery.DataParallelSize, n)
	}
	replay := map[int]int{0: 5558, -1: 0}[v.replayPort]
	if v.replayPort > 0 {
		replay = v.replayPort
	}
	ranks := replica.Ranks([]replica.Spec{{Name: "e", URL: "http://10.1.2.3:8000", KVEvents: replica.KVEvents(ev), DataParallel: replica.DataParallel{Size: cfg.Discovery.DataParallelSize}}})
	if len(ranks) != n {
		t.Fatalf("%d ranks, want %d", len(ranks), n)
	}
	used := map[string]bool{}
	for k, r := range ranks {
		want := fmt.Sprintf("tcp://10.1.2.3:%d", 5557+k)
		wantReplay := ""
		if replay != 0 {
			wantReplay = fmt.Sprintf("tcp://10.1.2.3:%d", replay+k)
		}
		if r.KVEvents.Endpoint != want || r.KVEvents.ReplayEndpoint != wantReplay {
			t.Errorf("rank %d dials %q and %q, want %q and %q", k, r.KVEvents.Endpoint, r.KVEvents.ReplayEndpoint, want, wantReplay)
		}
		for _, a := range []string{r.KVEvents.Endpoint, r.KVEvents.ReplayEndpoint} {
			if a != "" && used[a] {
				t.Errorf("%s is two sockets' address", a)
			}
			used[a] = true
		}
	}
}

// checkGRPCService checks the gRPC Service port: kubernetes.io/h2c, gRPC's
// HTTP/2 in clear, without TLS; no appProtocol with TLS, for which
// Kubernetes defines none (h2c would have a gateway speak clear text to it).
func checkGRPCService(t *testing.T, objs map[string]runtime.Object, v chartVariant) {
	t.Helper()
	var port *corev1.ServicePort
	for _, p := range objs["Service/semroute-semroute"].(*corev1.Service).Spec.Ports {
		if p.Name == "grpc" {
			port = &p
		}
	}
	if (port != nil) != v.grpc {
		t.Fatalf("gRPC port on the Service: %v, want %v", port != nil, v.grpc)
	}
	if port == nil {
		return
	}
	got := ""
	if port.AppProtocol != nil {
		got = *port.AppProtocol
	}
	if want := map[bool]string{false: "kubernetes.io/h2c", true: ""}[v.tls]; got != want {
		t.Errorf("TLS %v: the gRPC port's appProtocol is %q, want %q", v.tls, got, want)
	}
}

// What the chart refuses, with a message naming the values to change: two
// ways to find the engines; a misspelt, unknown or out-of-range value (the
// schema); a router config key the chart sets from a value, or a secret;
// settings the router would refuse or run badly with.
func TestHelmChartRefuses(t *testing.T) {
	for _, c := range []struct {
		name   string
		values string
		sets   []string
		want   []string
	}{
		{"service and inferencePool", "", []string{"discovery.service=vllm", "discovery.inferencePool=pool1"},
			[]string{`discovery.service="vllm" and discovery.inferencePool="pool1"`, "set one of discovery.service, discovery.selector, discovery.inferencePool and discovery.dnsName"}},
		{"selector and dnsName", "discovery: {selector: app=vllm, dnsName: vllm.llm.svc}", nil,
			[]string{`discovery.selector="app=vllm" and discovery.dnsName="vllm.llm.svc"`}},
		{"misspelt replicaCount", "replicaCout: 3", nil, []string{"schema", "replicaCout"}},
		{"antiAffinity sometimes", "", []string{"antiAffinity=sometimes"}, []string{"schema", "/antiAffinity"}},
		{"misspelt inferencePool", "discovery: {inferencePol: x}", nil, []string{"schema", "inferencePol"}},
		{"misspelt nested value", "", []string{"grpc.tls.requireClientCerts=true"}, []string{"schema", "requireClientCerts"}},
		{"no routers", "", []string{"replicaCount=0"}, []string{"schema", "/replicaCount"}},
		{"replicaCount a string", "replicaCount: three", nil, []string{"schema", "/replicaCount"}},
		{"port out of range", "", []string{"discovery.port=70000"}, []string{"schema", "/discovery/port"}},
		{"pool API", "", []string{"discovery.inferencePool=p", "discovery.poolAPI=v2"}, []string{"schema", "/discovery/poolAPI"}},
		{"pull policy", "", []string{"image.pullPolicy=Sometimes"}, []string{"schema", "/image/pullPolicy"}},
		{"scheme", "", []string{"discovery.scheme=grpc"}, []string{"schema", "/discovery/scheme"}},
		{"NATS URL", "", []string{"nats.url=http://nats:4222"}, []string{"schema", "/nats/url"}},
		{"interval", "", []string{"discovery.interval=10"}, []string{"schema", "/discovery/interval"}},
		{"decision log size", "", []string{"decisionLog.maxBytes=100"}, []string{"schema", "/decisionLog/maxBytes"}},
		{"config's discovery", "config: {discovery: {port: 9000}}", nil, []string{"config.discovery.port: the chart sets it from discovery.port"}},
		{"config's DNS beside the chart's Service", "config: {discovery: {dns_name: vllm}}", nil, []string{"config.discovery.dns_name", "discovery.dnsName"}},
		{"config's events", "config: {discovery: {kv_events: {listen: tcp://0.0.0.0:5557}}}", nil, []string{"config.discovery.kv_events", "discovery.kvEvents"}},
		{"config's decision log size", "config: {decision_log: {max_bytes: 1073741824}}", nil, []string{"config.decision_log.max_bytes", "decisionLog.maxBytes"}},
		{"config's listen", "config: {listen: 0.0.0.0:9000}", nil, []string{"config.listen"}},
		{"a token in the ConfigMap", "config: {grpc: {token: hunter2}}", nil, []string{"config.grpc.token", "grpc.tokenSecret"}},
		{"a password in the ConfigMap", "config: {cluster: {password: hunter2}}", nil, []string{"config.cluster.password", "nats.passwordSecret"}},
		{"estimated tokens with events", "config: {tokenizer: {mode: estimate}}", nil, []string{"config.tokenizer.mode estimate", "discovery.kvEvents.enabled=false"}},
		{"ranks' ports overlapping", "", []string{"discovery.dataParallelSize=2"}, []string{"discovery.kvEvents: ports 5557-5558 and replay ports 5558-5559 overlap"}},
		{"two routers without NATS", "", []string{"replicaCount=2"}, []string{"nats.url"}},
		{"gRPC unauthenticated", "", []string{"grpc.enabled=true", "grpc.tokenSecret.create=false", "grpc.tls.enabled=true", "grpc.tls.secretName=t"}, []string{"grpc.enabled needs a token"}},
		{"client certificates without TLS", "", []string{"grpc.enabled=true", "grpc.tls.requireClientCert=true"}, []string{"grpc.tls.requireClientCert needs grpc.tls.enabled"}},
		{"TLS without a certificate", "", []string{"grpc.enabled=true", "grpc.tls.enabled=true"}, []string{"grpc.tls.secretName is required"}},
		{"admin without a token", "", []string{"admin.enabled=true", "admin.tokenSecret.create=false"}, []string{"admin.enabled needs a token"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := renderErr(c.values, c.sets...)
			if err == nil {
				t.Fatalf("rendered")
			}
			t.Log(err)
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("the error does not say %q:\n%v", w, err)
				}
			}
		})
	}
}

// The values the router's config takes beside the chart's are kept, nested
// ones too: the chart merges its settings in, it does not replace sections.
func TestHelmChartConfigMerged(t *testing.T) {
	objs := renderedObjects(t, `
config:
  decision_log: {raw_ids: true}
  discovery: {kubernetes: {max_replicas: 64, trusted_managers: [mesh-controller]}}
  cluster: {prefix: llm}
  grpc: {max_unreleased_decisions: 500}
  flow_control: {enabled: true}
`, "discovery.inferencePool=pool1", "replicaCount=3", "nats.url=nats://nats:4222", "grpc.enabled=true")
	cfg := routerConfig(t, objs)
	k := cfg.Discovery.Kubernetes
	if !cfg.DecisionLog.RawIDs || cfg.DecisionLog.Path == "" || k.MaxReplicas != 64 || len(k.TrustedManagers) != 1 || k.InferencePool != "pool1" ||
		cfg.Cluster.Prefix != "llm" || len(cfg.Cluster.URLs) != 1 || cfg.GRPC.MaxUnreleasedDecisions != 500 || cfg.GRPCListen == "" || !cfg.FlowControl.Enabled {
		t.Errorf("config: %+v", cfg)
	}
}

// The decision log's volume holds what the router keeps, (max_files + 1)
// files of max_bytes, and one file more for a rotation that failed.
func TestHelmChartDecisionLogVolume(t *testing.T) {
	for _, c := range []struct {
		sets []string
		want string
	}{
		{nil, "1792Mi"},
		{[]string{"decisionLog.maxBytes=67108864", "decisionLog.maxFiles=2"}, "256Mi"},
		{[]string{"decisionLog.maxBytes=1500", "decisionLog.maxFiles=1"}, "4500"},
	} {
		objs := renderedObjects(t, "", c.sets...)
		cfg := routerConfig(t, objs)
		v := volume(deployment(objs).Spec.Template.Spec, "decisions")
		if v == nil || v.EmptyDir == nil || v.EmptyDir.SizeLimit == nil || v.EmptyDir.SizeLimit.String() != c.want ||
			v.EmptyDir.SizeLimit.Value() != int64(cfg.DecisionLog.MaxFiles+2)*cfg.DecisionLog.MaxBytes {
			t.Errorf("%v: volume %+v, want sizeLimit %s for max_files %d of max_bytes %d", c.sets, v, c.want, cfg.DecisionLog.MaxFiles, cfg.DecisionLog.MaxBytes)
		}
	}
}

// values.schema.json describes every value of values.yaml and no other,
// refusing unknown keys at every level but the free-form maps.
func TestHelmSchemaCoversValues(t *testing.T) {
	raw, err := os.ReadFile("helm/semroute/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var values map[string]any
	if err := utilyaml.Unmarshal(raw, &values); err != nil {
		t.Fatal(err)
	}
	raw, err = os.ReadFile("helm/semroute/values.schema.json")
	if err != nil {
		t.Fatal(err)
	}
	var schema map[string]any
	if err := stdjson.Unmarshal(raw, &schema); err != nil {
		t.Fatal(err)
	}
	if schema["$schema"] != "http://json-schema.org/draft-07/schema#" {
		t.Errorf("$schema %v, want draft-07", schema["$schema"])
	}
	freeForm := map[string]bool{"config": true, "nodeSelector": true, "tolerations": true, "resources": true, "global": true}
	var walk func(path string, v any, s map[string]any)
	walk = func(path string, v any, s map[string]any) {
		props, _ := s["properties"].(map[string]any)
		if s["additionalProperties"] != false {
			t.Errorf("%s: additionalProperties is not false", path)
		}
		m, _ := v.(map[string]any)
		for k, sub := range m {
			ps, ok := props[k].(map[string]any)
			if !ok {
				t.Errorf("%s%s: in values.yaml, not in the schema", path, k)
				continue
			}
			if _, isMap := sub.(map[string]any); isMap && !freeForm[k] {
				walk(path+k+".", sub, ps)
			} else if _, typed := ps["type"]; !typed && ps["enum"] == nil && ps["oneOf"] == nil {
				t.Errorf("%s%s: the schema gives it no type", path, k)
			}
		}
		for k := range props {
			if _, ok := m[k]; !ok && !freeForm[k] {
				t.Errorf("%s%s: in the schema, not in values.yaml", path, k)
			}
		}
	}
	walk("", values, schema)
}

// deployment returns the chart's Deployment.
func deployment(objs map[string]runtime.Object) *appsv1.Deployment {
	return objs["Deployment/semroute-semroute"].(*appsv1.Deployment)
}

// volume returns the pod's volume named name, nil if none.
func volume(spec corev1.PodSpec, name string) *corev1.Volume {
	for i, v := range spec.Volumes {
		if v.Name == name {
			return &spec.Volumes[i]
		}
	}
	return nil
}

// The plain manifests: every object valid against the API's types,
// strictly; every pod restricted; every Secret they name made by one of
// them or optional.
func TestPlainManifests(t *testing.T) {
	files, _ := filepath.Glob("k8s/*.yaml")
	if len(files) < 3 {
		t.Fatalf("manifests: %v", files)
	}
	all := map[string]runtime.Object{}
	made := map[string]bool{} // Secrets the manifests tell to make (secrets stay out of git)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range createSecret.FindAllStringSubmatch(string(b), -1) {
			made[m[1]] = true
		}
		for k, v := range objects(t, f, b) {
			all[k] = v
		}
	}
	for k, o := range all {
		var spec *corev1.PodSpec
		switch x := o.(type) {
		case *appsv1.Deployment:
			spec = &x.Spec.Template.Spec
		case *appsv1.StatefulSet:
			spec = &x.Spec.Template.Spec
		}
		if spec == nil {
			continue
		}
		if !strings.Contains(k, "vllm") { // the GPU engine's own image runs as it must
			restricted(t, k, *spec)
		}
		for _, c := range spec.Containers {
			for _, e := range c.Env {
				if r := e.ValueFrom; r != nil && r.SecretKeyRef != nil && all["Secret/"+r.SecretKeyRef.Name] == nil && !made[r.SecretKeyRef.Name] &&
					(r.SecretKeyRef.Optional == nil || !*r.SecretKeyRef.Optional) {
					t.Errorf("%s needs Secret %s, which no manifest makes or says how to make, and which is not optional", k, r.SecretKeyRef.Name)
				}
			}
		}
	}
	if all["PodDisruptionBudget/semroute"] == nil {
		t.Errorf("the three routers have no PodDisruptionBudget (objects: %v)", keys(all))
	}
	cm, ok := all["ConfigMap/semroute"].(*corev1.ConfigMap)
	if !ok {
		t.Fatal("no semroute ConfigMap")
	}
	cfg, err := configs.LoadBytes(configs.NewViper(), []byte(cm.Data["router.yaml"]))
	if err != nil {
		t.Fatalf("the manifests' router.yaml is refused: %v", err)
	}
	if err := cfg.CheckServable(); err != nil {
		t.Errorf("the manifests' router.yaml cannot serve: %v", err)
	}
	router, engine := all["Deployment/semroute"].(*appsv1.Deployment), all["Deployment/vllm"].(*appsv1.Deployment)
	c, err := loader.Load("helm/semroute")
	if err != nil {
		t.Fatal(err)
	}
	if img, want := router.Spec.Template.Spec.Containers[0].Image, c.Values["image"].(map[string]any)["repository"].(string)+":"+c.Metadata.AppVersion; img != want {
		t.Errorf("the manifests run %s, the chart %s", img, want)
	}
	if v := volume(router.Spec.Template.Spec, "decisions"); v == nil || v.EmptyDir == nil || v.EmptyDir.SizeLimit == nil ||
		v.EmptyDir.SizeLimit.Value() < int64(cfg.DecisionLog.MaxFiles+1)*cfg.DecisionLog.MaxBytes {
		t.Errorf("the decision log's volume cannot hold %d files of %d bytes: %+v", cfg.DecisionLog.MaxFiles+1, cfg.DecisionLog.MaxBytes, v)
	}
	pub, replay := engineEvents(t, engine.Spec.Template.Spec.Containers[0], cfg)
	if svc := all["Service/vllm"].(*corev1.Service); len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Name != "http" {
		t.Errorf("the vLLM Service's ports %+v: discovery through its EndpointSlices takes the first, which must be http", svc.Spec.Ports)
	}
	var policies []*networkingv1.NetworkPolicy
	for _, o := range all {
		if p, ok := o.(*networkingv1.NetworkPolicy); ok {
			policies = append(policies, p)
		}
	}
	for _, port := range []int32{8000, pub, replay} {
		if !reachable(policies, router.Spec.Template.Labels, engine.Spec.Template.Labels, port) {
			t.Errorf("a NetworkPolicy keeps the routers from the engines' port %d", port)
		}
	}
}

// vllmKVEventsFields are the fields of vLLM's KVEventsConfig
// (vllm/config/kv_events.py).
var vllmKVEventsFields = map[string]bool{"enable_kv_cache_events": true, "publisher": true, "endpoint": true, "replay_endpoint": true,
	"buffer_steps": true, "hwm": true, "max_queue_size": true, "topic": true}

// engineEvents checks that the engine publishes its KV events where the
// router's config dials them: vLLM's --kv-events-config names only its
// fields, binds (a wildcard endpoint) a PUB and a replay port the
// container declares, under a topic the router subscribes to, in the
// blocks the router cuts; the router runs a tokenizer mode that uses
// them. It returns the two ports.
func engineEvents(t *testing.T, c corev1.Container, cfg *configs.Config) (pub, replay int32) {
	t.Helper()
	var raw string
	blockSize := "16" // vLLM's default
	for i, a := range c.Args {
		switch {
		case a == "--kv-events-config" && i+1 < len(c.Args):
			raw = c.Args[i+1]
		case strings.HasPrefix(a, "--kv-events-config="):
			raw = strings.TrimPrefix(a, "--kv-events-config=")
		case strings.HasPrefix(a, "--block-size="):
			blockSize = strings.TrimPrefix(a, "--block-size=")
		}
	}
	var ev map[string]any
	if err := stdjson.Unmarshal([]byte(raw), &ev); err != nil {
		t.Fatalf("vLLM's --kv-events-config %q: %v", raw, err)
	}
	for k := range ev {
		if !vllmKVEventsFields[k] {
			t.Errorf("--kv-events-config: vLLM has no field %q", k)
		}
	}
	if ev["enable_kv_cache_events"] != true || ev["publisher"] != "zmq" {
		t.Errorf("--kv-events-config %v publishes nothing", ev)
	}
	port := func(field string) int32 {
		addr, _ := ev[field].(string)
		rest, ok := strings.CutPrefix(addr, "tcp://*:")
		n, err := strconv.Atoi(rest)
		if !ok || err != nil {
			t.Fatalf("--kv-events-config %s %q: not a port bound on every address (tcp://*:port), which the routers dial", field, addr)
		}
		return int32(n)
	}
	pub, replay = port("endpoint"), port("replay_endpoint")
	declared := map[int32]bool{}
	for _, p := range c.Ports {
		declared[p.ContainerPort] = true
	}
	if !declared[pub] || !declared[replay] {
		t.Errorf("the engine's container does not declare its KV events ports %d and %d: %+v", pub, replay, c.Ports)
	}
	d := cfg.Discovery
	if d.KVEvents != (configs.KVEventsConfig{Endpoint: fmt.Sprintf("tcp://{host}:%d", pub), ReplayEndpoint: fmt.Sprintf("tcp://{host}:%d", replay)}) {
		t.Errorf("the routers' discovery.kv_events %+v does not dial the engines' ports %d and %d", d.KVEvents, pub, replay)
	}
	if topic, _ := ev["topic"].(string); !strings.HasPrefix(topic, d.KVEvents.Topic) {
		t.Errorf("the engine publishes under %q, the routers subscribe to %q", topic, d.KVEvents.Topic)
	}
	if cfg.Tokenizer.Mode == "estimate" || strconv.Itoa(cfg.Tokenizer.BlockTokens) != blockSize {
		t.Errorf("tokenizer %+v: events need a precise mode and vLLM's --block-size %s", cfg.Tokenizer, blockSize)
	}
	r := replica.Ranks([]replica.Spec{{Name: "e", URL: "http://10.1.2.3:8000", KVEvents: replica.KVEvents(d.KVEvents)}})
	if r[0].KVEvents.Endpoint != fmt.Sprintf("tcp://10.1.2.3:%d", pub) {
		t.Errorf("an engine at 10.1.2.3 is dialed at %q", r[0].KVEvents.Endpoint)
	}
	return pub, replay
}

// reachable reports whether the NetworkPolicies of one namespace let pods
// labelled from reach pods labelled to on TCP port: to's ingress and
// from's egress, each allowed when no policy of that type selects the pod
// or a rule of one that does allows the port and the peer.
func reachable(policies []*networkingv1.NetworkPolicy, from, to map[string]string, port int32) bool {
	allows := func(subject, peer map[string]string, typ networkingv1.PolicyType) bool {
		isolated := false
		for _, p := range policies {
			types := p.Spec.PolicyTypes
			if len(types) == 0 {
				types = []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}
				if len(p.Spec.Egress) > 0 {
					types = append(types, networkingv1.PolicyTypeEgress)
				}
			}
			if !slices.Contains(types, typ) || !selects(&p.Spec.PodSelector, subject) {
				continue
			}
			isolated = true
			type rule struct {
				ports []networkingv1.NetworkPolicyPort
				peers []networkingv1.NetworkPolicyPeer
			}
			var rules []rule
			if typ == networkingv1.PolicyTypeIngress {
				for _, r := range p.Spec.Ingress {
					rules = append(rules, rule{r.Ports, r.From})
				}
			} else {
				for _, r := range p.Spec.Egress {
					rules = append(rules, rule{r.Ports, r.To})
				}
			}
			for _, r := range rules {
				portOK := len(r.ports) == 0
				for _, pp := range r.ports {
					if (pp.Protocol == nil || *pp.Protocol == corev1.ProtocolTCP) && (pp.Port == nil ||
						pp.Port.IntVal == port || pp.EndPort != nil && pp.Port.IntVal <= port && port <= *pp.EndPort) {
						portOK = true
					}
				}
				peerOK := len(r.peers) == 0
				for _, pe := range r.peers {
					if pe.IPBlock == nil && (pe.PodSelector == nil || selects(pe.PodSelector, peer)) {
						peerOK = true
					}
				}
				if portOK && peerOK {
					return true
				}
			}
		}
		return !isolated
	}
	return allows(to, from, networkingv1.PolicyTypeIngress) && allows(from, to, networkingv1.PolicyTypeEgress)
}

// selects reports whether sel selects pods labelled l.
func selects(sel *metav1.LabelSelector, l map[string]string) bool {
	s, err := metav1.LabelSelectorAsSelector(sel)
	return err == nil && s.Matches(labels.Set(l))
}

// reachable, which TestPlainManifests relies on to find a NetworkPolicy
// keeping the routers from the engines' KV events, finds one.
func TestManifestReachable(t *testing.T) {
	router, engine := map[string]string{"app": "semroute"}, map[string]string{"app": "vllm"}
	pol := func(y string) *networkingv1.NetworkPolicy {
		var p networkingv1.NetworkPolicy
		if err := utilyaml.Unmarshal([]byte(y), &p); err != nil {
			t.Fatal(err)
		}
		return &p
	}
	httpOnly := pol(`{spec: {podSelector: {matchLabels: {app: vllm}}, policyTypes: [Ingress], ingress: [{ports: [{port: 8000}], from: [{podSelector: {matchLabels: {app: semroute}}}]}]}}`)
	withEvents := pol(`{spec: {podSelector: {matchLabels: {app: vllm}}, ingress: [{ports: [{port: 8000}, {port: 5557, endPort: 5558}], from: [{podSelector: {matchLabels: {app: semroute}}}]}]}}`)
	egressDNS := pol(`{spec: {podSelector: {matchLabels: {app: semroute}}, policyTypes: [Egress], egress: [{ports: [{port: 53, protocol: UDP}]}]}}`)
	other := pol(`{spec: {podSelector: {matchLabels: {app: nats}}, policyTypes: [Ingress, Egress]}}`)
	for _, c := range []struct {
		policies []*networkingv1.NetworkPolicy
		port     int32
		want     bool
	}{
		{nil, 5557, true},
		{[]*networkingv1.NetworkPolicy{other}, 5557, true},
		{[]*networkingv1.NetworkPolicy{httpOnly}, 8000, true},
		{[]*networkingv1.NetworkPolicy{httpOnly}, 5557, false},
		{[]*networkingv1.NetworkPolicy{httpOnly, withEvents}, 5558, true},
		{[]*networkingv1.NetworkPolicy{withEvents, egressDNS}, 5557, false},
	} {
		if got := reachable(c.policies, router, engine, c.port); got != c.want {
			t.Errorf("%d policies, port %d: reachable %v, want %v", len(c.policies), c.port, got, c.want)
		}
	}
}
