"""The C layer as one OpenMP parallel region (cpu_kernels.c, specpair_llama_layer): its threads
meet only at the barriers that end the phases a later phase reads whole, and share the work
between the products (norms, rotary embedding, cache writes, SiLU, residuals) by token or by
lanes. Which thread does what changes no arithmetic, so with two threads every output and every
key and value written must be bitwise the one-thread layer's.

A barrier missing shows only when a thread reads a share another has not written yet, which an
unloaded machine rarely lets happen; so the layer is also run in a build that holds the team's
first thread back at the start of every phase (-DSPECPAIR_STAGGER_US), over a NaN-filled
scratch: there a missing barrier lets the other thread read that share unwritten."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from paged_pools import BLOCK, paged_copy

from specpair import cpu_kernels

D, H, KV_HEADS, HD, FFN = 128, 4, 2, 64, 264     # 264: a SiLU of T x 264 lanes ends mid-vector


def _case(kind: str, tokens: int, gen: torch.Generator) -> dict:
    """A layer call's inputs. decode/verify: `tokens` tokens of rows over a paged cache whose
    rows share 11 prefix blocks (every fourth row holds its own copy: groups and lone rows mix),
    every third row verifying 3 tokens; prompt: one row's `tokens` tokens (a prompt's chunk,
    attended as a group cut in parts); tree: a contiguous cache, rows of a token and two
    alternatives after it."""
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    shared, S = 11, 16 * BLOCK
    batch = max(1, tokens)
    kc, vc = r(batch, KV_HEADS, S, HD), r(batch, KV_HEADS, S, HD)
    kc[:, :, :shared * BLOCK] = kc[:1, :, :shared * BLOCK]
    vc[:, :, :shared * BLOCK] = vc[:1, :, :shared * BLOCK]
    lengths = [shared * BLOCK + int(n) for n in torch.randint(0, 2 * BLOCK, (batch,), generator=gen)]
    rows, positions, slots, parents, table = [], [], None, None, None
    if kind == "prompt":
        rows, positions = [0] * tokens, list(range(lengths[0] - tokens, lengths[0]))
    elif kind == "tree":
        slots, parents = [], []
        row = 0
        while len(rows) < tokens:
            width = min(3, tokens - len(rows))
            first = len(rows)
            for w in range(width):      # the row's next token, then two alternatives to its next
                rows.append(row), positions.append(lengths[row] + min(w, 1))
                slots.append(lengths[row] + w), parents.append(first if w else -1)
            row += 1
    else:
        row = 0
        while len(rows) < tokens:
            n = min(3 if kind == "verify" and row % 3 == 1 else 1, tokens - len(rows))
            for w in range(n):
                rows.append(row), positions.append(lengths[row] + w)
            row += 1
    if kind in ("decode", "verify", "prompt"):
        kc, vc, table = paged_copy(kc, vc, gen, shared)
        for own in range(0, batch, 4):
            if own == 0:
                continue
            fresh = torch.arange(kc.shape[0], kc.shape[0] + shared)
            kc, vc = torch.cat([kc, kc[table[own, :shared]]]), torch.cat([vc, vc[table[own, :shared]]])
            table[own, :shared] = fresh
    T = len(rows)
    weights = [r(H * HD, D) * 0.1, r(KV_HEADS * HD, D) * 0.1, r(KV_HEADS * HD, D) * 0.1,
               r(D, H * HD) * 0.1, r(FFN, D) * 0.1, r(FFN, D) * 0.1, r(D, FFN) * 0.1,
               1 + 0.1 * r(D), 1 + 0.1 * r(D)]
    options = {"bq": r(H * HD) * 0.1, "bk": r(KV_HEADS * HD) * 0.1, "bv": r(KV_HEADS * HD) * 0.1,
               "qn": 1 + 0.1 * r(HD), "kn": 1 + 0.1 * r(HD)} if kind == "tree" else None
    return dict(h=r(T, D), rows=torch.tensor(rows), positions=torch.tensor(positions),
                cos=r(T, HD), sin=r(T, HD), kc=kc, vc=vc, weights=weights, table=table,
                slots=None if slots is None else torch.tensor(slots),
                parents=None if parents is None else torch.tensor(parents), options=options,
                window=40 if kind == "verify" else None)


def _nan_scratch(case: dict) -> tuple[int, torch.Tensor]:
    """(positions the case attends, its layer scratch filled with NaN: a read of a value not
    written this call shows)."""
    reach = int((case["slots"] if case["slots"] is not None else case["positions"]).max()) + 1
    scratch = cpu_kernels.layer_scratch(len(case["rows"]), D, H, KV_HEADS, HD, FFN, reach)
    return reach, scratch.fill_(float("nan"))


def _run(case: dict, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output and the caches it wrote, on `threads` threads, over a NaN scratch."""
    kc, vc = case["kc"].clone(), case["vc"].clone()
    reach, scratch = _nan_scratch(case)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h = cpu_kernels.llama_layer(
            case["h"].clone(), case["rows"], case["positions"], case["cos"], case["sin"], kc, vc,
            case["weights"], 1e-5, H, KV_HEADS, HD, reach, scratch, slots=case["slots"],
            parents=case["parents"], options=case["options"], window=case["window"],
            table=case["table"])
    finally:
        torch.set_num_threads(before)
    return h, kc, vc


CASES = [("decode", n) for n in (1, 2, 5, 8, 13, 32, 64)] + [
    ("verify", 9), ("verify", 33), ("prompt", 20), ("prompt", 64), ("tree", 3), ("tree", 17)]


@pytest.fixture(scope="module")
def staggered():
    """The kernel built with its first thread held back 2 ms at each phase (TEAM_PHASE)."""
    assert cpu_kernels.available(), cpu_kernels.status()
    served = cpu_kernels.library()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "cpu_kernels_staggered.c"
        src.write_text(f'#define SPECPAIR_STAGGER_US 2000\n#include "{cpu_kernels.SOURCE}"\n')
        lib, error = cpu_kernels.build_library(src, cpu_kernels.SOURCE, *cpu_kernels.HEADERS)
        assert lib is not None, error
    for name in ("specpair_small_linear", "specpair_llama_layer", "specpair_llama_layers"):
        getattr(lib, name).argtypes = getattr(served, name).argtypes
        getattr(lib, name).restype = getattr(served, name).restype
    lib.specpair_max_tokens.restype = lib.specpair_max_head_dim.restype = ctypes.c_int
    return lib


@pytest.mark.parametrize("kind,tokens", CASES)
def test_two_threads_are_bitwise_one_thread(kind, tokens, staggered):
    assert cpu_kernels.available(), cpu_kernels.status()
    served = cpu_kernels.library()
    case = _case(kind, tokens, torch.Generator().manual_seed(tokens * 31 + len(kind)))
    one = _run(case, 1)
    assert not one[0].isnan().any()
    two = _run(case, 2)
    try:
        cpu_kernels.use_library(staggered)
        late = _run(case, 2)
    finally:
        cpu_kernels.use_library(served)
    # bit patterns: the pools' unused blocks hold NaN (paged_copy), and NaN != NaN
    for name, a, b, c in zip(("output", "keys", "values"), one, two, late):
        a, b, c = (x.view(torch.int32) for x in (a, b, c))
        assert torch.equal(a, b), f"{name}: two threads differ from one"
        assert torch.equal(a, c), f"{name}: two threads, the first held back, differ from one"


def test_the_staggered_build_holds_its_first_thread_back(staggered):
    """The test above can fail only if the held-back build really holds a thread back: a layer
    call in it takes at least its phases' 2 ms each, where the served build's takes far less."""
    import time
    served = cpu_kernels.library()
    case = _case("decode", 8, torch.Generator().manual_seed(0))
    try:
        cpu_kernels.use_library(staggered)
        start = time.perf_counter()
        _run(case, 2)
        held = time.perf_counter() - start
    finally:
        cpu_kernels.use_library(served)
    assert held >= 9 * 0.002, held      # at least nine phases of 2 ms (sleeps only add)


# ---- A step's layers in one call (specpair_llama_layers) ------------------------------------

def _stack_case(case: dict, gen: torch.Generator) -> tuple[list, list, list, list]:
    """Three layers over `case`'s tokens: the case's own weights, then two more of the same
    shapes; each its own cache (the case's, shifted per layer, so a layer reading another's
    shows); windows differing by layer (a sliding window on one, none on another)."""
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    weights = [case["weights"]] + [[r(*w.shape) * 0.1 if w.dim() == 2 else 1 + 0.1 * r(*w.shape)
                                     for w in case["weights"]] for _ in range(2)]
    options = [case["options"] or {}] + [
        {name: t + 0.05 * r(*t.shape) for name, t in (case["options"] or {}).items()}
        for _ in range(2)]
    windows = [case["window"], None, 24]
    caches = [(case["kc"] + 0.5 * layer, case["vc"] - 0.25 * layer) for layer in range(3)]
    return weights, options, windows, caches


def _layer_by_layer(case: dict, stack: tuple, capture: tuple[int, ...]):
    """The reference: llama_layer a layer a call, on one thread, each captured layer's input
    cloned before it runs."""
    weights, options, windows, caches = stack
    caches = [(k.clone(), v.clone()) for k, v in caches]
    h, taken = case["h"].clone(), []
    reach = int((case["slots"] if case["slots"] is not None else case["positions"]).max()) + 1
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for layer in range(3):
            if layer in capture:
                taken.append(h.clone())
            cpu_kernels.llama_layer(h, case["rows"], case["positions"], case["cos"], case["sin"],
                                    *caches[layer], weights[layer], 1e-5, H, KV_HEADS, HD, reach,
                                    slots=case["slots"], parents=case["parents"],
                                    options=options[layer], window=windows[layer],
                                    table=case["table"])
    finally:
        torch.set_num_threads(before)
    return h, taken, caches


def _one_call(case: dict, stack: tuple, capture: tuple[int, ...], threads: int):
    weights, options, windows, caches = stack
    caches = [(k.clone(), v.clone()) for k, v in caches]
    reach, scratch = _nan_scratch(case)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        h, taken = cpu_kernels.llama_layers(
            case["h"].clone(), case["rows"], case["positions"], case["cos"], case["sin"],
            cpu_kernels.LayerStack(weights, options, windows, caches), 1e-5, H, KV_HEADS, HD,
            reach, scratch, slots=case["slots"], parents=case["parents"], table=case["table"],
            capture=capture)
    finally:
        torch.set_num_threads(before)
    return h, taken, caches


@pytest.mark.parametrize("kind,tokens", CASES)
def test_a_steps_layers_in_one_call_are_bitwise_a_layer_a_call(kind, tokens, staggered):
    """Every layer's cache writes, the last output and the captured layer inputs (an EAGLE-3
    head's features: layers 0 and 2 here; 3, the layer count, names the output, which is h)
    equal llama_layer's a layer at a time, on 1 and 2 threads and in the held-back build."""
    assert cpu_kernels.available(), cpu_kernels.status()
    served = cpu_kernels.library()
    gen = torch.Generator().manual_seed(tokens * 17 + len(kind))
    case = _case(kind, tokens, gen)
    stack = _stack_case(case, gen)
    capture = (0, 2, 3)
    expected = _layer_by_layer(case, stack, capture)
    assert not expected[0].isnan().any() and len(expected[1]) == 2
    runs = {"1 thread": _one_call(case, stack, capture, 1),
            "2 threads": _one_call(case, stack, capture, 2)}
    try:
        cpu_kernels.use_library(staggered)
        runs["2 threads, one held back"] = _one_call(case, stack, capture, 2)
    finally:
        cpu_kernels.use_library(served)
    bits = lambda t: t.view(torch.int32)   # noqa: E731  (unused pool blocks hold NaN)
    for name, (h, taken, caches) in runs.items():
        assert torch.equal(bits(h), bits(expected[0])), f"{name}: output differs"
        assert len(taken) == 2, name
        for got, want in zip(taken, expected[1]):
            assert torch.equal(bits(got), bits(want)), f"{name}: a captured input differs"
        for layer, ((k, v), (k0, v0)) in enumerate(zip(caches, expected[2])):
            assert torch.equal(bits(k), bits(k0)) and torch.equal(bits(v), bits(v0)), \
                f"{name}: layer {layer}'s cache writes differ"


def test_a_layer_stack_is_built_again_when_a_weight_moves():
    """The stack's pointer arrays are built once; a weight whose storage is replaced (as the
    fixed step's joined q|k|v replaces it) makes it stale (paged_cache.PagedLayers.stack then
    builds it again); a stack's lists must agree in length."""
    gen = torch.Generator().manual_seed(5)
    case = _case("decode", 2, gen)
    weights, options, windows, caches = _stack_case(case, gen)
    stack = cpu_kernels.LayerStack(weights, options, windows, caches)
    assert stack.current()
    weights[1][0].data = weights[1][0].clone()
    assert not stack.current()
    with pytest.raises(ValueError, match="a layer stack of 3 weights"):
        cpu_kernels.LayerStack(weights, options, windows, caches[:2])
