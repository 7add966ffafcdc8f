// Package deploy holds the Kubernetes manifests and the Helm chart; its
// test renders the chart with Helm's own engine, as `helm template` does,
// and checks every object it and the plain manifests make against the
// Kubernetes API's types, strictly, offline.
package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/semroute/semroute/configs"
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

// render renders the chart with values as `helm template semroute
// deploy/helm/semroute --namespace llm` would.
func render(t *testing.T, values string) map[string]string {
	t.Helper()
	c, err := loader.Load("helm/semroute")
	if err != nil {
		t.Fatal(err)
	}
	vals, err := chartutil.ReadValues([]byte(values))
	if err != nil {
		t.Fatal(err)
	}
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: "semroute", Namespace: "llm", IsInstall: true}, chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatal(err)
	}
	out, err := engine.Render(c, rv)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// renderedObjects renders the chart and decodes every object it makes.
func renderedObjects(t *testing.T, values string) map[string]runtime.Object {
	t.Helper()
	files := render(t, values)
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

// The chart's defaults: one router finding a Service's endpoints, with
// the RBAC that reads them, restricted pods, a config the router accepts.
func TestHelmChartDefaults(t *testing.T) {
	objs := renderedObjects(t, "")
	for _, k := range []string{"Deployment/semroute-semroute", "Service/semroute-semroute", "ServiceAccount/semroute-semroute", "Role/semroute-semroute", "RoleBinding/semroute-semroute", "ConfigMap/semroute-semroute"} {
		if objs[k] == nil {
			t.Errorf("the chart makes no %s (it makes %v)", k, keys(objs))
		}
	}
	d := objs["Deployment/semroute-semroute"].(*appsv1.Deployment)
	restricted(t, "chart", d.Spec.Template.Spec)
	cfg := routerConfig(t, objs)
	if cfg.Discovery.Kubernetes.Service != "vllm" || cfg.Routing.Policy.Type != "semantic" {
		t.Errorf("config: discovery %+v, policy %q", cfg.Discovery.Kubernetes, cfg.Routing.Policy.Type)
	}
	if objs["PodDisruptionBudget/semroute-semroute"] != nil {
		t.Error("a PodDisruptionBudget for one router blocks every drain")
	}
}

// A fleet of three behind a gateway: NATS, the endpoint picker with TLS,
// the admin API, API keys, an InferencePool, a disruption budget and
// anti-affinity; the secrets it makes.
func TestHelmChartFleet(t *testing.T) {
	objs := renderedObjects(t, `
replicaCount: 3
antiAffinity: required
discovery: {service: "", inferencePool: qwen-pool}
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
	d := objs["Deployment/semroute-semroute"].(*appsv1.Deployment)
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
	if _, err := renderErr(`replicaCount: 2`); err == nil || !strings.Contains(err.Error(), "nats.url") {
		t.Errorf("two routers without NATS rendered: %v", err)
	}
}

func renderErr(values string) (map[string]string, error) {
	c, err := loader.Load("helm/semroute")
	if err != nil {
		return nil, err
	}
	vals, err := chartutil.ReadValues([]byte(values))
	if err != nil {
		return nil, err
	}
	rv, err := chartutil.ToRenderValues(c, vals, chartutil.ReleaseOptions{Name: "semroute", Namespace: "llm"}, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	return engine.Render(c, rv)
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
	if cm, ok := all["ConfigMap/semroute"].(*corev1.ConfigMap); !ok {
		t.Error("no semroute ConfigMap")
	} else if _, err := configs.LoadBytes(configs.NewViper(), []byte(cm.Data["router.yaml"])); err != nil {
		t.Errorf("the manifests' router.yaml is refused: %v", err)
	}
}
