{{/* Names. */}}
{{- define "gyre.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gyre.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gyre.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "gyre.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gyre
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "proxy") */}}
{{- define "gyre.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gyre.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gyre.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gyre.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gyre.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gyre.cellImage" -}}
{{- $repo := default .Values.image.repository .Values.cells.image.repository -}}
{{- $base := default .Chart.AppVersion .Values.image.tag -}}
{{- $tag := .Values.cells.image.tag -}}
{{- if not $tag -}}
{{- $tag = ternary (printf "%s-cuda" $base) $base (gt (int .Values.cells.gpusPerCell) 0) -}}
{{- end -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "gyre.secretName" -}}
{{- default (printf "%s-secrets" (include "gyre.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "gyre.natsHost" -}}
{{- printf "%s-nats.%s.svc.%s" (include "gyre.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* GYRE_NATS_URL (bundled: with $(NATS_USER)/$(NATS_PASSWORD) when auth is on). */}}
{{- define "gyre.natsUrl" -}}
{{- if .Values.nats.bundled -}}
{{- if .Values.nats.auth.enabled -}}
{{- printf "nats://$(NATS_USER):$(NATS_PASSWORD)@%s:4222" (include "gyre.natsHost" .) -}}
{{- else -}}
{{- printf "nats://%s:4222" (include "gyre.natsHost" .) -}}
{{- end -}}
{{- else -}}
{{- required "nats.url is required when nats.bundled is false" .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{- define "gyre.proxyUrl" -}}
{{- printf "http://%s-proxy.%s.svc.%s:8080" (include "gyre.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* Environment every Gyre container gets. */}}
{{- define "gyre.commonEnv" -}}
{{- $secret := include "gyre.secretName" . -}}
{{- if and .Values.nats.bundled .Values.nats.auth.enabled }}
- name: NATS_USER
  value: {{ .Values.nats.auth.user | quote }}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: nats-password}
{{- end }}
- name: GYRE_NATS_URL
  value: {{ include "gyre.natsUrl" . | quote }}
{{- if .Values.nats.credsSecret }}
- name: GYRE_NATS_CREDS
  value: /etc/gyre/nats/nats.creds
{{- end }}
- name: GYRE_STREAM_REPLICAS
  value: {{ .Values.nats.streamReplicas | quote }}
- name: GYRE_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ default $secret .Values.postgresql.existingSecret }}
      key: {{ ternary .Values.postgresql.secretKey "database-url" (not (empty .Values.postgresql.existingSecret)) }}
- name: GYRE_ADMIN_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: admin-token}
- name: GYRE_RUN_ID
  value: {{ .Values.runId | quote }}
- name: GYRE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: GYRE_LOG_JSON
  value: "true"
# the address this pod's transfer agent (KV offers, port weights and gradients) gives its
# peers: 127.0.0.1 would send them to their own loopback
- name: GYRE_TRANSFER_HOST
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
- name: GYRE_HOST
  value: "0.0.0.0"
- name: GYRE_RUN_DIR
  value: /var/lib/gyre
- name: GYRE_CACHE_DIR
  value: /var/cache/gyre
{{- range $name, $_ := .Values.secrets.extraEnv }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef: {name: {{ $secret }}, key: {{ printf "env-%s" $name | lower | replace "_" "-" }}}
{{- end }}
{{- end -}}

{{/* Plain NAME: value pairs as env entries. */}}
{{- define "gyre.env" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* Writable folders under a read-only root filesystem, and the NATS credentials. */}}
{{- define "gyre.volumeMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: state, mountPath: /var/lib/gyre}
- {name: cache, mountPath: /var/cache/gyre}
{{- if .Values.nats.credsSecret }}
- {name: nats-creds, mountPath: /etc/gyre/nats, readOnly: true}
{{- end }}
{{- end -}}

{{- define "gyre.volumes" -}}
{{- include "gyre.volumesFor" (dict "root" . "stateClaim" "") -}}
{{- end -}}

{{/* The same, with /var/lib/gyre on a PersistentVolumeClaim when stateClaim is set:
     (dict "root" $ "stateClaim" "name") */}}
{{- define "gyre.volumesFor" -}}
- {name: tmp, emptyDir: {}}
{{- if .stateClaim }}
- name: state
  persistentVolumeClaim: {claimName: {{ .stateClaim }}}
{{- else }}
- {name: state, emptyDir: {}}
{{- end }}
- {name: cache, emptyDir: {}}
{{- if .root.Values.nats.credsSecret }}
- name: nats-creds
  secret:
    secretName: {{ .root.Values.nats.credsSecret }}
    items: [{key: nats.creds, path: nats.creds}]
{{- end }}
{{- end -}}

{{/* GYRE_TRAINER_PUBLISH_TO: every cell as <cell name>=<its engine's URL> (the cell name is
     its pod's, GYRE_CELL_NAME). */}}
{{- define "gyre.publishTo" -}}
{{- $full := include "gyre.fullname" . -}}
{{- $c := .Values.cells -}}
{{- $domain := printf "%s-cell.%s.svc.%s" $full .Release.Namespace .Values.clusterDomain -}}
{{- $pods := list (printf "%s-cell-core-0" $full) -}}
{{- range $i := until (int (sub (int $c.count) 1)) -}}
{{- $pods = append $pods (printf "%s-cell-%d" $full $i) -}}
{{- end -}}
{{- $items := list -}}
{{- range $pod := $pods -}}
{{- $items = append $items (printf "%s=http://%s.%s:%d" $pod $pod $domain (int $c.enginePort)) -}}
{{- end -}}
{{- join "," $items -}}
{{- end -}}

{{/* startup, readiness and liveness probes on /health: (dict "root" $ "override" .probes) */}}
{{- define "gyre.probes" -}}
{{- $p := mergeOverwrite (deepCopy .root.Values.probes) (default (dict) .override) -}}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{ $kind }}Probe:
  httpGet: {path: /health, port: {{ default "http" $.port }}}
  {{- toYaml (get $p $kind) | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "gyre.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
