"""Judging a gate verdict (the JSON `specpair gate` writes) against the pair's thresholds.

The gate decides `passed` itself; the operator re-checks the thresholds on the reported numbers
so a gate that forgot one cannot promote a release, and so the condition message names each
failed threshold with how far off it was.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from specpair.contract import number, threshold_failures

__all__ = ["GateOutcome", "evaluate_verdict", "threshold_failures", "baseline_from_verdict", "verdict_digest",
           "verify_verdict"]


@dataclass(frozen=True)
class GateOutcome:
    passed: bool
    reason: str  # CamelCase, for the Gated condition
    message: str
    failures: list[str] = field(default_factory=list)
    tokenizer_compatible: bool | None = None
    tokenizer_message: str = ""


def evaluate_verdict(verdict: dict[str, Any], thresholds: dict[str, Any]) -> GateOutcome:
    if not isinstance(verdict, dict) or not isinstance(verdict.get("passed"), bool):
        return GateOutcome(False, "VerdictInvalid", "gate verdict has no boolean 'passed'", ["invalid verdict"])
    tok = verdict.get("tokenizer") or {}
    tok_ok = tok.get("compatible") if isinstance(tok.get("compatible"), bool) else None
    tok_msg = "; ".join(str(d) for d in tok.get("differences") or [])
    if tok_ok is False:
        msg = "tokenizers differ: " + (tok_msg or "no details reported")
        return GateOutcome(False, "TokenizerMismatch", msg, [msg], False, msg)
    failures = list(verdict.get("reasons") or []) if not verdict["passed"] else []
    for f in threshold_failures(verdict, thresholds):
        if f not in failures:
            failures.append(f)
    if not verdict["passed"] and not failures:
        failures.append("gate reported failure without reasons")
    tok_note = "tokenizers identical" if tok_ok else ("tokenizer check not reported" if tok_ok is None else "")
    if failures:
        return GateOutcome(False, "ThresholdsNotMet", "; ".join(failures), failures, tok_ok, tok_msg or tok_note)
    parts = []
    for label, key, fmt in (("acceptance", "acceptanceRate", "{:.3f}"), ("speedup", "speedup", "{:.2f}x"),
                            ("identity", "greedyIdentity", "{:.3f}")):
        v = number(verdict.get(key))
        if v is not None:
            parts.append(f"{label} {fmt.format(v)}")
    return GateOutcome(True, "GatePassed", "passed: " + ", ".join(parts), [], tok_ok, tok_msg or tok_note)


def baseline_from_verdict(verdict: dict[str, Any]) -> dict[str, float]:
    """Gated acceptance per category plus '*' overall: what drift is measured against."""
    base: dict[str, float] = {}
    overall = number(verdict.get("acceptanceRate"))
    if overall is not None:
        base["*"] = overall
    for cat, vals in (verdict.get("categories") or {}).items():
        v = number((vals or {}).get("acceptanceRate"))
        if v is not None:
            base[cat] = v
    return base


def verdict_digest(verdict: dict[str, Any]) -> str:
    """sha256 of the verdict as JSON with sorted keys, less the MLflow run id (which the registry
    adds when it records the verdict): the same digest before and after MLflow."""
    body = {k: v for k, v in verdict.items() if k != "mlflowRunId"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def verify_verdict(verdict: dict[str, Any], version: str, reported: str | None) -> GateOutcome | None:
    """None when the verdict read from MLflow is the one the gate Job reported (`reported`: the
    digest from its pod's termination message, or from the pair's status where it was kept);
    otherwise the failed outcome to record. reported None: the Job's report is gone (see
    handlers: the release is gated again)."""
    if reported is None:
        return GateOutcome(False, "VerdictUnverified", f"the verdict of v{version} in MLflow cannot be checked "
                           "against its gate Job's report", ["verdict unverified"])
    actual = verdict_digest(verdict)
    if actual != reported:
        msg = (f"the verdict of v{version} in MLflow (sha256 {actual[:12]}) is not the one its gate Job reported "
               f"({reported[:12]}): it was changed after the gate; not promoted")
        return GateOutcome(False, "VerdictMismatch", msg, [msg])
    return None
