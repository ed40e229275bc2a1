"""The C layer's calls counted, for the tests that a step runs every layer in one call
(test_engine_layers_one_call.py: the paged cache; test_engine_runner_one_call.py: the contiguous
one) against the same steps a layer a call."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from specpair import cpu_kernels


@contextmanager
def counted_layer_calls(monkeypatch, one_call: bool) -> Iterator[dict]:
    """While the block runs, {"layers": cpu_kernels.llama_layers calls, "layer": llama_layer calls};
    `one_call` False: layers_apply() says no, so a step takes the path of a kernel without
    llama_layers (a layer a call)."""
    calls = {"layers": 0, "layer": 0}

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "llama_layers", count("layers", cpu_kernels.llama_layers))
        patch.setattr(cpu_kernels, "llama_layer", count("layer", cpu_kernels.llama_layer))
        if not one_call:
            patch.setattr(cpu_kernels, "layers_apply", lambda: False)
        yield calls


def assert_the_path_taken(calls: dict, one_call: bool, layer_count: int, steps: int) -> None:
    """At least `steps` steps ran: each as one llama_layers call (one_call), else as layer_count
    llama_layer calls, and never the other way."""
    if one_call:
        assert calls["layer"] == 0 and calls["layers"] >= steps, calls
    else:
        assert calls["layers"] == 0 and calls["layer"] >= steps * layer_count, calls
