"""The per-row back-off: a request whose drafts keep failing stops paying for them (k 0 after
repeated rejections, a probe later), whatever the other rows do; its output stays target-only's.

The state machine is costs.DynamicK's (tables here); the identity tests run a real engine on the
tiny target with a draft that is another random model, so its drafts are rejected."""

from __future__ import annotations

import pytest

from specpair.config import GenerationParams, SpeculationConfig
from specpair.costs import CostModel, DynamicK, RequestAudit
from specpair.decoding import SpeculativeEngine

CONFIG = SpeculationConfig(k=3, k_min=1, k_max=4)


@pytest.fixture(autouse=True)
def row_back_off_default(monkeypatch):
    """These tests are of the default: the back-off on (costs.row_back_off_enabled)."""
    monkeypatch.delenv("SPECPAIR_ROW_BACK_OFF", raising=False)


def test_the_back_off_is_on_by_default_and_can_be_switched_off(monkeypatch):
    assert DynamicK(CONFIG).back_off and not DynamicK(CONFIG, back_off=False).back_off
    monkeypatch.setenv("SPECPAIR_ROW_BACK_OFF", "off")
    assert not DynamicK(CONFIG).back_off and DynamicK(CONFIG, back_off=True).back_off
AFTER, FIRST = DynamicK.BACKOFF_AFTER, DynamicK.BACKOFF_FIRST


def ks_through(dk: DynamicK, rounds: list[tuple[int, int] | str]) -> list[int]:
    """k after each round; a round is (drafted, accepted), or "k" to draft what k says and have
    none accepted, or "ok" to draft what k says and have all accepted."""
    out = []
    for r in rounds:
        drafted, accepted = (dk.k, 0) if r == "k" else (dk.k, dk.k) if r == "ok" else r
        dk.update(drafted, accepted)
        out.append(dk.k)
    return out


def test_repeated_rejections_rest_the_row_then_it_probes():
    dk = DynamicK(CONFIG)
    # Heuristic k (no cost model): shrinks by 1 per rejection, then rests at k 0.
    assert ks_through(dk, ["k"] * AFTER) == [2, 1, 0]
    assert dk.backed_off and dk.backoffs == 1
    # Resting: rounds draft nothing; after FIRST of them, one probe at k_min.
    assert ks_through(dk, [(0, 0)] * (FIRST - 1)) == [0] * (FIRST - 1)
    assert ks_through(dk, [(0, 0)]) == [CONFIG.k_min] and dk.probing
    # The probe rejected: rest twice as long.
    assert ks_through(dk, ["k"]) == [0] and dk.rest == 2 * FIRST and dk.backoffs == 2
    assert ks_through(dk, [(0, 0)] * (2 * FIRST)) == [0] * (2 * FIRST - 1) + [CONFIG.k_min]
    # The probe accepted: drafting resumes (and grows), the next rest starts short again.
    assert ks_through(dk, ["ok", "ok"]) == [3, 4] and not dk.backed_off and dk.next_rest == FIRST


def test_rests_double_up_to_the_cap():
    dk = DynamicK(CONFIG)
    ks_through(dk, ["k"] * AFTER)
    rests = [dk.rest]
    for _ in range(8):
        ks_through(dk, [(0, 0)] * dk.rest + ["k"])     # rest, probe, rejected
        rests.append(dk.rest)
    assert rests == [min(DynamicK.BACKOFF_MAX, FIRST * 2 ** i) for i in range(9)]


@pytest.mark.parametrize("rounds, backed_off", [
    (["k", "k", "ok", "k", "k"], False),        # an accepted draft restarts the count
    (["k", (0, 0), "k", (0, 0), "k"], True),    # rounds that drafted nothing judge nothing
    ([(3, 1), (3, 1), (3, 1), (3, 1)], False),  # partial acceptance is no failure
    (["k", "k", "k"], True),
])
def test_only_rounds_in_a_row_whose_drafts_all_failed_count(rounds, backed_off):
    dk = DynamicK(CONFIG)
    ks_through(dk, rounds)
    assert dk.backed_off is backed_off


def test_a_pair_that_asks_to_keep_drafting_never_rests():
    """fallbackThreshold 0 (keep drafting under a bad draft) turns the back-off off too, as does
    back_off=False."""
    for dk in (DynamicK(SpeculationConfig(k=3, fallback_threshold=0)), DynamicK(CONFIG, back_off=False)):
        assert min(ks_through(dk, ["k"] * 20)) == CONFIG.k_min and not dk.backoffs


def test_with_costs_a_row_rests_once_no_k_can_beat_a_target_step():
    """With the costs measured, one rejection is enough where drafting cannot pay at the
    acceptance now expected; where drafts are nearly free it takes the rejections in a row."""
    dear = CostModel(draft=0.6, verify={k: 1.0 + 0.3 * k for k in range(1, 5)})
    cheap = CostModel(draft=0.01, verify={k: 1.0 + 0.01 * k for k in range(1, 5)})
    config = SpeculationConfig(k=3, k_max=4)
    assert ks_through(DynamicK(config, dear), ["k"]) == [0]
    assert ks_through(DynamicK(config, cheap), ["k"] * AFTER)[-1] == 0
    assert ks_through(DynamicK(config, cheap), ["k"] * (AFTER - 1))[-1] > 0


@pytest.fixture(scope="module")
def unrelated_draft(tiny_tokenizer):
    from tiny_models import make_model
    return make_model(tiny_tokenizer, seed=77)


PROMPTS = ["def foo(x):\n    return", "The quick brown fox", "import os\nimport sys\n",
           "Hello world, hello world, hello"]
PARAMS = GenerationParams(max_new_tokens=40)


def run_rows(engine, prompts):
    """Each prompt's (token ids, drafted tokens, times backed off), as one batch. No request is
    audited (costs.RequestAudit: an audited one drafts every round): every row may back off."""
    engine.audit = RequestAudit(0.0)
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(p), PARAMS) for p in prompts]
    while batch.active:
        batch.step()
    return [(batch.result(s).token_ids, s.stats.num_draft_tokens, s.dynamic_k.backoffs) for s in seqs]


@pytest.mark.parametrize("rows", [1, 4])
def test_a_row_whose_drafts_fail_stops_drafting_and_its_output_is_target_only(
        tiny_target, unrelated_draft, rows):
    prompts = PROMPTS[:rows]
    target_only = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    expected = [target_only.generate([p], PARAMS)[0].token_ids for p in prompts]
    spec = dict(k=3, dynamic_k=False)
    backing_off = run_rows(SpeculativeEngine(tiny_target, draft=unrelated_draft,
                                             speculation=SpeculationConfig(**spec)), prompts)
    # The same draft where the pair asks to keep drafting (fallbackThreshold 0).
    drafting = run_rows(SpeculativeEngine(tiny_target, draft=unrelated_draft,
                                          speculation=SpeculationConfig(**spec, fallback_threshold=0)), prompts)
    for (ids, drafted, backoffs), (ids_on, drafted_on, backoffs_on), want in zip(backing_off, drafting, expected):
        assert ids == want and ids_on == want
        assert drafted >= AFTER * 3, "drafting happened before the back-off"
        assert backoffs >= 1 and backoffs_on == 0
        # Resting: far fewer drafts than the row that kept drafting every round.
        assert drafted <= drafted_on / 2, (drafted, drafted_on)
