"""The operator's Prometheus metrics: what its automatic actions did, per pair.

Served on SPECPAIR_METRICS_PORT (the chart sets it; unset or 0: not served). Labels are the
pair's namespace and name (`pair`, as the engine's metrics name it, so one dashboard variable
selects both) plus a bounded `reason`/`result`; nothing a client controls becomes a label.
The names are listed in docs/install.md, which the dashboard test reads.
"""

from __future__ import annotations

import os
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry()
PAIR = ["namespace", "pair"]

PROMOTIONS = Counter("specpair_promotions", "Releases promoted to champion.", PAIR, registry=REGISTRY)
ROLLBACKS = Counter("specpair_rollbacks", "Champions rolled back to the previous release, by cause.",
                    PAIR + ["reason"], registry=REGISTRY)
SPECULATION_OFF = Counter("specpair_speculation_off", "Times drift turned speculation off for a champion.",
                          PAIR, registry=REGISTRY)
SPECULATION_ON = Counter("specpair_speculation_on",
                         "Times speculation was turned back on for a champion whose acceptance recovered.",
                         PAIR, registry=REGISTRY)
DRIFT_STEP = Gauge("specpair_drift_ladder_step",
                   "Drift ladder steps taken for the serving release (0 none, 1 speculation off, ...).",
                   PAIR, registry=REGISTRY)
SHADOW_STARTS = Counter("specpair_shadow_starts", "Candidates whose shadow scoring on the champion's pods began.",
                        PAIR, registry=REGISTRY)
SHADOW_REFUSALS = Counter("specpair_shadow_refusals",
                          "Candidates the spec asked to score in shadow that cannot be (another target).",
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
CANARY_WEIGHT = Gauge("specpair_canary_weight_percent",
                      "The candidate's intended percent of the traffic in a canary step: the route's weight, "
                      "or the replica ratio without a Gateway.", PAIR + ["step"], registry=REGISTRY)
CANARY_OBSERVED = Gauge("specpair_canary_observed_share",
                        "The candidate's share of the requests both sides finished in a canary step, from the pods' "
                        "counters (0-1).", PAIR + ["step"], registry=REGISTRY)
RELEASE_SPEEDUP = Gauge("specpair_release_speedup",
                        "Gated speedup over target-only of the release a pair serves, per category ('all' overall).",
                        ["pair", "version", "category", "namespace"], registry=REGISTRY)

# Every metric with a series per pair, and its label names in order: a deleted pair's series
# go with it (forget_pair), so dashboards and alerts stop showing a pair that is not there.
PER_PAIR: tuple[tuple[Counter | Gauge | Histogram, tuple[str, ...]], ...] = (
    (PROMOTIONS, tuple(PAIR)), (ROLLBACKS, (*PAIR, "reason")), (SPECULATION_OFF, tuple(PAIR)),
    (SPECULATION_ON, tuple(PAIR)), (DRIFT_STEP, tuple(PAIR)), (SHADOW_STARTS, tuple(PAIR)),
    (SHADOW_REFUSALS, tuple(PAIR)), (SHADOW_VERDICTS, (*PAIR, "result")), (RECONCILE_ERRORS, (*PAIR, "reason")),
    (CANARY, (*PAIR, "decision")), (GATE_DURATION, (*PAIR, "result")),
    (RELEASE_SPEEDUP, ("pair", "version", "category", "namespace")),
    (CANARY_WEIGHT, (*PAIR, "step")), (CANARY_OBSERVED, (*PAIR, "step")),
)

ROLLBACK_CAUSES = ("drift", "latency", "tokenizer", "rollout")
# A drift rollback's reason is the ladder's words, then the judgements that breached: acceptance
# (drift.Judgement.message) or serving health (serving_health.Judgement.message), never both.
_SERVING_BREACH = re.compile(r"[^:]*: (?:overall|category '.*?') (?:TTFT|TPOT|error rate) ")
_served_port: int | None = None


def rollback_cause(reason: str) -> str:
    """The bounded label for a rollback's free-text reason (serving_plan writes it): `tokenizer`
    (a pod's fingerprint differs), `rollout` (its pods never became available), `latency` (serving
    health: TTFT, TPOT or the error rate), otherwise `drift` (live acceptance)."""
    if reason.startswith("tokenizer"):
        return "tokenizer"
    if reason.startswith("rollout of "):
        return "rollout"
    if _SERVING_BREACH.match(reason):
        return "latency"
    return "drift"


# What each recorded action counts (ledger.record), with its bounded label if the counter has
# one: every decision the operator records is an Event and a metric. RolledBack counts by cause.
_COUNTED: dict[str, tuple[Counter, str | None]] = {
    "Promoted": (PROMOTIONS, None),
    "SpeculationOff": (SPECULATION_OFF, None),
    "SpeculationOn": (SPECULATION_ON, None),
    "ShadowStarted": (SHADOW_STARTS, None),
    "ShadowRefused": (SHADOW_REFUSALS, None),
    "ShadowPromoted": (SHADOW_VERDICTS, "promoted"),
    "ShadowRejected": (SHADOW_VERDICTS, "rejected"),
    **{f"Canary{d.title()}": (CANARY, d) for d in ("started", "advanced", "passed", "aborted")},
}


def count(namespace: str, pair: str, action: str, reason: str) -> None:
    """Count a pair's recorded action in its metric (an action without one counts nowhere)."""
    if action == "RolledBack":
        ROLLBACKS.labels(namespace, pair, rollback_cause(reason)).inc()
        return
    counter, label = _COUNTED.get(action, (None, None))
    if counter is not None:
        counter.labels(namespace, pair, *(() if label is None else (label,))).inc()


def canary_share(namespace: str, pair: str, entry: dict | None) -> None:
    """A status.canary entry's intended and observed share, by its step (for the dashboard's
    weight-against-observed panel); nothing for an entry without them."""
    if not entry or not entry.get("step"):
        return
    step = str(entry["step"])
    if isinstance(entry.get("trafficShare"), (int, float)):
        CANARY_WEIGHT.labels(namespace, pair, step).set(100 * float(entry["trafficShare"]))
    if isinstance(entry.get("observedShare"), (int, float)):
        CANARY_OBSERVED.labels(namespace, pair, step).set(float(entry["observedShare"]))


def serve_from_env() -> int | None:
    """Start the metrics endpoint once per process (a test may start the operator many times)."""
    global _served_port
    port = int(os.environ.get("SPECPAIR_METRICS_PORT", "0") or 0)
    if port and _served_port is None:
        start_http_server(port, addr=os.environ.get("SPECPAIR_METRICS_ADDRESS", "0.0.0.0"), registry=REGISTRY)
        _served_port = port
    return _served_port


def forget_pair(namespace: str, pair: str) -> int:
    """Remove every series of a deleted pair from the registry; how many were removed."""
    removed = 0
    for metric, labels in PER_PAIR:
        mine = {tuple(sample.labels[name] for name in labels)
                for family in metric.collect() for sample in family.samples
                if sample.labels.get("namespace") == namespace and sample.labels.get("pair") == pair}
        for values in mine:
            try:
                metric.remove(*values)
                removed += 1
            except KeyError:   # removed meanwhile
                pass
    return removed
