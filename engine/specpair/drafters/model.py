"""ModelDrafter: a separate small causal LM with its own batched KV cache."""

from __future__ import annotations

import torch

from specpair.drafters.base import Drafter, Proposal
from specpair.drafters.draft_tokens import choose_draft_tokens, stack_draft_probs
from specpair.grammar import within_grammars
from specpair.kv.choice import kv_model


class ModelDrafter(Drafter):
    """A small causal LM sharing the target's tokenizer, with its own batched KV cache."""

    name = "model"
    deterministic = False
    draft_per_token = True

    def __init__(self, loaded, vocab_size: int, kv: str | None = None, compile: str | None = None):
        self.loaded = loaded
        self.settings = (vocab_size, kv, compile)
        self.kv = kv_model(loaded.model, vocab_size=vocab_size, kind=kv, compile=compile)
        self.fed_drafts: list[int] = []     # drafts fed into the cache during the last propose

    def draft_model(self):
        return self.loaded.model

    def step_model(self):
        return self.loaded.model

    def reusable_prefix_cache(self):
        return (f"draft {sorted(self.loaded.identity().items())}", self.kv) if self.kv.reuses_prefixes else None

    def cost_probe(self, timing) -> dict[str, float]:
        """One step of the draft model at one token, as the target's steps are timed."""
        return {"draft_step": timing.extends(self.loaded.model, [1])[1]}

    def for_batch(self) -> "ModelDrafter":
        # Each batch needs its own draft cache; the weights are shared.
        vocab_size, kv, compile = self.settings
        return ModelDrafter(self.loaded, vocab_size, kv=kv, compile=compile)

    def add_rows(self, count: int) -> None:
        self.kv.add_rows(count)
        self.fed_drafts += [0] * count

    def select(self, rows: list[int]) -> None:
        self.kv.select(rows)
        self.fed_drafts = [self.fed_drafts[i] for i in rows]

    def propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        B = len(sequences)
        K = max(ks, default=0)
        device = self.kv.device
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        num = torch.tensor(ks, dtype=torch.long, device=device)
        self.fed_drafts = [0] * B
        if K == 0:
            return Proposal(tokens=tokens, num=num, probs=None)
        probs_steps = []
        # Rows with a grammar propose within it: the draft's logits masked by what the grammar
        # allows after the committed tokens and the drafts so far (rolled back at the end).
        guides = [g.drafting() if g is not None and k else None
                  for g, k in zip(self.grammars or [None] * B, ks)]
        try:
            return self._propose(sequences, ks, sampling, tokens, num, probs_steps, guides, K)
        finally:
            for guide in guides:
                if guide is not None:
                    guide.close()

    def _propose(self, sequences, ks, sampling, tokens, num, probs_steps, guides, K) -> Proposal:
        B = len(sequences)
        guided = any(g is not None for g in guides)
        # First step feeds what the draft has not seen yet (the last round's bonus token, or a
        # whole prompt for a new row). A row not drafting this round is not fed: a row kept
        # target-only for memory (Batch._fit_kv_budget) holds no draft cache, and catches up in
        # one pass when it drafts again.
        feed = [seq[self.kv.lengths[i]:] if ks[i] else [] for i, seq in enumerate(sequences)]
        for j in range(K):
            logits = self.kv.extend(feed, last=1)[:, -1]                      # [B, V]
            if guided:
                logits = within_grammars(logits, [g if g is not None and j < ks[i] else None
                                                  for i, g in enumerate(guides)])
            chosen, q = choose_draft_tokens(logits, j, ks, sampling)
            tokens[:, j] = chosen
            if guided:
                for i, guide in enumerate(guides):
                    if guide is not None and j < ks[i]:
                        guide.take(int(chosen[i]))
            probs_steps.append(q)
            if j + 1 == K:
                break   # the last draft token is never fed: its verification is the target's job
            feed = []
            for i in range(B):
                if j + 1 < ks[i]:
                    feed.append([int(chosen[i])])
                    self.fed_drafts[i] += 1
                else:
                    feed.append([])
            if not any(feed):
                break
        return Proposal(tokens=tokens, num=num, probs=stack_draft_probs(probs_steps, K))

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        # The cache holds the old sequence plus the drafts fed; keep those that were accepted.
        self.kv.rollback(row, committed_before + min(num_accepted, self.fed_drafts[row]))

    def trim(self) -> None:
        self.kv.trim()

    def describe(self) -> dict:
        return {"kind": self.name, **self.loaded.identity()}
