"""SwapDraft for a draft model whose cache lives in the paged pool (issue 58): the new draft's
plane over the pool's block ids is made at load and put in between two steps, its shape (layers,
kv heads) free to differ, held to the pool's KV budget. Against the real server over gRPC
loopback: a steady stream across the swap loses and changes nothing; a draft whose plane does not
fit is refused by name and the old one keeps serving. The plane's fit is a pure decision."""

from __future__ import annotations

import gc
import weakref

import grpc
import pytest
from test_draft_swap import (NEW_TOKENS, PROMPTS, release_json, swap,
                             swap_under_a_steady_stream)
from tiny_models import make_model, perturbed_copy, save_tiny

from serving_helpers import client_for, reference, rpc_error

from specpair.config import GenerationParams
from specpair.decoding import SpeculativeEngine
from specpair.paged_cache import draft_plane_fits
from specpair.server.draft_swap import (CATCH_UP_POSITIONS, install, load_release_drafter, read_release,
                                        rows_that_catch_up)


def paged_draft_engine(tiny_pair) -> SpeculativeEngine:
    target, draft = tiny_pair
    engine = SpeculativeEngine(target, draft=draft)
    if engine.paged_space is None or engine.paged_space.draft is None:
        pytest.skip(f"the paged cache does not apply here: {engine.paged_unused}")
    return engine


def test_a_draft_plane_fits_the_budget_or_is_refused_by_name():
    # 10 blocks at 100 bytes besides the draft's, a budget of 1,500: a draft of up to 50 a block.
    assert draft_plane_fits(10, 100, 50, 50, 1500) is None            # the same shape
    assert draft_plane_fits(10, 100, 20, 50, 1500) is None            # fewer layers or kv heads
    why = draft_plane_fits(10, 100, 51, 50, 1500, "3 layers x 4 kv heads x head dim 16")
    assert why == ("the new draft's keys and values take 51 bytes a block (3 layers x 4 kv heads x head dim 16), "
                   "the serving draft's 50: the pool's 10 blocks would take 1510 bytes, past its KV budget of "
                   "1500 bytes (a larger KV budget, or new pods sized for this draft)")


def test_paged_draft_model_a_to_b_under_a_steady_stream(tiny_pair, start_server, tmp_path):
    # B has one layer where A has two: a plane of another shape over the same block ids.
    target, _ = tiny_pair
    engine = paged_draft_engine(tiny_pair)
    old_plane = engine.paged_space.draft
    other_dir = save_tiny(perturbed_copy(target, seed=13, noise=0.05, layers=1), tmp_path / "draft-b")
    server = start_server(engine, max_batch_size=8)
    swap_under_a_steady_stream(tiny_pair, server, release_json(target.source, "2", draft_source=other_dir),
                               other_dir, "paged draft model A (2 layers) -> B (1 layer)")
    space = server.engine.paged_space
    assert space.draft is not old_plane and space.draft.runner.layer_count == 1
    assert space.draft_generation == 1
    assert server.worker.batch.draft_kv.caches is space.draft.caches     # the rows draft in the new plane


def test_a_draft_whose_plane_does_not_fit_is_refused_and_the_old_one_serves(tiny_pair, start_server, tmp_path):
    # Four layers where the serving draft has two: every block priced at the new draft's bytes
    # passes the pool's budget (the default's, which the pool was cut to).
    target, _ = tiny_pair
    engine = paged_draft_engine(tiny_pair)
    old_plane = engine.paged_space.draft
    big_dir = save_tiny(make_model(target.tokenizer, seed=14, layers=4), tmp_path / "draft-big")
    server = start_server(engine)
    with client_for(server) as client:
        error = rpc_error(lambda: swap(client, release_json(target.source, "2", draft_source=big_dir)))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert "the new draft's plane does not fit the paged pool" in error.details()
        assert "4 layers x 4 kv heads x head dim 16" in error.details() and "KV budget" in error.details()
        info = client.model_info()
        assert (info.draft_version, info.draft.source) == ("1", tiny_pair[1].source)
        reply = client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
    assert reply.token_ids == reference(tiny_pair, PROMPTS[0], NEW_TOKENS).token_ids
    assert reply.last.stats.num_draft_tokens > 0                        # still drafting, with the old draft
    assert server.engine.paged_space.draft is old_plane and server.engine.paged_space.draft_generation == 0


def test_rows_catch_up_within_the_budget_most_tokens_left_a_position_first():
    # (positions held, tokens left) a row.
    assert rows_that_catch_up([(100, 50), (200, 50), (50, 50)], budget=1000) == [0, 1, 2]
    assert rows_that_catch_up([(100, 50), (200, 50), (50, 50)], budget=160) == [0, 2]
    assert rows_that_catch_up([(100, 50), (200, 50), (50, 50)], budget=120) == [2]      # 100 + 50 > 120
    assert rows_that_catch_up([(600, 400), (300, 10)], budget=700) == [0]     # 0.67 a position vs 0.03
    assert rows_that_catch_up([(10, 1), (10, 0), (10, 2)], budget=1000) == [2]   # one token left: no drafts
    assert rows_that_catch_up([(10, 5)], budget=0) == []


@pytest.mark.parametrize("catch_up", [CATCH_UP_POSITIONS, 0], ids=["rows-catch-up", "drafting-ended"])
def test_rows_mid_reply_across_a_paged_swap_keep_their_output_and_no_block_leaks(tiny_pair, catch_up):
    # A batch stepped directly: rows mid-reply when the plane changes (greedy and seeded sampled,
    # one prompt twice so a prefix block is shared), every reply equal to target-only, and once
    # the rows are done the pool holds nothing (the old draft rows' blocks came back). Within the
    # catch-up budget the rows draft on with the new draft; past it (0) they end drafting.
    target, _ = tiny_pair
    engine = paged_draft_engine(tiny_pair)
    pool = engine.paged_space.pool
    other = perturbed_copy(target, seed=13, noise=0.05, layers=1)
    params = [GenerationParams(max_new_tokens=NEW_TOKENS),
              GenerationParams(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=5)]
    prompts = PROMPTS[:3] + PROMPTS[:1]
    target_only = SpeculativeEngine(target)
    expected = [target_only.generate([p], params[i % 2], speculate=False)[0].token_ids
                for i, p in enumerate(prompts)]
    loaded = load_release_drafter(engine, read_release(release_json(target.source, "2", draft_source="b")),
                                  load_model=lambda *_a, **_k: other)
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(p), params[i % 2]) for i, p in enumerate(prompts)]
    for _ in range(3):
        batch.step()
    assert batch.active == len(prompts) and batch.draft_kv is not None
    drafted_before = sum(s.stats.num_draft_tokens for s in seqs)
    assert drafted_before > 0
    old_rows = batch.draft_kv
    old_keys = weakref.ref(engine.paged_space.draft.caches[0][0])
    install(engine, batch, loaded, catch_up_positions=catch_up)
    assert old_rows.batch_size == 0 and batch.draft_kv is not old_rows
    del old_rows, loaded
    gc.collect()
    assert old_keys() is None          # the old plane's arrays are gone with its rows
    assert batch.draft_kv.lengths == [0] * len(prompts)         # each catches up on its next round
    assert [s.drafts_ended for s in seqs] == [not catch_up] * len(prompts)
    while batch.active:
        batch.step()
    assert [batch.result(s).token_ids for s in seqs] == expected
    drafted_after = sum(s.stats.num_draft_tokens for s in seqs) - drafted_before
    assert drafted_after > 0 if catch_up else drafted_after == 0     # the new draft drafted, or none did
    assert pool.idle and all(not table for table in pool.tables.values())
    assert batch.drafter.draft_model() is other.model


def test_a_draft_model_swapped_into_a_contiguous_lookup_batch_gets_its_prefix_keys(tiny_pair, monkeypatch):
    # The contiguous cache's prefix store serves one cache more after an n-gram -> draft model
    # swap: each row in flight gets its keys for it (before Batch.replace_drafter the store's
    # save after the next step indexed a key the row did not have, and the step failed).
    from specpair.paged_cache import PAGED_ENV

    monkeypatch.setenv(PAGED_ENV, "off")
    target, draft = tiny_pair
    engine = SpeculativeEngine(target, drafter="ngram")
    assert engine.paged_space is None and engine.prefix_store is not None
    prompt, params = PROMPTS[2] * 4, GenerationParams(max_new_tokens=NEW_TOKENS)
    batch = engine.new_batch()
    seqs = [batch.add(engine.encode(prompt), params) for _ in range(2)]
    batch.step()
    loaded = load_release_drafter(engine, read_release(release_json(target.source, "2", draft_source="d")),
                                  load_model=lambda *_a, **_k: draft)
    install(engine, batch, loaded)
    assert [len(s.prefix_keys) for s in seqs] == [len(batch.prefix_caches)] * 2 == [2, 2]
    while batch.active:
        batch.step()
    expected = reference(tiny_pair, prompt, NEW_TOKENS).token_ids
    assert [batch.result(s).token_ids for s in seqs] == [expected, expected]
    assert engine.prefix_store.missing(seqs[0].prefix_keys[1]) == []     # the draft's blocks saved
