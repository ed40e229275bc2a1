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
        cond("Gated", "False", "ThresholdsNotMet", "code acceptance 0.21 < 0.35 (by 0.14)")]),
     "Degraded", "Gate failed: ThresholdsNotMet: code acceptance 0.21 < 0.35 (by 0.14)"),
    ("tokenizer mismatch", pair(observedGeneration=3, conditions=[
        cond("Ready", "False", "GateFailed"), cond("Gated", "False", "TokenizerMismatch"),
        cond("TokenizerCompatible", "False", "TokenizerMismatch", "vocab size 49152 != 151665")]),
     "Degraded", "Tokenizers differ: TokenizerMismatch: vocab size 49152 != 151665"),
    ("rolled back, but for an older generation", pair(generation=4, observedGeneration=3, conditions=[
        cond("Ready", "False", "RolledBack"), cond("Reconciling", "True", "RolledBack")]),
     "Progressing", "observe generation 4"),
    ("drifted, speculation off, still serving", pair(observedGeneration=3, servingVersion="4", conditions=READY + [
        cond("Drifted", "True", "SpeculationOff", "code acceptance 0.30 below gated 0.62")]),
     "Healthy", "drift: SpeculationOff: code acceptance 0.30 below gated 0.62"),
]


# -- statuses as the operator writes them ----------------------------------------------------------
# Each is what the operator's own status ledger (operator/specpair_operator/act/ledger.py) writes for a
# pass that reports (how, phase, reason) as the plans do (the Report(...) of plan/release_plan.py and
# serving_plan.py), with the other conditions such a pass sets: not hand-made condition lists.

OPERATOR_SOURCES = "\n".join(p.read_text() for p in (REPO_ROOT / "operator" / "specpair_operator").rglob("*.py"))


def written(how: str, phase: str, reason: str, message: str, *, ready_message: str | None = None,
            serving: str = "", others: tuple[tuple[str, str, str, str], ...] = ()) -> dict[str, Any]:
    """The pair as the operator leaves it after such a pass (generation 3, observed)."""
    import logging

    from specpair_operator.act.ledger import StatusLedger

    ledger = StatusLedger({}, 3, "ns", "default", logging.getLogger("health"))
    for type_, status, why, text in others:
        ledger.cond(type_, status, why, text)
    if serving:
        ledger.set(servingVersion=serving)
    if how == "ready":
        ledger.ready(phase, reason, message)
    elif how == "reconciling":
        ledger.reconciling(phase, reason, message, ready_message=ready_message)
    elif how == "stalled":
        ledger.stalled(phase, reason, message, ready_message=ready_message)
    else:
        ledger.stall(reason, message)
    return pair(**json.loads(json.dumps(ledger.status_patch())))


GATED_PASSED = ("Gated", "True", "GatePassed", "v4: passed")
OPERATOR_CASES = [
    ("serving", written("ready", "Serving", "Serving", "v4 serving on 2 pod(s), identity verified", serving="4",
                        others=(GATED_PASSED,)),
     "Healthy", "Serving release 4 (Serving: v4 serving on 2 pod(s), identity verified)"),
    ("speculation off after drift, still serving", written(
        "ready", "Degraded", "SpeculationOff", "v4 serving target-only after drift", serving="4",
        others=(GATED_PASSED, ("Drifted", "True", "SpeculationOff", "category 'code' acceptance 0.30 < 0.60"))),
     "Healthy", "drift: SpeculationOff: category 'code' acceptance 0.30 < 0.60"),
    ("gating, the champion serving", written(
        "reconciling", "Gating", "Gating", "gate Job default-gate-1a2b3c4d5e running for v5",
        ready_message="gating v5; v4 keeps serving", serving="4", others=(("Gated", "Unknown", "Gating", "v5"),)),
     "Progressing", "Gating: gate Job default-gate-1a2b3c4d5e running for v5"),
    ("gating again: MLflow lost the release", written(
        "reconciling", "Gating", "ReleaseMissing", "MLflow lost v1's gate verdict (the release was registered "
        "again); gate Job default-gate-1a2b3c4d5e-a2 running for v1", others=(("Gated", "Unknown", "ReleaseMissing", "v1"),)),
     "Progressing", "ReleaseMissing: MLflow lost v1's gate verdict"),
    ("rolling out", written("reconciling", "RollingOut", "RollingOut", "rolling out v5: 0/1 pods ready",
                            ready_message="0/1 pods ready", serving="5", others=(GATED_PASSED,)),
     "Progressing", "RollingOut: rolling out v5"),
    ("scored in shadow", written("reconciling", "Shadowing", "ShadowScoring", "v5 scored in shadow on v4's pods",
                                 serving="4", others=(GATED_PASSED,)),
     "Progressing", "ShadowScoring"),
    ("canary", written("reconciling", "Canary", "CanaryProgressing", "v5 serves 1 of 4 replicas", serving="4",
                       others=(GATED_PASSED,)),
     "Progressing", "CanaryProgressing"),
    # The case: a failed rollout with a previous release reads Reconciling/RolledBack.
    ("rolling back", written("reconciling", "RollingOut", "RolledBack", "rolling back to v3",
                             ready_message="rollout of v4 failed: ProgressDeadlineExceeded", serving="3",
                             others=(GATED_PASSED, ("Drifted", "True", "RolledBack", "rollout of v4 failed"))),
     "Degraded", "Rolled back: RolledBack: rolling back to v3"),
    ("rolled back, the previous release serving", written(
        "stalled", "Degraded", "ReleaseNotServable", "v4 was rolled back: rollout of v4 failed; v3 keeps serving",
        serving="3", others=(GATED_PASSED,)),
     "Degraded", "ReleaseNotServable: v4 was rolled back"),
    ("failed with no previous release", written(
        "stalled", "Failed", "NoPreviousRelease", "rollout of v1 failed: crash looping; no previous release",
        ready_message="rollout of v1 failed: crash looping; no previous release to roll back to"),
     "Degraded", "NoPreviousRelease: rollout of v1 failed"),
    ("gate failed, the champion serving", written(
        "stalled", "Degraded", "ReleaseNotServable", "gate of v5 failed: acceptance 0.200 < minAcceptance 0.500; "
        "v4 keeps serving", serving="4", others=(("Gated", "False", "ThresholdsNotMet", "v5: acceptance 0.200"),)),
     "Degraded", "ReleaseNotServable: gate of v5 failed"),
    ("gate failed while the champion drifted", written(
        "ready", "Degraded", "SpeculationOff", "v4 serving target-only after drift", serving="4",
        others=(("Gated", "False", "ThresholdsNotMet", "v5: acceptance 0.200 < minAcceptance 0.500"),)),
     "Degraded", "Gate failed: ThresholdsNotMet: v5: acceptance 0.200"),
    ("tokenizers differ while the champion drifted", written(
        "ready", "Degraded", "SpeculationOff", "v4 serving target-only after drift", serving="4",
        others=(("Gated", "False", "TokenizerMismatch", "v5"),
                ("TokenizerCompatible", "False", "Mismatch", "vocab size 49152 != 151665"))),
     "Degraded", "Tokenizers differ: Mismatch: vocab size 49152 != 151665"),
    ("gate errored", written("stalled", "Failed", "GateError", "gate of v1: 3 gate attempt(s) ended without a verdict"),
     "Degraded", "GateError: gate of v1"),
    ("invalid spec", written("stall", "Failed", "InvalidSpec", "the spec is invalid: spec.target.source: ..."),
     "Degraded", "InvalidSpec: the spec is invalid"),
    ("shadow rejected", written("stalled", "Degraded", "ShadowRejected", "v5 scored worse; v4 keeps serving",
                                serving="4", others=(GATED_PASSED,)),
     "Degraded", "ShadowRejected"),
    ("canary aborted", written("stalled", "Degraded", "CanaryAborted", "TTFT p95 800 ms; v4 keeps serving",
                               serving="4", others=(GATED_PASSED,)),
     "Degraded", "CanaryAborted"),
]


# The hand-written statuses and those the operator's own ledger writes, through one check.
@pytest.mark.parametrize("obj,expected_status,expected_message",
                         [c[1:] for c in CASES + OPERATOR_CASES], ids=[c[0] for c in CASES + OPERATOR_CASES])
def test_health(lua, tmp_path, obj, expected_status, expected_message):
    status, message = health(lua, obj, tmp_path)
    assert status == expected_status, message
    assert expected_message in message


def test_every_reason_in_the_cases_and_the_script_is_one_the_operator_writes():
    """A reason no code of the operator writes (the script once waited for `RolloutFailed`) would
    be a branch no pair ever takes; each reason the script branches on is decided by a case."""
    reasons = {c["reason"] for _, obj, _, _ in OPERATOR_CASES for c in obj["status"]["conditions"]}
    branched = set(re.findall(r'reason == "(\w+)"', HEALTH_LUA.read_text()))
    for reason in reasons | branched:
        assert f'"{reason}"' in OPERATOR_SOURCES, reason
    for reason in branched:
        assert any(c["reason"] == reason and c["status"] == "True" for _, obj, _, _ in OPERATOR_CASES
                   for c in obj["status"]["conditions"]), reason


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
    rolling_back = next(obj for name, obj, _, _ in OPERATOR_CASES if name == "rolling back")
    assert health_of_script(lua, cm["data"][HEALTH_KEY], rolling_back, tmp_path)[0] == "Degraded"


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
