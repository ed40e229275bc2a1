"""Attention scores of a group's queries from keys transposed once (prompt_scores.h): a prompt's
chunk, rows sharing a prompt prefix by reference. The scores must be bitwise those of
attend_group's own loop (dot8: the same lane chains, the lanes added in the same order), so a
prompt's keys, values and tokens are what they were, whatever path computed them.

Three builds of the served kernel source (prompt_scores.h wired in; a copy wired by
bench/prompt_scores_ab.py while cpu_kernels.c does not include it yet): as served, with the
header's path off (PS_MIN_QUERIES past any group: the loop as before), and broken on purpose
(PS_TEST_BROKEN: lane 0's chain added twice). Served must equal off bit for bit, and broken
must differ from off: the cases do run through the header's path."""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from paged_pools import BLOCK, paged_copy

from specpair import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from prompt_scores_ab import HEADER, OFF, wired  # noqa: E402

D, H, KV_HEADS, FFN = 128, 4, 2, 264


@pytest.fixture(scope="module")
def builds() -> dict:
    assert cpu_kernels.available(), cpu_kernels.status()
    served = cpu_kernels.library()
    text = wired(cpu_kernels.SOURCE.read_text())
    libs = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / HEADER.name).write_bytes(HEADER.read_bytes())
        for name, defines in (("served", ""), ("off", OFF[2:].replace("=", " ")),
                              ("broken", "PS_TEST_BROKEN 1")):
            src = Path(tmp) / f"cpu_kernels_{name}.c"
            src.write_text((f"#define {defines}\n" if defines else "") + text)
            lib, error = cpu_kernels.build_library(src, Path(tmp) / HEADER.name)
            assert lib is not None, error
            for fn in ("specpair_small_linear", "specpair_llama_layer"):
                getattr(lib, fn).argtypes = getattr(served, fn).argtypes
                getattr(lib, fn).restype = getattr(served, fn).restype
            lib.specpair_max_tokens.restype = lib.specpair_max_head_dim.restype = ctypes.c_int
            libs[name] = lib
    yield libs
    cpu_kernels.use_library(served)


def _case(kind: str, hd: int, gen: torch.Generator) -> dict:
    """prompt: one row's 64 tokens after 200 positions (a prompt's chunk); window: the same
    under a sliding window of 200 (every token's first key past 0: the keys all see start
    later); decode: 32 rows of one token over 11 shared prefix blocks (every fourth row its own
    copy of them) and 0-31 positions of their own; verify: 11 rows of 3 tokens over the shared
    blocks, a window of 150. Paged, blocks at shuffled places."""
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    shared, S = 11, 18 * BLOCK
    batch = 1 if kind in ("prompt", "window") else 32
    kc, vc = r(batch, KV_HEADS, S, hd), r(batch, KV_HEADS, S, hd)
    kc[:, :, :shared * BLOCK] = kc[:1, :, :shared * BLOCK]
    vc[:, :, :shared * BLOCK] = vc[:1, :, :shared * BLOCK]
    lengths = [shared * BLOCK + int(n) for n in torch.randint(0, 2 * BLOCK, (batch,), generator=gen)]
    rows, positions = [], []
    if kind in ("prompt", "window"):
        rows, positions = [0] * 64, list(range(200, 264))
    else:
        for row in range(11 if kind == "verify" else 32):
            n = 3 if kind == "verify" else 1
            rows += [row] * n
            positions += range(lengths[row], lengths[row] + n)
    kc, vc, table = paged_copy(kc, vc, gen, shared)
    for own in range(4, batch, 4):
        fresh = torch.arange(kc.shape[0], kc.shape[0] + shared)
        kc, vc = torch.cat([kc, kc[table[own, :shared]]]), torch.cat([vc, vc[table[own, :shared]]])
        table[own, :shared] = fresh
    weights = [r(H * hd, D) * 0.1, r(KV_HEADS * hd, D) * 0.1, r(KV_HEADS * hd, D) * 0.1,
               r(D, H * hd) * 0.1, r(FFN, D) * 0.1, r(FFN, D) * 0.1, r(D, FFN) * 0.1,
               1 + 0.1 * r(D), 1 + 0.1 * r(D)]
    T = len(rows)
    return dict(h=r(T, D), rows=torch.tensor(rows), positions=torch.tensor(positions),
                cos=r(T, hd), sin=r(T, hd), kc=kc, vc=vc, weights=weights, table=table,
                window={"window": 200, "verify": 150}.get(kind), hd=hd)


def _run(lib, case: dict, threads: int) -> tuple[torch.Tensor, ...]:
    cpu_kernels.use_library(lib)
    kc, vc = case["kc"].clone(), case["vc"].clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h = cpu_kernels.llama_layer(case["h"].clone(), case["rows"], case["positions"], case["cos"],
                                    case["sin"], kc, vc, case["weights"], 1e-5, H, KV_HEADS,
                                    case["hd"], window=case["window"], table=case["table"])
    finally:
        torch.set_num_threads(before)
    # bit patterns: the pools' unused blocks hold NaN (paged_copy), and NaN != NaN
    return tuple(x.view(torch.int32) for x in (h, kc, vc))


@pytest.mark.parametrize("kind,hd", [("prompt", 64), ("window", 64), ("decode", 64), ("verify", 64),
                                     ("prompt", 16), ("prompt", 128), ("decode", 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_scores_from_transposed_keys_are_bitwise_the_loops(builds, kind, hd, threads):
    case = _case(kind, hd, torch.Generator().manual_seed(hd * 7 + len(kind)))
    off = _run(builds["off"], case, threads)
    served = _run(builds["served"], case, threads)
    broken = _run(builds["broken"], case, threads)
    assert not off[0].view(torch.float32).isnan().any()
    for name, a, b in zip(("output", "keys", "values"), off, served):
        assert torch.equal(a, b), f"{name}: scores through prompt_scores.h differ from the loop's"
    assert not torch.equal(off[0], broken[0]), "the case never ran through prompt_scores.h"
