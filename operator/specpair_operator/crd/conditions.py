"""Status conditions in the kstatus convention (Ready, Reconciling, Stalled) plus our own.

kstatus readers (Flux, `kubectl wait --for=condition=Ready`) trust a condition only when its
observedGeneration equals metadata.generation, so every write stamps it.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
GATED = "Gated"
TOKENIZER_COMPATIBLE = "TokenizerCompatible"
DRIFTED = "Drifted"
SHADOW_SCORED = "ShadowScored"   # a candidate drafter scored in shadow: Unknown while scoring, True once judged


def finite(value: Any) -> Any:
    """`value` with each NaN and Infinity in it replaced by None (null), the very object when it
    holds none: JSON has no such numbers, and the API server refuses a whole patch over one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        safe = {k: finite(v) for k, v in value.items()}
        return value if all(safe[k] is v for k, v in value.items()) else safe
    if isinstance(value, list):
        items = [finite(v) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def parse_iso(text: str) -> datetime.datetime:
    """A Kubernetes timestamp (RFC 3339, 'Z' for UTC) as an aware datetime."""
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    for c in conditions or []:
        if c.get("type") == type_:
            return c
    return None


def set_condition(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: bool | str,
    reason: str,
    message: str,
    generation: int | None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """A new list with `type_` set; lastTransitionTime moves only when the status flips."""
    status_str = status if isinstance(status, str) else ("True" if status else "False")
    old = get_condition(conditions, type_)
    moved = old is None or old.get("status") != status_str
    new = {
        "type": type_,
        "status": status_str,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": (now or now_iso()) if moved else old.get("lastTransitionTime"),
    }
    out = [c for c in (conditions or []) if c.get("type") != type_]
    out.append(new)
    return sorted(out, key=lambda c: _ORDER.get(c["type"], 99))


_ORDER = {READY: 0, RECONCILING: 1, STALLED: 2, GATED: 3, TOKENIZER_COMPATIBLE: 4, DRIFTED: 5, SHADOW_SCORED: 6}


def summary(
    conditions: list[dict[str, Any]] | None,
    generation: int | None,
    *,
    ready: tuple[bool, str, str],
    reconciling: tuple[bool, str, str],
    stalled: tuple[bool, str, str],
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Set the three kstatus conditions at once from (status, reason, message) triples."""
    out = conditions
    for type_, (st, reason, msg) in ((READY, ready), (RECONCILING, reconciling), (STALLED, stalled)):
        out = set_condition(out, type_, st, reason, msg, generation, now)
    return out or []
