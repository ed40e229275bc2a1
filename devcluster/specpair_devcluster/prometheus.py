"""A real Prometheus beside the devcluster, scraping what the chart's monitors select.

Prometheus (built from its Go module by scripts/build-prometheus.sh) runs on 127.0.0.1 and finds
its targets the way it does in any cluster: `kubernetes_sd_configs` watching the devcluster's API
server, logged in as a ServiceAccount with the read-only RBAC Prometheus needs. The scrape jobs
are the chart's own PodMonitor and ServiceMonitor objects (rendered by helm) translated as the
Prometheus Operator translates them: a PodMonitor becomes `role: pod` keeping the pods whose labels
match its selector and whose container port has the monitor's port name. So a test scraping these
jobs proves the chart's selectors really select the pods the operator makes.

Pods here are local processes with their own loopback address as pod IP (node_agent.py), so the
discovered `podIP:port` is directly reachable from this machine: no address relabelling is needed.
The one difference: the API server refuses loopback addresses in Endpoints and EndpointSlices, so
no Service here has endpoints and the Prometheus Operator's `role: endpointslice` job for a
ServiceMonitor would find nothing. A ServiceMonitor therefore becomes `role: pod` too, keeping the
pods that carry the selector's labels (the operator puts the same labels on an engine Service and
its pods) on the container port of the monitor's port name (the engine Service's `metrics` port
targets the container port `metrics`; a vLLM pair's targets `http`, which this does not follow).

    prom = DevPrometheus(cluster, workdir, monitors, rule_files=[...]).start()
    prom.query('up')                     # /api/v1/query
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .processes import Child, built_binaries, first_exit, free_port, http_ok, repo_tool, wait_until

CHART = Path(__file__).resolve().parents[2] / "charts" / "specpair"
# The chart's alert rules (its PrometheusRule embeds this file).
CHART_RULES = CHART / "rules" / "specpair-alerts.yaml"
NAMESPACE = "devcluster-monitoring"
ACCOUNT = "prometheus"
# What Prometheus' Kubernetes discovery reads for the pod role; nothing else.
CLUSTER_ROLE_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def prometheus_binaries() -> Path:
    """The folder with `prometheus` and `promtool` ($SPECPAIR_PROMETHEUS_BIN or the build script's cache)."""
    return built_binaries("build-prometheus.sh", "SPECPAIR_PROMETHEUS_BIN", ("prometheus", "promtool"))


def _label_name(key: str) -> str:
    """A Kubernetes label key as Prometheus' discovery spells it in meta labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _selector_keeps(selector: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    if set(selector) - {"matchLabels"}:
        raise ValueError(f"only matchLabels selectors are translated, got {sorted(selector)}")
    return [{"action": "keep",
             "source_labels": [f"__meta_kubernetes_{kind}_label_{_label_name(k)}",
                               f"__meta_kubernetes_{kind}_labelpresent_{_label_name(k)}"],
             "regex": f"({re.escape(str(v))});true"}
            for k, v in sorted((selector.get("matchLabels") or {}).items())]


def _namespaces(monitor: dict[str, Any]) -> dict[str, Any] | None:
    """The monitor's namespaceSelector as kubernetes_sd `namespaces` (None: every namespace)."""
    chosen = monitor["spec"].get("namespaceSelector") or {}
    if chosen.get("any"):
        return None
    return {"names": list(chosen.get("matchNames") or [monitor["metadata"]["namespace"]])}


def scrape_configs(monitors: list[dict[str, Any]], api_server: str, ca_file: Path, token_file: Path,
                   interval: str | None = None) -> list[dict[str, Any]]:
    """Prometheus scrape jobs for PodMonitor and ServiceMonitor objects (what the Prometheus
    Operator generates for the fields the chart uses, ServiceMonitors as pod jobs: see the
    module docstring; anything else is refused, not ignored).
    `interval` overrides the monitors' own (tests scrape every second)."""
    jobs = []
    for monitor in monitors:
        kind, meta, spec = monitor["kind"], monitor["metadata"], monitor["spec"]
        if kind == "PodMonitor":
            endpoints = spec["podMetricsEndpoints"]
        elif kind == "ServiceMonitor":
            # A pod job too, not endpointslice: devcluster Services have no endpoints (module docstring).
            endpoints = spec["endpoints"]
        else:
            continue
        for i, endpoint in enumerate(endpoints):
            unknown = set(endpoint) - {"port", "path", "interval", "scheme", "honorLabels"}
            if unknown:
                raise ValueError(f"{kind} {meta['name']}: fields not translated: {sorted(unknown)}")
            sd: dict[str, Any] = {"role": "pod", "api_server": api_server,
                                  "tls_config": {"ca_file": str(ca_file)},
                                  "authorization": {"credentials_file": str(token_file)}}
            namespaces = _namespaces(monitor)
            if namespaces is not None:
                sd["namespaces"] = namespaces
            relabel = [
                # Finished pods keep their IP in status but serve nothing (the Prometheus Operator drops them too).
                {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
                *_selector_keeps(spec["selector"], "pod"),
                {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                 "regex": re.escape(endpoint["port"])},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            ]
            relabel += [{"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
                        {"target_label": "endpoint", "replacement": endpoint["port"]}]
            jobs.append({
                "job_name": f"{kind[0].lower()}{kind[1:]}/{meta['namespace']}/{meta['name']}/{i}",
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "scrape_interval": interval or endpoint.get("interval", "30s"),
                "metrics_path": endpoint.get("path", "/metrics"),
                "scheme": endpoint.get("scheme", "http"),
                "kubernetes_sd_configs": [sd],
                "relabel_configs": relabel,
            })
    return jobs


def chart_monitors(release: str, namespace: str, values: list[Path] = ()) -> list[dict[str, Any]]:
    """The PodMonitor and ServiceMonitor charts/specpair renders for a release (`helm template`
    with both monitors on, plus the given values files)."""
    argv = [repo_tool("helm"), "template", release, str(CHART), "--namespace", namespace,
            "--set", "operator.podMonitor.enabled=true", "--set", "metrics.serviceMonitor.enabled=true"]
    for v in values:
        argv += ["--values", str(v)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"helm template failed: {done.stderr.strip()[-2000:]}")
    return [d for d in yaml.safe_load_all(done.stdout) if d and d.get("kind") in ("PodMonitor", "ServiceMonitor")]


class DevPrometheus:
    """Prometheus scraping the devcluster's pods through the given monitors, evaluating
    `rule_files` every `interval`. `cluster` is a DevCluster, or anything with its `kube`,
    `server` and `ca_file`."""

    def __init__(self, cluster: Any, workdir: Path, monitors: list[dict[str, Any]],
                 rule_files: list[Path] = (), interval: str = "1s", port: int | None = None):
        self.cluster, self.workdir = cluster, Path(workdir)
        self.monitors, self.rule_files, self.interval = monitors, [Path(p) for p in rule_files], interval
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.child: Child | None = None

    def grant(self) -> Path:
        """A ServiceAccount allowed exactly what discovery reads, and a token file of it."""
        kube = self.cluster.kube
        name = f"{NAMESPACE}-{ACCOUNT}"
        for obj in ({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": ACCOUNT, "namespace": NAMESPACE}},
                    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
                     "rules": CLUSTER_ROLE_RULES},
                    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                     "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}]}):
            if kube.get(obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]) is None:
                kube.create(obj)
        got = kube.request("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{ACCOUNT}/token",
                           body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                 "spec": {"expirationSeconds": 24 * 3600}})
        token = self.workdir / "token"
        token.write_text(got["status"]["token"])
        token.chmod(0o600)
        return token

    def config(self, token_file: Path) -> dict[str, Any]:
        return {"global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
                "rule_files": [str(p) for p in self.rule_files],
                "scrape_configs": scrape_configs(self.monitors, self.cluster.server, self.cluster.ca_file,
                                                 token_file, interval=self.interval)}

    def config_file_jobs(self) -> list[dict[str, Any]]:
        """The scrape jobs of the configuration Prometheus was started with."""
        return yaml.safe_load((self.workdir / "prometheus.yml").read_text())["scrape_configs"]

    def start(self, timeout: float = 60.0) -> "DevPrometheus":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config(self.grant()), sort_keys=False))
        binary = prometheus_binaries() / "prometheus"
        self.child = Child("prometheus", [str(binary), f"--config.file={config}",
                                          f"--storage.tsdb.path={self.workdir / 'data'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}"],
                           self.workdir / "prometheus.log")
        wait_until(self._ready, timeout, what="Prometheus /-/ready",
                   abort=lambda: first_exit([self.child]))
        return self

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None

    def __enter__(self) -> "DevPrometheus":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _ready(self) -> bool:
        return http_ok(self.url + "/-/ready")

    # -- the HTTP API ------------------------------------------------------------------------------

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns `data`, raises with Prometheus' error otherwise."""
        query = urllib.parse.urlencode([(k, x) for k, v in params.items() for x in (v if isinstance(v, list) else [v])])
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus /api/v1/{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        return self.api("query", query=expr, **({"time": at} if at is not None else {}))["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]

    def wait_for(self, what: str, predicate: Any, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                return got
            time.sleep(0.5)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
