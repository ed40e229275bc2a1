"""The fixed step over a paged cache (kv/paged_fixed.py) against the contiguous fixed step
(kv/static.py): the same operations on both, every logit and hidden state bitwise equal, in fp32
and bf16, at batch 1, 8 and 32, through prompts (as one step of their rows and eagerly), chain
verifications with rollback, token trees with their kept branch moved, and rows leaving and
joining; while the paged cache holds blocks for each row's own length only."""

from __future__ import annotations

import random

import pytest
import torch

from specpair.errors import SpecpairError
from specpair.kv.paged_fixed import PagedFixedKVModel
from specpair.kv.protocol import KVCache
from specpair.kv.static import StaticKVModel

W = 8     # the token bucket: k = 4 drafts and a bonus token, or a 7-token tree


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, tiny_tokenizer):
    from tiny_models import make_model

    return make_model(tiny_tokenizer, seed=4, dtype=request.param).model.eval()


class Both:
    """One contiguous and one paged fixed-step cache driven alike; every result compared."""

    def __init__(self, model, blocks: int = 4096):
        self.contiguous = StaticKVModel(model, token_bucket=W, fixed=True)
        self.paged = PagedFixedKVModel(model, blocks=blocks, token_bucket=W)
        self.compared = 0

    def do(self, method: str, *args, **kwargs):
        want = getattr(self.contiguous, method)(*args, **kwargs)
        got = getattr(self.paged, method)(*args, **kwargs)
        if isinstance(want, tuple):
            for w, g in zip(want, got, strict=True):
                assert torch.equal(w, g), method
            self.compared += len(want)
        elif isinstance(want, torch.Tensor):
            assert torch.equal(want, got), method
            self.compared += 1
        assert self.paged.lengths == self.contiguous.lengths
        return want


def _chain_round(both: Both, rng: random.Random, hidden: bool = False) -> None:
    """Each row verifies 1..W tokens, then keeps a random prefix of them (rejected drafts)."""
    n = both.paged.batch_size
    starts = list(both.paged.lengths)
    feed = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, W + 1))] for _ in range(n)]
    both.do("extend", feed, last=max(map(len, feed)), hidden=hidden)
    for i in range(n):
        both.do("rollback", i, starts[i] + rng.randrange(1, len(feed[i]) + 1))
    both.do("trim")


def _tree_round(both: Both, rng: random.Random) -> None:
    """Each row feeds a chain of 3 and a sibling of its 2nd and 3rd tokens (parents: chain
    tokens), keeps a branch ending in a sibling, moved where the chain would have written it."""
    n = both.paged.batch_size
    starts = list(both.paged.lengths)
    feed = [[rng.randrange(3, 300) for _ in range(5)] for _ in range(n)]
    parents = [[-1, -1, -1, 0, 1] for _ in range(n)]
    both.do("extend", feed, last=5, parents=parents)
    moves = []
    for i in range(n):
        if rng.random() < 0.5:     # keep t0 then sibling s1 (slot 3) at the chain's slot 1
            moves.append((i, starts[i] + 3, starts[i] + 1))
    both.do("move", moves)
    for i in range(n):
        both.do("rollback", i, starts[i] + 2)
    both.do("trim")


def _prompts(rng: random.Random, n: int, longest: int = 40) -> list[list[int]]:
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, longest))] for _ in range(n)]


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_the_paged_fixed_step_equals_the_contiguous_one_bitwise(model, rows):
    rng = random.Random(rows)
    both = Both(model)
    both.do("add_rows", rows)
    both.do("extend", _prompts(rng, rows))
    for r in range(4):
        _chain_round(both, rng, hidden=r == 1)
    _tree_round(both, rng)
    # Rows leave (not the last ones only) and others join with their prompts beside the rest.
    keep = sorted(rng.sample(range(rows), max(1, rows // 2))) if rows > 1 else [0]
    both.do("select", keep)
    joining = max(1, rows // 4)
    both.do("add_rows", joining)
    both.do("extend", [[] for _ in keep] + _prompts(rng, joining))
    for _ in range(2):
        _chain_round(both, rng)
    _tree_round(both, rng)
    assert both.compared == 11      # ten extends compared, one with its hidden states
    # The paged cache's blocks are each row's own length, rounded up to a block.
    block = both.paged.block
    assert both.paged.pool.blocks - both.paged.pool.free == sum(
        -(-n // block) for n in both.paged.lengths)


def test_a_prompt_past_the_prefill_step_runs_eagerly_and_equally(model, monkeypatch):
    """Prompts too wide for the prompt's fixed step (PREFILL_STEP_TOKENS) run eagerly over the
    slots they reach: through the table too, bitwise."""
    from specpair.kv import buckets

    monkeypatch.setattr(buckets, "PREFILL_STEP_TOKENS", 0)
    rng = random.Random(5)
    both = Both(model)
    both.do("add_rows", 8)
    both.do("extend", _prompts(rng, 8))
    _chain_round(both, rng)
    _tree_round(both, rng)


def test_memory_follows_each_rows_length(model):
    """One long row beside short ones: the contiguous cache sizes every row as the longest, the
    paged one holds each row's own blocks; the logits stay equal."""
    rng = random.Random(7)
    both = Both(model)
    both.do("add_rows", 16)
    both.do("extend", [[rng.randrange(3, 300) for _ in range(300)]] + _prompts(rng, 15, 10))
    _chain_round(both, rng)
    assert both.contiguous.capacity == both.paged.capacity == (16, 512)
    assert both.paged.held_bytes * 8 < both.contiguous.cache_bytes
    both.do("select", list(range(1, 16)))          # the long row leaves: its blocks go back
    assert both.paged.pool.blocks - both.paged.pool.free <= 15 * 2
    _chain_round(both, rng)


def test_every_cache_is_a_kv_cache_and_says_whether_it_steps_fixed(model):
    """The one cache protocol (kv/protocol.py): the decoder reads `fixed` and `token_bucket` from
    every cache, the C layer's, the fixed step's, the paged fixed step's and the general one."""
    from specpair.kv.dynamic import BatchedKVModel

    caches = [StaticKVModel(model, fixed=False), StaticKVModel(model, token_bucket=W, fixed=True),
              PagedFixedKVModel(model, blocks=64, token_bucket=W), BatchedKVModel(model)]
    assert all(isinstance(kv, KVCache) for kv in caches)
    assert [kv.fixed for kv in caches] == [False, True, True, False]
    assert [kv.token_bucket for kv in caches] == [1, W, W, 1]


def test_the_paged_fixed_step_refuses_what_it_cannot_do(model):
    kv = PagedFixedKVModel(model, blocks=4, token_bucket=W)
    kv.add_rows(1)
    with pytest.raises(SpecpairError, match="branch off a branch"):
        kv.extend([[5, 6, 7, 8]], parents=[[-1, 0, 1, 2]])
    from specpair.block_pool import OutOfBlocks

    with pytest.raises(OutOfBlocks):         # 4 blocks of 16 hold 64 positions, not 100
        kv.extend([[5] * 100])


def test_the_compiled_paged_step_is_warmed_and_compiles_nothing_more(tiny_tokenizer, monkeypatch):
    """Compiled (the tables' rows and blocks symbolic, the pools' shape fixed), warmed at every
    bucket, then a generation with rows joining and leaving and a row crossing into the next
    capacity bucket compiles nothing new, and gives the contiguous eager step's logits."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from specpair.kv import buckets
    from tiny_models import make_model

    monkeypatch.setenv("SPECPAIR_COMPILE_BACKEND", "aot_eager")   # inductor: minutes on 2 cores
    model = make_model(tiny_tokenizer, seed=6, layers=2, dtype=torch.bfloat16).model.eval()
    torch._dynamo.reset()
    paged = PagedFixedKVModel(model, blocks=512, compile="on", token_bucket=W)
    eager = StaticKVModel(model, token_bucket=W)
    assert paged.fixed and paged.compiled
    before = counters["stats"]["unique_graphs"]
    report = paged.warm_up(max_rows=4, max_positions=buckets.INITIAL_POSITIONS)
    assert report["buckets"] == [(r, c) for r in (1, 2, 4) for c in (256, 512)]
    graphs = counters["stats"]["unique_graphs"]
    assert graphs - before == 5      # one row, several; the prompt's step three ways
    assert paged.pool.free == paged.pool.blocks    # the warm-up held no block
    rng = random.Random(0)

    def both(op, *args, **kwargs):
        out = [getattr(kv, op)(*args, **kwargs) for kv in (paged, eager)]
        if op == "extend":
            assert torch.equal(out[0], out[1])

    with torch._dynamo.config.patch(error_on_recompile=True):
        both("add_rows", 1)
        both("extend", [[rng.randrange(3, 300) for _ in range(30)]])
        for step in range(24):
            if step == 3:
                both("add_rows", 1)
                both("extend", [[7], [rng.randrange(3, 300) for _ in range(20)]])
            if step == 10:
                both("select", [1])
            if step == 14:
                both("add_rows", 1)
                both("extend", [[7], [rng.randrange(3, 300) for _ in range(3)]])
            k = rng.randrange(0, 5)
            feed = [[rng.randrange(3, 300) for _ in range(1 + k)] for _ in paged.lengths]
            both("extend", feed, last=1 + k)
            for i, n in enumerate([n - rng.randrange(0, len(f))
                                   for n, f in zip(paged.lengths, feed)]):
                both("rollback", i, n)
            both("trim")
            if step == 18:                                  # a long answer crosses into 512
                both("extend", [[5] * 200 if i == 0 else [5] for i in range(len(paged.lengths))])
    assert paged.capacity[1] == 512
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_paged_fixed_step_bench_runs_on_the_cpu(capsys):
    """bench/paged_fixed_step.py on the tiny shape (its figures are benchmark output; only that
    both caches gave the same logits is checked)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import paged_fixed_step

    assert paged_fixed_step.main(["--shape", "tiny", "--rows", "1", "4", "--long", "40",
                                  "--short", "5", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [json.loads(line) for line in lines[:2]]
    assert [r["rows"] for r in runs] == [1, 4] and all(r["bitwise_equal"] for r in runs)
    assert runs[1]["kv_bytes"]["paged_held"] < runs[1]["kv_bytes"]["contiguous"]
