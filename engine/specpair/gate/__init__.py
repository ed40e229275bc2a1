"""`specpair gate`: golden-prompt gating of one release, ending in one verdict.

Three modules, no circles: `verdict` is what every gate writes (the release check, the verdict's
shape, the tokenizer check); `engine` gates a release on our engine; `vllm` gates a release that
vLLM serves, with real vLLM servers, into the same verdict. `run_gate` picks by the release's
engine kind.
"""

__all__ = ["run_gate", "run_gate_file"]


def __getattr__(name: str):
    # `specpair.gate.vllm` is imported by torch-free processes (a vLLM pod's launcher): the engine's
    # gate, which imports torch, loads only when asked for.
    if name in __all__:
        from specpair.gate import engine
        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
