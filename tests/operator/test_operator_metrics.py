"""The operator's metrics (metrics.py) as the status ledger counts them: every action it records
that is a decision (promotion, rollback by cause, speculation off and on, shadow start, refusal
and verdict, canary steps) moves its counter by one, with its bounded label, read back from the
real Prometheus registry the operator serves. The rollback causes are read from the reasons the
serving plan writes in test_operator_serving_plan."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
import yaml

from specpair_operator.act import metrics
from specpair_operator.act.ledger import StatusLedger


ROOT = Path(__file__).resolve().parents[2]


def value(name: str, pair: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"namespace": "ns", "pair": pair, **labels}) or 0.0


@pytest.mark.parametrize("action, reason, sample, labels", [
    ("Promoted", "v2 passed the gate", "specpair_promotions_total", {}),
    ("RolledBack", "sustained drift: category 'code' acceptance 0.300 (upper bound 0.350) over 40 requests / "
     "400 drafted tokens < floor 0.600 (gated 0.800); v1 gated better", "specpair_rollbacks_total",
     {"reason": "drift"}),
    ("RolledBack", "sustained drift: category 'code' TTFT p95 800.0 ms (baseline p95 200.0 ms, threshold 300.0 ms): "
     "60.0% of 40 requests above the threshold (lower bound 45.0%) > 10%; v1 was faster",
     "specpair_rollbacks_total", {"reason": "latency"}),
    ("RolledBack", "drift persisted after speculation off: overall error rate 0.300 (lower bound 0.200) over 60 "
     "requests > max 0.050; v1 failed 0.000 of its requests", "specpair_rollbacks_total", {"reason": "latency"}),
    ("RolledBack", "tokenizer mismatch on pod p0: draft tokenizer fingerprint other != released d",
     "specpair_rollbacks_total", {"reason": "tokenizer"}),
    ("RolledBack", "rollout of v2 failed: crash looping", "specpair_rollbacks_total", {"reason": "rollout"}),
    ("SpeculationOff", "sustained drift: ...", "specpair_speculation_off_total", {}),
    ("SpeculationOn", "acceptance back within the gated baseline: ...", "specpair_speculation_on_total", {}),
    ("ShadowStarted", "v2 passed its gate and is scored in shadow", "specpair_shadow_starts_total", {}),
    ("ShadowRefused", "v2 cannot be scored in shadow: another target", "specpair_shadow_refusals_total", {}),
    ("ShadowPromoted", "v2: better", "specpair_shadow_verdicts_total", {"result": "promoted"}),
    ("ShadowRejected", "v2: worse", "specpair_shadow_verdicts_total", {"result": "rejected"}),
    ("CanaryStarted", "v2 serves beside v1", "specpair_canary_decisions_total", {"decision": "started"}),
    ("CanaryAdvanced", "step 2", "specpair_canary_decisions_total", {"decision": "advanced"}),
    ("CanaryPassed", "all steps healthy", "specpair_canary_decisions_total", {"decision": "passed"}),
    ("CanaryAborted", "TTFT p95 800 ms", "specpair_canary_decisions_total", {"decision": "aborted"}),
])
def test_each_recorded_decision_counts_once_in_its_metric(action, reason, sample, labels):
    pair = f"chat-{uuid.uuid4().hex[:6]}"   # the registry is the process's: a pair of its own
    ledger = StatusLedger({}, 1, "ns", pair, logging.getLogger("test"))
    ledger.record(action, reason, "1", "2", key="2")
    assert value(sample, pair, **labels) == 1.0
    assert ledger.events[-1][1] == action        # and an Event
    # No other cause or result of the same counter moved.
    family = sample.removesuffix("_total")
    moved = [(s.name, s.labels) for m in metrics.REGISTRY.collect() if m.name == family
             for s in m.samples if s.labels.get("pair") == pair and s.name == sample and s.value]
    assert moved == [(sample, {"namespace": "ns", "pair": pair, **labels})]


def test_an_action_that_is_no_decision_counts_nowhere():
    pair = f"chat-{uuid.uuid4().hex[:6]}"
    StatusLedger({}, 1, "ns", pair, logging.getLogger("test")).record("GateStarted", "gate Job started", None, "1")
    counted = [s for m in metrics.REGISTRY.collect() for s in m.samples
               if s.labels.get("pair") == pair and s.name.endswith("_total") and s.value]
    assert counted == []


def test_the_docs_and_the_rollback_alert_name_every_rollback_cause():
    row = next(line for line in (ROOT / "docs" / "install.md").read_text().splitlines()
               if line.startswith("| `specpair_rollbacks_total`"))
    alert = next(r for g in yaml.safe_load((ROOT / "charts" / "specpair" / "rules" / "specpair-alerts.yaml").read_text())
                 ["groups"] for r in g["rules"] if r.get("alert") == "SpecpairRolledBack")
    for cause in metrics.ROLLBACK_CAUSES:
        assert f"`{cause}`" in row, cause
        assert f"{cause}: " in alert["annotations"]["description"], cause
