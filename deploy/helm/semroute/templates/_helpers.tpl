{{- define "semroute.fullname" -}}
{{- printf "%s-semroute" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "semroute.labels" -}}
app.kubernetes.io/name: semroute
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "semroute.selector" -}}
app.kubernetes.io/name: semroute
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "semroute.serviceAccount" -}}
{{- if .Values.serviceAccount.create -}}{{ .Values.serviceAccount.name | default (include "semroute.fullname" .) }}{{- else -}}{{ .Values.serviceAccount.name | default "default" }}{{- end -}}
{{- end -}}

{{- define "semroute.grpcSecret" -}}
{{- .Values.grpc.tokenSecret.name | default (printf "%s-grpc" (include "semroute.fullname" .)) -}}
{{- end -}}

{{- define "semroute.adminSecret" -}}
{{- .Values.admin.tokenSecret.name | default (printf "%s-admin" (include "semroute.fullname" .)) -}}
{{- end -}}

{{- /*
semroute.discoveryMode is how the router finds the engines: service,
selector, inferencePool or dns. At most one of discovery.service,
discovery.selector, discovery.inferencePool and discovery.dnsName may be
set (the router refuses two); none set is service, the Service "vllm".
*/ -}}
{{- define "semroute.discoveryMode" -}}
{{- $d := .Values.discovery -}}
{{- $set := list -}}
{{- range $k := list "service" "selector" "inferencePool" "dnsName" -}}
{{- if index $d $k -}}{{- $set = append $set (printf "discovery.%s=%q" $k (index $d $k)) -}}{{- end -}}
{{- end -}}
{{- if gt (len $set) 1 -}}
{{- fail (printf "discovery: set one of discovery.service, discovery.selector, discovery.inferencePool and discovery.dnsName, not %s: they are ways to find the same engines, and the router takes one" (join " and " $set)) -}}
{{- end -}}
{{- if $d.selector -}}selector
{{- else if $d.inferencePool -}}inferencePool
{{- else if $d.dnsName -}}dns
{{- else -}}service
{{- end -}}
{{- end -}}

{{- /* semroute.kubeDiscovery is "true" when discovery reads the Kubernetes API (RBAC, a token), "" for DNS. */ -}}
{{- define "semroute.kubeDiscovery" -}}
{{- if ne (include "semroute.discoveryMode" .) "dns" -}}true{{- end -}}
{{- end -}}

{{- /*
semroute.decisionLogSizeLimit is the decision log volume's sizeLimit: the
router keeps the file it writes and decisionLog.maxFiles rotated ones, each
at most decisionLog.maxBytes, and one file more is left for a rotation that
failed (the file then grows until a retry succeeds): (maxFiles + 2) ×
maxBytes, in Mi when it divides.
*/ -}}
{{- define "semroute.decisionLogSizeLimit" -}}
{{- $bytes := mul (int64 .Values.decisionLog.maxBytes) (add (int64 .Values.decisionLog.maxFiles) 2) -}}
{{- if eq (mod $bytes 1048576) 0 -}}{{ div $bytes 1048576 }}Mi{{- else -}}{{ $bytes }}{{- end -}}
{{- end -}}
