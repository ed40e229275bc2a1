"""Drafters: whatever proposes tokens for the target to verify, behind one small interface
(base.Drafter), one proposer a module as vLLM v1 keeps its proposers.

The decoding loop never asks which kind it has. A drafter keeps per-row state for a batch whose
rows come and go (continuous batching): `add_rows`, `select`, then each step `propose` and, after
verification, `accepted` so it can cut back what it cached for rejected tokens.

- model.ModelDrafter: a separate small causal LM with its own batched KV cache.
- ngram.NgramDrafter: prompt lookup; no model, proposes the continuation of the latest earlier
  match of the sequence's trailing n-gram. Deterministic, so its q is a point mass.
- eagle.EagleDrafter: a head (heads.py) drafting from the target's own features, which the engine
  hands it after each verification (`observe`); it has no trunk of its own (its steps:
  eagle_steps.py).
- medusa.MedusaDrafter: Medusa heads (heads.py) drafting all k tokens at once from the last feature.
- eagle3.Eagle3Drafter: a published EAGLE-3 head (specpair/eagle3.py) over the target's auxiliary
  hidden states; imported where chosen (drafter_choice.py), not here.
- lookup_first.LookupFirstDrafter: prompt lookup where the sequence repeats itself, a head
  elsewhere (`speculation.lookup_min_match`).
What the head drafters share is head.HeadDrafter; choosing tokens from logits, draft_tokens.py.
Room for more (self-speculative layer skip): a module implementing base.Drafter.
"""

from specpair.drafters.base import Drafter, Proposal, RowSampling
from specpair.drafters.draft_tokens import choose_draft_tokens, choose_siblings, stack_draft_probs
from specpair.drafters.eagle import EagleDrafter
from specpair.drafters.eagle_steps import CATCH_UP_WIDTH, EagleCatchUp, EagleDraftStep
from specpair.drafters.head import HeadDrafter, draft_vocab_logits, head_logits, target_vocab_logits
from specpair.drafters.lookup_first import LookupFirstDrafter
from specpair.drafters.medusa import MedusaDraftStep, MedusaDrafter, medusa_draft
from specpair.drafters.model import ModelDrafter
from specpair.drafters.ngram import NgramDrafter, NgramIndex

__all__ = ["CATCH_UP_WIDTH", "Drafter", "EagleCatchUp", "EagleDraftStep", "EagleDrafter", "HeadDrafter",
           "LookupFirstDrafter", "MedusaDraftStep", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "NgramIndex",
           "Proposal", "RowSampling", "choose_draft_tokens", "choose_siblings", "draft_vocab_logits", "head_logits",
           "medusa_draft", "stack_draft_probs", "target_vocab_logits"]
