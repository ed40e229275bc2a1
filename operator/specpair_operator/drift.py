"""Drift policy: is live acceptance sustainedly below what the release was gated at?

Engines report cumulative counters (drafted and accepted tokens per category); the operator
keeps a few timestamped samples and takes differences, so a window is judged on the tokens
drafted inside it. Acceptance varies between identical runs (batch composition, kernels), so a
category breaches only when it falls below baseline - tolerance - noiseAllowance, and only with
enough drafted tokens to mean anything. One bad window is noise; `consecutive` in a row take
the next step of the ladder (speculation off, then roll back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SPECULATION_OFF = "SpeculationOff"
ROLLBACK = "Rollback"
OVERALL = "*"


@dataclass(frozen=True)
class DriftPolicy:
    tolerance: float = 0.1
    noise_allowance: float = 0.05
    min_drafted: int = 200
    consecutive: int = 3
    window_seconds: float = 300.0
    ladder: tuple[str, ...] = (SPECULATION_OFF, ROLLBACK)

    @classmethod
    def from_spec(cls, drift: dict[str, Any] | None) -> "DriftPolicy":
        d = drift or {}
        return cls(
            tolerance=float(d.get("tolerance", cls.tolerance)),
            noise_allowance=float(d.get("noiseAllowance", cls.noise_allowance)),
            min_drafted=int(d.get("minDraftedTokens", cls.min_drafted)),
            consecutive=int(d.get("consecutiveBreaches", cls.consecutive)),
            window_seconds=float(d.get("windowSeconds", cls.window_seconds)),
            ladder=tuple(d.get("ladder", cls.ladder)),
        )


@dataclass(frozen=True)
class Breach:
    category: str
    live: float
    baseline: float
    drafted: int

    def message(self, policy: DriftPolicy) -> str:
        floor = self.baseline - policy.tolerance - policy.noise_allowance
        name = "overall" if self.category == OVERALL else f"category '{self.category}'"
        return (f"{name} acceptance {self.live:.3f} over {self.drafted} drafted tokens < "
                f"{floor:.3f} (gated {self.baseline:.3f} - tolerance {policy.tolerance} - noise {policy.noise_allowance})")


@dataclass(frozen=True)
class DriftState:
    breaches_in_row: int = 0
    steps_taken: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"breachesInRow": self.breaches_in_row, "stepsTaken": self.steps_taken}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "DriftState":
        d = d or {}
        return cls(int(d.get("breachesInRow", 0)), int(d.get("stepsTaken", 0)))


def state_for_release(stored: dict[str, Any] | None, champion: str) -> DriftState:
    """The ladder belongs to one release: a state recorded for another version starts fresh.

    (The pass that promotes a new champion can return before the drift check runs, so the old
    release's steps would otherwise be charged to the new one.)
    """
    stored = stored or {}
    if str(stored.get("version", "")) != str(champion):
        return DriftState()
    return DriftState.from_dict(stored)


Counters = dict[str, tuple[int, int]]  # category -> (drafted, accepted), cumulative


def windowed_counts(samples: list[dict[str, Any]], window_seconds: float) -> Counters:
    """Tokens drafted/accepted per category between the newest sample and the one a window ago.

    samples: [{"t": seconds, "cats": {cat: [drafted, accepted]}}], oldest first. A counter that
    went backwards means an engine restarted; only samples after the restart count.
    """
    if len(samples) < 2:
        return {}
    newest = samples[-1]
    start = 0
    for i in range(len(samples) - 1, 0, -1):
        if any(samples[i]["cats"].get(c, [0, 0])[0] < v[0] for c, v in samples[i - 1]["cats"].items()):
            start = i
            break
    usable = samples[start:]
    if len(usable) < 2:
        return {}
    base = usable[0]
    for s in usable[:-1]:
        if newest["t"] - s["t"] >= window_seconds:
            base = s
    out: Counters = {}
    for cat, (drafted, accepted) in newest["cats"].items():
        d0, a0 = base["cats"].get(cat, [0, 0])
        if drafted - d0 > 0:
            out[cat] = (drafted - d0, accepted - a0)
    return out


def prune_samples(samples: list[dict[str, Any]], now: float, window_seconds: float, keep: int = 64) -> list[dict[str, Any]]:
    """Keep what the next window needs: everything newer than 2 windows, at most `keep`."""
    kept = [s for s in samples if now - s["t"] <= 2 * window_seconds]
    return kept[-keep:]


def judge_window(baseline: dict[str, float], window: Counters, policy: DriftPolicy) -> tuple[list[Breach], list[str]]:
    """(breaches, categories judged). Categories without a gated baseline or with too few
    drafted tokens are not judged; the overall rate is judged against the overall baseline."""
    judged: list[str] = []
    breaches: list[Breach] = []
    allowance = policy.tolerance + policy.noise_allowance
    rows = dict(window)
    if window:
        rows[OVERALL] = (sum(d for d, _ in window.values()), sum(a for _, a in window.values()))
    expected = dict(baseline)
    if OVERALL in baseline and window:
        expected[OVERALL] = mix_baseline(baseline, window)
    for cat, (drafted, accepted) in sorted(rows.items()):
        if cat not in expected or drafted < policy.min_drafted:
            continue
        judged.append(cat)
        live = accepted / drafted
        if live < expected[cat] - allowance:
            breaches.append(Breach(cat, live, expected[cat], drafted))
    return breaches, judged


def mix_baseline(baseline: dict[str, float], window: Counters) -> float:
    """What the gate predicts for this window's traffic mix: each category's gated acceptance
    weighted by its share of drafted tokens (categories the gate did not see: the overall value).

    Acceptance differs a lot between categories (extraction ~0.6, creative ~0.2 for n-gram
    lookup), so comparing a window that happens to hold more of a hard category with the
    golden set's overall average would call a change of traffic mix drift.
    """
    total = sum(d for d, _ in window.values())
    if not total:
        return baseline[OVERALL]
    return sum(d * baseline.get(cat, baseline[OVERALL]) for cat, (d, _) in window.items()) / total


def next_step(state: DriftState, breaches: list[Breach], judged: list[str], policy: DriftPolicy) -> tuple[DriftState, str | None]:
    """Advance the breach streak; return the ladder action to take now, if any.

    Once speculation is off nothing is drafted, so nothing can be judged: with a later ladder
    step configured, an unjudged window then counts as the drift persisting (no evidence it
    went away). With no traffic before any step, nothing is counted either way.
    """
    if breaches or (not judged and state.steps_taken > 0):
        in_row = state.breaches_in_row + 1
    elif not judged:
        return state, None
    else:
        return DriftState(0, state.steps_taken), None
    if in_row >= policy.consecutive and state.steps_taken < len(policy.ladder):
        return DriftState(0, state.steps_taken + 1), policy.ladder[state.steps_taken]
    return DriftState(in_row, state.steps_taken), None


def fingerprint_mismatch(expected: dict[str, str | None], reported: dict[str, str | None]) -> list[str]:
    """Differences between the release's tokenizer fingerprints and what a pod reports.

    A side the release does not know (n-gram drafter, not yet gated) is not compared.
    """
    out = []
    for side in ("target", "draft"):
        want, got = expected.get(side), reported.get(side)
        if want and got and want != got:
            out.append(f"{side} tokenizer fingerprint {got[:12]} != released {want[:12]}")
    return out
