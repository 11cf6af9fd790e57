{{/* Names and labels. */}}
{{- define "kvxfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvxfer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvxfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvxfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvxfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvxfer.labels" -}}
helm.sh/chart: {{ include "kvxfer.chart" . }}
{{ include "kvxfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvxfer
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one role: (dict "root" $ "role" "prefill"). */}}
{{- define "kvxfer.roleSelectorLabels" -}}
{{ include "kvxfer.selectorLabels" .root }}
app.kubernetes.io/component: {{ .role }}
kvxfer.io/role: {{ .role }}
{{- end -}}

{{- define "kvxfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvxfer.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The per-role keys: global defaults that a role block (prefill:, decode:) may override.
tests/deploy checks that this list and values.schema.json's role block agree.
*/}}
{{- define "kvxfer.roleKeys" -}}
variant image vllm gpu sidecar rdma hostNetwork shm podAnnotations podLabels podSecurityContext nodeSelector tolerations affinity topologySpreadConstraints priorityClassName runtimeClassName schedulerName terminationGracePeriodSeconds extraEnv extraVolumes extraVolumeMounts
{{- end -}}

{{/* Deep merge of .src into .dst, in place: maps merge, anything else replaces. */}}
{{- define "kvxfer.mergeInto" -}}
{{- $dst := .dst -}}
{{- range $k, $v := .src -}}
{{- if and (kindIs "map" $v) (hasKey $dst $k) (kindIs "map" (index $dst $k)) -}}
{{- include "kvxfer.mergeInto" (dict "dst" (index $dst $k) "src" $v) -}}
{{- else -}}
{{- $_ := set $dst $k $v -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The effective settings of one role as YAML: the global per-role keys, overridden by the role
block. Use: $cfg := include "kvxfer.roleConfig" (dict "root" $ "role" "prefill") | fromYaml
*/}}
{{- define "kvxfer.roleConfig" -}}
{{- $root := .root -}}
{{- $cfg := dict -}}
{{- range $k := splitList " " (include "kvxfer.roleKeys" $root) -}}
{{- $_ := set $cfg $k (deepCopy (index $root.Values $k)) -}}
{{- end -}}
{{- $block := deepCopy (index $root.Values .role) -}}
{{- include "kvxfer.mergeInto" (dict "dst" $cfg "src" $block) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* image reference: (dict "image" $cfg.image "root" $ "variant" $cfg.variant). */}}
{{- define "kvxfer.image" -}}
{{- $tag := default (printf "%s-%s" .root.Chart.AppVersion .variant) .image.tag -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/*
The vLLM --kv-transfer-config JSON: the kvxfer connector, loaded by module path, producing KV on
prefill pods and consuming it on decode pods. (dict "cfg" $cfg "role" "prefill")
*/}}
{{- define "kvxfer.kvTransferConfig" -}}
{{- $kvRole := ternary "kv_producer" "kv_consumer" (eq .role "prefill") -}}
{{- $c := dict "kv_connector" "KvxferConnector" "kv_connector_module_path" "kvxfer.integrations.vllm" "kv_role" $kvRole -}}
{{- with .cfg.vllm.kvConnectorExtraConfig -}}
{{- $_ := set $c "kv_connector_extra_config" . -}}
{{- end -}}
{{- toJson $c -}}
{{- end -}}

{{/* Socket volume path shared by the worker and the sidecars. */}}
{{- define "kvxfer.socketDir" -}}/run/kvxfer{{- end -}}

{{/*
Worker ranks of one pod (one sidecar each): tensorParallelSize x pipelineParallelSize of the
role's effective settings. Use: int (include "kvxfer.ranks" $cfg)
*/}}
{{- define "kvxfer.ranks" -}}
{{- mul (int .vllm.tensorParallelSize) (int .vllm.pipelineParallelSize) -}}
{{- end -}}

{{/*
Name of one rank's sidecar port: (dict "kind" "metrics" "rank" 0). Rank 0 keeps the contract's
names (kvxfer-peer, kvxfer-metrics, kvxfer-data); rank r > 0 is <kind>-<r>, because a port name
has at most 15 characters and "kvxfer-metrics-1" has 16.
*/}}
{{- define "kvxfer.portName" -}}
{{- if eq (int .rank) 0 -}}
kvxfer-{{ .kind }}
{{- else -}}
{{ .kind }}-{{ int .rank }}
{{- end -}}
{{- end -}}

{{/* The most worker ranks of any enabled role's pod: what the metrics objects must cover. */}}
{{- define "kvxfer.maxRanks" -}}
{{- $max := 0 -}}
{{- range $role := list "prefill" "decode" -}}
{{- if (index $.Values $role).enabled -}}
{{- $cfg := include "kvxfer.roleConfig" (dict "root" $ "role" $role) | fromYaml -}}
{{- $max = max $max (int (include "kvxfer.ranks" $cfg)) -}}
{{- end -}}
{{- end -}}
{{- $max -}}
{{- end -}}

{{/* The Secret holding the shared token: auth.secretName, or the one the chart creates. */}}
{{- define "kvxfer.tokenSecretName" -}}
{{- default (printf "%s-token" (include "kvxfer.fullname" .)) .Values.auth.secretName -}}
{{- end -}}

{{/* True (non-empty) when the chart creates the token Secret itself. */}}
{{- define "kvxfer.createsToken" -}}
{{- if and .Values.auth.enabled (not .Values.auth.secretName) -}}true{{- end -}}
{{- end -}}

{{/*
The token of the Secret the chart creates: the one already in the cluster (so `helm upgrade` keeps
it and no running sidecar is left with an old one), else 48 random letters and digits. Computed
once per render and kept in .Values.auth, so the Secret and the pods' checksum annotation agree
whichever template asks first. `helm template` cannot look up, so it makes a new token each time;
the checksum then rolls every pod onto it together.
*/}}
{{- define "kvxfer.generatedToken" -}}
{{- if not (hasKey .Values.auth "__generatedToken") -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "kvxfer.tokenSecretName" .) -}}
{{- $old := dig "data" .Values.auth.tokenKey "" (default dict $existing) -}}
{{- $_ := set .Values.auth "__generatedToken" (ternary (b64dec $old) (randAlphaNum 48) (ne $old "")) -}}
{{- end -}}
{{- index .Values.auth "__generatedToken" -}}
{{- end -}}

{{/*
Whether peers must prove themselves: the shared token, or mutual TLS (TLS with a CA to check
client certificates; TLS alone lets any client in). Non-empty when they must.
*/}}
{{- define "kvxfer.peersAuthenticated" -}}
{{- if or .Values.auth.enabled (and .Values.tls.enabled .Values.tls.caKey) -}}true{{- end -}}
{{- end -}}

{{/*
The Prometheus Operator endpoint's bearer credentials when /metrics asks for the token
(metrics.auth: token): the token Secret's key.
*/}}
{{- define "kvxfer.metricsAuthorization" -}}
{{- if eq .Values.metrics.auth "token" -}}
authorization:
  type: Bearer
  credentials:
    name: {{ include "kvxfer.tokenSecretName" . }}
    key: {{ .Values.auth.tokenKey }}
{{- end -}}
{{- end -}}

{{/*
The data plane's UCX/NIXL environment (sidecar.ucx, sidecar.nixlPluginDir) as env entries, for the
container whose process runs the NIXL agent: each sidecar, or with sidecar.backend worker the vLLM
container. (dict "sc" $sc "netDevices" "<UCX_NET_DEVICES of this container>"); empty settings are
left out.
*/}}
{{- define "kvxfer.ucxEnv" -}}
{{- with .sc.ucx.tls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with .netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- if ne (toString .sc.ucx.gidIndex) "" }}
- name: UCX_IB_GID_INDEX
  value: {{ toString .sc.ucx.gidIndex | quote }}
{{- end }}
{{- with .sc.nixlPluginDir }}
- name: NIXL_PLUGIN_DIR
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
One sidecar probe's body: grpc.health.v1 on the rank's peer port, or with TLS there (which
Kubernetes' gRPC probes cannot speak) `kvxfer health` on the rank's local socket. The exec probe
starts a Python process before it asks: the sidecar gets the probe's timeoutSeconds to answer
(--timeout-seconds), and the kubelet 3 s more, so that a slow answer fails with the CLI's own
message rather than a kill at the kubelet's timeout.
(dict "probe" <sidecar.*Probe> "tls" <bool> "socket" <path> "port" <int> "service" "liveness"|"")
*/}}
{{- define "kvxfer.sidecarProbe" -}}
{{- if .tls -}}
exec:
  command: ["kvxfer", "health", "--target={{ .socket }}", "--service={{ .service }}", "--timeout-seconds={{ int .probe.timeoutSeconds }}"]
{{- else -}}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
{{- end }}
periodSeconds: {{ int .probe.periodSeconds }}
failureThreshold: {{ int .probe.failureThreshold }}
timeoutSeconds: {{ ternary (add (int .probe.timeoutSeconds) 3) (int .probe.timeoutSeconds) (and .tls true) }}
{{- end -}}
