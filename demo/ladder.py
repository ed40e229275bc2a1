"""The drift chapter's pieces that need no cluster: what traffic a domain shift sends, what the
operator's rule predicts from the two gates, and how far the drift ladder got, read from the
pair's status alone (so they can be tested on recorded status objects)."""

from __future__ import annotations

import time
from typing import Any, Callable

from specpair_operator.policy import drift as drift_rule

from . import traffic

BREACH = "live acceptance below the gated baseline"
OFF = "speculation switched off (SpeculationOff)"
PROBE = "the operator probes with the drafter after a quiet window"
DECIDED = "the operator's rollback decision"
SERVING = "v{to} serving, identity verified"
# The last stage on the road without a rollback: the drifted release keeps serving, its
# speculation off (the chapter printed SERVING's "v1 serving" there, a label of the other road).
KEPT = "v{now} keeps serving target-only on the shifted traffic (no rollback)"


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c.get("type") == type_), {})


def actions(obj: dict[str, Any] | None) -> list[str]:
    return [h.get("action", "") for h in ((obj or {}).get("status") or {}).get("history") or []]


def domain_shift_prompts(category: str) -> list[tuple[str, str]]:
    """Requests labelled `category` (one the release was gated on, where the answer copies the
    document) whose content comes from another domain: free-form writing, which gives an n-gram
    drafter nothing to copy from. What a client sending its other work through the same route
    (or with the same label) looks like to the operator."""
    return [(category, prompt) for _, prompt in traffic.CREATIVE]


def gated_rate(verdict: dict[str, Any] | None, category: str) -> float | None:
    value = (((verdict or {}).get("categories") or {}).get(category) or {}).get("acceptanceRate")
    return float(value) if isinstance(value, (int, float)) else None


def rollback_prediction(policy_spec: dict[str, Any], current: dict[str, Any] | None, previous: dict[str, Any] | None,
                        category: str) -> tuple[bool, str]:
    """What the operator's rollback rule allows before any live number is in, from the gates.

    Both releases draft by n-gram on the same target, so the rule treats them as the same models:
    a rollback needs the previous release's gated floor on the category above what the serving
    release was gated at (otherwise the drop would be the traffic's and would hit it alike), and
    then live acceptance below that floor too. Returns (possible, a sentence with the numbers)."""
    policy = drift_rule.DriftPolicy.from_spec(policy_spec)
    now, before = gated_rate(current, category), gated_rate(previous, category)
    if now is None or before is None:
        return False, f"no rollback is possible: one of the two releases was not gated on '{category}'"
    floor = policy.floor(before)
    if floor <= now:
        return False, (f"no rollback is possible: the previous release gated '{category}' at {before:.3f} (floor "
                       f"{floor:.3f}), not above this release's {now:.3f}, and with the same target and drafter the "
                       "rule reads the drop as the traffic's; expect SpeculationOff and probes only")
    return True, (f"a rollback is possible: the previous release gated '{category}' at {before:.3f} (floor "
                  f"{floor:.3f}) > this release's {now:.3f}; the operator rolls back if live acceptance stays "
                  f"below {floor:.3f} too")


class Ladder:
    """How far the drift ladder got since the chapter started, from the pair's status: a breach
    counted, SpeculationOff, a probe, the rollback decision (RolledBack, or the Drifted condition's
    RollbackWouldNotHelp), and after a rollback the previous release serving again. `update` is
    fed each status read and returns the stages reached; `at` holds when (seconds from start)."""

    def __init__(self, before: int, to_version: str, clock: Callable[[], float] = time.monotonic,
                 rollback_expected: bool = False):
        self.before = before          # history entries written before the chapter
        self.to_version = to_version
        self.stages = [BREACH, OFF, PROBE, DECIDED, SERVING.format(to=to_version)]
        self.clock = clock
        self.t0 = clock()
        self.at: dict[str, float] = {}
        self.rolled_back: bool | None = None     # None until the operator decided
        self.decision = ""
        # Where the chapter expects a rollback, RollbackWouldNotHelp is final only once the
        # probe is over: the condition can still hold an older verdict while the probe runs.
        self.rollback_expected = rollback_expected

    def new_actions(self, obj: dict[str, Any] | None) -> list[str]:
        return actions(obj)[self.before:]

    def update(self, obj: dict[str, Any] | None) -> int:
        st = (obj or {}).get("status") or {}
        new = self.new_actions(obj)
        drifted = condition(obj, "Drifted")
        reached = {BREACH} if drifted.get("reason") in ("AcceptanceBelowBaseline", "SpeculationOff") else set()
        if "SpeculationOff" in new:
            reached |= {BREACH, OFF}
            # A probe is short-lived; a rollback after SpeculationOff rests on fresh drafts, which
            # only a probe gives (the engine drafts nothing while off).
            if (st.get("drift") or {}).get("probing") or "RolledBack" in new:
                reached.add(PROBE)
        if "RolledBack" in new:
            reached |= {BREACH, OFF, DECIDED}
            self.rolled_back = True
            self.decision = next((h.get("reason", "") for h in reversed(st.get("history") or [])
                                  if h.get("action") == "RolledBack"), "")
            if str(st.get("servingVersion")) == self.to_version and st.get("phase") in ("Serving", "Degraded"):
                # After a rollback the pair stays Degraded ("v2 was rolled back ...; v1 keeps
                # serving"): the phase the operator sets once v1's pods passed the identity check.
                reached.add(self.stages[-1])
        elif OFF in reached and (PROBE in reached or PROBE in self.at) and \
                drifted.get("reason") == "RollbackWouldNotHelp" and \
                not (self.rollback_expected and (st.get("drift") or {}).get("probing")):
            # In place (the list the chapter's wait prints from): this road's last stage.
            self.stages[-1] = KEPT.format(now=st.get("servingVersion") or "?")
            reached |= {DECIDED, self.stages[-1]}
            self.rolled_back = False
            self.decision = drifted.get("message", "")
        now = round(self.clock() - self.t0, 1)
        for stage in self.stages:
            if stage in reached:
                self.at.setdefault(stage, now)
        n = 0
        while n < len(self.stages) and self.stages[n] in self.at:
            n += 1
        return n

    def done(self) -> bool:
        return all(s in self.at for s in self.stages)

    def rows(self) -> list[tuple[float, str]]:
        """(seconds from the chapter's start, stage) in order, for the report; the last stage
        only where it happened as named (no v1 serving when there was no rollback)."""
        out = []
        for stage in self.stages:
            if stage not in self.at or (stage == self.stages[-1] and not self.rolled_back):
                continue
            label = stage
            if stage == DECIDED:
                label = f"rolled back to v{self.to_version}" if self.rolled_back else \
                    "no rollback (Drifted: RollbackWouldNotHelp)"
            out.append((self.at[stage], label))
        return out
