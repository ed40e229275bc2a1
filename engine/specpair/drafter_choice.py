"""Which drafter a pair drafts with: n-gram lookup, a draft model, an EAGLE or Medusa head, or a
head that copies first (lookup-first). One function decides, for `pair.load_pair` and for
`SpeculativeEngine(target, draft=...)` alike; it lives apart from both so the engine can call it
without importing what builds engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specpair.config import NGRAM_MAX, NGRAM_MIN, SpeculationConfig, known_drafter
from specpair.drafters import (Drafter, EagleDrafter, LookupFirstDrafter, MedusaDrafter,
                               ModelDrafter, NgramDrafter)
from specpair.errors import SpecpairError, TokenizerMismatch
from specpair.kv.families import supports
from specpair.tokenizer_identity import compare, fingerprint


@dataclass
class DrafterChoice:
    drafter: Drafter | None
    draft: object | None                 # the draft LoadedModel kept (None: none, or refused)
    warnings: list[str] = field(default_factory=list)
    draft_fingerprint: dict | None = None
    tokenizer_check: object | None = None   # tokenizer_identity.compare's result


def build_drafter(target, draft=None, drafter: Drafter | str | None = None, *,
                  speculation: SpeculationConfig, kv: str = "static", compile: str = "off",
                  on_mismatch: str = "error", check_tokenizers: bool = True,
                  target_fingerprint: dict | None = None,
                  ngram: tuple[int, int] = (NGRAM_MAX, NGRAM_MIN)) -> DrafterChoice:
    """The drafter for a target (a LoadedModel). drafter: a Drafter as it is, or a model-free
    drafter by name ("ngram", matching ngram = (longest, shortest) tokens); else one built from
    `draft` (a LoadedModel): a drafting head drafts from the target's features, any other model
    keeps its own cache. A draft whose tokenizer differs from the target's is refused
    (TokenizerMismatch), or with on_mismatch "target-only" dropped with a warning.
    speculation.lookup_min_match puts n-gram lookup in front of a head."""
    choice = DrafterChoice(drafter=None, draft=draft)
    vocab_size = len(target.tokenizer)
    if isinstance(drafter, str) and known_drafter(drafter) == "ngram":
        longest, shortest = ngram
        if not 1 <= shortest <= longest:
            raise SpecpairError("need 1 <= --ngram-min <= --ngram-max")
        drafter = NgramDrafter(max_ngram=longest, min_ngram=shortest, device=target.device)
    if drafter is None and draft is not None:
        if check_tokenizers:
            choice.draft_fingerprint = fingerprint(draft.tokenizer, embedding_rows=draft.embedding_rows)
            choice.tokenizer_check = compare(choice.draft_fingerprint, target_fingerprint or fingerprint(
                target.tokenizer, embedding_rows=target.embedding_rows))
            if not choice.tokenizer_check.compatible:
                if on_mismatch != "target-only":
                    raise TokenizerMismatch(choice.tokenizer_check.differences)
                choice.warnings.append("draft tokenizer differs from the target's; serving target-only: "
                                       + "; ".join(choice.tokenizer_check.differences))
                draft = choice.draft = None
        if draft is not None and getattr(draft.model, "is_drafting_head", False):
            why = supports(target.model) if kv == "static" else "--kv dynamic"
            if why:
                raise SpecpairError(f"{draft.model.method} heads draft from the features the "
                                    f"static KV cache hands over; not available here: {why}")
            if draft.model.method == "medusa":
                drafter = MedusaDrafter(draft, target.model, vocab_size=vocab_size, compile=compile)
            elif draft.model.method == "eagle3":
                from specpair.drafters.eagle3 import Eagle3Drafter
                drafter = Eagle3Drafter(draft, target.model, vocab_size=vocab_size, compile=compile)
            else:
                drafter = EagleDrafter(draft, target.model, vocab_size=vocab_size, compile=compile)
        elif draft is not None:
            drafter = ModelDrafter(draft, vocab_size=vocab_size, kv=kv, compile=compile)
    if speculation.lookup_min_match:
        if drafter is not None and drafter.wants_features:     # a head (drafts from the target's features)
            drafter = LookupFirstDrafter(NgramDrafter(device=target.device), drafter,
                                         speculation.lookup_min_match)
        else:
            choice.warnings.append(f"lookup_min_match applies to drafting heads (EAGLE, Medusa); "
                                   f"the {drafter.name if drafter else 'target-only'} engine ignores it")
    if speculation.tree_width > 1 and drafter is not None and not drafter.tree_capable:
        choice.warnings.append(f"tree_width {speculation.tree_width} applies to drafting heads "
                               f"(EAGLE, Medusa); the {drafter.name} drafter verifies chains")
    choice.drafter = drafter
    return choice
