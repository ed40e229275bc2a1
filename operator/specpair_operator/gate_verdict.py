"""Judging a gate verdict (the JSON `specpair gate` writes) against the pair's thresholds.

The gate decides `passed` itself; the operator re-checks the thresholds on the reported numbers
so a gate that forgot one cannot promote a release, and so the condition message names each
failed threshold with how far off it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GateOutcome:
    passed: bool
    reason: str  # CamelCase, for the Gated condition
    message: str
    failures: list[str] = field(default_factory=list)
    tokenizer_compatible: bool | None = None
    tokenizer_message: str = ""


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def threshold_failures(verdict: dict[str, Any], thresholds: dict[str, Any]) -> list[str]:
    """One sentence per threshold the verdict's numbers miss, with the shortfall."""
    failures: list[str] = []
    if thresholds.get("requireGreedyIdentity", True):
        # bf16 verification can flip exact logit ties; the gate reports those separately
        # (greedyIdentityWithinTies, each mismatch with its margin) and only they are forgiven.
        identity = _num(verdict.get("greedyIdentityWithinTies", verdict.get("greedyIdentity")))
        if identity is None or identity < 1.0:
            shown = "missing" if identity is None else f"{identity:.3f}"
            failures.append(f"greedy identity {shown} < 1.000 (required: speculative output must equal target-only)")
    min_acc = _num(thresholds.get("minAcceptance")) or 0.0
    acc = _num(verdict.get("acceptanceRate"))
    if min_acc > 0 and (acc is None or acc < min_acc):
        shown = "missing" if acc is None else f"{acc:.3f}"
        short = "" if acc is None else f" (short by {min_acc - acc:.3f})"
        failures.append(f"acceptance {shown} < minAcceptance {min_acc:.3f}{short}")
    cats = verdict.get("categories") or {}
    for cat, floor in sorted((thresholds.get("minCategoryAcceptance") or {}).items()):
        got = _num((cats.get(cat) or {}).get("acceptanceRate"))
        if got is None:
            failures.append(f"category '{cat}' acceptance missing (no golden prompt in that category?) < {float(floor):.3f}")
        elif got < float(floor):
            failures.append(f"category '{cat}' acceptance {got:.3f} < {float(floor):.3f} (short by {float(floor) - got:.3f})")
    min_speedup = _num(thresholds.get("minSpeedup")) or 0.0
    speedup = _num(verdict.get("speedup"))
    if min_speedup > 0 and (speedup is None or speedup < min_speedup):
        shown = "missing" if speedup is None else f"{speedup:.3f}x"
        short = "" if speedup is None else f" (short by {min_speedup - speedup:.3f}x)"
        failures.append(f"speedup {shown} < minSpeedup {min_speedup:.3f}x{short}")
    return failures


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
        v = _num(verdict.get(key))
        if v is not None:
            parts.append(f"{label} {fmt.format(v)}")
    return GateOutcome(True, "GatePassed", "passed: " + ", ".join(parts), [], tok_ok, tok_msg or tok_note)


def baseline_from_verdict(verdict: dict[str, Any]) -> dict[str, float]:
    """Gated acceptance per category plus '*' overall: what drift is measured against."""
    base: dict[str, float] = {}
    overall = _num(verdict.get("acceptanceRate"))
    if overall is not None:
        base["*"] = overall
    for cat, vals in (verdict.get("categories") or {}).items():
        v = _num((vals or {}).get("acceptanceRate"))
        if v is not None:
            base[cat] = v
    return base
