"""The Argo CD health check (deploy/argocd/health.lua), run by a real Lua 5.1 interpreter (the
language Argo CD's gopher-lua speaks) the way Argo CD runs it: `obj` global, a returned table."""

from __future__ import annotations

import json
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


def test_docs_show_the_argo_cd_customization_with_this_exact_script():
    """docs/install.md carries the argocd-cm snippet; its Lua must be the tested file verbatim."""
    text = (REPO_ROOT / "docs" / "install.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    (block,) = [b for b in blocks if "resource.customizations.health." in b]
    snippet = yaml.safe_load(block)
    assert snippet["metadata"]["name"] == "argocd-cm"
    script = snippet["data"]["resource.customizations.health.specpair.io_SpecModelPair"]
    assert script.strip() == HEALTH_LUA.read_text().strip()
