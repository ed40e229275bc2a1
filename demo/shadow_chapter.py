"""The shadow chapter's pieces that need no cluster: the candidate's spec, how far its shadow
scoring got (read from the pair's status alone), and its verdict in words with the numbers.

The candidate changes only the draft side of what serves (its draft, and `k`), so the operator
chooses Shadow by itself (rollout_strategy.choose_strategy): it is gated, not promoted, and scored
on the champion's own pods while they go on serving. The outcome is the operator's; the demo reads
it from the pair's status and never assumes it:

- n-gram lookup (the default pair): the team tries a draft model in place of the lookup, a
  layer-skip draft made of the target's own first LAYER_SKIP_LAYERS layers (untrained). It passes
  its gate (greedy identity holds whatever the draft, and the demo's gate sets no acceptance
  floor); on the extraction traffic the lookup copies well, its first-position acceptance is near
  0 against the lookup's ~0.7 (measured with the engine alone on CPU: 0.023 against 0.722 on the
  two extraction prompts), so it is rejected on that evidence well before `maxSeconds`. The same
  lookup with another `k` is no such candidate: the gate's k sweep replaces the k a release asks
  for (a k 2 candidate served at k 6, as v1 did), and scored on the same requests its
  first-position acceptance stayed within the margin of v1's, undecided until `maxSeconds`.
- a draft model (`--draft`): the candidate drafts with v2's draft files, which the drift chapter
  overwrote with noise; it passes its gate and is then scored against the champion's good draft.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

from . import traffic
from .chapters.releases import THRESHOLDS
from .ladder import actions, condition

# spec.rollout.shadow for the demo: every request scored (share 1.0) so evidence comes in as fast
# as the pods answer; a category judged from 10 shadowed requests a side (the verdict's 200 scored
# positions a side still apply: the n-gram champion drafts ~9 rounds on each 64-token extraction
# answer, so ~23 requests); undecided 600 s after the start mark (which the operator sets before the
# champion's pods roll, so the roll's time counts) is Rejected: a bound, not the expected verdict.
SHADOW = {"share": 1.0, "minRequests": 10, "maxSeconds": 600}
CANDIDATE_K = 2
# The n-gram pair's candidate draft: the target's first layers and its own head. Two layers of
# SmolLM2-135M's 30 accept 2% of first positions on the extraction traffic (four: 1%) and cost
# least to draft with beside the champion's lookup.
LAYER_SKIP_LAYERS = 2

REGISTERED = "candidate registered, gate Job running"
GATED = "gate passed, not promoted"
STARTED = "scored in shadow on the champion's pods (ShadowStarted)"
DECIDED = "verdict (ShadowScored)"
STAGES = [REGISTERED, GATED, STARTED, DECIDED]


def candidate_spec(spec: dict[str, Any], gate_tokens: int, draft_source: str | None = None) -> dict[str, Any]:
    """The pair's spec as a candidate that differs from what serves only on its draft side.

    `k` becomes CANDIDATE_K (no release of the demo used it, so it is a new release; the gate's k
    sweep then picks the k it serves with); `draft_source` (a draft model's directory) replaces the
    spec's draft, None keeps the draft the spec names. The strategy is left to the operator. The
    gate runs one golden prompt (document work, where the champion was gated too), with no
    acceptance floor and the demo's speedup floor of 0 (releases.THRESHOLDS): the gate proves greedy
    identity and measures the candidate, the live verdict decides. A merge patch: None deletes what the spec had (a floor, the n-gram drafter)."""
    out = copy.deepcopy(spec)
    out["speculation"] = {**(out.get("speculation") or {}), "k": CANDIDATE_K}
    if draft_source is not None:
        out["draft"] = {**{key: None for key in out.get("draft") or {}}, "source": draft_source}
    category, prompt = traffic.COPYING[0]
    out["gating"] = {**(out.get("gating") or {}), "prompts": [{"prompt": prompt, "category": category}],
                     "maxNewTokens": gate_tokens,
                     "thresholds": {**THRESHOLDS, "minCategoryAcceptance": None}}
    # No strategy: the operator chooses (v2 asked for Replace; None deletes it).
    out["rollout"] = {**(out.get("rollout") or {}), "strategy": None, "shadow": dict(SHADOW)}
    return out


def make_layer_skip_draft(target_dir: str | Path, out_dir: Path, layers: int = LAYER_SKIP_LAYERS) -> Path:
    """A draft model made of the target's first `layers` decoder layers with its own embeddings,
    final norm and head, untrained, with the target's tokenizer files (the engine refuses a draft
    whose tokenizer differs). Written once; a directory already there is reused."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()      # the demo's own line says what was written
    try:
        return _write_layer_skip_draft(AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32),
                                       Path(target_dir), out_dir, layers)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _write_layer_skip_draft(model, target_dir: Path, out_dir: Path, layers: int) -> Path:
    if not 1 <= layers < model.config.num_hidden_layers:
        raise ValueError(f"a layer-skip draft keeps 1..{model.config.num_hidden_layers - 1} layers, not {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for path in target_dir.iterdir():
        if path.is_file() and path.name.startswith(("tokenizer", "special_tokens", "chat_template",
                                                    "generation_config", "vocab", "merges")):
            shutil.copy(path, tmp / path.name)
    tmp.replace(out_dir)
    return out_dir


def shadow_traffic(gated: set[str]) -> list[tuple[str, str]]:
    """Document work in the champion's gated categories: the requests the verdict judges."""
    return [(c, p) for c, p in traffic.COPYING if c in gated] or traffic.COPYING[:1]


class Progress:
    """How far the candidate got along STAGES, from the pair's status. `version` is the candidate's
    (None until the operator registered a version after `before_version`); `result` the verdict
    once there is one: Promoted, Rejected or ShadowRefused."""

    def __init__(self, before_actions: int, before_version: str):
        self.before = before_actions
        self.before_version = before_version
        self.version: str | None = None
        self.result: str | None = None

    def update(self, obj: dict[str, Any] | None) -> int:
        st = (obj or {}).get("status") or {}
        candidate = str(st.get("candidateVersion") or "")
        if self.version is None and candidate and candidate != self.before_version:
            self.version = candidate
        if self.version is None:
            return 0
        gated = condition(obj, "Gated")
        if candidate == self.version and gated.get("status") == "False":
            raise ValueError(f"v{self.version} failed its gate: {gated.get('message')}")
        new = actions(obj)[self.before:]
        scored = condition(obj, "ShadowScored")
        if "ShadowRefused" in new or (scored.get("status") == "False" and scored.get("reason") == "ShadowRefused"):
            self.result = "ShadowRefused"
            return len(STAGES)
        if scored.get("status") == "True" and str((st.get("shadow") or {}).get("version")) == self.version:
            self.result = scored.get("reason")
            return len(STAGES)
        if "Promoted" in new and str(st.get("servingVersion")) == self.version:
            # Replaced at once (the operator did not choose Shadow): what happened, said as such.
            self.result = "PromotedWithoutShadow"
            return len(STAGES)
        if "ShadowStarted" in new:
            return 3
        if gated.get("status") == "True" and str(gated.get("message", "")).startswith(f"v{self.version}:"):
            return 2
        return 1


def numbers_rows(shadow: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    """status.shadow's per-category numbers: (category, candidate alpha, champion alpha, bounds
    of the difference, requests, what it says); the pooled gated traffic is named as such."""
    rows = []
    for cat, n in sorted((shadow.get("categories") or {}).items()):
        name = "gated traffic pooled" if cat == "*" else cat
        bounds = "–" if n.get("status") == "short" else f"[{n.get('lower'):+.3f}, {n.get('upper'):+.3f}]"
        rows.append((name, f"{n.get('candidateAlpha', 0):.3f}", f"{n.get('championAlpha', 0):.3f}", bounds,
                     str(n.get("requests")), str(n.get("status"))))
    return rows


def explain(result: str | None, shadow: dict[str, Any]) -> str:
    """What the verdict means, from what the operator wrote (status.shadow's reason)."""
    reason = str(shadow.get("reason") or "")
    if result == "Rejected" and reason.startswith("still undecided"):
        return ("rejected: not shown better than the champion before rollout.shadow.maxSeconds ran out; the "
                "champion keeps serving, and its pods drop the candidate's drafter.")
    if result == "Rejected":
        return "rejected on the live evidence: the champion keeps serving, and its pods drop the candidate's drafter."
    if result == "Promoted":
        return "promoted on the live evidence: the aliases move and the engine rolls to the candidate."
    if result == "ShadowRefused":
        return "the operator refused to score it in shadow; the champion keeps serving."
    if result == "PromotedWithoutShadow":
        return "the operator did not choose Shadow for it and replaced the champion at once."
    return "no verdict."
