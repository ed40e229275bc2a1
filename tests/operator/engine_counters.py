"""An engine pod's cumulative serving counters as GetStats reports them (the probe's dict form),
for the operator's latency tables (test_canary, test_serving_health, test_canary_plan): TTFT and
TPOT histograms with the engine's own bucket bounds, requests by status, and acceptance sums.
"""

from __future__ import annotations

import bisect
import random
from typing import Any

from specpair.server.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS


def histogram(bounds: tuple[float, ...]) -> dict[str, Any]:
    """An empty cumulative histogram over `bounds` (each count: the observations <= its bound)."""
    return {"upperBounds": list(bounds), "counts": [0] * len(bounds), "count": 0, "sum": 0.0}


def serving() -> dict[str, Any]:
    """A category's serving counters, empty: TTFT, TPOT and the requests by status."""
    return {"ttft": histogram(LATENCY_BUCKETS), "tpot": histogram(TOKEN_BUCKETS), "requests": {}}


def acceptance() -> dict[str, Any]:
    """A category's acceptance sums, empty."""
    return {"drafted": 0, "accepted": 0, "requests": 0, "draftedSq": 0.0, "acceptedSq": 0.0, "draftedAccepted": 0.0}


def observe(h: dict[str, Any], value: float) -> None:
    for i in range(bisect.bisect_left(h["upperBounds"], value), len(h["counts"])):
        h["counts"][i] += 1
    h["count"] += 1
    h["sum"] += value


def finished(counters: dict[str, Any], status: str) -> None:
    counters["requests"][status] = counters["requests"].get(status, 0) + 1


def latencies(counters: dict[str, Any], rng: random.Random, ttft: float, tpot: float, sigma: float) -> None:
    """One answered request's TTFT and TPOT, log-normal around the given medians."""
    for key, median in (("ttft", ttft), ("tpot", tpot)):
        observe(counters[key], median * rng.lognormvariate(0.0, sigma))


def drafted(sums: dict[str, Any], rng: random.Random, rate: float, tokens: int) -> None:
    """One request's `tokens` drafted tokens, each accepted with probability `rate`."""
    accepted = sum(rng.random() < rate for _ in range(tokens))
    sums["drafted"] += tokens
    sums["accepted"] += accepted
    sums["requests"] += 1
    sums["draftedSq"] += tokens * tokens
    sums["acceptedSq"] += accepted * accepted
    sums["draftedAccepted"] += tokens * accepted
