"""The Argo CD health check (deploy/argocd/health.lua), run by a real Lua 5.1 interpreter (the
language Argo CD's gopher-lua speaks) the way Argo CD runs it: `obj` global, a returned table."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ship_helpers import REPO_ROOT, run

HEALTH_LUA = REPO_ROOT / "deploy" / "argocd" / "health.lua"


def to_lua(value: Any) -> str:
    """A Lua literal for a JSON-like value (what Argo CD hands the script: tables, strings, numbers)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid Lua escapes for these texts
    if isinstance(value, list):
        return "{" + ", ".join(to_lua(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{json.dumps(k)}] = {to_lua(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def health(lua: Path, obj: dict[str, Any], tmp_path: Path) -> tuple[str, str]:
    driver = tmp_path / "driver.lua"
    driver.write_text(
        f"obj = {to_lua(obj)}\n"
        f"local hs = dofile({json.dumps(str(HEALTH_LUA))})\n"
        "io.write(hs.status, '\\n', hs.message or '')\n")
    status, _, message = run([lua, driver]).stdout.partition("\n")
    return status, message


def pair(generation: int = 3, **status: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair",
                           "metadata": {"name": "default", "namespace": "ns", "generation": generation},
                           "spec": {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}}
    if status:
        obj["status"] = status
    return obj


def cond(type_: str, status: str, reason: str = "", message: str = "", generation: int = 3) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason or type_, "message": message,
            "observedGeneration": generation, "lastTransitionTime": "2026-01-01T00:00:00Z"}


READY = [cond("Ready", "True", "Serving", "2/2 engine pods SERVING release 4"), cond("Reconciling", "False"),
         cond("Stalled", "False"), cond("Gated", "True", "GatePassed"), cond("TokenizerCompatible", "True")]

CASES = [
    ("no status yet", pair(), "Progressing", "Waiting for the specpair operator"),
    ("status without conditions", pair(phase="Pending"), "Progressing", "Waiting for the specpair operator"),
    ("ready", pair(observedGeneration=3, servingVersion="4", conditions=READY), "Healthy",
     "Serving release 4 (Serving: 2/2 engine pods SERVING release 4)"),
    ("ready but for an older generation", pair(generation=4, observedGeneration=3, conditions=READY),
     "Progressing", "observe generation 4"),
    ("ready, generation only on the condition", pair(generation=4, conditions=[cond("Ready", "True", generation=3)]),
     "Progressing", "observe generation 4"),
    ("reconciling: gate running", pair(observedGeneration=3, conditions=[
        cond("Ready", "True", "Serving"), cond("Reconciling", "True", "Gating", "gate Job default-gate-1a2b running"),
        cond("Stalled", "False"), cond("Gated", "Unknown", "Gating")]),
     "Progressing", "Gating: gate Job default-gate-1a2b running"),
    ("reconciling: first rollout", pair(observedGeneration=3, conditions=[
        cond("Ready", "False", "RollingOut", "0/1 pods ready"), cond("Reconciling", "True", "RollingOut", "0/1 pods ready")]),
     "Progressing", "RollingOut"),
    ("not ready, nothing else said", pair(observedGeneration=3, conditions=[cond("Ready", "False", "Waiting")]),
     "Progressing", "Waiting"),
    ("stalled", pair(observedGeneration=3, conditions=[
        cond("Ready", "False", "MLflowUnreachable"), cond("Stalled", "True", "MLflowUnreachable", "retrying in 30s")]),
     "Degraded", "MLflowUnreachable: retrying in 30s"),
    ("gate failed, champion keeps serving", pair(observedGeneration=3, servingVersion="3", conditions=[
        cond("Ready", "True", "Serving"), cond("Reconciling", "False"), cond("Stalled", "False"),
        cond("Gated", "False", "ThresholdFailed", "code acceptance 0.21 < 0.35 (by 0.14)")]),
     "Degraded", "Gate failed: ThresholdFailed: code acceptance 0.21 < 0.35 (by 0.14)"),
    ("tokenizer mismatch", pair(observedGeneration=3, conditions=[
        cond("Ready", "False", "GateFailed"), cond("Gated", "False", "TokenizerMismatch"),
        cond("TokenizerCompatible", "False", "TokenizerMismatch", "vocab size 49152 != 151665")]),
     "Degraded", "Tokenizers differ: TokenizerMismatch: vocab size 49152 != 151665"),
    ("rollout failed, not stalled", pair(observedGeneration=3, servingVersion="3", conditions=[
        cond("Ready", "False", "RolloutFailed", "v4: ProgressDeadlineExceeded after 600s"),
        cond("Reconciling", "False"), cond("Gated", "True", "GatePassed")]),
     "Degraded", "Rollout failed: RolloutFailed: v4: ProgressDeadlineExceeded after 600s"),
    ("rollout failed while still reconciling", pair(observedGeneration=3, conditions=[
        cond("Ready", "False", "RolloutFailed", "v4 did not become ready"),
        cond("Reconciling", "True", "RollingOut", "rolling out v4")]),
     "Degraded", "Rollout failed: RolloutFailed: v4 did not become ready"),
    ("rollout failed, but for an older generation", pair(generation=4, observedGeneration=3, conditions=[
        cond("Ready", "False", "RolloutFailed")]),
     "Progressing", "observe generation 4"),
    ("drifted, speculation off, still serving", pair(observedGeneration=3, servingVersion="4", conditions=READY + [
        cond("Drifted", "True", "SpeculationOff", "code acceptance 0.30 below gated 0.62")]),
     "Healthy", "drift: SpeculationOff: code acceptance 0.30 below gated 0.62"),
]


@pytest.mark.parametrize("obj,expected_status,expected_message",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_health(lua, tmp_path, obj, expected_status, expected_message):
    status, message = health(lua, obj, tmp_path)
    assert status == expected_status, message
    assert expected_message in message


def test_lua_is_5_1_like_argo_cd(lua):
    assert "Lua 5.1" in run([lua, "-v"]).stderr + run([lua, "-v"]).stdout


HEALTH_KEY = "resource.customizations.health.specpair.io_SpecModelPair"
INSTALL_DOC = REPO_ROOT / "docs" / "install.md"


def health_of_script(lua: Path, script: str, obj: dict[str, Any], tmp_path: Path) -> tuple[str, str]:
    """Run a script as Argo CD holds it (the text of an argocd-cm key), not the file."""
    copy = tmp_path / "from-configmap.lua"
    copy.write_text(script)
    driver = tmp_path / "driver.lua"
    driver.write_text(f"obj = {to_lua(obj)}\nlocal hs = dofile({json.dumps(str(copy))})\n"
                      "io.write(hs.status, '\\n', hs.message or '')\n")
    status, _, message = run([lua, driver]).stdout.partition("\n")
    return status, message


def test_kustomize_component_merges_the_check_into_argocd_cm(kubectl, lua, tmp_path):
    """deploy/argocd is a kustomize component: built into an Argo CD install (here its argocd-cm
    alone) by the kustomize inside kubectl, it adds the one key and keeps the others."""
    base = tmp_path / "argocd"
    base.mkdir()
    (base / "argocd-cm.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "argocd-cm", "labels": {"app.kubernetes.io/part-of": "argocd"}},
        "data": {"url": "https://argocd.example.com", "exec.enabled": "false"}}))
    component = Path(os.path.relpath(HEALTH_LUA.parent, base))
    (base / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "argocd",
        "resources": ["argocd-cm.yaml"], "components": [str(component)]}))
    (cm,) = [d for d in yaml.safe_load_all(run([kubectl, "kustomize", base]).stdout) if d]
    assert cm["metadata"]["name"] == "argocd-cm" and cm["metadata"]["namespace"] == "argocd"
    assert cm["metadata"]["labels"] == {"app.kubernetes.io/part-of": "argocd"}
    assert cm["data"]["url"] == "https://argocd.example.com" and cm["data"]["exec.enabled"] == "false"
    assert cm["data"][HEALTH_KEY] == HEALTH_LUA.read_text()
    failed = pair(observedGeneration=3, conditions=[cond("Ready", "False", "RolloutFailed", "v4 never ready")])
    assert health_of_script(lua, cm["data"][HEALTH_KEY], failed, tmp_path)[0] == "Degraded"


def test_argo_cd_helm_chart_command_in_the_docs_sets_the_key(helm, tmp_path):
    """The documented `--set-file` for Argo CD's Helm chart, run against a stand-in chart that
    renders `configs.cm` as the argo-cd chart does (its argocd-cm data)."""
    (flag,) = re.findall(r"--set-file '([^']+)'", INSTALL_DOC.read_text())
    chart = tmp_path / "argo-cd"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: argo-cd\nversion: 0.0.1\n")
    (chart / "templates" / "argocd-cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: argocd-cm\ndata:\n"
        "  {{- toYaml .Values.configs.cm | nindent 2 }}\n")
    out = run([helm, "template", "argocd", chart, "--set-file", flag], cwd=REPO_ROOT).stdout
    (cm,) = [d for d in yaml.safe_load_all(out) if d]
    assert cm["data"] == {HEALTH_KEY: HEALTH_LUA.read_text()}


def test_the_lua_has_one_home():
    """No copy of the script in the docs or the chart: the component and --set-file read the file."""
    marker = HEALTH_LUA.read_text().splitlines()[0]
    copies = [p for p in (REPO_ROOT / "docs").rglob("*.md") if marker in p.read_text()]
    copies += [p for p in (REPO_ROOT / "charts").rglob("*") if p.is_file() and marker in p.read_text(errors="replace")]
    assert copies == []
    text = INSTALL_DOC.read_text()
    assert "//deploy/argocd?ref=" in text and "deploy/argocd/health.lua" in text
