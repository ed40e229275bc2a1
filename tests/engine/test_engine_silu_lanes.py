"""The MLP's SiLU (cpu_kernels.c silu_lanes): eight whole gate/up outputs load and store as
vectors, a block's last one to seven lane by lane. Both must give the very bits: an output's
SiLU may not depend on where it sits in its block (the served bits of a model whose FFN width is
not a multiple of eight, and issue 51's bitwise rule for the cold prompt's products)."""

from __future__ import annotations

import pytest
import torch

from specpair import cpu_kernels

D, H, KV_HEADS, HD = 16, 2, 1, 8
FFN = 20          # one block of outputs: 8 + 8 as vectors, the last 4 lane by lane
TAIL = 16         # the first output of the lane-by-lane run


@pytest.mark.parametrize("threads", [1, 2])
def test_an_outputs_silu_is_the_same_in_a_vector_and_in_a_blocks_last_lanes(threads):
    """Gate and up outputs 16-19 (the block's last four, lane by lane) get the weights of
    outputs 0-3 (a vector's first four), so their SiLU(gate) * up must be the same floats. The
    down product reads them out one-hot: model output d (d < 4) is sum_d + g[d], output 4 + d
    is sum_{4+d} + g[16 + d], with sum_d == sum_{4+d} (the residual's and attention output's
    columns duplicated the same way). Any difference between the two paths' roundings shows: a
    vector path computing g * u / (1 + e) fails both cases."""
    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(threads)
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    wq, wk, wv = r(H * HD, D) * 0.3, r(KV_HEADS * HD, D) * 0.3, r(KV_HEADS * HD, D) * 0.3
    wo, wg, wu = r(D, H * HD) * 0.3, r(FFN, D) * 0.5, r(FFN, D) * 0.5
    wo[4:8] = wo[0:4]
    wg[TAIL:TAIL + 4], wu[TAIL:TAIL + 4] = wg[0:4], wu[0:4]
    wd = torch.zeros(D, FFN)
    for d in range(4):
        wd[d, d] = wd[4 + d, TAIL + d] = 1.0
    n1, n2 = 1 + 0.1 * r(D), 1 + 0.1 * r(D)
    T = 6
    h = r(T, D) * 2
    h[:, 4:8] = h[:, 0:4]           # the residual's columns, as wo's rows
    kc, vc = torch.zeros(1, KV_HEADS, T, HD), torch.zeros(1, KV_HEADS, T, HD)
    cos, sin = r(T, HD), r(T, HD)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.llama_layer(h.clone(), torch.zeros(T, dtype=torch.long), torch.arange(T),
                                      cos, sin, kc, vc, [wq, wk, wv, wo, wg, wu, wd, n1, n2], 1e-5,
                                      H, KV_HEADS, HD)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(out).all()
    # the layer did add each token's SiLU outputs: column d moved from its residual
    assert not torch.equal(out[:, 0:4], h[:, 0:4])
    for t in range(T):
        assert torch.equal(out[t, 0:4], out[t, 4:8]), (t, out[t, 0:8])
