"""The contiguous cache's C step (kv.runner.StaticLlama.run_layers: the draft model's and the
non-paged engines') runs every layer in one C call (cpu_kernels.llama_layers, issue 51), as the
paged cache's does: a prompt, rows decoding at their own lengths (cut by width into parts:
rows as `rows`), a token tree, a verification and an EAGLE-3 head's features taken on the
way must give logits, features and every layer's keys and values bitwise what the same steps
give a layer a call (run_layers' path for a kernel without llama_layers)."""

from __future__ import annotations

import torch
from layer_calls import assert_the_path_taken, counted_layer_calls

from specpair import cpu_kernels
from specpair.kv.runner import StaticLlama
from specpair.kv.static import StaticKVModel


def _script(gen: torch.Generator) -> list[tuple]:
    t = lambda n: torch.randint(3, 300, (n,), generator=gen).tolist()   # noqa: E731
    rows = 5
    return [("add_rows", (rows,), {}),
            ("extend", ([t(6 + 2 * r) for r in range(rows)],), {"hidden": True}),   # 6-14 tokens a row
            ("extend", ([t(1) for _ in range(rows)],), {"hidden": True}),
            ("extend", ([t(1 + r % 3) for r in range(rows)],), {"last": [1, 2, 3, 1, 2]}),
            ("extend", ([t(3) for _ in range(rows)],),
             {"last": 3, "hidden": True, "parents": [[-1, 0, 0]] * rows}),
            ("extend", ([t(4) for _ in range(rows)],), {"last": 4, "hidden": True})]


def _run(model, steps, one_call: bool, monkeypatch) -> tuple[list, list]:
    with counted_layer_calls(monkeypatch, one_call) as calls:
        kv = StaticKVModel(model, fixed=False)
        results = []
        for op, args, kwargs in steps:
            out = getattr(kv, op)(*args, **kwargs)
            if op == "extend":
                results.append(out if isinstance(out, tuple) else (out,))
        caches = [(k.clone(), v.clone()) for k, v in kv.caches]
    assert_the_path_taken(calls, one_call, len(model.model.layers), steps=5)
    return results, caches


def test_the_contiguous_step_in_one_call_is_bitwise_a_layer_a_call(eagle3_target, monkeypatch):
    assert cpu_kernels.available() and cpu_kernels.layers_apply(), cpu_kernels.status()
    model = eagle3_target.model
    runner = StaticLlama.of(model)
    monkeypatch.setattr(runner, "feature_layers", (1, 2, runner.layer_count))
    steps = _script(torch.Generator().manual_seed(52))
    one, one_caches = _run(model, steps, True, monkeypatch)
    apart, apart_caches = _run(model, steps, False, monkeypatch)
    assert len(one) == len(apart) == 5
    for step, (a, b) in enumerate(zip(one, apart)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"extend {step} differs"
    assert one[0][1].shape[-1] == model.config.hidden_size * 3     # the features handed over
    for layer, ((k, v), (k0, v0)) in enumerate(zip(one_caches, apart_caches)):
        assert torch.equal(k, k0) and torch.equal(v, v0), f"layer {layer}'s keys or values differ"
