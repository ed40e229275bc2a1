"""Drafters: whatever proposes tokens for the target to verify, behind one small interface.

The decoding loop never asks which kind it has. A drafter keeps per-row state for a batch whose
rows come and go (continuous batching): `add_rows`, `select`, then each step `propose` and, after
verification, `accepted` so it can cut back what it cached for rejected tokens.

- ModelDrafter: a separate small causal LM with its own batched KV cache.
- NgramDrafter: prompt lookup; no model, proposes the continuation of the latest earlier match
  of the sequence's trailing n-gram. Deterministic, so its q is a point mass.
Room for more (self-speculative layer skip, EAGLE-style heads): implement the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpair.config import NGRAM_MAX, NGRAM_MIN
from specpair.static_cache import kv_model
from specpair.rejection_sampler import process_logits, sample_next


@dataclass
class Proposal:
    tokens: torch.Tensor            # [B, K] long, row i valid up to num[i]
    num: torch.Tensor               # [B] long
    probs: torch.Tensor | None      # [B, K, V] draft distributions q, None when deterministic


@dataclass
class RowSampling:
    """Per-row sampling settings as tensors, shared by draft and target so p and q match."""

    temperature: torch.Tensor       # [B]
    top_k: torch.Tensor             # [B]
    top_p: torch.Tensor             # [B]
    generators: list                # [B] torch.Generator or None

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature <= 0).all())


class Drafter:
    """Interface. `deterministic` drafters propose point masses (q = one-hot)."""

    name = "drafter"
    deterministic = True

    def add_rows(self, count: int) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass

    def propose(self, sequences: list[list[int]], ks: list[int], sampling: RowSampling) -> Proposal:
        raise NotImplementedError

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        """Row's sequence was `committed_before` tokens long; `num_accepted` drafts were kept."""

    def describe(self) -> dict:
        return {"kind": self.name}


class NgramDrafter(Drafter):
    """Prompt lookup: match the trailing n-gram (longest first) earlier in the sequence."""

    name = "ngram"
    deterministic = True

    def __init__(self, max_ngram: int = NGRAM_MAX, min_ngram: int = NGRAM_MIN, device="cpu"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device(device)

    def lookup(self, sequence: list[int], k: int) -> list[int]:
        if k <= 0 or len(sequence) < 2:
            return []
        seq = torch.tensor(sequence, dtype=torch.long)
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            windows = seq[:-1].unfold(0, n, 1)                     # [L-n, n]: excludes the tail itself
            hits = (windows == tail).all(1).nonzero().squeeze(1)
            if hits.numel():
                start = int(hits[-1]) + n                          # latest match: most local context
                return sequence[start:start + k]
        return []

    def propose(self, sequences, ks, sampling) -> Proposal:
        found = [self.lookup(seq, k) for seq, k in zip(sequences, ks)]
        K = max((len(f) for f in found), default=0)
        tokens = torch.zeros(len(found), K, dtype=torch.long)
        for i, f in enumerate(found):
            if f:
                tokens[i, :len(f)] = torch.tensor(f)
        num = torch.tensor([len(f) for f in found], dtype=torch.long)
        return Proposal(tokens=tokens.to(self.device), num=num.to(self.device), probs=None)

    def describe(self) -> dict:
        return {"kind": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}


class ModelDrafter(Drafter):
    """A small causal LM sharing the target's tokenizer, with its own batched KV cache."""

    name = "model"
    deterministic = False

    def __init__(self, loaded, vocab_size: int, kv: str | None = None, compile: str | None = None):
        self.loaded = loaded
        self.kv = kv_model(loaded.model, vocab_size=vocab_size, kind=kv, compile=compile)
        self.fed_drafts: list[int] = []     # drafts fed into the cache during the last propose

    def add_rows(self, count: int) -> None:
        self.kv.add_rows(count)
        self.fed_drafts += [0] * count

    def select(self, rows: list[int]) -> None:
        self.kv.select(rows)
        self.fed_drafts = [self.fed_drafts[i] for i in rows]

    def propose(self, sequences, ks, sampling) -> Proposal:
        B = len(sequences)
        K = max(ks, default=0)
        device = self.kv.device
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        num = torch.tensor(ks, dtype=torch.long, device=device)
        self.fed_drafts = [0] * B
        if K == 0:
            return Proposal(tokens=tokens, num=num, probs=None)
        probs_steps = []
        # First step feeds what the draft has not seen yet (the last round's bonus token, or a
        # whole prompt for a new row); rows not drafting this step still catch up, so they don't
        # fall far behind.
        feed = [seq[self.kv.lengths[i]:] for i, seq in enumerate(sequences)]
        for j in range(K):
            logits = self.kv.extend(feed, last=1)[:, -1]                      # [B, V]
            q = process_logits(logits.unsqueeze(1), sampling.temperature, sampling.top_k,
                               sampling.top_p).squeeze(1)                    # [B, V]
            if sampling.all_greedy:
                chosen = logits.argmax(-1)
            else:
                # Only rows still drafting draw from their generator: a seeded row's random stream
                # must not depend on the other rows' k (batch-independent sampling).
                gens = [g if j < k else None for g, k in zip(sampling.generators, ks)]
                drafting = torch.tensor([j < k for k in ks], device=device)
                sampled = torch.where(drafting, sample_next(q, gens), logits.argmax(-1))
                chosen = torch.where(sampling.temperature.to(device) <= 0, logits.argmax(-1), sampled)
            tokens[:, j] = chosen
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
        probs = torch.stack(probs_steps, dim=1)                               # [B, K', V]
        if probs.shape[1] < K:
            probs = torch.cat([probs, probs[:, -1:].expand(B, K - probs.shape[1], -1)], dim=1)
        return Proposal(tokens=tokens, num=num, probs=probs)

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        # The cache holds the old sequence plus the drafts fed; keep those that were accepted.
        self.kv.rollback(row, committed_before + min(num_accepted, self.fed_drafts[row]))

    def trim(self) -> None:
        self.kv.trim()

    def describe(self) -> dict:
        return {"kind": self.name, **self.loaded.identity()}
