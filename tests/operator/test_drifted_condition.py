"""The Drifted condition a drift check without a ladder step leaves (serving_drift.drifted_without_step):
the current decision, never an older one, nor another release's (new_release_status). A "no rollback" verdict written before a probe stood
through it while the acceptance ladder went on to roll back (fresh-clone CI, 2026-12-07: the
demo read it as the decision)."""

from __future__ import annotations

import copy
import logging

import pytest
from merge_patch import merge_patch

from specpair_operator.act.ledger import StatusLedger
from specpair_operator.plan.release_steps import Condition, SetStatus
from specpair_operator.plan.serving_drift import (NOT_JUDGED, PROBING, ROLLBACK_WOULD_NOT_HELP, drifted_without_step,
                                                  new_release_status)

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


# -- a new champion (serving_drift.new_release_status) ------------------------------------------

V2_DRIFT = {"version": "2", "stepsTaken": 1, "streaks": {"extraction": 38}, "breachesInRow": 38, "fineInRow": 0,
            "since": 5.0, "probing": False}
BASELINE = {"ttftP95": {"extraction": 0.02}, "tpotP95": {"extraction": 0.005}, "errorRate": 0.0, "load": 1.5,
            "requests": 120}   # serving_health.Baseline.as_dict
V2_HEALTH = {"version": "2", "streaks": {"tpot/extraction": 2}, "baselines": {"1": BASELINE, "2": BASELINE},
             "live": {"tpot/extraction": {"verdict": "breach", "requests": 40, "share": 1.0}}}
NO_ROLLBACK = {"type": "Drifted", "status": "True", "reason": ROLLBACK_WOULD_NOT_HELP, "observedGeneration": 3,
               "message": "no rollback: no previous release", "lastTransitionTime": "2026-12-07T20:00:00Z"}

# (what, status as read, champion) -> (status fields set, Drifted (status, reason) or None); None: nothing planned
NEW_RELEASE = [
    ("v3 promoted over the drifted v2: not judged yet, v3's fields fresh",
     {"drift": V2_DRIFT, "servingHealth": V2_HEALTH, "conditions": [NO_ROLLBACK]}, "3",
     ({"acceptance", "drift", "live", "servingHealth", "speculationEnabled"}, ("Unknown", NOT_JUDGED))),
    ("v2's fields without a Drifted condition: fresh fields, no condition",
     {"drift": V2_DRIFT}, "3", ({"acceptance", "drift", "live", "speculationEnabled"}, None)),
    ("the drift fields are the champion's own: nothing",
     {"drift": V2_DRIFT, "conditions": [NO_ROLLBACK]}, "2", None),
    ("a pair never checked: nothing stale",
     {}, "1", None),
    ("status.drift naming no release (as a rollback wrote it before): RolledBack stands",
     {"drift": {"stepsTaken": 0}, "conditions": [{**NO_ROLLBACK, "reason": "RolledBack"}]}, "1", None),
]


@pytest.mark.parametrize("what, status, champion, expected", NEW_RELEASE, ids=[c[0] for c in NEW_RELEASE])
def test_a_new_champion_starts_with_its_own_drift_fields(what, status, champion, expected):
    steps = new_release_status(status, champion)
    if expected is None:
        assert steps == (), what
        return
    fields = {k: v for s in steps if isinstance(s, SetStatus) for k, v in s.fields.items()}
    drifted = [s for s in steps if isinstance(s, Condition)]
    assert (set(fields), (drifted[0].status, drifted[0].reason) if drifted else None) == expected, what
    assert fields["drift"] == {"version": champion, "stepsTaken": 0, "streaks": {}, "breachesInRow": 0,
                               "fineInRow": 0, "since": 0.0, "probing": False}
    assert fields["live"] == {"acceptance": {}, "draftedTokens": {}, "trafficShift": {}}
    if "servingHealth" in fields:   # v2's streaks and verdicts go, every release's baseline stays
        assert fields["servingHealth"] == {"version": champion, "streaks": {}, "baselines": V2_HEALTH["baselines"],
                                           "live": {}}
    # Written through the status ledger (the real pass's), as a whole field and with this generation.
    ledger = StatusLedger(copy.deepcopy(status), 4, "ns", "chat", logging.getLogger("test"))
    for step in steps:
        if isinstance(step, SetStatus):
            ledger.set(**step.fields)
        else:
            ledger.cond(step.type, step.status, step.reason, step.message)
    written = merge_patch(copy.deepcopy(status), ledger.status_patch())
    assert written["drift"] == fields["drift"] and written["live"] == fields["live"]
    if drifted:
        condition = written["conditions"][0]
        assert condition["observedGeneration"] == 4 and condition["lastTransitionTime"] != NO_ROLLBACK["lastTransitionTime"]
        assert condition["message"] == f"v{champion} serves; no drift window of it judged yet (v2's last: True " \
                                       f"{ROLLBACK_WOULD_NOT_HELP})"
