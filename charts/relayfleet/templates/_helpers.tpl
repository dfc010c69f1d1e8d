{{/* Names, labels and images shared by every template. */}}

{{- define "relayfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "relayfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A cluster-scoped object's name: one per release and namespace, so a second release in
another namespace does not clash ("<namespace>.<fullname>": a namespace has no dots). */}}
{{- define "relayfleet.clusterScopedName" -}}
{{- printf "%s.%s" .Release.Namespace (include "relayfleet.fullname" .) -}}
{{- end -}}

{{- define "relayfleet.labels" -}}
app.kubernetes.io/name: {{ include "relayfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: relayfleet
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "relayfleet.operator.selector" -}}
app.kubernetes.io/name: {{ include "relayfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "relayfleet.operator.serviceAccount" -}}
{{- default (printf "%s-operator" (include "relayfleet.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{- define "relayfleet.spark.serviceAccount" -}}
{{- default (printf "%s-spark" (include "relayfleet.fullname" .)) .Values.spark.serviceAccount.name -}}
{{- end -}}

{{/* Whether any Spark CronJob renders (and with it the Spark namespace and its RBAC). */}}
{{- define "relayfleet.spark.enabled" -}}
{{- if and .Values.spark.fleets (or .Values.spark.retention.enabled .Values.spark.rebalance.enabled) -}}true{{- end -}}
{{- end -}}

{{/* The Spark jobs' own namespace: never the release's, where the operator's and Redis'
Secrets, ServiceAccounts and claims live (docs/spark.md, "Namespaces and rights"). */}}
{{- define "relayfleet.spark.namespace" -}}
{{- $name := default (printf "%s-%s-spark" .Release.Namespace (include "relayfleet.fullname" .)) .Values.spark.namespace.name -}}
{{- if gt (len $name) 63 -}}
{{- fail (printf "the Spark namespace %q is longer than 63 characters: set spark.namespace.name" $name) -}}
{{- end -}}
{{- if or (eq $name .Release.Namespace) (eq $name (include "relayfleet.watchNamespace" .)) -}}
{{- fail "spark.namespace.name must not be the release's or the watched namespace: the Spark jobs get a namespace of their own" -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* Where the fleets the Spark jobs serve live (their shard maps, RelayShards, RelayRebalances). */}}
{{- define "relayfleet.spark.fleetNamespace" -}}
{{- include "relayfleet.watchNamespace" . -}}
{{- end -}}

{{- define "relayfleet.watchNamespace" -}}
{{- default .Release.Namespace .Values.operator.watchNamespace -}}
{{- end -}}

{{- define "relayfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "relayfleet.redis.image" -}}
{{- printf "%s:%s" .Values.redis.image.repository (default .Chart.AppVersion .Values.redis.image.tag) -}}
{{- end -}}

{{- define "relayfleet.spark.image" -}}
{{- printf "%s:%s" .Values.spark.image.repository (default .Chart.AppVersion .Values.spark.image.tag) -}}
{{- end -}}

{{/* Restricted-profile pod and container security settings. */}}
{{- define "relayfleet.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}
