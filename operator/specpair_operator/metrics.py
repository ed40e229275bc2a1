"""The operator's Prometheus metrics: what its automatic actions did, per pair.

Served on SPECPAIR_METRICS_PORT (the chart sets it; unset or 0: not served). Labels are the
pair's namespace and name (`pair`, as the engine's metrics name it, so one dashboard variable
selects both) plus a bounded `reason`/`result`; nothing a client controls becomes a label.
The names are listed in docs/install.md, which the dashboard test reads.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()
PAIR = ["namespace", "pair"]

PROMOTIONS = Counter("specpair_promotions", "Releases promoted to champion.", PAIR, registry=REGISTRY)
ROLLBACKS = Counter("specpair_rollbacks", "Champions rolled back to the previous release, by cause.",
                    PAIR + ["reason"], registry=REGISTRY)
SPECULATION_OFF = Counter("specpair_speculation_off", "Times drift turned speculation off for a champion.",
                          PAIR, registry=REGISTRY)
DRIFT_STEP = Gauge("specpair_drift_ladder_step",
                   "Drift ladder steps taken for the serving release (0 none, 1 speculation off, ...).",
                   PAIR, registry=REGISTRY)
SHADOW_VERDICTS = Counter("specpair_shadow_verdicts", "Candidates judged by shadow scoring on live traffic, by result.",
                          PAIR + ["result"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("specpair_reconcile_errors", "Reconcile passes that ended in an error, by kind.",
                           PAIR + ["reason"], registry=REGISTRY)
CANARY = Counter("specpair_canary_decisions", "Canary decisions: steps started, advanced, passed, aborted.",
                 PAIR + ["decision"], registry=REGISTRY)
GATE_DURATION = Histogram("specpair_gate_duration_seconds", "Gate Job run time, from its start to the verdict, by result.",
                          PAIR + ["result"], buckets=(30, 60, 120, 300, 600, 1200, 1800, 3600, 7200),
                          registry=REGISTRY)
RELEASE_SPEEDUP = Gauge("specpair_release_speedup",
                        "Gated speedup over target-only of the release a pair serves, per category ('all' overall).",
                        ["pair", "version", "category", "namespace"], registry=REGISTRY)

ROLLBACK_CAUSES = ("drift", "tokenizer", "rollout")
_served_port: int | None = None


def rollback_cause(reason: str) -> str:
    """The bounded label for a rollback's free-text reason."""
    text = reason.lower()
    if "tokenizer" in text:
        return "tokenizer"
    if "rollout" in text:
        return "rollout"
    return "drift"


def serve_from_env() -> int | None:
    """Start the metrics endpoint once per process (a test may start the operator many times)."""
    global _served_port
    port = int(os.environ.get("SPECPAIR_METRICS_PORT", "0") or 0)
    if port and _served_port is None:
        start_http_server(port, addr=os.environ.get("SPECPAIR_METRICS_ADDRESS", "0.0.0.0"), registry=REGISTRY)
        _served_port = port
    return _served_port
