"""Drafters: whatever proposes tokens for the target to verify, behind one small interface.

The decoding loop never asks which kind it has. A drafter keeps per-row state for a batch whose
rows come and go (continuous batching): `add_rows`, `select`, then each step `propose` and, after
verification, `accepted` so it can cut back what it cached for rejected tokens.

- ModelDrafter: a separate small causal LM with its own batched KV cache.
- NgramDrafter: prompt lookup; no model, proposes the continuation of the latest earlier match
  of the sequence's trailing n-gram. Deterministic, so its q is a point mass.
- EagleDrafter: a head (heads.py) drafting from the target's own features, which the engine hands
  it after each verification (`observe`); it has no trunk of its own.
- MedusaDrafter: Medusa heads (heads.py) drafting all k tokens at once from the last feature.
- LookupFirstDrafter: prompt lookup where the sequence repeats itself, a head elsewhere
  (`speculation.lookup_min_match`).
Room for more (self-speculative layer skip): implement the same methods.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specpair.config import NGRAM_MAX, NGRAM_MIN
from specpair.errors import SpecpairError
from specpair import cpu_kernels
from specpair.static_cache import (StepGraphs, bucket, compiled_function, cuda_graphs_wanted,
                                   fixed_step_applies, kv_model, resolve_compile, to_device)
from specpair.rejection_sampler import DrawKeys, keyed_alternatives, process_logits, sample_next

log = logging.getLogger(__name__)


@dataclass
class Proposal:
    tokens: torch.Tensor            # [B, K] long, row i valid up to num[i]
    num: torch.Tensor               # [B] long
    probs: torch.Tensor | None      # [B, K, V] draft distributions q, None when deterministic
    siblings: torch.Tensor | None = None   # [B, K, S] alternatives to tokens[:, j] (a token tree,
                                           # rejection_sampler.verify_tree); None: a chain
    copied: list[bool] | None = None       # per row: drafted by copying (LookupFirstDrafter)
    host: list[list[int]] | None = None    # per row its drafted tokens, where the drafter made
                                           # them on the host: the step need not read them back


@dataclass
class RowSampling:
    """Per-row sampling settings as tensors, shared by draft and target so p and q match."""

    temperature: torch.Tensor       # [B]
    top_k: torch.Tensor             # [B]
    top_p: torch.Tensor             # [B]
    generators: list                # [B] torch.Generator or None
    greedy: bool | None = None      # every row greedy, when the caller knows it without the device
    keys: DrawKeys | None = None    # seeded rows: they draw by (seed, position) instead, the
                                    # draft as the target does (rejection_sampler.keyed_sample)

    @property
    def all_greedy(self) -> bool:
        if self.greedy is not None:
            return self.greedy
        return bool((self.temperature <= 0).all())


class Drafter:
    """Interface. `deterministic` drafters propose point masses (q = one-hot). Drafters that
    `wants_features` are handed the target's features of every committed token (`observe`)."""

    name = "drafter"
    deterministic = True
    wants_features = False
    tree_capable = False     # proposes alternatives per position (siblings) when width > 1
    copies = False           # drafts some rows' rounds by copying, each round saying which
                             # (Proposal.copied): those rounds keep a k of their own (copy_ks)

    def for_batch(self) -> "Drafter":
        """The drafter a new batch uses: itself when it keeps no per-row state."""
        return self

    def trim(self) -> None:
        """End of a round: release what rejected drafts left behind."""

    def observe(self, row: int, start: int, features: torch.Tensor) -> None:
        """The target's features [n, D] of row's committed tokens at positions start..start+n-1."""

    def add_rows(self, count: int) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass

    def propose(self, sequences: list[list[int]], ks: list[int], sampling: RowSampling,
                width: int = 1) -> Proposal:
        """Up to ks[i] draft tokens for each row. `width`: candidates per position for a
        `tree_capable` drafter (the release's tree width; 1 is a chain); others draft chains."""
        raise NotImplementedError

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        """Row's sequence was `committed_before` tokens long; `num_accepted` drafts were kept."""

    def describe(self) -> dict:
        return {"kind": self.name}


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

    def match(self, k: int) -> tuple[int, list[int]]:
        """As NgramDrafter.match on the synced sequence."""
        tokens = self.tokens
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self.latest.get(tuple(tokens[-n:]))
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

    def propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        found = [tokens for _, tokens in self.match_rows(sequences, ks)]
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


class ModelDrafter(Drafter):
    """A small causal LM sharing the target's tokenizer, with its own batched KV cache."""

    name = "model"
    deterministic = False

    def __init__(self, loaded, vocab_size: int, kv: str | None = None, compile: str | None = None):
        self.loaded = loaded
        self.settings = (vocab_size, kv, compile)
        self.kv = kv_model(loaded.model, vocab_size=vocab_size, kind=kv, compile=compile)
        self.fed_drafts: list[int] = []     # drafts fed into the cache during the last propose

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
        # First step feeds what the draft has not seen yet (the last round's bonus token, or a
        # whole prompt for a new row). A row not drafting this round is not fed: a row kept
        # target-only for memory (Batch._fit_kv_budget) holds no draft cache, and catches up in
        # one pass when it drafts again.
        feed = [seq[self.kv.lengths[i]:] if ks[i] else [] for i, seq in enumerate(sequences)]
        for j in range(K):
            logits = self.kv.extend(feed, last=1)[:, -1]                      # [B, V]
            chosen, q = choose_draft_tokens(logits, j, ks, sampling)
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
        return Proposal(tokens=tokens, num=num, probs=stack_draft_probs(probs_steps, K))

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        # The cache holds the old sequence plus the drafts fed; keep those that were accepted.
        self.kv.rollback(row, committed_before + min(num_accepted, self.fed_drafts[row]))

    def trim(self) -> None:
        self.kv.trim()

    def describe(self) -> dict:
        return {"kind": self.name, **self.loaded.identity()}


def choose_draft_tokens(logits: torch.Tensor, j: int, ks: list[int], sampling: RowSampling
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft position j's tokens from logits [B, V] and their distributions q (None when every
    row is greedy: greedy verification never reads q). Greedy rows take the argmax; the others
    draw from q with their own generator, and only while still drafting, so a row's random
    stream does not depend on the other rows' k; seeded rows draw with the key of position j,
    the noise the target's draw there uses, so the two draws agree where p and q do."""
    if sampling.all_greedy:
        return logits.argmax(-1), None
    q = process_logits(logits.unsqueeze(1), sampling.temperature, sampling.top_k,
                       sampling.top_p).squeeze(1)
    gens = [g if j < k else None for g, k in zip(sampling.generators, ks)]
    drafting = torch.tensor([j < k for k in ks], device=logits.device)
    sampled = torch.where(drafting, sample_next(q, gens, sampling.keys, j), logits.argmax(-1))
    greedy = sampling.temperature.to(logits.device) <= 0
    return torch.where(greedy, logits.argmax(-1), sampled), q


def choose_siblings(logits: torch.Tensor, chosen: torch.Tensor, q: torch.Tensor | None, j: int,
                    ks: list[int], sampling: RowSampling, count: int) -> torch.Tensor:
    """`count` alternatives [B, count] to position j's chosen tokens, for a token tree: a greedy
    row's next most likely tokens; a sampled row's further independent draws from q (what keeps
    the tree's sampler exact, rejection_sampler.verify_tree), with its own generator and only
    while it drafts; a seeded row's next ranked tokens under its keyed noise. Rows past their k
    get zeros (never verified)."""
    B = logits.shape[0]
    out = torch.zeros(B, count, dtype=torch.long, device=logits.device)
    greedy = (sampling.temperature <= 0).tolist()
    if any(greedy):
        masked = logits.scatter(-1, chosen.view(B, 1), float("-inf"))
        top = masked.topk(count, dim=-1).indices
        rows = torch.tensor(greedy, device=logits.device).view(B, 1)
        out = torch.where(rows, top, out)
    keys = sampling.keys
    keyed = keys.rows if keys is not None else []
    for i, g in enumerate(sampling.generators):
        if not greedy[i] and j < ks[i] and i not in keyed:
            out[i] = torch.multinomial(q[i], count, replacement=True, generator=g)
    at = [r for r, i in enumerate(keyed) if j < ks[i]]
    if at:
        rows = [keyed[r] for r in at]
        out[rows] = keyed_alternatives(q[rows], keys.seeds[at], keys.start[at] + j, chosen[rows], count)
    return out


def stack_draft_probs(steps: list, K: int) -> torch.Tensor | None:
    """q of each drafted position [B, K, V]; positions a row never reached repeat the last one
    (the verifier reads only each row's first num[i]). None when all rows were greedy."""
    if not steps or steps[0] is None:
        return None
    probs = torch.stack(steps, dim=1)
    if probs.shape[1] < K:
        probs = torch.cat([probs, probs[:, -1:].expand(probs.shape[0], K - probs.shape[1], -1)], dim=1)
    return probs


def draft_vocab_logits(head, vectors: torch.Tensor) -> torch.Tensor:
    """Logits over the head's draft vocabulary [..., Vd] of its vectors [..., D]."""
    return cpu_kernels.linear(vectors.reshape(-1, 1, vectors.shape[-1]),
                              head.lm_head.weight).reshape(*vectors.shape[:-1], -1)


def head_logits(head, vectors: torch.Tensor, vocab_size: int, draft_ids: torch.Tensor) -> torch.Tensor:
    """Target-vocabulary logits [..., V] of a head's vectors [..., D] (`target_vocab_logits`)."""
    return target_vocab_logits(draft_vocab_logits(head, vectors), vocab_size, draft_ids)


def target_vocab_logits(small: torch.Tensor, vocab_size: int, draft_ids: torch.Tensor
                        ) -> torch.Tensor:
    """Draft-vocabulary logits [..., Vd] spread over the target's vocabulary [..., V]: the draft
    vocabulary's rows, -inf elsewhere (q is zero off the draft vocabulary)."""
    full = torch.full((*small.shape[:-1], vocab_size), float("-inf"), dtype=small.dtype,
                      device=small.device)
    full[..., draft_ids] = small
    return full


class EagleDraftStep:
    """One drafting step of an EAGLE head over every row of its fixed-step cache, one token a
    row, as a function of device buffers only (no host read), so that on CUDA it records as one
    graph (StaticKVModel.capture) and a greedy draft token costs one replay.

    From each row's token `ids` [R, 1] and its feature `features` [R, 1, D] (the head's normed
    output for the token before), at `positions`/`slots` [R, 1]: the target's embedding of the token,
    the head's inputs (fc over [embedding, feature]), its layer(s) through the fixed step's
    layer (StaticLlama.fixed_layers, compiled where the cache is), its norm, the draft
    vocabulary's logits and their top `width` mapped to target ids. It then moves its own inputs
    on: the top token and the new feature become the next step's, positions and slots advance,
    and the top tokens land in `drafted` [R, C, width] at the slot the row wrote (read back once
    a round). -> the draft-vocabulary logits [R, Vd] (a sampled row chooses from them and
    overwrites its `ids`). Every row writes one slot past wherever its position is: rows that
    do not draft write past their length, which no query attends."""

    def __init__(self, head, embed, draft_ids: torch.Tensor, kv, width: int):
        rows, capacity = kv.capacity
        device, dtype = kv.device, kv.runner.dtype
        # One token a row as a dimension of its own: the layer's input is then no view, which
        # lets it share the compiled graph of the cache's other one-token vector steps.
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.features = torch.zeros(rows, 1, head.config.hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.drafted = torch.zeros(rows, capacity, width, dtype=torch.long, device=device)
        self.state = (self.ids, self.features, self.positions, self.slots)
        self.graph = None
        runner, caches, compiled = kv.runner, kv.caches, kv.compiled
        at = self.slots.view(rows, 1, 1).expand(rows, 1, width)

        def step():
            x = head.inputs(embed(self.ids).to(dtype), self.features)             # [R, 1, D]
            h = runner.fixed_layers(x, self.positions, self.slots, caches, compiled=compiled)
            g = head.model.norm(h)
            logits = draft_vocab_logits(head, g[:, 0])                            # [R, Vd]
            top = draft_ids[logits.topk(width, dim=-1).indices]                  # [R, width]
            self.drafted.scatter_(1, at, top.unsqueeze(1))
            self.ids.copy_(top[:, :1])
            self.features.copy_(g)
            self.positions.add_(1)
            self.slots.add_(1)
            return logits

        self.step = step

    def start(self, ids: torch.Tensor, features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """A round's first inputs: rows 0..B-1 feed ids [B] with features [B, D] at their
        lengths; the cache's other rows at slot 0 (rows no request holds). -> the lengths on
        the device [B, 1]."""
        B = len(lengths)
        start = torch.zeros(self.positions.shape, dtype=torch.long)
        start[:B, 0] = torch.tensor(lengths, dtype=torch.long)
        start = to_device(start, self.positions.device)
        self.positions.copy_(start)
        self.slots.copy_(start)
        self.ids[:B, 0] = ids
        self.features[:B, 0] = features
        return start[:B]

    def __call__(self, kv):
        """One step, through its recorded graph where the cache records graphs."""
        if self.graph is None:
            self.graph = kv.capture(self.step, self.state)
        return self.graph.replay() if self.graph is not None else self.step()

    def tokens(self, start: torch.Tensor, steps: int) -> torch.Tensor:
        """What rows 0..B-1 drafted in the round's `steps` steps from `start` [B, 1] (`start`'s
        result): [B, steps, width]."""
        B = start.shape[0]
        index = start + torch.arange(steps, device=start.device).view(1, steps)
        return self.drafted[torch.arange(B, device=start.device).view(B, 1), index]


# The widest catch-up run as one fixed step: a round's pending pairs are its accepted drafts and
# the bonus token (k_max + 1 at most); wider ones (a prompt's first) run as before.
CATCH_UP_WIDTH = 16


class EagleCatchUp:
    """A round's catch-up for every row of an EAGLE head's fixed-step cache as one step over
    device buffers at `width` pairs a row: each row's pairs observed since its last round (the
    token after each observed position, `planes[0]` [R, W], and the target's feature there,
    `features` [R, W, D]) fed at `planes[1]`/`planes[2]` (positions, slots) through the head's
    input projection, its layer (StaticLlama.fixed_layers) and its norm; -> the normed output at
    each row's last pair (`planes[3, :, 0]`), [R, D]. Pad pairs continue a row's slots past its
    new length (written, never attended). On CUDA recorded as one graph (StaticKVModel.capture):
    the catch-up was the projection per row and the layer compiled but launched call by call,
    with the first draft about 2 ms a round on an H100 (docs/gpu.md)."""

    def __init__(self, head, embed, kv, width: int):
        rows, dim = kv.capacity[0], head.config.hidden_size
        device, dtype = kv.device, kv.runner.dtype
        self.width = width
        self.planes = torch.zeros(4, rows, width, dtype=torch.long, device=device)
        self.features = torch.zeros(rows, width, dim, dtype=dtype, device=device)
        self.graph = None
        runner, caches, compiled = kv.runner, kv.caches, kv.compiled
        ids, positions, slots, last = self.planes[0], self.planes[1], self.planes[2], self.planes[3]
        every = torch.arange(rows, device=device)

        def step():
            x = head.inputs(embed(ids).to(dtype), self.features)                 # [R, W, D]
            h = runner.fixed_layers(x, positions, slots, caches, compiled=compiled)
            return head.model.norm(h[every, last[:, 0]])                         # [R, D]

        self.step = step

    def __call__(self, kv, tokens: list[list[int]], features: list[torch.Tensor]) -> torch.Tensor:
        """Rows 0..B-1 feed `tokens[i]` with `features[i]` [n_i, D] from their lengths, which
        move on by n_i; -> [R, D] (rows' outputs at their last pair; a row feeding none: unused)."""
        host = torch.zeros(self.planes.shape, dtype=torch.long)
        starts = torch.zeros(host.shape[1], 1, dtype=torch.long)
        for i, (toks, feats) in enumerate(zip(tokens, features)):
            n = len(toks)
            starts[i, 0] = kv.lengths[i]
            if n:
                host[0, i, :n] = torch.tensor(toks, dtype=torch.long)
                host[3, i, 0] = n - 1
                self.features[i, :n] = feats
            kv.lengths[i] += n
        host[1] = host[2] = starts + torch.arange(self.width).view(1, -1)
        self.planes.copy_(to_device(host, self.planes.device))
        if self.graph is None:
            self.graph = kv.capture(self.step)
        return self.graph.replay() if self.graph is not None else self.step()


def medusa_draft(heads, features: torch.Tensor, draft_ids: torch.Tensor, width: int):
    """Every Medusa head over features [R, D]: the draft vocabulary's logits [R, H, Vd] and their
    top `width` mapped to target ids [R, H, width]."""
    logits = draft_vocab_logits(heads, heads(features))
    return logits, draft_ids[logits.topk(width, dim=-1).indices]


class MedusaDraftStep:
    """A round of Medusa heads over rows 0..R-1 as one step of a device buffer (each row's
    `features` [R, D]): `medusa_draft`, compiled where asked (rows past one symbolic), and on CUDA
    recorded as one graph (StepGraphs), so a round's drafts are one replay. Every head runs
    whatever the round's k: one shape a rows bucket."""

    def __init__(self, heads, draft_ids: torch.Tensor, rows: int, width: int, compiled: bool):
        param = heads.lm_head.weight
        self.features = torch.zeros(rows, heads.config.hidden_size, dtype=param.dtype,
                                    device=param.device)
        draft = compiled_function(medusa_draft, param.device) if compiled else medusa_draft
        if compiled and rows > 1:
            torch._dynamo.maybe_mark_dynamic(self.features, 0)
        self.step = lambda: draft(heads, self.features, draft_ids, width)
        self.graph = None

    def __call__(self, graphs: StepGraphs):
        """-> (logits [R, H, Vd], top [R, H, width]): the graph's own buffers where recorded."""
        if self.graph is None:
            self.graph = graphs.capture(self.step)
        return self.graph.replay() if self.graph is not None else self.step()


class HeadDrafter(Drafter):
    """What heads share: they draft from the target's features of committed tokens (`observe`),
    through a draft vocabulary. Subclasses keep what they need of the features (`_keep`) and
    their per-row state (`_add_rows`, `_select`)."""

    deterministic = False
    wants_features = True
    tree_capable = True

    def __init__(self, loaded, target_model, vocab_size: int):
        self.loaded, self.head = loaded, loaded.model
        if self.head.config.hidden_size != target_model.config.hidden_size:
            raise SpecpairError(f"head hidden size {self.head.config.hidden_size} does not match "
                                f"the target's {target_model.config.hidden_size}")
        self.target_model, self.vocab_size = target_model, vocab_size
        self.draft_ids = self.head.draft_token_ids.to(next(self.head.parameters()).device)
        if int(self.draft_ids.max()) >= vocab_size:
            raise SpecpairError(f"head drafts token {int(self.draft_ids.max())}; the target has {vocab_size}")
        self.known: list[int] = []          # per row: positions with an observed feature

    def add_rows(self, count: int) -> None:
        self.known += [0] * count
        self._add_rows(count)

    def select(self, rows: list[int]) -> None:
        self.known = [self.known[i] for i in rows]
        self._select(rows)

    def observe(self, row: int, start: int, features: torch.Tensor) -> None:
        if start != self.known[row]:
            raise SpecpairError(f"row {row}: features from position {start}, expected {self.known[row]}")
        if features.shape[0]:
            self._keep(row, features)
            self.known[row] += int(features.shape[0])

    def _add_rows(self, count: int) -> None:
        raise NotImplementedError

    def _select(self, rows: list[int]) -> None:
        raise NotImplementedError

    def _keep(self, row: int, features: torch.Tensor) -> None:
        raise NotImplementedError

    def _logits(self, vectors: torch.Tensor) -> torch.Tensor:
        return head_logits(self.head, vectors, self.vocab_size, self.draft_ids)

    def _choose(self, small, j, row_ks, sampling, width, chosen_steps, q_steps, sibling_steps):
        """Position j's tokens (and, for a tree, their alternatives) from the head's logits over
        its draft vocabulary [B, Vd]. All rows greedy: their top, mapped to the target's ids (no
        distribution over the whole vocabulary is needed: greedy verification reads no q)."""
        if sampling.all_greedy:
            top = self.draft_ids[small.topk(width, dim=-1).indices]       # [B, C]
            chosen, q = top[:, 0], None
            if width > 1:
                sibling_steps.append(top[:, 1:])
        else:
            logits = target_vocab_logits(small, self.vocab_size, self.draft_ids)
            chosen, q = choose_draft_tokens(logits, j, row_ks, sampling)
            if width > 1:
                sibling_steps.append(choose_siblings(logits, chosen, q, j, row_ks, sampling, width - 1))
        chosen_steps.append(chosen)
        q_steps.append(q)
        return chosen

    def _proposal(self, chosen_steps, q_steps, sibling_steps, num, K, width) -> Proposal:
        B = num.shape[0]
        tokens = torch.zeros(B, K, dtype=torch.long, device=num.device)
        if chosen_steps:
            tokens[:, :len(chosen_steps)] = torch.stack(chosen_steps, dim=1)
        siblings = None
        if sibling_steps:
            siblings = torch.zeros(B, K, width - 1, dtype=torch.long, device=num.device)
            siblings[:, :len(sibling_steps)] = torch.stack(sibling_steps, dim=1)
        return Proposal(tokens=tokens, num=num, probs=stack_draft_probs(q_steps, K),
                        siblings=siblings)

    def describe(self) -> dict:
        return {"kind": self.name, "draft_vocab_size": int(len(self.draft_ids)),
                **self.loaded.identity()}


class MedusaDrafter(HeadDrafter):
    """Medusa heads: from the target's feature of the token before the last committed one, head
    m drafts the token m+1 places past the last one. No cache, no recurrence: one pass over the
    heads per round, whatever k (capped at the number of heads). Each head's distribution is a
    valid proposal whatever it conditions on, so the rejection sampler stays exact.

    Where the fixed step applies (`drafts_in_fixed_steps`: static_cache.fixed_step_applies, CUDA
    or bf16) a round is a MedusaDraftStep over the rows bucket, its steps and graphs (`graphs`)
    shared by every batch; elsewhere (or switched off, as the tests compare) the first k heads
    run eagerly over the batch's rows."""

    name = "medusa"

    def __init__(self, loaded, target_model, vocab_size: int, compile: str | None = None,
                 graphs: StepGraphs | None = None):
        super().__init__(loaded, target_model, vocab_size)
        self.last: list[torch.Tensor | None] = []   # per row: feature of the newest observed token
        self.compile = compile
        device, dtype = self.draft_ids.device, self.head.lm_head.weight.dtype
        self.drafts_in_fixed_steps = fixed_step_applies(device, dtype)
        self.compiled = self.drafts_in_fixed_steps and resolve_compile(compile, device) == "on"
        self.graphs = graphs or StepGraphs(device, self.compiled and device.type == "cuda"
                                           and cuda_graphs_wanted())

    def for_batch(self) -> "MedusaDrafter":
        return MedusaDrafter(self.loaded, self.target_model, self.vocab_size, self.compile,
                             self.graphs)

    def draft_step(self, rows: int, width: int) -> MedusaDraftStep:
        """The heads' step for a rows bucket and width, made on first use."""
        step = self.graphs.steps.get((rows, width))
        if step is None:
            step = self.graphs.steps[(rows, width)] = MedusaDraftStep(
                self.head, self.draft_ids, rows, width, self.compiled)
        return step

    @torch.no_grad()
    def warm_up(self, max_rows: int, width: int) -> dict | None:
        """The heads' step once at every rows bucket up to max_rows (compiled, on CUDA recorded:
        serving replays these graphs); -> the buckets, the graphs and the seconds, None where
        the fixed step does not apply."""
        if not self.drafts_in_fixed_steps:
            return None
        started = time.perf_counter()
        rows = [1 << i for i in range(bucket(max_rows).bit_length())]
        for r in rows:
            self.draft_step(r, width)(self.graphs)
        report = {"rows": rows, "width": width, "graphs": self.graphs.recorded["graphs"],
                  "seconds": round(time.perf_counter() - started, 3)}
        log.info("Medusa heads warmed: %d rows buckets, %d CUDA graphs recorded in %.1f s",
                 len(rows), report["graphs"], report["seconds"])
        return report

    def _add_rows(self, count: int) -> None:
        self.last += [None] * count

    def _select(self, rows: list[int]) -> None:
        self.last = [self.last[i] for i in rows]

    def _keep(self, row: int, features: torch.Tensor) -> None:
        self.last[row] = features[-1]

    @torch.no_grad()
    def propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        B = len(sequences)
        device = self.draft_ids.device
        # A row drafts when its newest feature is of the token before its last (always, after the
        # target's first pass over it).
        row_ks = [min(k, self.head.num_heads) if self.last[i] is not None
                  and self.known[i] == len(sequences[i]) - 1 else 0 for i, k in enumerate(ks)]
        K = max(row_ks, default=0)
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        num = torch.tensor(row_ks, dtype=torch.long, device=device)
        if K == 0:
            return Proposal(tokens=tokens, num=num, probs=None)
        dim = self.head.config.hidden_size
        features = torch.stack([f if f is not None else torch.zeros(dim, device=device)
                                for f in self.last]).to(self.head.lm_head.weight.dtype)
        chosen, qs, sibs = [], [], []
        if self.drafts_in_fixed_steps:
            step = self.draft_step(bucket(B), width)
            step.features[:B] = features
            logits, top = step(self.graphs)               # [R, H, Vd], [R, H, width]
            if sampling.all_greedy:
                chosen = list(top[:B, :K, 0].unbind(1))
                sibs = list(top[:B, :K, 1:].unbind(1)) if width > 1 else []
                qs = [None] * K
            else:
                for j in range(K):
                    self._choose(logits[:B, j], j, row_ks, sampling, width, chosen, qs, sibs)
            return self._proposal(chosen, qs, sibs, num, K, width)
        vectors = self.head(features, K)                                       # [B, K, D]
        for j in range(K):
            self._choose(draft_vocab_logits(self.head, vectors[:, j]), j, row_ks, sampling, width,
                         chosen, qs, sibs)
        return self._proposal(chosen, qs, sibs, num, K, width)

    def timing_step(self, context: int):
        """One round's heads (all of them; the bench times it and charges it per round): the
        one-row MedusaDraftStep where the fixed step applies."""
        if self.drafts_in_fixed_steps:
            step = self.draft_step(1, 1)
            return torch.no_grad()(lambda: step(self.graphs))
        feature = torch.zeros(1, self.head.config.hidden_size, device=self.draft_ids.device)
        return torch.no_grad()(lambda: self._logits(self.head(feature)).argmax(-1).tolist())

    def describe(self) -> dict:
        return {"kind": self.name, "heads": self.head.num_heads,
                "draft_vocab_size": int(len(self.draft_ids)), **self.loaded.identity()}


class EagleDrafter(HeadDrafter):
    """Drafts with an EAGLE head (heads.py) from the features the target computed while verifying.

    Per row the head's cache holds the pairs (embedding of x[j+1], feature f[j]) for every j whose
    target feature is known; a round first feeds the pairs observed since the last round, then
    drafts by feeding the head its own predicted features. Those predicted pairs are dropped after
    verification (the target's real features replace them), so rejection costs nothing.
    A row drafts nothing until the target has processed its prompt once (no features yet).

    q lives on the draft vocabulary (zero elsewhere); the rejection sampler is exact for any q,
    so sampling stays lossless. The last draft token is never fed: verifying it is the target's job.

    On a fixed-step cache (static_cache.fixed_step_applies: CUDA, bf16) the drafting steps after
    the catch-up are EagleDraftStep's, one step over every row a token; elsewhere (float32 on the
    CPU: the C layer) they feed only the rows still drafting, through extend_vectors.
    """

    name = "eagle"
    # Whether a fixed-step cache drafts through EagleDraftStep (off: extend_vectors token by
    # token, as elsewhere; the tests compare the two).
    drafts_in_fixed_steps = True

    def __init__(self, loaded, target_model, vocab_size: int, compile: str | None = None):
        from specpair.static_cache import StaticKVModel, supports

        why = supports(target_model)
        if why:
            raise SpecpairError(f"an EAGLE head drafts from the static cache's features: {why}")
        super().__init__(loaded, target_model, vocab_size)
        self.compile = compile
        self.embed = target_model.get_input_embeddings()
        self.kv = StaticKVModel(self.head, compile=compile)
        self.pending: list[list[torch.Tensor]] = []   # per row: observed features not yet fed

    def for_batch(self) -> "EagleDrafter":
        return EagleDrafter(self.loaded, self.target_model, self.vocab_size, compile=self.compile)

    def _add_rows(self, count: int) -> None:
        self.kv.add_rows(count)
        self.pending += [[] for _ in range(count)]

    def _select(self, rows: list[int]) -> None:
        self.kv.select(rows)
        self.pending = [self.pending[i] for i in rows]

    def _keep(self, row: int, features: torch.Tensor) -> None:
        self.pending[row].append(features.to(self.kv.runner.dtype))

    @torch.no_grad()
    def propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        B = len(sequences)
        K = max(ks, default=0)
        device = self.kv.device
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        # Catch every row up on the pairs observed since its last round (drafting or not): the
        # token after each observed position and the target's feature there.
        pairs, features, drafting = [], [], []
        for i, seq in enumerate(sequences):
            start, known = self.kv.lengths[i], self.known[i]
            pairs.append(seq[start + 1:known + 1] if self.pending[i] else [])
            features.append(torch.cat(self.pending[i]).to(device) if self.pending[i] else None)
            self.pending[i] = []
            # A row drafts when its last pair is fed now (known == its cache length after this).
            drafting.append(ks[i] > 0 and known > 0 and len(pairs[-1]) > 0)
        num = torch.tensor([ks[i] if drafting[i] else 0 for i in range(B)], dtype=torch.long,
                           device=device)
        if not any(pairs):
            return Proposal(tokens=tokens, num=torch.zeros_like(num), probs=None)
        g = self._catch_up(pairs, features)                                      # [B, D]
        if K == 0 or not any(drafting):
            return Proposal(tokens=tokens, num=torch.zeros_like(num), probs=None)
        row_ks = [ks[i] if drafting[i] else 0 for i in range(B)]
        if self.kv.fixed and self.drafts_in_fixed_steps:
            return self._draft_in_fixed_steps(g, row_ks, sampling, width, num, K)
        chosen_steps, qs, sibs = [], [], []
        for j in range(K):
            chosen = self._choose(draft_vocab_logits(self.head, g), j, row_ks, sampling, width,
                                  chosen_steps, qs, sibs)
            if j + 1 == K or not any(j + 1 < k for k in row_ks):
                break
            # The rows still drafting feed (embedding of their token, their predicted feature).
            going = [i for i in range(B) if j + 1 < row_ks[i]]
            index = torch.tensor(going, device=device)
            pairs = self.head.inputs(self.embed(chosen[index]).to(g.dtype), g[index])
            step = [g.new_zeros(0, g.shape[1])] * B
            for n, i in enumerate(going):
                step[i] = pairs[n:n + 1]
            g = self.head.model.norm(self.kv.extend_vectors(step)[:, 0])
        return self._proposal(chosen_steps, qs, sibs, num, K, width)

    def _draft_in_fixed_steps(self, g, row_ks, sampling, width, num, K) -> Proposal:
        """The round's drafts from the catch-up's features g [B, D]: the first from g's logits,
        each further one from an EagleDraftStep over every row. Greedy: the steps read and write
        only the device, and the tokens come back in one gather at the end."""
        B = g.shape[0]
        chosen_steps, qs, sibs = [], [], []
        chosen = self._choose(draft_vocab_logits(self.head, g), 0, row_ks, sampling, width,
                              chosen_steps, qs, sibs)
        steps = max(row_ks) - 1            # the last draft token is never fed
        if steps <= 0:
            return self._proposal(chosen_steps, qs, sibs, num, K, width)
        self.kv.make_room(steps)           # before the step: a grown cache is a new one
        step = self.draft_step(width)
        start = step.start(chosen, g, self.kv.lengths)
        greedy = sampling.all_greedy
        for j in range(1, steps + 1):
            logits = step(self.kv)
            if not greedy:
                chosen = self._choose(logits[:B], j, row_ks, sampling, width, chosen_steps, qs, sibs)
                step.ids[:B, 0] = chosen
        for i, k in enumerate(row_ks):
            self.kv.lengths[i] += max(k - 1, 0)
        if greedy:
            drafted = step.tokens(start, steps)                      # [B, steps, width]
            chosen_steps += list(drafted[..., 0].unbind(1))
            if width > 1:
                sibs += list(drafted[..., 1:].unbind(1))
            qs += [None] * steps
        return self._proposal(chosen_steps, qs, sibs, num, K, width)

    def _catch_up(self, pairs: list[list[int]], features: list) -> torch.Tensor:
        """Feed rows 0..B-1 their pending pairs; -> the head's normed output at each row's last
        pair [B, D] (a row feeding none: unused). On a fixed-step cache, pairs up to
        CATCH_UP_WIDTH a row as one EagleCatchUp step at their width's bucket (on CUDA one
        replay); wider (a prompt's first) and elsewhere, the head's projection per row and
        extend_vectors."""
        B = len(pairs)
        widest = max(map(len, pairs))
        if self.kv.fixed and widest <= CATCH_UP_WIDTH:
            width = bucket(widest)
            self.kv.make_room(width)     # before the step: a grown cache is a new one
            return self.catch_up_step(width)(self.kv, pairs, features)[:B]
        device, dim = self.kv.device, self.head.config.hidden_size
        feeds = []
        for toks, feats in zip(pairs, features):
            if toks:
                nxt = torch.tensor(toks, dtype=torch.long, device=device)
                feeds.append(self.head.inputs(self.embed(nxt).to(feats.dtype), feats))
            else:
                feeds.append(torch.zeros(0, dim, device=device))
        out = self.kv.extend_vectors(feeds)
        last = torch.tensor([max(len(toks) - 1, 0) for toks in pairs], device=device)
        return self.head.model.norm(out[torch.arange(B, device=device), last])

    def catch_up_step(self, width: int) -> EagleCatchUp:
        """The catch-up step over the cache in use at `width` pairs a row (one per cache and
        width, kept with the cache's graphs as the drafting step is)."""
        key = ("eagle-catch-up", width, id(self.embed))
        step = self.kv.graphs.get(key)
        if step is None:
            step = self.kv.graphs[key] = EagleCatchUp(self.head, self.embed, self.kv, width)
        return step

    def draft_step(self, width: int) -> EagleDraftStep:
        """The head's drafting step over the cache in use (one per cache and width, kept with
        the cache's graphs: a grown or shrunk cache gets its own)."""
        key = ("eagle-draft", width, id(self.embed))
        step = self.kv.graphs.get(key)
        if step is None:
            step = self.kv.graphs[key] = EagleDraftStep(self.head, self.embed, self.draft_ids,
                                                        self.kv, width)
        return step

    def accepted(self, row: int, committed_before: int, num_accepted: int) -> None:
        # Drop the pairs built on predicted features; the target's own replace them (observe).
        self.kv.rollback(row, self.known[row])

    @torch.no_grad()
    def warm_up(self, max_rows: int, max_positions: int, width: int, depth: int) -> dict | None:
        """Run the head's steps once at every shape a batch of up to max_rows drafting rows of up
        to max_positions positions uses, on scratch batches, so no request compiles: at each
        (rows, capacity) bucket, rounds of `depth` drafts `width` wide (the drafting step,
        recorded on CUDA) after catch-up feeds of several pairs for every row, of one pair, and
        of several for one row beside one-pair rows (the catch-up step, recorded on CUDA, and
        past its width the vector steps, compiled where the cache is). -> as
        StaticKVModel.warm_up's report; None where the head's cache runs no fixed step (its
        steps there are the C layer's)."""
        if not self.kv.fixed:
            return None
        started = time.perf_counter()
        shapes = self.kv.buckets(max_rows, max_positions)
        dim, recorded = self.head.config.hidden_size, 0
        for rows, positions in shapes:
            batch = self.for_batch()
            batch.add_rows(rows)
            batch.kv.make_room(positions)
            sampling = RowSampling(*(torch.zeros(rows),) * 3, [None] * rows, greedy=True)
            # Pairs fed per row: each width and row count a catch-up compiles for, twice (the
            # second width makes dynamo compile it symbolic): the catch-up step's widths
            # (EagleCatchUp, recorded on CUDA), then wider ones, as a prompt's first catch-up
            # runs (the vector steps by row).
            wide, wider = CATCH_UP_WIDTH + 1, 2 * CATCH_UP_WIDTH + 1
            for fed in ([3] * rows, [2] * rows, [1] * rows, [2] + [1] * (rows - 1),
                        [5] + [1] * (rows - 1), [wide] * rows, [wider] + [1] * (rows - 1)):
                for i, n in enumerate(fed):
                    batch.observe(i, batch.known[i], torch.zeros(n, dim, device=self.kv.device))
                sequences = [[0] * (batch.known[i] + 1) for i in range(rows)]
                batch.propose(sequences, [depth] * rows, sampling, width)
                for i in range(rows):
                    batch.accepted(i, batch.known[i], 0)
            recorded += batch.kv.recorded["graphs"]
            del batch
        report = {"buckets": shapes, "width": width, "depth": depth, "graphs": recorded,
                  "seconds": round(time.perf_counter() - started, 3)}
        log.info("EAGLE head warmed: %d buckets (rows, capacity), %d CUDA graphs recorded in "
                 "%.1f s", len(shapes), recorded, report["seconds"])
        return report

    def timing_step(self, context: int):
        """One draft step after `context` pairs, undone after each call: what the bench times and
        the cost model charges per draft token. On a fixed-step cache the drafting step a round
        runs (EagleDraftStep; on CUDA one graph replay), its position put back after each call;
        elsewhere a head layer step through extend_vectors and the draft vocabulary's logits."""
        from specpair.static_cache import StaticKVModel

        dim = self.head.config.hidden_size
        kv = StaticKVModel(self.head, compile=self.compile)
        kv.add_rows(1)
        kv.extend_vectors([torch.zeros(context, dim, device=kv.device)])
        if kv.fixed and self.drafts_in_fixed_steps:
            kv.make_room(1)
            drafting = EagleDraftStep(self.head, self.embed, self.draft_ids, kv, 1)
            drafting.start(torch.zeros(1, dtype=torch.long, device=kv.device),
                           torch.zeros(1, dim, dtype=kv.runner.dtype, device=kv.device), [context])

            @torch.no_grad()
            def fixed_step():
                drafting(kv)
                drafting.positions.sub_(1)
                drafting.slots.sub_(1)
            return fixed_step

        @torch.no_grad()
        def step():
            g = self.head.model.norm(kv.extend_vectors([torch.zeros(1, dim, device=kv.device)])[:, 0])
            self._logits(g).argmax(-1).tolist()
            kv.rollback(0, context)
        return step

    def timing_round(self, context: int, drafts: int = 1):
        """A greedy round of `drafts` drafts for one row after `context` pairs, as a batch runs
        it: the catch-up on the pair observed since the last round, the head's norm and the
        first draft's logits and choice, the drafting steps, the drafts then rejected. Of one
        draft, less one drafting step (`timing_step`): what a round costs beyond its draft
        tokens, the cost model's `draft_round` (on an H100 about 2 ms, docs/gpu.md). Each call
        observes one pair more (the cache grows by a slot a call)."""
        batch = self.for_batch()
        batch.add_rows(1)
        dim, device = self.head.config.hidden_size, self.kv.device
        greedy = RowSampling(*(torch.zeros(1),) * 3, [None], greedy=True)
        batch.observe(0, 0, torch.zeros(context, dim, device=device))

        @torch.no_grad()
        def round_of_one():
            batch.observe(0, batch.known[0], torch.zeros(1, dim, device=device))
            batch.propose([[5] * (batch.known[0] + 1)], [drafts], greedy, 1)
            batch.accepted(0, batch.known[0], 0)
        round_of_one()            # the context's own catch-up
        return round_of_one


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
