"""`specpair gate`: golden-prompt gating of one release, ending in one verdict.

Three modules, no circles: `verdict` is what every gate writes (the release check, the verdict's
shape, the tokenizer check); `engine` gates a release on our engine; `vllm` gates a release that
vLLM serves, with real vLLM servers, into the same verdict. `run_gate` picks by the release's
engine kind.
"""

from specpair.gate.engine import run_gate, run_gate_file

__all__ = ["run_gate", "run_gate_file"]
