{{/* Chart name, truncated to the 63 characters Kubernetes allows. */}}
{{- define "headroom.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart unless the release name already has it. */}}
{{- define "headroom.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "headroom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "headroom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "headroom.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "headroom.selectorLabels" . }}
app.kubernetes.io/component: gateway
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* "true" when caps and the queue are shared through Redis (admission.backend redis). */}}
{{- define "headroom.shared" -}}
{{- eq .Values.admission.backend "redis" -}}
{{- end }}

{{/* Gateway pods: replicaCount, or 1 (memory) / 2 (redis) when it is empty. */}}
{{- define "headroom.replicas" -}}
{{- if ne (toString .Values.replicaCount) "" }}
{{- int .Values.replicaCount }}
{{- else if eq (include "headroom.shared" .) "true" }}
{{- 2 }}
{{- else }}
{{- 1 }}
{{- end }}
{{- end }}

{{/* PDB maxUnavailable: the value, or 0 (memory: one pod) / 1 (redis) when it is empty. */}}
{{- define "headroom.pdbMaxUnavailable" -}}
{{- if ne (toString .Values.podDisruptionBudget.maxUnavailable) "" }}
{{- .Values.podDisruptionBudget.maxUnavailable }}
{{- else if eq (include "headroom.shared" .) "true" }}
{{- 1 }}
{{- else }}
{{- 0 }}
{{- end }}
{{- end }}

{{/* "true" when the release runs its own Redis: backend redis and no external URL. */}}
{{- define "headroom.bundledRedis" -}}
{{- and (eq (include "headroom.shared" .) "true") (not .Values.admission.redis.url) (not .Values.admission.redis.urlSecret.name) (not .Values.admission.redis.sentinel.master) -}}
{{- end }}

{{- define "headroom.redisName" -}}
{{- printf "%s-redis" (include "headroom.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The bundled Redis's labels: not matched by the gateway's selector (other name). */}}
{{- define "headroom.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-redis" (include "headroom.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The bundled Redis's address, host:port (its Service). */}}
{{- define "headroom.redisAddress" -}}
{{- printf "%s:6379" (include "headroom.redisName" .) }}
{{- end }}

{{/* "true" when the bundled Redis requires a password (admission.bundledRedis.auth). */}}
{{- define "headroom.redisAuth" -}}
{{- and (eq (include "headroom.bundledRedis" .) "true") .Values.admission.bundledRedis.auth.enabled -}}
{{- end }}

{{/* The Secret and key holding the bundled Redis's password: auth.existingSecret and
auth.existingSecretKey, else the Secret the chart makes (redis-secret.yaml), key password. */}}
{{- define "headroom.redisSecretName" -}}
{{- if .Values.admission.bundledRedis.auth.existingSecret }}
{{- .Values.admission.bundledRedis.auth.existingSecret }}
{{- else }}
{{- printf "%s-auth" (include "headroom.redisName" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "headroom.redisSecretKey" -}}
{{- if .Values.admission.bundledRedis.auth.existingSecret }}
{{- .Values.admission.bundledRedis.auth.existingSecretKey }}
{{- else }}
{{- "password" }}
{{- end }}
{{- end }}

{{/* An image reference, [registry/]repository:tag, from (list <image values> <tag>). */}}
{{- define "headroom.image" -}}
{{- $image := index . 0 }}
{{- $tag := index . 1 }}
{{- if $image.registry }}
{{- printf "%s/%s:%s" (trimSuffix "/" $image.registry) $image.repository $tag }}
{{- else }}
{{- printf "%s:%s" $image.repository $tag }}
{{- end }}
{{- end }}

{{/* Refuse values that would break the caps or cannot work. */}}
{{- define "headroom.validate" -}}
{{- if not (has .Values.admission.backend (list "memory" "redis")) }}
{{- fail "admission.backend must be memory or redis" }}
{{- end }}
{{- if and (ne (include "headroom.shared" .) "true") (ne (include "headroom.replicas" .) "1") }}
{{- fail "replicaCount must be 1 with admission.backend memory: each Headroom process owns the full caps of its GPUs. Set admission.backend redis to run several gateway pods over one set of caps, or install one release per disjoint set of GPUs." }}
{{- end }}
{{- if and (ne (include "headroom.shared" .) "true") (ne (int .Values.admission.workers) 1) }}
{{- fail "admission.workers must be 1 with admission.backend memory: each worker process would own the full caps. Set admission.backend redis to run several workers." }}
{{- end }}
{{- if lt (int .Values.admission.workers) 1 }}
{{- fail "admission.workers must be at least 1" }}
{{- end }}
{{- if not .Values.pools }}
{{- fail "pools: at least one pool with replicas is required" }}
{{- end }}
{{- if not (has .Values.podMonitor.port (list "client" "admin")) }}
{{- fail "podMonitor.port must be client or admin" }}
{{- end }}
{{- if and (eq .Values.podMonitor.port "admin") (not .Values.podMonitor.adminKeySecret.name) }}
{{- fail "podMonitor.port admin needs podMonitor.adminKeySecret.name: a Secret with the admin token and its SHA-256 (values.yaml)" }}
{{- end }}
{{- if and .Values.podMonitor.enabled (eq .Values.podMonitor.port "client") (not (dig "metrics" "client_port" false .Values.config)) }}
{{- fail "podMonitor.port client scrapes /metrics on the client port: set config.metrics.client_port true, or podMonitor.port admin" }}
{{- end }}
{{- if and .Values.networkPolicy.gateway.enabled .Values.podMonitor.enabled (eq .Values.podMonitor.port "admin") (not .Values.networkPolicy.gateway.scraper) }}
{{- fail "networkPolicy.gateway.scraper: name the Prometheus pods allowed to the admin port (podMonitor.port admin), or the NetworkPolicy keeps them out" }}
{{- end }}
{{- if and (eq (include "headroom.redisAuth" .) "true") .Values.admission.bundledRedis.auth.existingSecret (not .Values.admission.bundledRedis.auth.existingSecretKey) }}
{{- fail "admission.bundledRedis.auth.existingSecretKey: name the key of the password in auth.existingSecret" }}
{{- end }}
{{- end }}

{{/* The Headroom configuration file: config with pools, routes and (redis) admission added.
With urlSecret the URL stays out of the file: HEADROOM_ADMISSION__REDIS__URL carries it. */}}
{{- define "headroom.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- if eq (include "headroom.shared" .) "true" }}
{{- $r := .Values.admission.redis }}
{{- $redis := dict "key_prefix" $r.key_prefix "lease_ttl_s" $r.lease_ttl_s "renew_interval_s" $r.renew_interval_s "fence_margin_s" $r.fence_margin_s "timeout_s" $r.timeout_s }}
{{- if $r.url }}
{{- $_ := set $redis "url" $r.url }}
{{- else if $r.sentinel.master }}
{{- /* With Sentinel the URL's host is not used; a urlSecret still overrides it. */}}
{{- $_ := set $redis "url" "redis://sentinel/0" }}
{{- else if not $r.urlSecret.name }}
{{- /* With auth, HEADROOM_ADMISSION__REDIS__URL adds the password (deployment.yaml). */}}
{{- $_ := set $redis "url" (printf "redis://%s/0" (include "headroom.redisAddress" .)) }}
{{- end }}
{{- if $r.sentinel.master }}
{{- $_ := set $redis "sentinel" (dict "master" $r.sentinel.master "nodes" $r.sentinel.nodes) }}
{{- end }}
{{- $_ := set $cfg "admission" (dict "backend" "redis" "on_backend_loss" .Values.admission.on_backend_loss "redis" $redis) }}
{{- end }}
{{- if eq .Values.podMonitor.port "admin" }}
{{- /* /metrics on the admin listener only, bound where Prometheus reaches it (its key:
HEADROOM_ADMIN__API_KEY_SHA256, from podMonitor.adminKeySecret). */}}
{{- $_ := set $cfg "admin" (set (get $cfg "admin" | default dict) "host" "0.0.0.0") }}
{{- $_ := set $cfg "metrics" (set (get $cfg "metrics" | default dict) "client_port" false) }}
{{- end }}
{{- $_ := set $cfg "pools" .Values.pools }}
{{- $_ := set $cfg "routes" .Values.routes }}
{{- toYaml $cfg }}
{{- end }}
