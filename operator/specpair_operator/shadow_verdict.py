"""Shadow verdict: is a candidate drafter, scored in shadow on live traffic, good enough to serve?

One pure function, `judge_shadow`, turns what the engine pods report about a candidate drafter
scored beside the champion (GetStats.shadow; specpair/shadow.py has the math) into Promote,
Rejected or Undecided, with the numbers.

Evidence
    Per category, two `RequestMoments` over the same shadowed requests: the candidate's and the
    champion's. With the default measure, "alpha", d_i is request i's first draft positions
    scored and a_i the sum of their acceptance probabilities sum_x min(p(x), q(x)); with "chain"
    (greedy traffic only), d_i and a_i are the drafted and accepted tokens, the candidate's from
    its chain replayed against the committed tokens. The caller sums pods' deltas (as drift does:
    pod_deltas) since the candidate's shadow started.

Comparing (the request is the unit)
    rate = Σa / Σd for each, with drift's ratio-estimator standard error
    (drift.standard_error). The difference diff = candidate - champion gets
        se = sqrt(se_candidate² + se_champion²),
    which ignores that both are measured on the same requests: the two rates move together with
    the traffic, so the true standard error of the difference is smaller and the bound is
    conservative (a verdict waits longer, it is not wrong more often). With z the one-sided
    confidence (default 2.33, 99%), lower = diff - z·se and upper = diff + z·se:
        worse         upper < -margin        (the candidate is surely below the champion)
        better        lower > 0
        not worse     lower > -margin
        inconclusive  otherwise
    A category is "short" until both sides have `min_requests` requests and `min_positions`
    positions.

Deciding
    Only the gated categories are judged; others are traffic shift, reported and never judged.
    A gated category without any shadowed request says nothing either way and does not block.
    - Rejected: a gated category is worse; or a category where the release says the candidate
      should be better (`better_in`; without it, the gated categories pooled) is worse or still
      not shown better after `max_requests` requests.
    - Promote: every gated category with traffic is not worse (or better) and every `better_in`
      category (or the pool) is better.
    - Undecided otherwise: evidence short or inconclusive; the champion keeps serving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from specpair.stats import RequestMoments

from specpair_operator.drift import OVERALL, DriftPolicy, standard_error

PROMOTE, REJECTED, UNDECIDED = "Promote", "Rejected", "Undecided"
WORSE, BETTER, NOT_WORSE, INCONCLUSIVE, SHORT = "worse", "better", "not worse", "inconclusive", "short"
MEASURES = ("alpha", "chain")


@dataclass(frozen=True)
class ShadowPolicy:
    z: float = 2.33                  # one-sided confidence of each bound (99%)
    margin: float = 0.03             # absolute: how far below the champion still counts as not worse
    min_requests: int = 20           # per side and category, before a category is judged
    min_positions: int = 200
    max_requests: int = 2000         # shadowed requests after which "not shown better" is a rejection
    measure: str = "alpha"           # "alpha" (every request) or "chain" (greedy requests)

    def __post_init__(self):
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {MEASURES}, got {self.measure!r}")


@dataclass(frozen=True)
class ShadowEvidence:
    """One category: the candidate's and the champion's sums over the same shadowed requests."""
    candidate: RequestMoments
    champion: RequestMoments

    def __add__(self, other: "ShadowEvidence") -> "ShadowEvidence":
        return ShadowEvidence(self.candidate + other.candidate, self.champion + other.champion)

    @classmethod
    def from_message(cls, msg: Any, measure: str = "alpha") -> "ShadowEvidence":
        """From a specpair.engine.v1.ShadowCategoryStats (GetStats.shadow.categories[...])."""
        if measure == "chain":
            return cls(RequestMoments.from_message(msg.candidate_chain),
                       RequestMoments.from_message(msg.champion_chain))
        return cls(alpha_moments(msg.candidate_alpha), alpha_moments(msg.champion_alpha))


def alpha_moments(msg: Any) -> RequestMoments:
    """An AlphaSums message as RequestMoments: positions as drafted, Σ alpha as accepted."""
    return RequestMoments(int(msg.positions), float(msg.alpha), int(msg.requests), float(msg.positions_sq),
                          float(msg.alpha_sq), float(msg.positions_alpha))


@dataclass(frozen=True)
class Comparison:
    category: str
    status: str
    candidate: float
    champion: float
    lower: float          # bounds of candidate - champion
    upper: float
    requests: int         # the fewer of the two sides'

    def message(self) -> str:
        name = "gated traffic pooled" if self.category == OVERALL else f"category '{self.category}'"
        if self.status == SHORT:
            return f"{name}: {self.requests} shadowed requests, too few to judge"
        return (f"{name}: candidate {self.candidate:.3f} vs champion {self.champion:.3f} over "
                f"{self.requests} requests, difference in [{self.lower:+.3f}, {self.upper:+.3f}]: {self.status}")


@dataclass(frozen=True)
class ShadowVerdict:
    result: str                                   # Promote, Rejected, Undecided
    reason: str
    comparisons: tuple[Comparison, ...]
    shift: tuple[str, ...] = ()                   # categories seen that the gate never measured

    @property
    def message(self) -> str:
        lines = [f"{self.result}: {self.reason}"] + [c.message() for c in self.comparisons]
        if self.shift:
            lines.append("not judged (never gated): " + ", ".join(self.shift))
        return "; ".join(lines)


def _rate(m: RequestMoments) -> float:
    return m.accepted / m.drafted if m.drafted else 0.0


def compare(category: str, e: ShadowEvidence, policy: ShadowPolicy) -> Comparison:
    """One category's candidate - champion difference and what it says (module docstring)."""
    requests = min(e.candidate.requests or 0, e.champion.requests or 0)
    cand, champ = _rate(e.candidate), _rate(e.champion)
    if requests < policy.min_requests or min(e.candidate.drafted, e.champion.drafted) < policy.min_positions:
        return Comparison(category, SHORT, cand, champ, -1.0, 1.0, requests)
    drift = DriftPolicy(z=policy.z)
    se = math.hypot(standard_error(e.candidate, drift)[0], standard_error(e.champion, drift)[0])
    diff = cand - champ
    lower, upper = diff - policy.z * se, diff + policy.z * se
    status = WORSE if upper < -policy.margin else BETTER if lower > 0 else \
        NOT_WORSE if lower > -policy.margin else INCONCLUSIVE
    return Comparison(category, status, cand, champ, lower, upper, requests)


def judge_shadow(evidence: Mapping[str, ShadowEvidence], gated: Iterable[str], better_in: Iterable[str] = (),
                 policy: ShadowPolicy = ShadowPolicy()) -> ShadowVerdict:
    """The verdict on a candidate from its shadow evidence per category (module docstring).

    gated: the categories the champion's gate measured (OVERALL, "*", is ignored here);
    better_in: where the candidate's release says it should do better (empty: the gated
    categories pooled)."""
    gated = sorted({c for c in gated if c != OVERALL})
    shift = tuple(sorted(c for c in evidence if c not in gated))
    judged = [compare(c, evidence[c], policy) for c in gated if c in evidence
              and ((evidence[c].candidate.requests or 0) or (evidence[c].champion.requests or 0))]
    by_name = {c.category: c for c in judged}
    targets = sorted(set(better_in))
    if targets:
        wanted = [by_name.get(c) or compare(c, evidence.get(c, _empty()), policy) for c in targets]
    else:
        pooled = _empty()
        for c in gated:
            if c in evidence:
                pooled = pooled + evidence[c]
        wanted = [compare(OVERALL, pooled, policy)]
    shown = tuple(judged) + tuple(w for w in wanted if w.category not in by_name)

    worse = [c for c in judged + wanted if c.status == WORSE]
    if worse:
        return ShadowVerdict(REJECTED, "worse than the champion in " + _names(worse), shown, shift)
    stale = [w for w in wanted if w.status != BETTER and w.status != SHORT and w.requests >= policy.max_requests]
    if stale:
        return ShadowVerdict(REJECTED, f"not shown better after {policy.max_requests} requests in "
                             + _names(stale), shown, shift)
    waiting = {c.category: c for c in judged if c.status in (SHORT, INCONCLUSIVE)}
    waiting.update((w.category, w) for w in wanted if w.status != BETTER)
    if waiting:
        return ShadowVerdict(UNDECIDED, "evidence short or inconclusive in " + _names(list(waiting.values())),
                             shown, shift)
    return ShadowVerdict(PROMOTE, "not worse in any gated category and better in " + _names(wanted), shown, shift)


def _empty() -> ShadowEvidence:
    return ShadowEvidence(RequestMoments.zero(), RequestMoments.zero())


def _names(comparisons: list[Comparison]) -> str:
    names = ("gated traffic pooled" if c.category == OVERALL else c.category for c in comparisons)
    return ", ".join(dict.fromkeys(names))
