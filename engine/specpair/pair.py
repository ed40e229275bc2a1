"""One way to build a pair: `load_pair(PairSpec) -> SpeculativeEngine`.

`specpair generate` and `specpair bench` (cli.py), the engine server (server/cli.py) and the gate
(gate/engine.py) each turn what they were given, flags or a release (config.Release), into a PairSpec
and load it here, so a release is served as it was gated, whoever loads it.
"""

from __future__ import annotations

import sys

from specpair.config import PairSpec


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_pair(pair: PairSpec, progress=_stderr):
    """Load the target, and the draft where the pair has one, into a SpeculativeEngine with the
    pair's drafter (drafter_choice.build_drafter), k policy and runtime settings. Its warnings
    (a draft refused for its tokenizer, a setting its drafter ignores) go to progress."""
    import torch

    from specpair.decoding import SpeculativeEngine
    from specpair.models import load_model

    if pair.threads:
        torch.set_num_threads(pair.threads)

    def load(role: str, ref):
        progress(f"loading {role} {ref.source}")
        loaded = load_model(ref.source, device=pair.device, dtype=pair.dtype, revision=ref.revision,
                            progress=progress)
        progress(f"{role} loaded: {loaded.num_parameters / 1e6:.1f} M parameters on {loaded.device} "
                 f"in {loaded.load_seconds:.1f} s")
        return loaded

    target = load("target", pair.target)
    draft = load("draft", pair.draft) if pair.draft is not None else None
    engine = SpeculativeEngine(target, drafter=pair.drafter, draft=draft, speculation=pair.speculation,
                               on_mismatch=pair.on_mismatch, kv=pair.kv, compile=pair.compile,
                               kv_budget=pair.kv_budget, ngram=(pair.ngram_max, pair.ngram_min))
    for warning in engine.warnings:
        progress(f"warning: {warning}")
    costs = engine.apply_k_policy(pair.k_policy)
    if costs:
        progress("calibrated: target step {:.1f} ms, draft step {:.2f} ms{}, verify k=4 {:.1f} ms".format(
            costs["target_step"] * 1e3, costs["draft_step"] * 1e3,
            f" (and {costs['draft_round'] * 1e3:.2f} ms a round)" if costs.get("draft_round") else "",
            costs["verify"].get(4, 0) * 1e3))
    return engine
