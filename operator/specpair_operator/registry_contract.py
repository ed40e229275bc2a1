"""What the registry holds for specpair, with no MLflow client: the tag names, a gate's tags and
metrics from its verdict, a version's gate result from its tags, the error every registry
adapter raises when MLflow cannot be reached, and how an adapter finds or creates what two
writers may create at once. The operator's adapter (registry.py, MlflowClient) and the gate
runner's (gate_record.py, MLflow's REST API without importing mlflow) both write and read
through these, so they cannot disagree on a name, a shape or a race."""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

T = TypeVar("T")

TAG_HASH = "specpair.content_hash"
TAG_GATE_STATUS = "specpair.gate.status"  # pending | passed | failed | error
TAG_GATE_VERDICT = "specpair.gate.verdict"
TAG_GATE_RUN = "specpair.gate.run_id"
TAG_GATE_MESSAGE = "specpair.gate.message"
TAG_ROLLED_BACK = "specpair.rolled_back"
TAG_TOKENIZER_TARGET = "specpair.tokenizer.target_fingerprint"
TAG_TOKENIZER_DRAFT = "specpair.tokenizer.draft_fingerprint"
TAG_BEST_SPECULATION = "specpair.gate.best_speculation"


class RegistryUnavailable(Exception):
    """MLflow could not be reached (or answered 5xx) after the in-call retries."""


TAG_OWNER, TAG_OWNER_UID = "specpair.pair", "specpair.pair_uid"


def find_or_create(find: Callable[[], T | None], create: Callable[[], T]) -> T:
    """What `find` returns, else what `create` makes. Another writer may create the same thing
    between the two (a pair's experiment is made by the operator's release run or by a gate
    runner, whichever comes first): MLflow refuses the later create with error_code
    RESOURCE_ALREADY_EXISTS (on MlflowClient's RestException and on gate_record's MlflowRefused
    alike) and `find` is asked again. Any other error, or a thing still not found, raises the
    create's error."""
    found = find()
    if found is not None:
        return found
    try:
        return create()
    except Exception as exc:
        if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
        found = find()
        if found is None:
            raise
        return found


def gate_tags(verdict: dict[str, Any], run_id: str) -> dict[str, str]:
    """The tags a recorded verdict puts on its model version, the status last (dicts keep their
    order): the operator acts on the status, so everything it points at must be written first."""
    tok = verdict.get("tokenizer") or {}
    tags = {
        TAG_GATE_RUN: run_id,
        TAG_GATE_VERDICT: json.dumps({**verdict, "mlflowRunId": run_id}, sort_keys=True, separators=(",", ":")),
        TAG_GATE_MESSAGE: "; ".join(verdict.get("reasons") or []) or "passed",
    }
    if tok.get("targetFingerprint"):
        tags[TAG_TOKENIZER_TARGET] = str(tok["targetFingerprint"])
    if tok.get("draftFingerprint"):
        tags[TAG_TOKENIZER_DRAFT] = str(tok["draftFingerprint"])
    if verdict.get("bestSpeculation"):
        tags[TAG_BEST_SPECULATION] = json.dumps(verdict["bestSpeculation"], sort_keys=True)
    tags[TAG_GATE_STATUS] = "passed" if verdict.get("passed") is True else "failed"
    return tags


def gate_error_tags(message: str) -> dict[str, str]:
    """The tags of a gate that ended in an error instead of a verdict (status last)."""
    return {TAG_GATE_MESSAGE: message[-4000:], TAG_GATE_STATUS: "error"}


def gate_run_tags(version: str) -> dict[str, str]:
    """The tags of the run a gate's verdict is logged to when the gate opened none."""
    return {"mlflow.runName": f"gate-v{version}", "specpair.model_version": str(version)}


def gate_experiment(model_name: str) -> str:
    """The MLflow experiment a pair's release and gate runs go to."""
    return f"specpair/{model_name}"


def gate_result_of(tags: dict[str, str]) -> tuple[str, dict[str, Any] | None, str]:
    """(status, verdict or None, message) from a version's tags."""
    verdict = None
    if tags.get(TAG_GATE_VERDICT):
        try:
            verdict = json.loads(tags[TAG_GATE_VERDICT])
        except (ValueError, RecursionError):  # not JSON, or nested deeper than a verdict is
            verdict = None
    return tags.get(TAG_GATE_STATUS, "pending"), verdict, tags.get(TAG_GATE_MESSAGE, "")


def gate_metrics(verdict: dict[str, Any]) -> dict[tuple[str, int], float]:
    """MLflow metrics from a verdict: overall, per category, per draft position, k sweep."""
    out: dict[tuple[str, int], float] = {}

    def put(name: str, value: Any, step: int = 0) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[(name, step)] = float(value)

    for key, name in (("acceptanceRate", "acceptance_rate"), ("meanAcceptanceLength", "mean_acceptance_length"),
                      ("speedup", "speedup"), ("greedyIdentity", "greedy_identity")):
        put(name, verdict.get(key))
    for cat, vals in (verdict.get("categories") or {}).items():
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(cat))
        for key, name in (("acceptanceRate", "acceptance_rate"), ("speedup", "speedup"),
                          ("greedyIdentity", "greedy_identity"), ("meanAcceptanceLength", "mean_acceptance_length")):
            put(f"{name}.{safe}", (vals or {}).get(key))
    for pos, v in enumerate(verdict.get("acceptancePerPosition") or []):
        put("acceptance_per_position", v, pos)
    for row in verdict.get("kSweep") or []:
        if isinstance(row, dict) and isinstance(row.get("k"), int):
            put("speedup_by_k", row.get("speedup"), row["k"])
    out[("passed", 0)] = 1.0 if verdict.get("passed") is True else 0.0
    return out
