"""Judging a gate verdict (the JSON `specpair gate` writes) against the pair's thresholds.

The gate decides `passed` itself; the operator re-checks the thresholds on the reported numbers
so a gate that forgot one cannot promote a release, and so the condition message names each
failed threshold with how far off it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specpair.contract import number, threshold_failures

__all__ = ["GateOutcome", "evaluate_verdict", "threshold_failures", "baseline_from_verdict"]


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
