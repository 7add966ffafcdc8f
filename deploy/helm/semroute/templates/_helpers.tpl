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
{{- if .Values.serviceAccount.create -}}{{ include "semroute.fullname" . }}{{- else -}}{{ .Values.serviceAccount.name | default "default" }}{{- end -}}
{{- end -}}

{{- define "semroute.grpcSecret" -}}
{{- .Values.grpc.tokenSecret.name | default (printf "%s-grpc" (include "semroute.fullname" .)) -}}
{{- end -}}

{{- define "semroute.adminSecret" -}}
{{- .Values.admin.tokenSecret.name | default (printf "%s-admin" (include "semroute.fullname" .)) -}}
{{- end -}}
