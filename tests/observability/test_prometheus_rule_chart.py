"""The chart's PrometheusRule, rendered by the real helm: off by default, on with
metrics.prometheusRule.enabled, its spec exactly the shipped rule file, and that file accepted by
the real promtool (the live evaluation is test_prometheus_live.py)."""

from __future__ import annotations

import subprocess

import yaml

from obs_helpers import RULES, alert_rules, helm, render


def _rules(manifests):
    return [m for m in manifests if m["kind"] == "PrometheusRule"]


def test_no_prometheus_rule_by_default():
    # The kind exists only where the Prometheus Operator is installed, like the monitors' kinds.
    assert _rules(render({})) == []


def test_enabled_prometheus_rule_is_the_shipped_rule_file_with_the_given_labels():
    (rule,) = _rules(render({"metrics": {"prometheusRule": {"enabled": True,
                                                            "labels": {"release": "kube-prometheus-stack"}}}}))
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "specpair-obs"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == "obs"
    # Embedded verbatim: Prometheus' own {{ $labels.x }} templates survive helm.
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    assert any("{{ $labels.pair }}" in r["annotations"]["summary"] for r in alert_rules())


def test_schema_refuses_an_unknown_prometheus_rule_key():
    done = helm("template", "obs", str(RULES.parents[1]), values={"metrics": {"prometheusRule": {"enable": True}}},
                check=False)
    assert done.returncode != 0 and "enable" in done.stderr


def test_the_pod_monitor_keeps_the_operators_namespace_label():
    # The operator labels its series with the pair's namespace; honorLabels keeps it from being
    # renamed exported_namespace next to the target's namespace (the live test proves the effect).
    (monitor,) = [m for m in render({"operator": {"podMonitor": {"enabled": True}}}) if m["kind"] == "PodMonitor"]
    assert [e.get("honorLabels") for e in monitor["spec"]["podMetricsEndpoints"]] == [True]


def test_promtool_accepts_the_rendered_rules(prometheus_bin, tmp_path):
    (rule,) = _rules(render({"metrics": {"prometheusRule": {"enabled": True}}}))
    path = tmp_path / "rendered.rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run([str(prometheus_bin / "promtool"), "check", "rules", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_promtool_refuses_a_broken_rule(prometheus_bin, tmp_path):
    # The check above can fail: a rule with a PromQL syntax error is refused.
    spec = yaml.safe_load(RULES.read_text())
    spec["groups"][0]["rules"][0]["expr"] = "max by (pair ("
    path = tmp_path / "broken.rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([str(prometheus_bin / "promtool"), "check", "rules", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
