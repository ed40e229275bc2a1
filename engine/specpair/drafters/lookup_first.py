"""LookupFirstDrafter: prompt lookup where the sequence repeats itself, a head elsewhere
(`speculation.lookup_min_match`)."""

from __future__ import annotations

import torch

from specpair.drafters.base import Drafter, Proposal
from specpair.drafters.head import HeadDrafter
from specpair.drafters.ngram import NgramDrafter
from specpair.errors import SpecpairError


class LookupFirstDrafter(Drafter):
    """Prompt lookup where the text repeats itself, a head everywhere else: per row and round,
    when the trailing `min_match` tokens (or more) occurred earlier in the sequence, the row
    copies what followed them (NgramDrafter); otherwise the head drafts. Copying wins where a
    reply quotes its prompt (extraction, summaries, code that reuses names), a head where it does
    not; Arctic Inference pairs suffix decoding with a model drafter for the same reason.

    The head sees every round either way: it is handed the committed tokens' features (`observe`)
    and its propose catches its cache up for rows that copy (they draft 0 head tokens), so it
    drafts from the right state the next time a row needs it.

    Exactness: a copied row's q is a point mass. In a token tree (width > 1) a copied row's
    siblings repeat its chain token: for a point-mass q, further independent draws from q are that
    token again, which is what the multi-candidate rule (rejection_sampler.verify_tree) assumes, and
    greedy verification never takes a sibling equal to the rejected chain token. Since one is never
    kept, the engine does not feed them (Batch._verify_tree); when no row of the batch asks its
    head, the round verifies plain chains.
    """

    deterministic = False
    wants_features = True
    tree_capable = True
    copies = True

    def __init__(self, ngram: NgramDrafter, head: HeadDrafter, min_match: int,
                 rounds: dict | None = None):
        if not 1 <= min_match <= ngram.max_ngram:
            raise SpecpairError(f"lookup_min_match must be in 1..{ngram.max_ngram} (the longest "
                                f"n-gram the lookup matches), got {min_match}")
        self.ngram, self.head, self.min_match = ngram, head, min_match
        self.name = f"ngram+{head.name}"
        # Row-rounds that copied and that asked the head (which drafts nothing before a row's
        # first features), shared by every batch of the engine: what `describe` tells.
        self.rounds = rounds if rounds is not None else {"copied": 0, "head": 0}

    # What the engine needs of it is its head's: its cache, its warm-up, its price (the rounds
    # that copy are priced apart by the cost model, from `copies`).
    def cached_model(self):
        return self.head.cached_model()

    def priced_as(self) -> HeadDrafter:
        return self.head

    def warm_up_steps(self, rows: int, context_length: int, tree_width: int, k_max: int) -> dict | None:
        return self.head.warm_up_steps(rows, context_length, tree_width, k_max)

    def prefix_identity(self) -> str | None:
        return self.head.prefix_identity()

    def prefix_positions(self, row: int) -> int:
        return self.head.prefix_positions(row)

    def read_prefix(self, row: int, starts: list[int], width: int) -> list:
        return self.head.read_prefix(row, starts, width)

    def load_prefix(self, row: int, blocks: list) -> int:
        return self.head.load_prefix(row, blocks)

    def for_batch(self) -> "LookupFirstDrafter":
        return LookupFirstDrafter(self.ngram.for_batch(), self.head.for_batch(), self.min_match, self.rounds)

    def trim(self) -> None:
        self.head.trim()

    def observe(self, row: int, start: int, features: torch.Tensor) -> None:
        self.head.observe(row, start, features)

    def add_rows(self, count: int) -> None:
        self.ngram.add_rows(count)
        self.head.add_rows(count)

    def select(self, rows: list[int]) -> None:
        self.ngram.select(rows)
        self.head.select(rows)

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        self.head.accepted(row, committed_before, num_accepted)

    def lookup(self, sequence: list[int], k: int) -> list[int]:
        """The copy this drafter would make, or none (what the bench times as its per-round cost)."""
        n, tokens = self.ngram.match(sequence, k)
        return tokens if n >= self.min_match else []

    def propose(self, sequences, ks, sampling, width: int = 1, copy_ks: list[int] | None = None
                ) -> Proposal:
        """ks: the head's k per row; copy_ks: how many tokens a row that copies may copy (the
        engine grows it on runs, as for n-gram lookup alone; default: ks)."""
        copy_ks = ks if copy_ks is None else copy_ks
        copies = [tokens if n >= self.min_match else []
                  for n, tokens in self.ngram.match_rows(sequences, copy_ks)]
        if self.grammars is not None:
            # A grammar row copies what its grammar allows, then what it forces (RowGrammar.
            # guided_drafts), and copies that way whenever its grammar forces a token now: the
            # forced tokens are point masses like a copy's. Otherwise its head drafts within the
            # grammar (HeadDrafter.propose).
            copies = self.ngram.within_grammars(
                self.grammars, sequences, [ck if c else k for c, ck, k in zip(copies, copy_ks, ks)], copies,
                min_match=self.min_match)
        self.head.grammars = self.grammars      # the head drafts within each row's grammar
        drafted = self.head.propose(sequences, [0 if c else k for c, k in zip(copies, ks)],
                                    sampling, width)
        copying = [i for i, c in enumerate(copies) if c]
        self.rounds["copied"] += len(copying)
        self.rounds["head"] += sum(1 for c, k in zip(copies, ks) if k and not c)
        if not copying:
            return drafted
        copied = [bool(c) for c in copies]
        B = len(sequences)
        device = drafted.tokens.device
        K = max(drafted.tokens.shape[1], max(len(copies[i]) for i in copying))
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        tokens[:, :drafted.tokens.shape[1]] = drafted.tokens
        num = drafted.num.clone()
        for i in copying:
            tokens[i] = 0
            tokens[i, :len(copies[i])] = torch.tensor(copies[i], device=device)
            num[i] = len(copies[i])
        probs = drafted.probs
        if probs is not None:             # sampled rows drafted by the head: copies are point masses
            probs = torch.cat([probs, probs[:, -1:].expand(B, K - probs.shape[1], -1)], dim=1)
            for i in copying:
                probs[i] = 0
                probs[i].scatter_(-1, tokens[i].unsqueeze(-1), 1.0)
        siblings = None
        if drafted.siblings is not None and bool((drafted.num > 0).any()):
            S = drafted.siblings.shape[2]
            siblings = torch.zeros(B, K, S, dtype=torch.long, device=device)
            siblings[:, :drafted.siblings.shape[1]] = drafted.siblings
            for i in copying:
                siblings[i] = tokens[i].unsqueeze(-1).expand(K, S)
        return Proposal(tokens=tokens, num=num, probs=probs, siblings=siblings, copied=copied)

    def describe(self) -> dict:
        return {**self.head.describe(), "kind": self.name, "lookup_min_match": self.min_match,
                "lookup": self.ngram.describe(), "rounds": dict(self.rounds)}
