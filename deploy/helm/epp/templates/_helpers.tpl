{{/* The release's full name (pods are <fullname>-0 .. -N-1). */}}
{{- define "epp.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "epp.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "epp.labels" -}}
{{ include "epp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "epp.serviceAccountName" -}}
{{- default (include "epp.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The headless Service giving each replica its peer DNS name. */}}
{{- define "epp.peerService" -}}
{{- printf "%s-peers" (include "epp.fullname" .) -}}
{{- end -}}

{{/* Node i+1 is pod i: "1=<fullname>-0.<peers>.<ns>.svc:<port>,2=...". */}}
{{- define "epp.peers" -}}
{{- $name := include "epp.fullname" . -}}
{{- $svc := include "epp.peerService" . -}}
{{- $peers := list -}}
{{- range $i := until (int .Values.replicas) -}}
{{- $peers = append $peers (printf "%d=%s-%d.%s.%s.svc:%d" (add1 $i) $name $i $svc $.Release.Namespace (int $.Values.cluster.peerPort)) -}}
{{- end -}}
{{- join "," $peers -}}
{{- end -}}

{{/* The name each replica's peer certificate carries ({id} / {ordinal} filled by the EPP). */}}
{{- define "epp.peerIdentity" -}}
{{- if .Values.cluster.tls.identity -}}
{{- .Values.cluster.tls.identity -}}
{{- else if .Values.cluster.tls.secretName -}}
epp-node-{id}
{{- else -}}
{{- printf "%s-{ordinal}.%s.%s.svc" (include "epp.fullname" .) (include "epp.peerService" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "epp.clustered" -}}
{{- if gt (int .Values.replicas) 1 -}}true{{- end -}}
{{- end -}}

{{/* Fails the render on values that cannot work. */}}
{{- define "epp.validate" -}}
{{- if not .Values.pool.name -}}
{{- fail "pool.name is required: the InferencePool whose pods the EPP serves" -}}
{{- end -}}
{{- $tls := .Values.cluster.tls -}}
{{- if and (include "epp.clustered" .) (not $tls.issuer.name) (not $tls.secretName) (not .Values.cluster.insecure) -}}
{{- fail "more than one replica needs peer mutual TLS: cluster.tls.issuer.name (a cert-manager issuer; each replica gets its own key from the csi-driver) or cluster.tls.secretName; or cluster.insecure=true for a throwaway test cluster" -}}
{{- end -}}
{{- if and $tls.issuer.name $tls.secretName -}}
{{- fail "cluster.tls.issuer.name and cluster.tls.secretName exclude each other (each replica's own key from the csi-driver, or every key in one Secret)" -}}
{{- end -}}
{{- if and (or $tls.issuer.name $tls.secretName) .Values.cluster.insecure -}}
{{- fail "cluster.tls and cluster.insecure exclude each other" -}}
{{- end -}}
{{- if not (has $tls.issuer.kind (list "Issuer" "ClusterIssuer")) -}}
{{- fail "cluster.tls.issuer.kind must be Issuer or ClusterIssuer" -}}
{{- end -}}
{{- if gt (int .Values.drain.delaySeconds) (int .Values.drain.timeoutSeconds) -}}
{{- fail "drain.delaySeconds must not exceed drain.timeoutSeconds" -}}
{{- end -}}
{{- if le (int .Values.terminationGracePeriodSeconds) (int .Values.drain.timeoutSeconds) -}}
{{- fail "terminationGracePeriodSeconds must exceed drain.timeoutSeconds (Kubernetes kills the pod at the end of the grace period: the rest is for leaving the cluster)" -}}
{{- end -}}
{{- if and .Values.pool.create (not .Values.pool.matchLabels) -}}
{{- fail "pool.create needs pool.matchLabels (the model servers' pod labels)" -}}
{{- end -}}
{{- if and .Values.standalone.enabled (eq .Values.pool.failureMode "FailOpen") (not .Values.pool.matchLabels) -}}
{{- fail "standalone.enabled with pool.failureMode FailOpen needs pool.matchLabels: when the EPP cannot be reached, Envoy balances over the pool's pods (the <fullname>-pool-pods headless Service), never over an address from the request" -}}
{{- end -}}
{{- if not (has .Values.pool.failureMode (list "FailOpen" "FailClose")) -}}
{{- fail "pool.failureMode must be FailOpen or FailClose" -}}
{{- end -}}
{{- if and .Values.tenantsSecret .Values.watchTenants -}}
{{- fail "tenantsSecret and watchTenants exclude each other (tenants from a file, or from TenantQuota objects)" -}}
{{- end -}}
{{- end -}}
