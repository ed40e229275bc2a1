"""The bench's speedup bound is an upper bound built from the rounds a run really had.

Pure functions, no timing: the costs are given, the rounds are recorded as the engine records
them (AcceptanceStats.record_round)."""

import pytest
import torch

from specpair.bench import ideal_spec_seconds, rounds_by_k, speedup_bound
from specpair.stats import AcceptanceStats

COSTS = {"target_step": 0.040, "verify": {1: 0.044, 2: 0.048, 3: 0.052, 4: 0.060}, "draft_step": 0.001,
         "draft_per_token": False}


def stats_of(rounds: list[tuple[int, ...]]) -> AcceptanceStats:
    """(drafted, accepted[, copied]) per round."""
    s = AcceptanceStats()
    for drafted, accepted, *copied in rounds:
        s.record_round(drafted, accepted, copied=bool(copied and copied[0]))
    return s


def test_rounds_are_counted_by_the_k_they_really_drafted():
    s = stats_of([(4, 4), (4, 0), (2, 1), (1, 1), (4, 2)])
    assert rounds_by_k(s.num_draft_tokens_per_pos) == {1: 1, 2: 1, 4: 3}


def test_bursty_acceptance_is_not_underestimated():
    """n-gram acceptance comes in runs: all four drafts or none. Leviathan's i.i.d. formula at
    a = 0.5 expects 1.94 tokens a round; these rounds yield 3. The bound counts what they
    yielded, through what they cost, so a loop that ran them cannot beat it."""
    rounds = [(4, 4), (4, 0)] * 10
    s = stats_of(rounds)
    tokens = sum(a + 1 for _, a in rounds)
    ideal = ideal_spec_seconds(s, 0, COSTS)
    assert ideal == pytest.approx(20 * (0.001 + 0.060))
    target_seconds = tokens * COSTS["target_step"]          # target-only at exactly one step a token
    bound = speedup_bound(s, 0, COSTS, target_seconds)
    # A real speculative run of the same rounds costs at least `ideal`, so its speedup is at most
    # the bound; the old formula gave less than the speedup such a run can reach.
    leviathan_tokens = 20 * (1 - 0.5 ** 5) / (1 - 0.5)
    old = leviathan_tokens * 0.040 / ideal
    assert bound == pytest.approx(tokens * 0.040 / ideal) and old < bound


def test_rounds_without_drafts_prefill_and_model_drafts_cost_what_they_cost():
    s = stats_of([(3, 3), (3, 1)])
    model = {**COSTS, "draft_per_token": True, "draft_step": 0.005}
    ideal = ideal_spec_seconds(s, 5, model, prefill_seconds=0.2)
    assert ideal == pytest.approx(0.2 + 5 * 0.040 + 2 * (3 * 0.005 + 0.052))
    # An unmeasured k uses the nearest measured verification.
    assert ideal_spec_seconds(stats_of([(6, 0)]), 0, COSTS) == pytest.approx(0.001 + 0.060)


def test_lookup_first_prices_each_round_as_the_kind_it_was():
    """Lookup first, then a head: a round that asked the head costs head steps and a tree's
    verification; a round that copied costs a lookup and a chain's. The stats record which, so
    the bound prices each as what it was (not every round at the cheaper copy)."""
    head = {**COSTS, "draft_per_token": True, "draft_step": 0.005,
            "verify": {1: 0.050, 2: 0.060, 3: 0.070, 4: 0.090},
            "copy": {"verify": COSTS["verify"], "draft_step": 0.001, "draft_per_token": False}}
    s = stats_of([(3, 3), (3, 1, True), (2, 0, True), (3, 0)])
    assert rounds_by_k(s.num_copied_draft_tokens_per_pos) == {2: 1, 3: 1}
    assert ideal_spec_seconds(s, 0, head) == pytest.approx(
        2 * (3 * 0.005 + 0.070) + (0.001 + 0.052) + (0.001 + 0.048))
    # Merged stats (a category, the whole run) keep the kinds apart.
    merged = AcceptanceStats()
    merged.merge(s)
    merged.merge(stats_of([(2, 2, True)]))
    assert rounds_by_k(merged.num_copied_draft_tokens_per_pos) == {2: 2, 3: 1}


def test_a_run_that_never_drafts_is_bounded_by_its_target_only_time():
    s = AcceptanceStats()
    assert speedup_bound(s, 10, COSTS, target_seconds=10 * 0.040) == pytest.approx(1.0)


def test_step_bytes_count_each_weight_once_and_the_cache_read():
    """A step reads every weight but the input embedding table (one row of it); a tied LM head is
    the table itself, read once as the head. Plus keys and values of the cached tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from specpair.bench import step_bytes, step_figures

    def model(tied: bool):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, tie_word_embeddings=tied))
    untied, tied = model(False), model(True)
    table = 100 * 32 * 4
    total = lambda m: sum(p.numel() * 4 for p in m.parameters())       # noqa: E731
    assert step_bytes(untied, 0) == total(untied) - table
    assert step_bytes(tied, 0) == total(tied)                 # parameters() lists the tied table once
    kv = 2 * 2 * 2 * 8 * 10 * 4                               # K and V, 2 layers, 2 heads, dim 8, 10 tokens
    assert step_bytes(untied, 10) - step_bytes(untied, 0) == kv
    figures = step_figures(0.02, 500_000_000, 40.0)
    assert figures == {"step_ms": 20.0, "bytes": 500_000_000, "gb_s": 25.0, "fraction_of_bandwidth": 0.625}
