"""Past the KV budget, speculation's memory goes first: the request that does not fit with its
drafts is admitted target-only, its output unchanged, a counter and a log line say so, and it
drafts again once the rows that filled the budget have left."""

from __future__ import annotations

import logging

import pytest

from specpair.config import KV_BUDGET_ENV, GenerationParams, SpeculationConfig, parse_kv_budget
from specpair.decoding import SpeculativeEngine, kv_bytes_per_token
from specpair.errors import SpecpairError
from specpair.server.metrics import EngineMetrics

PROMPTS = ["def foo(x):\n    return", "The quick brown fox", "import os\nimport sys\n", "while True:"]
SHORT, LONG = GenerationParams(max_new_tokens=12), GenerationParams(max_new_tokens=40)
CONFIG = SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0)


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    return [engine.generate([p], LONG if i == 3 else SHORT)[0].token_ids for i, p in enumerate(PROMPTS)]


def budget_for_three(tiny_target, tiny_draft) -> int:
    """Bytes that hold three rows with their drafts and a fourth row without its drafts."""
    probe = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=CONFIG)
    rows = [probe.row_memory(len(probe.encode(p)), LONG if i == 3 else SHORT) for i, p in enumerate(PROMPTS)]
    assert all(spec > 0 for _, spec in rows)
    return sum(own + spec for own, spec in rows[:3]) + rows[3][0]


def test_a_fourth_request_is_admitted_target_only_and_drafts_again_later(tiny_target, tiny_draft,
                                                                           reference, caplog,
                                                                           monkeypatch):
    # The contiguous cache's byte budget (the paged pool's rule: test_engine_paged_draft.py).
    monkeypatch.setenv("SPECPAIR_PAGED", "off")
    budget = budget_for_three(tiny_target, tiny_draft)
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=CONFIG, kv_budget=f"{budget}B")
    assert engine.kv_budget == budget
    metrics = EngineMetrics("tiny", "1")
    batch = engine.new_batch()
    with caplog.at_level(logging.INFO, logger="specpair.engine"):
        seqs = [batch.add(engine.encode(p), LONG if i == 3 else SHORT) for i, p in enumerate(PROMPTS)]
        assert [s.memory_target_only for s in seqs] == [False, False, False, True]
        assert engine.memory_fallbacks == 1 and batch.kv_in_use() == budget
        assert any("admitted target-only" in r.getMessage() and seqs[3].request_id in r.getMessage()
                   for r in caplog.records)
        drafts_while_full = None
        while batch.active:
            batch.step()
            if any(not s.finished for s in seqs[:3]):
                drafts_while_full = seqs[3].stats.num_drafts
                # Not drafting: the draft model holds nothing of the row.
                assert batch.drafter.kv.lengths[batch.rows.index(seqs[3])] == 0
        assert any("drafts again" in r.getMessage() for r in caplog.records)
    assert drafts_while_full == 0, "the row drafted while the budget was full"
    assert seqs[3].stats.num_drafts > 0, "the row never drafted again after memory freed"
    assert all(s.stats.num_drafts > 0 for s in seqs[:3])
    # Output unchanged: every row equals target-only greedy.
    assert [s.generated for s in seqs] == reference
    metrics.record_memory_fallbacks(engine.memory_fallbacks)
    metrics.record_memory_fallbacks(engine.memory_fallbacks)     # a total, not an increment
    assert metrics.registry.get_sample_value("specpair_memory_fallback_total",
                                             {"pair": "tiny", "version": "1", "engine": "specpair"}) == 1


def test_rows_already_drafting_stop_when_the_newcomer_alone_does_not_fit(tiny_target, tiny_draft,
                                                                           monkeypatch):
    """Three rows with drafts fill the budget to the byte: the fourth's own cache fits only if
    the newest drafting row gives its drafts' memory up too (the contiguous cache's byte budget;
    the paged pool's blocks: test_engine_paged_draft.py)."""
    monkeypatch.setenv("SPECPAIR_PAGED", "off")
    probe = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=CONFIG)
    ids = [probe.encode(p) for p in PROMPTS]
    rows = [probe.row_memory(len(i), SHORT) for i in ids]
    budget = sum(own + spec for own, spec in rows[:3]) + rows[3][0] - 1
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=CONFIG, kv_budget=f"{budget}B")
    batch = engine.new_batch()
    seqs = [batch.add(i, SHORT) for i in ids]
    assert [s.memory_target_only for s in seqs] == [False, False, True, True]
    assert engine.memory_fallbacks == 2 and batch.kv_in_use() <= budget


def test_without_a_budget_nothing_falls_back(tiny_target, tiny_draft, monkeypatch):
    monkeypatch.delenv(KV_BUDGET_ENV, raising=False)
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=CONFIG)
    assert engine.kv_budget is None          # a CPU and no setting: no budget
    batch = engine.new_batch()
    assert not any(batch.add(engine.encode(p), SHORT).memory_target_only for p in PROMPTS)
    assert engine.memory_fallbacks == 0


def test_budget_settings(tiny_target, tiny_draft, monkeypatch):
    per_token = kv_bytes_per_token(tiny_target.model)
    assert per_token == 2 * 2 * 4 * 16 * 4             # K and V, 2 layers, 4 heads of 16, fp32
    monkeypatch.setenv(KV_BUDGET_ENV, "1000")
    assert SpeculativeEngine(tiny_target).kv_budget == 1000 * per_token
    assert SpeculativeEngine(tiny_target, kv_budget="2MiB").kv_budget == 2 * 2**20
    assert parse_kv_budget("1.5GB") == (1_500_000_000, "bytes") and parse_kv_budget(64) == (64, "tokens")
    for bad in ("lots", "12 parsecs", "0", "-3MiB"):
        with pytest.raises(SpecpairError, match="KV budget"):
            SpeculativeEngine(tiny_target, kv_budget=bad)
    # Speculation's share: k drafted positions in the target, the draft's cache of the row.
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, speculation=CONFIG)
    own, spec = engine.row_memory(10, SHORT)
    draft = kv_bytes_per_token(tiny_draft.model)
    assert (own, spec) == (22 * per_token, CONFIG.k_max * per_token + (22 + CONFIG.k_max) * draft)
    assert engine.row_memory(10, GenerationParams(max_new_tokens=12, speculation_k=0))[1] == 0


def test_cli_passes_the_budget(tiny_pair_dirs):
    from specpair.cli import build_engine, build_parser
    args = build_parser().parse_args(["generate", "--target", tiny_pair_dirs["target"], "--draft",
                                      tiny_pair_dirs["draft"], "--kv-budget", "300", "--prompt", "x"])
    engine = build_engine(args)
    assert engine.kv_budget == 300 * kv_bytes_per_token(engine.target.model)
