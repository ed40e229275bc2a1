"""A group's attention by key/value head (cpu_kernels.c, attend_group and plan_step, issue 51):
one task takes a key/value head's query heads (GQA: H / Hkv of them read the same keys and
values) for a part of the group's rows, so each key tile transposed (prompt_scores.h) and each
value tile read serves heads x rows queries, and value loads are shared across heads as across
rows. Which query shares a load must change no arithmetic: every output must be bitwise the
contiguous cache's one-row, one-head path (attend_run), for query heads per key/value head of
1, 3 (SmolLM2: 9 over 3), 7 (two parts of 3 and 4 heads at head dim 64) and 8 (four parts of 2
at head dim 128), with row counts that the threads' parts do not divide evenly (a part's last
value loads shared by two heads of different tokens), a row verifying 3 tokens, a row with its
own copy of the prefix, a sliding window, and a prompt's chunk; with one thread and with two."""

from __future__ import annotations

import pytest
import torch
from paged_pools import BLOCK, paged_copy
from test_engine_paged_kernel import reference_layer

from specpair import cpu_kernels

D, FFN = 96, 136
SHAPES = {               # (query heads, key/value heads, head dim)
    "mha": (3, 3, 32),
    "smollm2": (9, 3, 64),
    "seven": (14, 2, 64),
    "mqa": (8, 1, 128),
}


def _case(shape: str, kind: str, rows: int, gen: torch.Generator) -> dict:
    """decode: `rows` rows over 11 shared prefix blocks plus 0-31 positions of their own, row 1
    verifying 3 tokens, row 3 holding its own copy of the prefix; prompt: one row's `rows`
    tokens after 150 positions (a prompt's chunk, attended as a group)."""
    H, kv_heads, hd = SHAPES[shape]
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    shared, S = 11, 14 * BLOCK
    batch = 1 if kind == "prompt" else rows
    kc, vc = r(batch, kv_heads, S, hd), r(batch, kv_heads, S, hd)
    kc[:, :, :shared * BLOCK] = kc[:1, :, :shared * BLOCK]
    vc[:, :, :shared * BLOCK] = vc[:1, :, :shared * BLOCK]
    pool_k, pool_v, table = paged_copy(kc, vc, gen, shared)
    if kind == "prompt":
        row_of, positions = [0] * rows, list(range(150, 150 + rows))
    else:
        own = torch.arange(pool_k.shape[0], pool_k.shape[0] + shared)
        pool_k = torch.cat([pool_k, pool_k[table[3, :shared]]])
        pool_v = torch.cat([pool_v, pool_v[table[3, :shared]]])
        table[3, :shared] = own
        lengths = [shared * BLOCK + int(n) for n in torch.randint(0, 2 * BLOCK, (batch,), generator=gen)]
        row_of, positions = [], []
        for i in range(batch):
            for w in range(3 if i == 1 else 1):
                row_of.append(i), positions.append(lengths[i] + w)
    T = len(row_of)
    weights = [r(H * hd, D) * 0.1, r(kv_heads * hd, D) * 0.1, r(kv_heads * hd, D) * 0.1,
               r(D, H * hd) * 0.1, r(FFN, D) * 0.1, r(FFN, D) * 0.1, r(D, FFN) * 0.1,
               1 + 0.1 * r(D), 1 + 0.1 * r(D)]
    return dict(h=r(T, D), rows=row_of, positions=positions, cos=r(T, hd), sin=r(T, hd),
                kc=kc, vc=vc, pool_k=pool_k, pool_v=pool_v, table=table, weights=weights,
                H=H, kv_heads=kv_heads, hd=hd)


def _layer(case: dict, threads: int, paged: bool, window: int | None = None,
           only: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer over the paged pool (grouped) or the contiguous cache (one row, one head a
    task), for the tokens `only` (all by default), on `threads` threads: its output and the
    keys and values it left."""
    at = list(range(len(case["rows"]))) if only is None else only
    pick = torch.tensor(at)
    kc, vc = ((case["pool_k"], case["pool_v"]) if paged else (case["kc"], case["vc"]))
    kc, vc = kc.clone(), vc.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.llama_layer(
            case["h"][pick].clone(), torch.tensor(case["rows"])[pick],
            torch.tensor(case["positions"])[pick], case["cos"][pick], case["sin"][pick],
            kc, vc, case["weights"], 1e-5, case["H"], case["kv_heads"],
            case["hd"], window=window, table=case["table"] if paged else None)
    finally:
        torch.set_num_threads(before)
    return out, kc, vc


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind,rows,window", [("decode", 13, None), ("decode", 31, 100),
                                              ("prompt", 37, None)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_groups_heads_by_key_value_head_are_bitwise_each_head_alone(shape, kind, rows, window,
                                                                     threads):
    assert cpu_kernels.available(), cpu_kernels.status()
    case = _case(shape, kind, rows, torch.Generator().manual_seed(rows * 17 + threads + len(shape)))
    grouped = _layer(case, threads, paged=True, window=window)[0]
    alone, kc, vc = _layer(case, threads, paged=False, window=window)
    assert not grouped.isnan().any()
    assert torch.equal(grouped, alone), "a query's attention differs from its head alone"
    if window is None:      # and both are the layer's arithmetic (reference_layer: no window)
        expected = reference_layer(case["h"], case["rows"], case["positions"], case["cos"],
                                   case["sin"], kc, vc, case["weights"],
                                   case["H"], case["kv_heads"], case["hd"])
        torch.testing.assert_close(alone, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", ["smollm2", "seven"])
def test_a_row_in_a_gqa_group_is_bitwise_the_row_stepped_alone(shape):
    """Each row of a 13-row group (two threads: parts of 6 and 7 rows, each task 3 or 4 heads of
    every row) equals that row stepped alone, and rows differ (a sum given to the wrong row or
    head could not hide behind equal rows)."""
    assert cpu_kernels.available(), cpu_kernels.status()
    case = _case(shape, "decode", 13, torch.Generator().manual_seed(51))
    together = _layer(case, 2, paged=True)[0]
    for t in range(len(case["rows"])):
        if case["rows"][t] == 1:        # a verification's tokens: stepped together, below
            continue
        assert torch.equal(together[t], _layer(case, 2, paged=True, only=[t])[0][0]), f"token {t}"
    verify = [t for t in range(len(case["rows"])) if case["rows"][t] == 1]
    assert torch.equal(together[verify], _layer(case, 2, paged=True, only=verify)[0])
    assert not torch.equal(together[0], together[2])
