"""Live acceptance under the per-row back-off: a random share of requests is audited (drafts
every round, costs.RequestAudit), and what live acceptance reads (drift's per-request sums, the
engine-wide fallback, shadow scoring) is theirs alone; k per batch size from the start-up
measurement held in the running batch (costs.k_for_rows).

The engine tests run the tiny target with test_prometheus_live's mediocre draft (the target's
weights with more noise): backed off, its rows draft only at their start and in probes, which on
these prompts are rejected far more than the rest of a request."""

from __future__ import annotations

import pytest

from specpair.config import GenerationParams, SpeculationConfig
from specpair.costs import RequestAudit, RowsDecision, k_for_rows
from specpair.decoding import SpeculativeEngine
from specpair.stats import AcceptanceStats

CODE = ["def add(a, b):\n    return", "for i in range(10):\n    print(", "import json\n\ndef load(path):",
        "class Point:\n    def __init__(self, x, y):"]
# A fixed k: the rounds are then the same whatever the machine's timings (no cost model).
FIXED = SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0.05)


@pytest.fixture(autouse=True)
def defaults(monkeypatch):
    monkeypatch.delenv("SPECPAIR_ROW_BACK_OFF", raising=False)
    monkeypatch.delenv("SPECPAIR_AUDIT_SHARE", raising=False)


@pytest.fixture(scope="module")
def mediocre_draft(tiny_target):
    from tiny_models import perturbed_copy
    return perturbed_copy(tiny_target, seed=5, noise=0.07)


# -- the draw -------------------------------------------------------------------------------------

@pytest.mark.parametrize("share, config, env, audited", [
    (0.0, FIXED, None, False),                                  # backing off, never drawn
    (1.0, FIXED, None, True),
    (0.0, SpeculationConfig(fallback_threshold=0.0), None, True),   # never backs off: always counted
    (0.0, FIXED, "off", True),                                  # the back-off switched off
])
def test_who_is_audited(monkeypatch, share, config, env, audited):
    if env:
        monkeypatch.setenv("SPECPAIR_ROW_BACK_OFF", env)
    draws = RequestAudit(share, seed=1)
    assert {draws.draw(config) for _ in range(50)} == {audited}


def test_the_share_is_drawn_at_random_and_set_by_the_environment(monkeypatch):
    audit = RequestAudit(seed=3)
    assert audit.share == 0.5 and abs(sum(audit.draw(FIXED) for _ in range(4000)) / 4000 - 0.5) < 0.03
    monkeypatch.setenv("SPECPAIR_AUDIT_SHARE", "0.1")
    audit = RequestAudit(seed=4)
    assert audit.share == 0.1 and abs(sum(audit.draw(FIXED) for _ in range(4000)) / 4000 - 0.1) < 0.02
    with pytest.raises(ValueError, match="audit share"):
        RequestAudit(1.5)


def test_an_unaudited_request_is_no_sample_of_live_acceptance():
    stats = AcceptanceStats(num_draft_tokens=9, num_accepted_tokens=4)
    assert stats.drift_sample() == (9, 4)
    stats.audited = False
    assert stats.drift_sample() == (0, 0)


# -- the engine -----------------------------------------------------------------------------------

def per_request(engine, prompts, n=12):
    """Each prompt alone, in turn: (audited, drafted, accepted, times backed off, token ids)."""
    out = []
    for p in prompts:
        batch = engine.new_batch()
        seq = batch.add(engine.encode(p), GenerationParams(max_new_tokens=n))
        while batch.active:
            batch.step()
        out.append((seq.stats.audited, seq.stats.num_draft_tokens, seq.stats.num_accepted_tokens,
                    seq.dynamic_k.backoffs, batch.result(seq).token_ids))
    return out


def test_audited_requests_draft_every_round_as_without_the_back_off(tiny_target, mediocre_draft, monkeypatch):
    """An audited request's counts are exactly those of the same request with the back-off off
    (what the gate measures); an unaudited one backs off and drafts less; every reply is the
    same. Live acceptance over the audited requests is then the drafter's, where the backed-off
    rounds read far lower."""
    prompts = CODE * 4
    monkeypatch.setenv("SPECPAIR_ROW_BACK_OFF", "off")
    full = per_request(SpeculativeEngine(tiny_target, draft=mediocre_draft, speculation=FIXED), prompts)
    monkeypatch.delenv("SPECPAIR_ROW_BACK_OFF")
    engine = SpeculativeEngine(tiny_target, draft=mediocre_draft, speculation=FIXED)
    engine.audit = RequestAudit(0.5, seed=7)
    mixed = per_request(engine, prompts)
    assert {a for a, *_ in mixed} == {True, False}
    for (audited, drafted, accepted, backoffs, ids), (_, drafted_full, accepted_full, _, ids_full) in zip(mixed, full):
        assert ids == ids_full
        if audited:
            assert (drafted, accepted, backoffs) == (drafted_full, accepted_full, 0)
        else:
            assert drafted <= drafted_full
    backed_off = [m for m in mixed if not m[0] and m[3]]
    assert backed_off and all(m[1] < f[1] for m, f in zip(mixed, full) if not m[0] and m[3])
    live = [m for m in mixed if m[0]]
    rate = sum(m[2] for m in live) / sum(m[1] for m in live)
    rate_full = sum(f[2] for f in full) / sum(f[1] for f in full)
    biased = sum(m[2] for m in backed_off) / sum(m[1] for m in backed_off)
    print(f"\nacceptance: every round {rate_full:.3f}, audited {rate:.3f}, backed-off rows {biased:.3f}")
    assert biased < rate_full and rate > 0


def test_the_fallback_window_reads_audited_rounds_only(tiny_target, mediocre_draft):
    engine = SpeculativeEngine(tiny_target, draft=mediocre_draft, speculation=FIXED)
    engine.audit = RequestAudit(0.0)
    got = per_request(engine, CODE)
    assert sum(d for _, d, *_ in got) > 0 and engine.controller.window.drafted == 0
    engine.audit = RequestAudit(1.0)
    got = per_request(engine, CODE)
    assert engine.controller.window.drafted == sum(d for _, d, *_ in got) > 0


# -- k per batch size -----------------------------------------------------------------------------

DECIDED = [RowsDecision(1, 4, 1.6, True), RowsDecision(2, 4, 1.3, True), RowsDecision(4, 1, 1.1, True),
           RowsDecision(8, 1, 0.9, False)]


@pytest.mark.parametrize("rows, k", [
    (1, None),       # batch 1: each row's own k and back-off judge
    (2, 4), (3, 4),  # between two measured sizes the smaller's verdict holds
    (4, 1), (7, 1),
    (8, 0), (64, 0),  # where drafting did not pay
])
def test_k_for_rows(rows, k):
    assert k_for_rows(DECIDED, rows) == k


def test_k_for_rows_without_a_measurement():
    assert k_for_rows([], 8) is None and k_for_rows(None, 8) is None
    assert k_for_rows([RowsDecision(2, 3, 1.2, True)], 1) is None


def test_the_running_batch_holds_k_to_its_size(tiny_target, tiny_draft):
    """Rows join one by one: while the batch has 1 row its k is the pair's, at 2-3 rows at most
    the k measured for 2, from 4 rows the measured 1; output equals target-only's."""
    speculation = SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0.0, batch_size_threshold=64)
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=speculation)
    engine.speculation_by_rows = [RowsDecision(1, 3, 1.5, True), RowsDecision(2, 2, 1.2, True),
                                  RowsDecision(4, 1, 1.1, True)]
    solo = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    params = GenerationParams(max_new_tokens=24)
    batch = engine.new_batch()
    seqs, widest = [], {}
    for step in range(200):
        if step % 2 == 0 and len(seqs) < 4:
            seqs.append(batch.add(engine.encode(CODE[len(seqs)]), params))
        if not batch.active:
            break
        rows = batch.active
        before = [s.stats.num_draft_tokens for s in batch.rows]
        drafting = list(batch.rows)
        batch.step()
        drafted = max(s.stats.num_draft_tokens - b for s, b in zip(drafting, before))
        widest[rows] = max(widest.get(rows, 0), drafted)
    assert widest[1] == 3 and 0 < max(widest.get(2, 0), widest.get(3, 0)) <= 2 and widest[4] == 1, widest
    for prompt, seq in zip(CODE, seqs):
        assert batch.result(seq).token_ids == solo.generate([prompt], params)[0].token_ids
