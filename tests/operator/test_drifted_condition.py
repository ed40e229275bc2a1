"""The Drifted condition a drift check without a ladder step leaves (serving_drift.drifted_without_step):
the current decision, never an older one. A "no rollback" verdict written before a probe stood
through it while the acceptance ladder went on to roll back (fresh-clone CI, 2026-12-07: the
demo read it as the decision)."""

from __future__ import annotations

import pytest

from specpair_operator.plan.serving_drift import PROBING, ROLLBACK_WOULD_NOT_HELP, drifted_without_step

# What drift.decide says as its reason where no rollback helps: from serving health's pressure
# (serving_health._pressure's `why`) and from sustained acceptance breaches (drift.rollback_helps).
SERVING = "no rollback: v1's latency was not measured"
ACCEPTANCE = ("no rollback: the previous release would not do better (same target and draft): code: previous "
              "gated 0.800 (floor 0.620) not above this release now (upper bound 0.300)")

# (what, no_rollback, from_acceptance, probing, off, said_now, standing) -> (status, reason) or None
CASES = [
    ("a serving-health verdict with no probe running is the decision",
     SERVING, False, False, True, False, "SpeculationOff", (True, ROLLBACK_WOULD_NOT_HELP)),
    ("a serving-health verdict before speculation went off is the decision",
     SERVING, False, False, False, True, "LatencyAboveBaseline", (True, ROLLBACK_WOULD_NOT_HELP)),
    ("acceptance's verdict from this probe's windows is the decision",
     ACCEPTANCE, True, True, True, True, "Probing", (True, ROLLBACK_WOULD_NOT_HELP)),
    ("a serving-health verdict while the probe runs is not: the acceptance ladder may still roll back",
     SERVING, False, True, True, False, ROLLBACK_WOULD_NOT_HELP, (True, PROBING)),
    ("a probe starting replaces the older no-rollback verdict",
     "", False, True, True, False, ROLLBACK_WOULD_NOT_HELP, (True, PROBING)),
    ("a probe running keeps saying so",
     "", False, True, True, False, PROBING, None),
    ("a breach this check said while probing stands",
     "", False, True, True, True, ROLLBACK_WOULD_NOT_HELP, None),
    ("serving health's breach said this check stands beside its own no-rollback while probing",
     SERVING, False, True, True, True, ROLLBACK_WOULD_NOT_HELP, None),
    ("a probe with SpeculationOff standing changes nothing",
     "", False, True, True, False, "SpeculationOff", None),
    ("the probe over without a verdict: speculation stays off",
     "", False, False, True, False, PROBING, (True, "SpeculationOff")),
    ("the probe over with a breach said this check: that breach stands",
     "", False, False, True, True, PROBING, None),
    ("nothing said, nothing running: the standing condition stays",
     "", False, False, False, False, "WithinBaseline", None),
    ("a pair never drifted has none to write",
     "", False, False, False, False, None, None),
]


@pytest.mark.parametrize("what, no_rollback, from_acceptance, probing, off, said_now, standing, expected", CASES,
                         ids=[c[0] for c in CASES])
def test_the_drifted_condition_says_the_current_decision(what, no_rollback, from_acceptance, probing, off,
                                                         said_now, standing, expected):
    got = drifted_without_step(no_rollback, from_acceptance, probing, off, said_now, standing)
    assert (got[:2] if got else None) == expected, what
    if got is not None and got[1] == ROLLBACK_WOULD_NOT_HELP:
        assert got[2] == no_rollback
    if got is not None and got[1] == PROBING and no_rollback:
        assert SERVING in got[2]   # serving health's verdict is still said, beside the probe
