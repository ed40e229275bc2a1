"""The gate's verdict and the checks before any decoding, one home for both gates.

`specpair gate` judges a release with our engine (gate/engine.py) or, for a release that vLLM serves,
with real vLLM servers (gate/vllm.py); both check the release, compare the tokenizers from their
files and fill the same verdict, so the operator judges and promotes both alike.
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple

from specpair.contract import GOLDEN_STRUCTURE_KEYS
from specpair.errors import SpecpairError


def check_release(release: dict) -> None:
    if not isinstance(release, dict):
        raise SpecpairError("release must be a JSON object")
    if not isinstance(release.get("target"), dict):
        raise SpecpairError("release.target is missing (an object with 'source')")
    draft = release.get("draft")
    if not isinstance(draft, dict) or not (draft.get("source") or draft.get("drafter")):
        raise SpecpairError("release.draft needs 'source' (a model) or 'drafter' (e.g. 'ngram')")
    prompts = (release.get("gating") or {}).get("prompts") or []
    if not prompts:
        raise SpecpairError("release.gating.prompts is empty: the gate needs golden prompts")
    for i, p in enumerate(prompts):
        if not isinstance(p, dict) or not str(p.get("prompt", "")).strip():
            raise SpecpairError(f"release.gating.prompts[{i}] needs a non-empty 'prompt'")
    if any(p.get(key) is not None for p in prompts for key in GOLDEN_STRUCTURE_KEYS):
        # Structured golden prompts: refused before any model loads, naming the field.
        from specpair.gate.structured import golden_ask, golden_chat
        chat = bool((release.get("gating") or {}).get("chat", True))
        for i, p in enumerate(prompts):
            golden_ask(p, i, golden_chat(p, chat))


def new_verdict(**extra) -> dict:
    """The verdict before anything is measured: every key of the contract, nothing passed."""
    return {"passed": False, "reasons": [], "tokenizer": None, "greedyIdentity": None,
            "acceptanceRate": None, "meanAcceptanceLength": None, "speedup": None, "speedupNoise": None,
            "categories": {}, "acceptancePerPosition": [], "bestSpeculation": None,
            "kSweep": [], "batchSweep": [], "mlflowRunId": None, "device": None, **extra}


def tokenizer_check(release: dict, progress=print) -> dict:
    """Compare draft and target tokenizers without loading either model's weights. An EAGLE-3 head
    without tokenizer files (what `distill --method eagle3` writes, so every learned head of
    issue 58's training Job) is held to the target's vocabulary instead (vllm_head_check): loading
    its tokenizer failed our engine's gate on every such head (the demo's learning loop, 2026-12-07)."""
    from transformers import AutoTokenizer

    from specpair.models import resolve_source
    from specpair.tokenizer_identity import compare, fingerprint
    from specpair.vllm_head_check import head_tokenizer_check

    head = head_tokenizer_check(release, progress)
    if head is not None:
        return head

    def load_tok(side: dict):
        where = resolve_source(side.get("source") or "default", progress)
        try:
            return AutoTokenizer.from_pretrained(str(where), revision=side.get("revision"))
        except OSError as exc:
            raise SpecpairError(f"cannot load tokenizer for {side.get('source')!r}: {exc}") from exc

    target_fp = fingerprint(load_tok(release["target"]))
    draft = release["draft"]
    if draft.get("drafter"):
        # Model-free drafters propose the target's own tokens: nothing to compare.
        return {"compatible": True, "differences": [], "notes": [f"{draft['drafter']} drafter: no draft tokenizer"],
                "draftFingerprint": None, "targetFingerprint": target_fp["sha256"]}
    draft_fp = fingerprint(load_tok(draft))
    result = compare(draft_fp, target_fp)
    return {**result.to_dict(), "draftFingerprint": draft_fp["sha256"],
            "targetFingerprint": target_fp["sha256"]}


# Both gates (gate/engine.py, gate/vllm.py) time target-only this often and read its noise here.
# Target-only timings of each golden prompt, at least: their spread is the gate's noise.
class PromptRow(NamedTuple):
    """One golden prompt's outcome as both gates record it for the verdict's figures (prompt_figures)."""
    category: str
    base_seconds: float
    spec_seconds: float
    acceptance: Any             # its drafts' counts: AcceptanceStats (ours) or SpecDecodeCounters (vLLM)
    identical: bool
    identical_within_ties: bool
    schema_valid: bool | None   # None: no structure was asked for
    tool_call_parsed: bool | None


def prompt_figures(rows: list[PromptRow], acceptance: Any) -> dict:
    """The verdict's figures over `rows` (every golden prompt, or one category's), whose drafts'
    counts summed are `acceptance`: acceptance, speedup (time summed over the prompts, so long
    replies weigh as they cost), greedy identity; schema validity and tool-call parsing only where
    golden prompts asked for structure (a verdict without them reads as before)."""
    from specpair.gate.structured import rate

    t_base, t_spec = sum(r.base_seconds for r in rows), sum(r.spec_seconds for r in rows)
    figures = {"acceptanceRate": round(acceptance.acceptance_rate, 4),
               "meanAcceptanceLength": round(acceptance.mean_acceptance_length, 4),
               "speedup": round(t_base / t_spec, 4) if t_spec else 0.0,
               "greedyIdentity": round(sum(r.identical for r in rows) / len(rows), 4),
               "greedyIdentityWithinTies": round(sum(r.identical_within_ties for r in rows) / len(rows), 4)}
    for key, value in (("schemaValidity", rate([r.schema_valid for r in rows])),
                       ("toolCallParse", rate([r.tool_call_parsed for r in rows]))):
        if value is not None:
            figures[key] = value
    return figures


NOISE_REPEATS = 3


def timing_noise(repeats: list[list[float]]) -> float:
    """The relative noise of repeated identical work: `repeats` holds, per prompt, the seconds of
    each repeat. Each timing's distance from its prompt's median, relative to that median, pooled
    over the prompts; their median is returned (0 with fewer than two repeats). A median, not the
    largest spread: one repeat slowed by a burst elsewhere (or a first run's warm-up) should not
    make the floor forgive everything."""
    deviations = [abs(t - middle) / middle for times in repeats if len(times) >= 2
                  for middle in [statistics.median(times)] if middle > 0 for t in times]
    return statistics.median(deviations) if deviations else 0.0
