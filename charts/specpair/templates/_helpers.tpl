{{/* Names and labels shared by every template. */}}

{{- define "specpair.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specpair.fullname" -}}
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

{{- define "specpair.metaLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specpair
{{- end -}}

{{- define "specpair.labels" -}}
app.kubernetes.io/name: {{ include "specpair.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "specpair.metaLabels" . }}
{{- end -}}

{{- define "specpair.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specpair.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "specpair.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specpair.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* A digest pins the exact bytes; otherwise the tag (defaulting to the app version). */}}
{{- define "specpair.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* engine.imagePullSecrets as a comma list of names. */}}
{{- define "specpair.enginePullSecrets" -}}
{{- $names := list -}}
{{- range .Values.engine.imagePullSecrets -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{/*
Peers allowed to reach engine pods, as JSON: engine.networkPolicy.from plus the operator's own
pods (it calls the engines' gRPC port); empty (any source) when engine.networkPolicy.from is.
*/}}
{{- define "specpair.engineIngressFrom" -}}
{{- $from := .Values.engine.networkPolicy.from | default list -}}
{{- if not $from -}}
{{- /* None named: the watched namespaces, each by name (none when all are watched: any source). */ -}}
{{- range .Values.watchNamespaces -}}
{{- $from = append $from (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .))) -}}
{{- end -}}
{{- end -}}
{{- if $from -}}
{{- $operator := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "specpair.selectorLabels" . | fromYaml)) -}}
{{- append $from $operator | toJson -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/*
The namespaced rules, exactly those of operator/rbac.yaml (the operator's own list of what it
calls). Used both by the ClusterRole (all namespaces) and by each per-namespace Role.
*/}}
{{- define "specpair.namespacedRules" -}}
# Exactly the verbs the operator was seen using against a real API server (the API server's
# audit log in tests/operator/test_operator_e2e.py fails on any grant left unused).
# The pairs: list and watch them (Kopf), patch annotations (Kopf's progress state) and status.
- apiGroups: [specpair.io]
  resources: [specmodelpairs]
  verbs: [list, watch, patch]
- apiGroups: [specpair.io]
  resources: [specmodelpairs/status]
  verbs: [patch]
# Owner references with blockOwnerDeletion (kopf.adopt sets it on every Deployment, Service and
# Job): clusters with the OwnerReferencesPermissionEnforcement admission plugin (OpenShift) ask
# whether the operator may update the owner's finalizers and answer 403 otherwise. Nothing ever
# calls it, so the audit-log test exempts it (tests/operator/cluster_env.py).
- apiGroups: [specpair.io]
  resources: [specmodelpairs/finalizers]
  verbs: [update]
# Engine Deployments it rolls (owner references let the garbage collector delete them), watched
# (Kopf) so a rollout's progress wakes a pass over its pair at once.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch, list, watch]
# The engine pods' ReplicaSet: its pod template set to a release whose draft was swapped into the
# running pods (act/draft_swap.py), so the Deployment moves to it without a roll. Never read.
- apiGroups: [apps]
  resources: [replicasets]
  verbs: [patch]
# The engine Service in front of each Deployment. Listed and watched: passes read Services,
# NetworkPolicies and Deployments from watches (clients/pod_watch.py), and one edited or deleted
# by hand wakes its pair's pass. Deleted: a Gateway route's Service no longer wanted
# (desired/routes.py: an old champion's after a promotion, all when no Gateway is named).
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, list, watch, delete]
# Per pair: ingress to engine pods on their ports only, none to gate pods; patched when the
# chart's engine.networkPolicy.from changes.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, list, watch]
# Gate Jobs (one per release) and model-fetch Jobs (one per set of models, when the pair names a
# model cache claim), never deleted by the operator; watched so a finished Job wakes its pair's pass.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, create, list, watch]
# Engine, gate and model-fetch pods: readiness, IPs (for GetModelInfo / GetStats over gRPC), the scheduler's
# reason when one is Pending. Read only; engine pods watched, so a settled pair's pass reads them
# from the watch (clients/pod_watch.py). Patched only by a promotion in place: a pod whose draft
# was swapped gets the release's version label and release annotations (act/draft_swap.py).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, patch]
# Golden prompts given as gating.configMapRef.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get]
# Every promotion, rollback and drift action is an Event on the pair.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# Each pair's engine control-listener certificate (mutual TLS with the operator): created, and
# patched on renewal only while the pair owns it. Never read: what was issued is in the pair's
# status, so the operator cannot read any Secret in a pair's namespace.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, patch]
# Each autoscaled pair's autoscaler on its scale subresource (rollout.autoscaling): an HPA, or
# KEDA's ScaledObject where KEDA is installed; deleted when autoscaling is removed or KEDA comes
# or goes. Whether KEDA is installed is API discovery, open to every identity. Listed and
# watched: passes read them from watches (clients/pod_watch.py).
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, create, patch, delete, list, watch]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, create, patch, delete, list, watch]
# A pair naming a Gateway (rollout.gateway, or the chart's gateway.parentRef): its HTTPRoute and
# GRPCRoute, read, created, patched with each canary step's weight, and deleted when the pair
# names no Gateway any more (desired/routes.py). Whether Gateway API is installed is API
# discovery, open to every identity.
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes, grpcroutes]
  verbs: [get, create, patch, delete]
{{- end -}}

{{/* The CA Secret of the engines' control listeners, in the operator's own namespace: read by
name, created on first start unless cert-manager (tls.certManager) writes it. */}}
{{- define "specpair.caRules" -}}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
  resourceNames: [specpair-operator-ca]
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
{{- end -}}

{{/* Leader election: the Lease in the operator's own namespace, read and renewed by name
(create cannot be limited to a name). */}}
{{- define "specpair.leaseRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, patch]
  resourceNames: [{{ include "specpair.fullname" . | quote }}]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
{{- end -}}

{{/* The MLflow credentials Secret, readable only by name and only when asked for. */}}
{{- define "specpair.secretRule" -}}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
  resourceNames: [{{ .Values.mlflow.credentialsSecret.name | quote }}]
{{- end -}}
