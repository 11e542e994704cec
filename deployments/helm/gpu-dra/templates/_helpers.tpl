{{/* Names: <release>-gpu-dra, or the release name when it already holds the chart name. */}}
{{- define "gpu-dra.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-dra.fullname" -}}
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

{{- define "gpu-dra.kubeletPlugin.name" -}}
{{- printf "%s-kubelet-plugin" (include "gpu-dra.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-dra.controller.name" -}}
{{- printf "%s-controller" (include "gpu-dra.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object: the selector's name and instance, plus gpu-dra.metaLabels. */}}
{{- define "gpu-dra.labels" -}}
app.kubernetes.io/name: {{ include "gpu-dra.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "gpu-dra.metaLabels" . }}
{{- end }}

{{- define "gpu-dra.metaLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: (dict "context" $ "component" "kubelet-plugin") */}}
{{- define "gpu-dra.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-dra.name" .context }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "gpu-dra.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The ServiceAccount user name the apiserver gives a pod of `sa`: (dict "context" $ "sa" name) */}}
{{- define "gpu-dra.serviceAccountUser" -}}
{{- printf "system:serviceaccount:%s:%s" .context.Release.Namespace .sa }}
{{- end }}

{{/* NVIDIA's logVerbosity (klog -v) as a Python log level: DEBUG from 5, else INFO. */}}
{{- define "gpu-dra.logLevel" -}}
{{- if ge (int .Values.logVerbosity) 5 }}DEBUG{{ else }}INFO{{ end }}
{{- end }}

{{/* Kubernetes' logging gates, which NVIDIA's binaries take through the same flag: accepted,
no effect on gpu-dra (Python logging), so not passed to the plugin. */}}
{{- define "gpu-dra.loggingGates" -}}
{{- toJson (list "ContextualLogging" "LoggingAlphaOptions" "LoggingBetaOptions") }}
{{- end }}

{{/* featureGates as NVIDIA's FEATURE_GATES: Name=value, in name order, comma-terminated;
the logging gates left out. */}}
{{- define "gpu-dra.featureGates" -}}
{{- $logging := include "gpu-dra.loggingGates" . | fromJsonArray }}
{{- range $name, $value := .Values.featureGates }}{{ if not (has $name $logging) }}{{ $name }}={{ $value }},{{ end }}{{ end }}
{{- end }}

{{/* The port of an NVIDIA HTTP endpoint value (":8080", "0.0.0.0:8080", "[::]:8080"). */}}
{{- define "gpu-dra.endpointPort" -}}
{{- regexFind "[0-9]+$" . }}
{{- end }}

{{/* The kubelet plugin's metrics port: 0 (no metrics server) with NVIDIA's
kubeletPlugin.metrics.enabled=false, else the port of its gpuHttpEndpoint when given, else
metrics.kubeletPluginPort. */}}
{{- define "gpu-dra.kubeletPlugin.metricsPort" -}}
{{- $nvidia := .Values.kubeletPlugin.metrics | default dict }}
{{- if and (hasKey $nvidia "enabled") (not $nvidia.enabled) }}0
{{- else if $nvidia.gpuHttpEndpoint }}{{ include "gpu-dra.endpointPort" $nvidia.gpuHttpEndpoint }}
{{- else }}{{ .Values.metrics.kubeletPluginPort }}
{{- end }}
{{- end }}

{{/* The controller's metrics (and health) port: the port of NVIDIA's
controller.metrics.httpEndpoint when given, else metrics.controllerPort. */}}
{{- define "gpu-dra.controller.metricsPort" -}}
{{- $nvidia := .Values.controller.metrics | default dict }}
{{- if $nvidia.httpEndpoint }}{{ include "gpu-dra.endpointPort" $nvidia.httpEndpoint }}
{{- else }}{{ .Values.metrics.controllerPort }}
{{- end }}
{{- end }}

{{/* Whether the controller's metrics Service is rendered: metrics.enabled and not NVIDIA's
controller.metrics.enabled=false ("true" or ""). */}}
{{- define "gpu-dra.controller.metricsService" -}}
{{- $nvidia := .Values.controller.metrics | default dict }}
{{- if and .Values.metrics.enabled (or (not (hasKey $nvidia "enabled")) $nvidia.enabled) }}true{{ end }}
{{- end }}

{{/* ServiceAccount annotations (NVIDIA's serviceAccount.annotations), on both accounts. */}}
{{- define "gpu-dra.serviceAccountAnnotations" -}}
{{- with (.Values.serviceAccount | default dict).annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The catalog files of deviceclasses/ that are shipped (exclude left out). */}}
{{- define "gpu-dra.deviceClassFiles" -}}
{{- $files := list }}
{{- range $path, $_ := .Files.Glob "deviceclasses/*.yaml" }}
{{- if not (has (base $path) $.Values.deviceClasses.exclude) }}
{{- $files = append $files $path }}
{{- end }}
{{- end }}
{{- toJson $files }}
{{- end }}

{{/* The extended resource name of the NVIDIA device plugin's renamed shared replicas, and the
catalog file of each share tier that may carry it (deviceClasses.sharedResource). */}}
{{- define "gpu-dra.sharedResourceName" -}}
nvidia.com/gpu.shared
{{- end }}
{{- define "gpu-dra.sharedResourceFiles" -}}
{{- toJson (dict "mps" "mps.gpu.nvidia.com.yaml" "capped" "capped.gpu.nvidia.com.yaml") }}
{{- end }}

{{/* One catalog file as the controller gets it (dict "root" $ "path" <file>): verbatim, except
that nvidia.com/gpu.shared is on the share tier deviceClasses.sharedResource names and on no
other (the repository's catalog puts it on mps.gpu.nvidia.com). */}}
{{- define "gpu-dra.deviceClassFile" -}}
{{- $text := .root.Files.Get .path }}
{{- $tiers := include "gpu-dra.sharedResourceFiles" .root | fromJson }}
{{- $carrier := get $tiers (.root.Values.deviceClasses.sharedResource | default "") }}
{{- $shared := include "gpu-dra.sharedResourceName" .root }}
{{- if has (base .path) (values $tiers) }}
{{- $class := fromYaml $text }}
{{- $has := eq (get $class.spec "extendedResourceName" | default "") $shared }}
{{- if and (eq (base .path) $carrier) (not $has) }}
{{- $_ := set $class.spec "extendedResourceName" $shared }}
{{- $text = toYaml $class }}
{{- else if and (ne (base .path) $carrier) $has }}
{{- $_ := unset $class.spec "extendedResourceName" }}
{{- $text = toYaml $class }}
{{- end }}
{{- end }}
{{- $text }}
{{- end }}

{{/* The names of the catalog's share classes (a JSON list): classes one of whose CEL selectors
requires device.allowMultipleAllocations as a top-level && term, the rule the controller applies
to the same files (gpu_dra.driver.cluster.share_memory.is_share_class). */}}
{{- define "gpu-dra.shareClassNames" -}}
{{- $names := list }}
{{- if .Values.deviceClasses.enabled }}
{{- range (include "gpu-dra.deviceClassFiles" . | fromJsonArray) }}
{{- $class := include "gpu-dra.deviceClassFile" (dict "root" $ "path" .) | fromYaml }}
{{- range ($class.spec.selectors | default list) }}
{{- $expression := regexReplaceAll "\\s+" ((.cel | default dict).expression | default "") " " }}
{{- if regexMatch "(^|&&) *device\\.allowMultipleAllocations *(&&|$)" $expression }}
{{- $names = append $names $class.metadata.name }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson (uniq $names) }}
{{- end }}

{{/* The DeviceClass serving the NVIDIA device plugin's mixed-strategy MIG resource of one
profile (the argument, e.g. 1g.10gb+me): nvidia.com/mig-<profile>, `+` written `.` as the device plugin
writes it, on the MIG devices of exactly that profile, static or made on demand. */}}
{{- define "gpu-dra.migProfileSlug" -}}
mig-{{ replace "+" "." . }}
{{- end }}
{{- define "gpu-dra.migProfileClassName" -}}
{{ include "gpu-dra.migProfileSlug" . }}.gpu.nvidia.com
{{- end }}
{{- define "gpu-dra.migProfileClass" -}}
# MIG devices of profile {{ . }} (static slices and, with dynamic MIG, the partitions made on
# demand), for pods that ask for nvidia.com/{{ include "gpu-dra.migProfileSlug" . }} as with the
# NVIDIA device plugin's mixed MIG strategy (chart value deviceClasses.migProfiles).
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: {{ include "gpu-dra.migProfileClassName" . }}
spec:
  selectors:
    - cel:
        expression: >-
          device.driver == 'gpu.nvidia.com' &&
          device.attributes['gpu.nvidia.com'].type == 'mig' &&
          !('compute' in device.capacity['gpu.nvidia.com']) &&
          device.attributes['gpu.nvidia.com'].profile == '{{ . }}'
  extendedResourceName: nvidia.com/{{ include "gpu-dra.migProfileSlug" . }}
{{- end }}

{{/* The names of imagePullSecrets, comma-separated (the MPS daemon pods' pull secrets). */}}
{{- define "gpu-dra.imagePullSecretNames" -}}
{{- $names := list }}
{{- range .Values.imagePullSecrets }}{{ $names = append $names .name }}{{ end }}
{{- join "," $names }}
{{- end }}

{{/* The DRA driver name: opaque configs of this driver are the webhook's to judge. */}}
{{- define "gpu-dra.driverName" -}}
gpu.nvidia.com
{{- end }}

{{/* The admission webhook's Service (also the name of its configuration and cert objects). */}}
{{- define "gpu-dra.webhook.name" -}}
{{- printf "%s-webhook" (include "gpu-dra.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Secret holding the webhook's tls.crt and tls.key: the user's in mode secret. */}}
{{- define "gpu-dra.webhook.secretName" -}}
{{- if eq .Values.webhook.tls.mode "secret" }}
{{- .Values.webhook.tls.secret.name }}
{{- else }}
{{- printf "%s-webhook-tls" (include "gpu-dra.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* NVIDIA's driver feature gates gpu-dra does not implement: false only (the kubelet plugin's
GATES_NOT_IMPLEMENTED, checked by tests/test_helm_chart.py). */}}
{{- define "gpu-dra.unimplementedGates" -}}
{{- toJson (list "IMEXDaemonsWithDNSNames" "PassthroughSupport" "ComputeDomainCliques" "CrashOnNVLinkFabricErrors" "DeviceMetadata" "DRAListTypeAttributes" "FabricManagerPartitioning" "HostManagedIMEXDaemon" "ConsumableShares") }}
{{- end }}

{{/* The idle policy's bound on a claim's activity report, in seconds: three times the longest a
live plugin's report waits (a write per claimStatus.minInterval of a sample per
metrics.utilization.interval, seen by a writer pass every 2 s; docs/idle-reclaim.md). */}}
{{- define "gpu-dra.idleReclaim.maxSampleAge" -}}
{{- mul 3 (add (ceil .Values.kubeletPlugin.claimStatus.minInterval) (ceil .Values.metrics.utilization.interval) 2) }}
{{- end }}

{{/* The catalog's extended resource names, as JSON {name: DeviceClass}: those of the rendered
deviceclasses/ files and of the deviceClasses.migProfiles classes (the tier-quota policy maps a
pod's nvidia.com/... requests to the class the scheduler allocates them from). */}}
{{- define "gpu-dra.extendedResourceClasses" -}}
{{- $names := dict }}
{{- if .Values.deviceClasses.enabled }}
{{- range include "gpu-dra.deviceClassFiles" . | fromJsonArray }}
{{- $class := include "gpu-dra.deviceClassFile" (dict "root" $ "path" .) | fromYaml }}
{{- with get $class.spec "extendedResourceName" }}
{{- $_ := set $names . $class.metadata.name }}
{{- end }}
{{- end }}
{{- range .Values.deviceClasses.migProfiles }}
{{- $_ := set $names (printf "nvidia.com/%s" (include "gpu-dra.migProfileSlug" .)) (include "gpu-dra.migProfileClassName" .) }}
{{- end }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/* The whole-GPU class of one deviceClasses.models entry (dict with name, productName). */}}
{{- define "gpu-dra.modelClass" -}}
# Whole {{ .productName }} GPUs (not those offered as shares), for quotas
# per model (chart value deviceClasses.models, docs/quotas.md).
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: {{ .name }}.gpu.nvidia.com
spec:
  selectors:
    - cel:
        expression: >-
          device.driver == 'gpu.nvidia.com' &&
          device.attributes['gpu.nvidia.com'].type == 'gpu' &&
          !('compute' in device.capacity['gpu.nvidia.com']) &&
          device.attributes['gpu.nvidia.com'].productName == '{{ .productName }}'
{{- end }}
