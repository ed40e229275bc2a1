"""NgramDrafter: prompt lookup; no model, proposes the continuation of the latest earlier match of
the sequence's trailing n-gram (NgramIndex, kept per row). Deterministic, so its q is a point mass."""

from __future__ import annotations

import torch

from specpair.config import NGRAM_MAX, NGRAM_MIN
from specpair.drafters.base import Drafter, Proposal
from specpair.kv.graphs import to_device


class NgramIndex:
    """One row's n-gram lookup kept as its committed sequence grows: for each n-gram (n in
    min..max) that occurs before the row's tail, where its latest occurrence's continuation
    starts. Each committed token adds (max - min + 1) entries, so a round's lookup costs the same
    at 40 tokens as at 16,000 (a scan of the whole sequence per round took 0.4 ms at 100 tokens
    and 43 ms at 16,000 on one CPU core: more than a GPU step at any length).

    A row's committed sequence only grows; a sequence that is not the indexed one continued
    (shorter, or another last indexed token) is indexed again from the start."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}   # n-gram -> start of its latest continuation

    def sync(self, sequence: list[int]) -> None:
        known = len(self.tokens)
        if len(sequence) < known or (known and sequence[known - 1] != self.tokens[-1]):
            self.tokens, self.latest, known = [], {}, 0
        for token in sequence[known:]:
            self.tokens.append(token)
            length = len(self.tokens)
            # At this length the n-gram that ended just before the new token is no longer the
            # tail: it becomes something a later tail can match (its continuation is the new token).
            for n in range(self.min_ngram, min(self.max_ngram, length - 1) + 1):
                start = length - 1 - n
                self.latest[tuple(self.tokens[start:length - 1])] = length - 1

    def match(self, k: int, after: list[int] = ()) -> tuple[int, list[int]]:
        """As NgramDrafter.match on the synced sequence, or on it continued by `after` (tokens
        not committed, such as the drafts a grammar forced): the tail is looked up among the
        committed tokens' n-grams only, whose continuations are committed tokens."""
        tokens = self.tokens
        tail = tokens[-self.max_ngram:] + list(after) if after else tokens
        for n in range(min(self.max_ngram, len(tokens) + len(after) - 1), self.min_ngram - 1, -1):
            start = self.latest.get(tuple(tail[-n:]))
            if start is not None:
                return n, tokens[start:start + k]
        return 0, []


class NgramDrafter(Drafter):
    """Prompt lookup: match the trailing n-gram (longest first) earlier in the sequence.

    The drafter a batch uses (`for_batch`) keeps an NgramIndex per row, so its rounds cost no
    more as replies grow; `match`/`lookup` on any other instance scan the sequence given."""

    name = "ngram"
    deterministic = True

    def __init__(self, max_ngram: int = NGRAM_MAX, min_ngram: int = NGRAM_MIN, device="cpu"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = torch.device(device)
        self.rows: list[NgramIndex] | None = None     # a batch's drafter: one index per row

    def for_batch(self) -> "NgramDrafter":
        drafter = NgramDrafter(self.max_ngram, self.min_ngram, self.device)
        drafter.rows = []
        return drafter

    def add_rows(self, count: int) -> None:
        if self.rows is not None:
            self.rows.extend(NgramIndex(self.min_ngram, self.max_ngram) for _ in range(count))

    def select(self, rows: list[int]) -> None:
        if self.rows is not None:
            self.rows = [self.rows[r] for r in rows]

    def _continuations(self, sequence: list[int]) -> tuple[int, torch.Tensor] | None:
        """(n, where the continuations of the trailing n-gram's earlier occurrences start, in
        sequence order) for the longest n that occurs earlier at all (None: none does)."""
        if len(sequence) < 2:
            return None
        seq = torch.tensor(sequence, dtype=torch.long)
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            windows = seq[:-1].unfold(0, n, 1)                     # [L-n, n]: excludes the tail itself
            hits = (windows == tail).all(1).nonzero().squeeze(1)
            if hits.numel():
                return n, hits + n
        return None

    def matches(self, sequence: list[int]) -> list[int]:
        """Every continuation's start (see _continuations), latest first; for measuring."""
        found = self._continuations(sequence)
        return [] if found is None else found[1].flip(0).tolist()

    def match(self, sequence: list[int], k: int) -> tuple[int, list[int]]:
        """(the matched n-gram's length, the k tokens after its latest occurrence, the most local
        context); (0, []) when nothing matches."""
        found = self._continuations(sequence) if k > 0 else None
        if found is None:
            return 0, []
        start = int(found[1][-1])
        return found[0], sequence[start:start + k]

    def lookup(self, sequence: list[int], k: int) -> list[int]:
        """The k tokens after the latest match, or none."""
        return self.match(sequence, k)[1]

    def match_rows(self, sequences: list[list[int]], ks: list[int]) -> list[tuple[int, list[int]]]:
        """`match` for every row of a round: from the rows' indexes in a batch's drafter."""
        if self.rows is None or len(self.rows) != len(sequences):
            return [self.match(seq, k) for seq, k in zip(sequences, ks)]
        found = []
        for index, seq, k in zip(self.rows, sequences, ks):
            index.sync(seq)
            found.append(index.match(k) if k > 0 else (0, []))
        return found

    def continued(self, row: int, sequence: list[int], after: list[int], k: int) -> tuple[int, list[int]]:
        """`match` on row's sequence continued by `after` (drafts not committed): from the row's
        index in a batch's drafter (synced by match_rows this round), else by a scan."""
        if k <= 0:
            return 0, []
        index = self.rows[row] if self.rows is not None and row < len(self.rows) else None
        if index is not None and len(index.tokens) == len(sequence):
            return index.match(k, after)
        return self.match(list(sequence) + list(after), k)

    def within_grammars(self, grammars: list, sequences, ks, found: list[list[int]],
                        min_match: int = 1) -> list[list[int]]:
        """Each grammar row's lookup `found` as drafts its grammar (grammars[i], None: a free
        row, kept as found) allows (RowGrammar.guided_drafts): cut at the first token it
        refuses, then what it forces, the lookup continued after forced tokens (matches of at
        least `min_match`)."""
        out = list(found)
        for i, grammar in enumerate(grammars):
            if grammar is None or not ks[i]:
                continue

            def more(drafts, i=i):
                n, tokens = self.continued(i, sequences[i], drafts, ks[i] - len(drafts))
                return tokens if n >= min_match else []
            out[i] = grammar.guided_drafts(found[i], ks[i], more)
        return out

    def propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        found = [tokens for _, tokens in self.match_rows(sequences, ks)]
        if self.grammars is not None:    # grammar rows draft what their grammar allows or forces
            found = self.within_grammars(self.grammars, sequences, ks, found)
        K = max((len(f) for f in found), default=0)
        tokens = torch.zeros(len(found), K, dtype=torch.long)
        for i, f in enumerate(found):
            if f:
                tokens[i, :len(f)] = torch.tensor(f)
        num = torch.tensor([len(f) for f in found], dtype=torch.long).view(-1, 1)
        packed = to_device(torch.cat((tokens, num), dim=1), self.device)    # one copy over
        return Proposal(tokens=packed[:, :K], num=packed[:, K], probs=None, host=found)

    def describe(self) -> dict:
        return {"kind": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
