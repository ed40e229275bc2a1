"""The shadow verdict (specpair_operator.policy.shadow_verdict.judge_shadow) as a table: synthetic
per-request evidence for a candidate drafter and the champion on the same requests, and what the
operator must conclude. Pure: no servers."""

from __future__ import annotations

import random

import pytest
from specpair.stats import PairedSums, RequestMoments

from specpair_operator.policy.drift import DriftPolicy
from specpair_operator.policy.shadow_verdict import (PROMOTE, REJECTED, UNDECIDED, ShadowEvidence, ShadowPolicy,
                                              alpha_moments, difference_se, judge_shadow)

GATED = ["*", "code", "chat"]


def per_request(candidate: float, champion: float, requests: int, seed: int = 1) -> list:
    """Per-request sums for both drafters on the same requests, as a shadowed category adds them
    up: first positions per request log-normal (median ~40), the champion's acceptance per
    request around `champion` (requests differ in difficulty), the candidate's the same request's
    shifted by the difference of the means, with a little noise of its own."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        d = max(1, int(rng.lognormvariate(3.7, 0.8)))
        e = max(1, int(d * rng.uniform(0.7, 1.3)))      # the champion's rounds fall elsewhere
        hard = rng.betavariate(champion * 8, (1 - champion) * 8)
        mine = min(1.0, max(0.0, hard + candidate - champion + rng.gauss(0, 0.05)))
        out.append(((d, mine * d), (e, hard * e)))
    return out


def evidence(candidate: float, champion: float, requests: int, seed: int = 1, paired: bool = True
             ) -> ShadowEvidence:
    cand, champ, cross = RequestMoments.zero(), RequestMoments.zero(), PairedSums()
    for mine, theirs in per_request(candidate, champion, requests, seed):
        cand += RequestMoments.of_request(*mine)
        champ += RequestMoments.of_request(*theirs)
        cross += PairedSums.of_request(mine, theirs)
    return ShadowEvidence(cand, champ, cross if paired else None)


CASES = [
    # (name, {category: (candidate, champion, requests)}, better_in, result, words in the reason)
    ("better everywhere", {"code": (0.75, 0.55, 200), "chat": (0.6, 0.45, 200)}, (), PROMOTE, ["better in"]),
    ("better where promised, level elsewhere", {"code": (0.75, 0.55, 300), "chat": (0.5, 0.5, 300)},
     ("code",), PROMOTE, ["code"]),
    ("better in code, worse in chat", {"code": (0.8, 0.5, 200), "chat": (0.3, 0.5, 200)}, ("code",),
     REJECTED, ["worse", "chat"]),
    ("worse where promised better", {"code": (0.4, 0.6, 200), "chat": (0.5, 0.5, 200)}, ("code",),
     REJECTED, ["worse", "code"]),
    ("few requests", {"code": (0.8, 0.5, 8), "chat": (0.6, 0.5, 8)}, (), UNDECIDED, ["short"]),
    ("level, still gathering", {"code": (0.55, 0.55, 300), "chat": (0.5, 0.5, 300)}, ("code",), UNDECIDED,
     ["code"]),
    ("level after max_requests", {"code": (0.55, 0.55, 2500), "chat": (0.5, 0.5, 2500)}, ("code",), REJECTED,
     ["not shown better after 2000", "code"]),
    ("worse only on traffic never gated", {"code": (0.75, 0.5, 200), "chat": (0.6, 0.5, 200),
                                            "poetry": (0.1, 0.6, 200)}, (), PROMOTE, []),
    ("a gated category without traffic", {"code": (0.75, 0.5, 200)}, ("code",), PROMOTE, []),
    ("promised better where nothing came", {"chat": (0.6, 0.5, 200)}, ("code",), UNDECIDED, ["code"]),
]


@pytest.mark.parametrize("name,cats,better_in,result,words", CASES, ids=[c[0] for c in CASES])
def test_verdict_table(name, cats, better_in, result, words):
    ev = {cat: evidence(c, k, n, seed=i) for i, (cat, (c, k, n)) in enumerate(sorted(cats.items()))}
    verdict = judge_shadow(ev, GATED, better_in)
    assert verdict.result == result, verdict.message
    for word in words:
        assert word in verdict.reason, verdict.message


def test_traffic_shift_is_reported_not_judged():
    ev = {"code": evidence(0.75, 0.5, 200), "poetry": evidence(0.1, 0.6, 200)}
    verdict = judge_shadow(ev, GATED)
    assert verdict.shift == ("poetry",)
    assert "poetry" not in {c.category for c in verdict.comparisons}
    assert "never gated): poetry" in verdict.message


def test_numbers_in_the_message_and_bounds_around_the_difference():
    verdict = judge_shadow({"code": evidence(0.3, 0.6, 200), "chat": evidence(0.5, 0.5, 200)}, GATED)
    assert verdict.result == REJECTED
    code = next(c for c in verdict.comparisons if c.category == "code")
    assert code.lower < code.candidate - code.champion < code.upper < 0
    assert f"candidate {code.candidate:.3f} vs champion {code.champion:.3f}" in verdict.message


def test_one_long_request_is_one_request():
    """Many positions from few requests are no evidence: the request is the unit."""
    long_ones = ShadowEvidence(RequestMoments.of_request(5000, 4000.0) + RequestMoments.of_request(5000, 4000.0),
                               RequestMoments.of_request(5000, 2500.0) + RequestMoments.of_request(5000, 2500.0))
    assert judge_shadow({"code": long_ones}, GATED).result == UNDECIDED


def test_paired_standard_error_is_the_per_request_difference():
    """The expanded sums give what the per-request linearisation gives, computed directly."""
    rows = per_request(0.6, 0.5, 120, seed=4)
    ev = evidence(0.6, 0.5, 120, seed=4)
    rc = sum(a for (_, a), _ in rows) / sum(d for (d, _), _ in rows)
    rk = sum(b for _, (_, b) in rows) / sum(e for _, (e, _) in rows)
    n = len(rows)
    dbar, ebar = sum(d for (d, _), _ in rows) / n, sum(e for _, (e, _) in rows) / n
    direct = sum(((a - rc * d) / dbar - (b - rk * e) / ebar) ** 2 for (d, a), (e, b) in rows) / (n * (n - 1))
    assert difference_se(ev, DriftPolicy()) == pytest.approx(direct ** 0.5, rel=1e-9)
    unpaired = difference_se(evidence(0.6, 0.5, 120, seed=4, paired=False), DriftPolicy())
    assert unpaired > 2 * direct ** 0.5      # the requests' own difficulty no longer counts twice


def test_pairing_decides_sooner_than_the_conservative_bound():
    cats = {"code": (0.75, 0.55, 300), "chat": (0.5, 0.5, 300)}
    for paired, result in ((True, PROMOTE), (False, UNDECIDED)):
        ev = {c: evidence(a, b, n, seed=i, paired=paired) for i, (c, (a, b, n)) in enumerate(sorted(cats.items()))}
        assert judge_shadow(ev, GATED, ("code",)).result == result


def test_a_tighter_confidence_waits_longer():
    ev = {"code": evidence(0.58, 0.55, 60, seed=0), "chat": evidence(0.58, 0.55, 60, seed=1)}
    assert judge_shadow(ev, GATED).result == PROMOTE
    assert judge_shadow(ev, GATED, policy=ShadowPolicy(z=6.0)).result == UNDECIDED


def test_evidence_from_get_stats_messages():
    from specpair._proto import engine_pb2 as pb

    msg = pb.ShadowCategoryStats(
        requests=3, candidate_alpha=pb.AlphaSums(requests=3, positions=30, alpha=21.5, positions_sq=300.0,
                                                 alpha_sq=160.0, positions_alpha=215.0),
        champion_alpha=pb.AlphaSums(requests=3, positions=28, alpha=14.0, positions_sq=262.0, alpha_sq=66.0,
                                    positions_alpha=131.0),
        candidate_chain=RequestMoments.of_request(40, 25).to_message(),
        champion_chain=RequestMoments.of_request(44, 20).to_message(),
        alpha_paired=PairedSums(3, 100.0, 200.0, 140.0, 280.0).to_message())
    alpha = ShadowEvidence.from_message(msg)
    assert alpha.candidate == alpha_moments(msg.candidate_alpha)
    assert (alpha.candidate.drafted, alpha.candidate.accepted, alpha.champion.accepted) == (30, 21.5, 14.0)
    assert alpha.paired == PairedSums(3, 100.0, 200.0, 140.0, 280.0)
    chain = ShadowEvidence.from_message(msg, measure="chain")
    assert chain.paired is None        # not reported: the conservative bound
    assert (chain.candidate.drafted, chain.candidate.accepted, chain.champion.drafted) == (40, 25, 44)
    with pytest.raises(ValueError, match="measure"):
        ShadowPolicy(measure="tokens")
