"""The attention's softmax and exp8 (also the MLP's SiLU) with AVX's min/max/floor where they were
selects, and the softmax's scaled scores computed again where they were stored (cpu_kernels.c).
exp8: each instruction gives the select's very result lane by lane, so the served build must be
its reference build (SPECPAIR_SELECT_EXP: the selects, as it was) bit for bit, over every kind of
float exp8 meets: a sweep of all bit patterns (NaNs, infinities, denormals, both clamps) and the
clamps' edges. The softmax: bit for bit the algorithm as it was, written out here in float32
steps (scale, max, exp8 of the differences, eight lane sums in order, then their lanes, then the
tail, 1 / the sum), for every length 1-300 from several first keys, scores past the low clamp
included. Fails: a floor rounding to nearest (1.2M of the sweep's 4.2M differ), a max raised by
1e-3 in the first eight lanes (a softmax of 17 keys differs)."""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

import numpy as np
import pytest

from specpair import cpu_kernels


@pytest.fixture(scope="module")
def builds() -> dict:
    assert cpu_kernels.available(), cpu_kernels.status()
    libs = {"served": cpu_kernels.library()}
    with tempfile.TemporaryDirectory() as tmp:
        headers = []
        for header in cpu_kernels.HEADERS:
            (Path(tmp) / header.name).write_bytes(header.read_bytes())
            headers.append(Path(tmp) / header.name)
        src = Path(tmp) / "cpu_kernels_select_exp.c"
        src.write_text("#define SPECPAIR_SELECT_EXP 1\n" + cpu_kernels.SOURCE.read_text())
        lib, error = cpu_kernels.build_library(src, *headers)
        assert lib is not None, error
        libs["reference"] = lib
    for lib in libs.values():
        lib.specpair_exp.argtypes = [ctypes.c_void_p, ctypes.c_long]
        lib.specpair_exp.restype = ctypes.c_int
        lib.specpair_softmax_exp.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                             ctypes.c_float]
        lib.specpair_softmax_exp.restype = ctypes.c_float
    return libs


def _exp_bits(lib, x: np.ndarray, n: int) -> np.ndarray:
    out = x.copy()
    lib.specpair_exp(out.ctypes.data, n)
    return out.view(np.uint32)


def test_exp8_is_the_selects_bit_for_bit(builds):
    # every 1021st bit pattern of the 2^32 (both signs, NaNs, infinities, denormals), less a
    # few at the end so the tail's lanes run too
    sweep = np.arange(0, 2**32, 1021, dtype=np.uint64).astype(np.uint32).view(np.float32)
    hi, lo = np.float32(88.3762626647949), np.float32(-87.3365447504019)
    edges = [np.nextafter(e, d, dtype=np.float32) for e in (hi, lo) for d in (-np.inf, np.inf)]
    edges = np.array([*edges, hi, lo, 0.0, -0.0, np.inf, -np.inf, np.nan, 0.5, -0.5, 1e-45,
                      -1e-45, 126.5, -126.5, 63.0, -63.0], dtype=np.float32)
    for x, n in ((sweep, sweep.size - 3), (edges, edges.size)):
        served, reference = (_exp_bits(builds[k], x, n) for k in ("served", "reference"))
        differ = np.flatnonzero(served != reference)
        assert differ.size == 0, f"{differ.size} differ, e.g. exp({x[differ[0]]!r})"
    finite = sweep[np.isfinite(sweep) & (np.abs(sweep) < 80)]
    got = _exp_bits(builds["served"], finite, finite.size).view(np.float32)
    assert np.allclose(got, np.exp(finite.astype(np.float64)), rtol=1e-6, atol=0)


def _softmax_as_it_was(lib, scores: np.ndarray, first: int, end: int, scale: np.float32):
    """softmax_exp's weights and 1 / sum, step by step in float32 (every numpy operation here
    rounds once to float32, as the kernel's lanes do); exp8 is the served library's (held to its
    reference above), lane by lane."""
    s = scores.copy()
    s[first:end] = s[first:end] * scale
    mx = s[first:end].max()
    x = (s[first:end] - mx).astype(np.float32)
    w = x.copy()
    lib.specpair_exp(w.ctypes.data, w.size)
    s[first:end] = w
    whole = w.size // 8 * 8
    lanes = np.zeros(8, dtype=np.float32)
    for c in range(0, whole, 8):
        lanes = lanes + w[c:c + 8]
    total = np.float32(0)
    for lane in lanes:                      # hsum: lane 0 first
        total = np.float32(total + lane)
    for tail in w[whole:]:
        total = np.float32(total + tail)
    return s, np.float32(np.float32(1) / total)


@pytest.mark.parametrize("spread", [1.0, 8.0, 400.0])   # 400: many scores clamp at exp8's low end
def test_softmax_is_the_algorithm_as_it_was_bit_for_bit(builds, spread):
    rng = np.random.default_rng(int(spread))
    scale = np.float32(0.125)
    for n in range(1, 301):
        first = int(rng.integers(0, 9))
        scores = (rng.standard_normal(first + n + 4) * spread).astype(np.float32)
        want, want_inv = _softmax_as_it_was(builds["served"], scores, first, first + n, scale)
        for name in ("served", "reference"):
            s = scores.copy()
            inv = builds[name].specpair_softmax_exp(s.ctypes.data, first, first + n, scale)
            assert np.array_equal(s.view(np.uint32), want.view(np.uint32)), \
                f"{name}, length {n} from {first}: weights differ"
            assert np.float32(inv).view(np.uint32) == want_inv.view(np.uint32), \
                f"{name}, length {n} from {first}: 1 / sum differs"
        # and it is a softmax: the weights times 1 / their sum add to 1
        assert abs(want[first:first + n].astype(np.float64).sum() * float(want_inv) - 1) < 1e-5
