"""The paged cache's steps run every layer in one C call (cpu_kernels.llama_layers, issue 51):
through a model's whole life (a prompt longer than one call, a shared prefix, 32 rows decoding,
token trees, an EAGLE-3 head's features taken on the way) its logits, features and every
layer's keys and values are bitwise what the same steps give a layer a call
(paged_cache.PagedKVModel.extend's path for a kernel without llama_layers)."""

from __future__ import annotations

import pytest
import torch
from layer_calls import assert_the_path_taken, counted_layer_calls

from specpair import cpu_kernels
from specpair.kv.runner import StaticLlama
from specpair.paged_cache import PagedKVModel
from specpair.prefix_cache import block_keys


def _script(model, gen: torch.Generator) -> list[tuple]:
    """The steps both caches run: (operation, args, kwargs)."""
    t = lambda n: torch.randint(3, 300, (n,), generator=gen).tolist()   # noqa: E731
    prompt = t(150)                                 # 9 full blocks and 6: two C calls (128 + 22)
    rows = 32
    steps = [("add_rows", (1,), {}), ("extend", ([prompt],), {"hidden": True}),
             ("publish", (0, block_keys("m", prompt)), {}), ("add_rows", (rows - 1,), {})]
    steps += [("share_prefix", (r, block_keys("m", prompt), len(prompt)), {})
              for r in range(1, rows)]
    # each joining row feeds the prompt's last 6 tokens and its own question
    steps.append(("extend", ([[]] + [prompt[144:] + t(3 + r % 5) for r in range(1, rows)],),
                  {"hidden": True}))
    for hidden in (True, False, True):
        steps.append(("extend", ([t(1) for _ in range(rows)],), {"hidden": hidden}))
    # a tree a row: a token, two alternatives after it (96 tokens: one call of MAX_TOKENS 128)
    steps.append(("extend", ([t(3) for _ in range(rows)],),
                  {"last": 3, "hidden": True, "parents": [[-1, 0, 0]] * rows}))
    steps += [("rollback", (r, None), {}) for r in range(0, rows, 3)]
    steps.append(("extend", ([t(4) for _ in range(rows)],), {"last": 4}))       # verification
    return steps


def _run(model, steps, one_call: bool, monkeypatch) -> tuple[list, list]:
    """Each extend's results and, at the end, every layer's keys and values."""
    with counted_layer_calls(monkeypatch, one_call) as calls:
        kv = PagedKVModel(model, blocks=96)
        results = []
        for op, args, kwargs in steps:
            if op == "rollback":
                args = (args[0], kv.lengths[args[0]] - 2)       # the tree's alternatives go
            out = getattr(kv, op)(*args, **kwargs)
            if op == "extend":
                results.append(out if isinstance(out, tuple) else (out,))
        caches = [(k.clone(), v.clone()) for k, v in kv.caches]
    assert_the_path_taken(calls, one_call, len(model.model.layers), steps=10)
    return results, caches


def test_a_paged_models_steps_in_one_call_are_bitwise_a_layer_a_call(eagle3_target, monkeypatch):
    assert cpu_kernels.available() and cpu_kernels.layers_apply(), cpu_kernels.status()
    model = eagle3_target.model
    runner = StaticLlama.of(model)
    # an EAGLE-3 head's features: the inputs of layers 1 and 2 and the last output (4)
    monkeypatch.setattr(runner, "feature_layers", (1, 2, runner.layer_count))
    steps = _script(model, torch.Generator().manual_seed(51))
    one, one_caches = _run(model, steps, True, monkeypatch)
    apart, apart_caches = _run(model, steps, False, monkeypatch)
    assert len(one) == len(apart) == 7
    for step, (a, b) in enumerate(zip(one, apart)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"extend {step} differs"
    width = model.config.hidden_size * 3
    assert one[0][1].shape[-1] == width                 # the three features were handed over
    for layer, ((k, v), (k0, v0)) in enumerate(zip(one_caches, apart_caches)):
        assert torch.equal(k, k0) and torch.equal(v, v0), f"layer {layer}'s keys or values differ"


def test_a_stack_follows_a_weight_that_moved(one_layer_target, monkeypatch):
    """A weight's storage replaced between steps (as the fixed step's joined q|k|v replaces
    it): the next step reads the new one (the stack is built again), as a layer a call does."""
    model = one_layer_target.model
    assert cpu_kernels.available() and cpu_kernels.layers_apply(), cpu_kernels.status()
    one, apart = PagedKVModel(model, blocks=8), PagedKVModel(model, blocks=8)

    def step(tokens):
        got = one.extend(tokens)
        with monkeypatch.context() as patch:
            patch.setattr(cpu_kernels, "layers_apply", lambda: False)
            assert torch.equal(got, apart.extend(tokens))
        return got
    one.add_rows(1), apart.add_rows(1)
    step([[5, 6, 7]])
    stack = one.plane.stack()
    assert one.plane.stack() is stack                      # built once, not per step
    q = model.model.layers[0].self_attn.q_proj.weight
    before = q.data
    try:
        q.data = before * 2                                # new storage, new values
        assert one.plane.stack() is not stack
        step([[8]])
    finally:
        q.data = before


def test_the_wheel_ships_every_kernel_source_and_header():
    """The engine image installs the wheel and compiles the kernels where it runs: every C file
    the kernels build from, and every header they #include, must be in the package data (a
    missing one fails the build there, and the engine falls back to torch)."""
    import fnmatch
    import re
    import tomllib
    from pathlib import Path

    from specpair import head_kernels

    root = Path(cpu_kernels.SOURCE).parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["specpair"]
    files = {cpu_kernels.SOURCE, head_kernels.SOURCE, *cpu_kernels.HEADERS}
    for source in list(files):
        for name in re.findall(r'^#include "([^"/]+)"', source.read_text(), re.M):
            files.add(source.with_name(name))
    assert cpu_kernels.HEADERS[0] in files and len(files) >= 3
    for path in files:
        assert path.exists(), path
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns), \
            f"{path.name} is not in pyproject's package data {patterns}"


@pytest.mark.parametrize("cpu", [
    ["-march=x86-64-v2"],                       # no AVX: the scalar paths
    ["-march=x86-64", "-mavx", "-mno-fma"],      # AVX without FMA (Sandy/Ivy Bridge, some VMs)
    ["-march=x86-64-v3"],                       # AVX2 and FMA, no AVX-512
])
def test_the_kernels_compile_for_cpus_with_fewer_extensions(cpu, tmp_path):
    """The kernels build with -march=native where they run: a node whose CPU lacks FMA or AVX
    must still get a library, not the torch fallback (a build with AVX but no FMA once failed on
    an __m256 that only the FMA branch's #include declared)."""
    import os
    import platform
    import shutil
    import subprocess

    from specpair import head_kernels

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if platform.machine() != "x86_64" or not compiler:
        pytest.skip("x86-64 flags, and a C compiler to try them")
    # -O1: what fails to compile fails at any level, in a fraction of -O3's time
    flags = ["-O1" if f == "-O3" else f for f in cpu_kernels.FLAGS
             if f not in ("-march=native", "-shared", "-fPIC")]
    for source in (cpu_kernels.SOURCE, head_kernels.SOURCE):
        proc = subprocess.run([compiler, *flags, *cpu, "-Werror=implicit-function-declaration",
                               f"-I{cpu_kernels.SOURCE.parent}", "-c", str(source),
                               "-o", str(tmp_path / f"{source.stem}.o")],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (source.name, cpu, proc.stderr[-2000:])
