"""Judging a gate verdict (the JSON `specpair gate` writes) against the pair's thresholds.

A verdict is first checked against one schema (verdict_problems): types, and every number
finite and in its range. A NaN compares false with every threshold, so unchecked it would pass
them all; a string where a mapping belongs would raise in the pass. A verdict that fails the
schema is a GateError naming each problem, wherever it was read (the gate's output file, the
MLflow tag).

The gate decides `passed` itself; the operator re-checks the thresholds on the reported numbers
so a gate that forgot one cannot promote a release, and so the condition message names each
failed threshold with how far off it was.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from specpair.contract import number, threshold_failures

from specpair_operator.crd.validation import spec_schema

__all__ = ["GateOutcome", "evaluate_verdict", "threshold_failures", "baseline_from_verdict", "verdict_digest",
           "verify_verdict", "verdict_problems", "usable_verdict", "GATE_ERROR"]

GATE_ERROR = "GateError"  # the Gated reason of a gate that produced no usable verdict

# The measured numbers of a verdict, overall and per category: (in range?, the range in words).
# Absent or null means not measured (a gate that stopped at the tokenizer check).
_RATE = (lambda v: 0.0 <= v <= 1.0, "a finite number in [0, 1]")
MEASURES: dict[str, tuple[Callable[[float], bool], str]] = {
    "acceptanceRate": _RATE,
    "greedyIdentity": _RATE,
    "greedyIdentityWithinTies": _RATE,
    "meanAcceptanceLength": (lambda v: v >= 0.0, "a finite number >= 0"),
    "speedup": (lambda v: v > 0.0, "a finite number > 0"),
}
# A point of the gate's k or batch-size sweep (0 where a timing came out empty).
_SWEEP_SPEEDUP = (lambda v: v >= 0.0, "a finite number >= 0")


def _show(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    try:
        text = json.dumps(value, default=str)
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _finite_number(v: Any) -> bool:
    """A JSON number that is a float too (an integer of 400 digits is not: float() overflows)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


class _Check:
    """Collects the problems of one verdict, each as 'PATH is VALUE, must be WHAT', one per path."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.paths: set[str] = set()

    def fail(self, path: str, value: Any, must: str) -> None:
        if path not in self.paths:
            self.paths.add(path)
            self.problems.append(f"{path} is {_show(value)}, must be {must}")

    def number(self, path: str, value: Any, rule: tuple[Callable[[float], bool], str], optional: bool = True) -> None:
        ok, words = rule
        if value is None and optional:
            return
        if not _finite_number(value) or not ok(float(value)):
            self.fail(path, value, words)

    def integer(self, path: str, value: Any, low: int, high: int | None = None) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
            self.fail(path, value, f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}")

    def mapping(self, path: str, value: Any, what: str, optional: bool = True) -> bool:
        """Whether `value` is a mapping to look into (None, where optional, is not, silently)."""
        if value is None and optional:
            return False
        if not isinstance(value, dict):
            self.fail(path, value, what)
            return False
        return True

    def strings(self, path: str, value: Any) -> None:
        if value is not None and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            self.fail(path, value, "a list of strings")

    def optional_string(self, path: str, value: Any) -> None:
        if value is not None and not isinstance(value, str):
            self.fail(path, value, "a string")

    def finite_everywhere(self, path: str, value: Any) -> None:
        """No NaN or Infinity anywhere, in fields the schema names or not: a verdict's numbers
        reach status patches and metrics, and JSON has no such values."""
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(path, value, "a finite number")
        elif isinstance(value, dict):
            for k, v in value.items():
                self.finite_everywhere(f"{path}.{k}" if path else str(k), v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                self.finite_everywhere(f"{path}[{i}]", v)


def verdict_problems(verdict: Any) -> list[str]:
    """Everything wrong with `verdict` against the verdict schema ([]: usable)."""
    check = _Check()
    if not isinstance(verdict, dict):
        check.fail("the verdict", verdict, "a JSON object")
        return check.problems

    def measures(prefix: str, values: dict[str, Any]) -> None:
        for key, rule in MEASURES.items():
            check.number(prefix + key, values.get(key), rule)

    if not isinstance(verdict.get("passed"), bool):
        check.fail("passed", verdict.get("passed"), "true or false")
    check.strings("reasons", verdict.get("reasons"))
    measures("", verdict)
    categories = verdict.get("categories")
    if check.mapping("categories", categories, "a mapping of category to its numbers"):
        for cat, values in categories.items():
            if check.mapping(f"categories.{cat}", values, "a mapping of measure to number", optional=False):
                measures(f"categories.{cat}.", values)
    tok = verdict.get("tokenizer")
    if check.mapping("tokenizer", tok, "a mapping (compatible, differences, fingerprints)"):
        if tok.get("compatible") is not None and not isinstance(tok.get("compatible"), bool):
            check.fail("tokenizer.compatible", tok.get("compatible"), "true or false")
        check.strings("tokenizer.differences", tok.get("differences"))
        check.strings("tokenizer.notes", tok.get("notes"))
        for key in ("targetFingerprint", "draftFingerprint"):
            check.optional_string(f"tokenizer.{key}", tok.get(key))
    positions = verdict.get("acceptancePerPosition")
    if positions is not None and not isinstance(positions, list):
        check.fail("acceptancePerPosition", positions, "a list of numbers in [0, 1]")
    for i, v in enumerate(positions if isinstance(positions, list) else []):
        check.number(f"acceptancePerPosition[{i}]", v, _RATE, optional=False)
    best = verdict.get("bestSpeculation")
    if check.mapping("bestSpeculation", best, "a mapping (k, batchSizeThreshold)"):
        # Served as the engine's k: within what a spec may ask for.
        if "k" in best:
            check.integer("bestSpeculation.k", best["k"], 1, max_k())
        if "batchSizeThreshold" in best:
            check.integer("bestSpeculation.batchSizeThreshold", best["batchSizeThreshold"], 0)
        if "kByBatchSize" in best:
            # A vLLM gate's k by load: served as vLLM's batch-size schedule, after its own rules.
            from specpair.errors import SpecpairError
            from specpair.vllm_peer import checked_schedule
            try:
                checked_schedule(best["kByBatchSize"], max_k())
            except SpecpairError as exc:
                check.fail("bestSpeculation.kByBatchSize", best["kByBatchSize"], f"a batch-size schedule vLLM takes ({exc})")
    for key, size in (("kSweep", "k"), ("batchSweep", "batchSize")):
        rows = verdict.get(key)
        if rows is not None and not isinstance(rows, list):
            check.fail(key, rows, f"a list of ({size}, speedup) mappings")
        for i, row in enumerate(rows if isinstance(rows, list) else []):
            if check.mapping(f"{key}[{i}]", row, f"a mapping ({size}, speedup)", optional=False):
                check.integer(f"{key}[{i}].{size}", row.get(size), 1)
                check.number(f"{key}[{i}].speedup", row.get("speedup"), _SWEEP_SPEEDUP, optional=False)
    for key in ("mlflowRunId", "device", "engine"):
        check.optional_string(key, verdict.get(key))
    try:
        check.finite_everywhere("", verdict)
    except RecursionError:
        check.fail("the verdict", "...", "nested less deeply than Python's recursion limit")
    return check.problems


def max_k() -> int:
    """The largest k a spec may ask for (the CRD's speculation.k maximum)."""
    return int(spec_schema()["properties"]["speculation"]["properties"]["k"]["maximum"])


def unusable_message(problems: list[str]) -> str:
    return "the gate's verdict is unusable: " + "; ".join(problems)


def usable_verdict(verdict: Any) -> dict[str, Any]:
    """The verdict when it passes the schema, else {} (nothing measured): what the serving
    path, drift baselines and status read numbers from."""
    return verdict if isinstance(verdict, dict) and not verdict_problems(verdict) else {}


@dataclass(frozen=True)
class GateOutcome:
    passed: bool
    reason: str  # CamelCase, for the Gated condition
    message: str
    failures: list[str] = field(default_factory=list)
    tokenizer_compatible: bool | None = None
    tokenizer_message: str = ""


def evaluate_verdict(verdict: Any, thresholds: dict[str, Any]) -> GateOutcome:
    problems = verdict_problems(verdict)
    if problems:
        return GateOutcome(False, GATE_ERROR, unusable_message(problems), problems)
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
    verdict = usable_verdict(verdict)
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
