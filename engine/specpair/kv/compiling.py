"""torch.compile for the cache's steps: whether to compile (`resolve_compile`), with what
(`compile_options`), where inductor keeps its kernels (`use_compile_cache`), and one compiled
function per process and device type (`compiled_function`)."""

from __future__ import annotations

import os

import torch
import torch._dynamo

from specpair.errors import SpecpairError


COMPILE_MODES = ("off", "on")


def compile_options(device: torch.device) -> dict:
    """torch.compile's settings for the fixed step's layer: inductor, or SPECPAIR_COMPILE_BACKEND
    (the tests use aot_eager: the same graphs and guards without inductor's minutes on 2 cores).
    No mode="reduce-overhead": on CUDA the engine records the whole step as one CUDA graph itself
    (`CapturedStep`), which replays without dynamo's guards or the graph trees' bookkeeping, the
    0.9-1.1 ms a call that reduce-overhead cost on every shape (docs/gpu.md)."""
    return {"backend": os.environ.get("SPECPAIR_COMPILE_BACKEND") or "inductor"}


def resolve_compile(mode: str | None = None, device: torch.device | None = None) -> str:
    """Whether the static step is compiled: asked for, else SPECPAIR_COMPILE, else on for CUDA
    (CUDA graphs: 2.17 ms a SmolLM2 step on an H100 where the eager step took 38 ms; docs/gpu.md)
    and off elsewhere (on this 2-core CPU the compiled step measured slower than the eager one)."""
    default = "on" if device is not None and torch.device(device).type == "cuda" else "off"
    mode = mode or os.environ.get("SPECPAIR_COMPILE") or default
    if mode not in COMPILE_MODES:
        raise SpecpairError(f"compile mode {mode!r}: choose one of {', '.join(COMPILE_MODES)}")
    return mode


_compiled_functions: dict = {}


def compiled_function(function, device: torch.device):
    """`function` compiled with fullgraph=True (compile_options), once per process and device
    type (the fixed step's layer, Medusa's heads)."""
    key = (function, torch.device(device).type)
    if key not in _compiled_functions:
        # A few graphs per model and token bucket (one row, several rows: mark_sizes), each
        # model one more entry: past dynamo's default of 8 in a server with a target, a draft
        # and a head.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        use_compile_cache()
        _compiled_functions[key] = torch.compile(function, fullgraph=True,
                                                 **compile_options(torch.device(key[1])))
    return _compiled_functions[key]


def use_compile_cache() -> None:
    """Keep inductor's compiled kernels in the model cache (SPECPAIR_CACHE/inductor) unless
    TORCHINDUCTOR_CACHE_DIR says otherwise: a cold compile of the fixed step took 147 s on an
    H100 and a warm one 30 s (docs/gpu.md), so an engine restarted on the same volume starts warm.
    A cache it cannot write (a read-only volume) is left to inductor's default under /tmp."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    from specpair.models import cache_root

    folder = cache_root() / "inductor"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    if os.access(folder, os.W_OK):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
