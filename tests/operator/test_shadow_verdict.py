"""The shadow verdict (specpair_operator.shadow_verdict.judge_shadow) as a table: synthetic
per-request evidence for a candidate drafter and the champion on the same requests, and what the
operator must conclude. Pure: no servers."""

from __future__ import annotations

import random

import pytest
from specpair.stats import RequestMoments

from specpair_operator.shadow_verdict import (PROMOTE, REJECTED, UNDECIDED, ShadowEvidence, ShadowPolicy,
                                              alpha_moments, judge_shadow)

GATED = ["*", "code", "chat"]


def evidence(candidate: float, champion: float, requests: int, seed: int = 1) -> ShadowEvidence:
    """Per-request sums for both drafters on the same requests, as a shadowed category adds them
    up: first positions per request log-normal (median ~40), the champion's acceptance per
    request around `champion` (requests differ in difficulty), the candidate's the same request's
    shifted by the difference of the means, with a little noise of its own."""
    rng = random.Random(seed)
    cand, champ = RequestMoments.zero(), RequestMoments.zero()
    for _ in range(requests):
        d = max(1, int(rng.lognormvariate(3.7, 0.8)))
        hard = rng.betavariate(champion * 8, (1 - champion) * 8)
        mine = min(1.0, max(0.0, hard + candidate - champion + rng.gauss(0, 0.05)))
        champ += RequestMoments.of_request(d, hard * d)
        cand += RequestMoments.of_request(d, mine * d)
    return ShadowEvidence(cand, champ)


CASES = [
    # (name, {category: (candidate, champion, requests)}, better_in, result, words in the reason)
    ("better everywhere", {"code": (0.75, 0.55, 200), "chat": (0.6, 0.45, 200)}, (), PROMOTE, ["better in"]),
    # Level needs many requests: the bound ignores that both sides share the requests (conservative).
    ("better where promised, level elsewhere", {"code": (0.75, 0.55, 1500), "chat": (0.5, 0.5, 1500)},
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


def test_a_tighter_confidence_waits_longer():
    ev = {"code": evidence(0.62, 0.55, 600), "chat": evidence(0.6, 0.55, 600)}
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
        champion_chain=RequestMoments.of_request(44, 20).to_message())
    alpha = ShadowEvidence.from_message(msg)
    assert alpha.candidate == alpha_moments(msg.candidate_alpha)
    assert (alpha.candidate.drafted, alpha.candidate.accepted, alpha.champion.accepted) == (30, 21.5, 14.0)
    chain = ShadowEvidence.from_message(msg, measure="chain")
    assert (chain.candidate.drafted, chain.candidate.accepted, chain.champion.drafted) == (40, 25, 44)
    with pytest.raises(ValueError, match="measure"):
        ShadowPolicy(measure="tokens")
