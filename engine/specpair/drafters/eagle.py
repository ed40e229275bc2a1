"""EagleDrafter: a head (heads.py) drafting from the target's own features, which the engine hands
it after each verification (`observe`); it has no trunk of its own."""

from __future__ import annotations

import logging
import time

import torch

from specpair.drafters.base import Proposal, RowSampling
from specpair.drafters.eagle_steps import CATCH_UP_WIDTH, EagleCatchUp, EagleDraftStep
from specpair.drafters.head import draft_vocab_logits, HeadDrafter
from specpair.errors import SpecpairError
from specpair.kv.buckets import bucket

log = logging.getLogger(__name__)


class EagleDrafter(HeadDrafter):
    """Drafts with an EAGLE head (heads.py) from the features the target computed while verifying.

    Per row the head's cache holds the pairs (embedding of x[j+1], feature f[j]) for every j whose
    target feature is known; a round first feeds the pairs observed since the last round, then
    drafts by feeding the head its own predicted features. Those predicted pairs are dropped after
    verification (the target's real features replace them), so rejection costs nothing.
    A row drafts nothing until the target has processed its prompt once (no features yet).

    q lives on the draft vocabulary (zero elsewhere); the rejection sampler is exact for any q,
    so sampling stays lossless. The last draft token is never fed: verifying it is the target's job.

    On a fixed-step cache (kv.fixed_step.fixed_step_applies: CUDA, bf16) the drafting steps after
    the catch-up are EagleDraftStep's, one step over every row a token; elsewhere (float32 on the
    CPU: the C layer) they feed only the rows still drafting, through extend_vectors.
    """

    name = "eagle"
    draft_per_token = True
    # Whether a fixed-step cache drafts through EagleDraftStep (off: extend_vectors token by
    # token, as elsewhere; the tests compare the two).
    drafts_in_fixed_steps = True

    def __init__(self, loaded, target_model, vocab_size: int, compile: str | None = None):
        from specpair.kv.families import supports
        from specpair.kv.static import StaticKVModel

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

    def cache_bytes(self) -> int:
        """The head's own keys and values (its StaticKVModel, every row)."""
        return self.kv.cache_bytes

    shares_prefix = True

    def prefix_positions(self, row: int) -> int:
        return self.kv.lengths[row]      # rolled back to the observed pairs after each round

    def _prefix_cache(self, row: int, start: int, width: int) -> torch.Tensor:
        """[2, layers, KV, width, hd] (the head cache's read_blocks, keys and values first)."""
        return self.kv.read_blocks(row, [start], width)[0].transpose(0, 1)

    def _load_prefix_cache(self, row: int, span: torch.Tensor) -> int:
        return self.kv.load_blocks(row, [span.transpose(0, 1)])

    def _add_rows(self, count: int) -> None:
        self.kv.add_rows(count)
        self.pending += [[] for _ in range(count)]

    def _select(self, rows: list[int]) -> None:
        self.kv.select(rows)
        self.pending = [self.pending[i] for i in rows]

    def _keep(self, row: int, features: torch.Tensor) -> None:
        self.pending[row].append(features.to(self.kv.runner.dtype))

    @torch.no_grad()
    def _propose(self, sequences, ks, sampling, width: int = 1) -> Proposal:
        B = len(sequences)
        K = max(ks, default=0)
        device = self.kv.device
        # Catch every row up on the pairs observed since its last round (drafting or not): the
        # token after each observed position and the target's feature there.
        tokens, pairs, features, drafting, num = self._open_round(sequences, ks, self.kv.lengths, device)
        if not any(pairs):
            return self._no_drafts(tokens, num)
        g = self._catch_up(pairs, features)                                      # [B, D]
        if K == 0 or not any(drafting):
            return self._no_drafts(tokens, num)
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
        # A row with a grammar chooses each draft on the host within it (_choose), as sampled
        # rows do: the greedy steps' own top is the grammar's choice only by chance.
        greedy = sampling.all_greedy and self._guides is None
        for j in range(1, steps + 1):
            logits = step(self.kv)
            if not greedy:
                chosen = self._choose(logits[:B], j, row_ks, sampling, width, chosen_steps, qs, sibs)
                step.ids[:B, 0] = chosen
        for i, k in enumerate(row_ks):
            self.kv.lengths[i] += max(k - 1, 0)
        if greedy:
            self._gather_greedy(step, start, steps, width, chosen_steps, qs, sibs)
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

    def step_model(self):
        return self.loaded.model

    def warm_up_steps(self, rows: int, context_length: int, tree_width: int, k_max: int) -> dict | None:
        return self.warm_up(rows, context_length, tree_width, k_max)

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
        from specpair.kv.static import StaticKVModel

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
