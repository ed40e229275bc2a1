"""The preallocated KV cache written in place (`StaticKVModel`): the engine's cache for the
families the static step runs (families.py), on the CPU's C layer or the fixed step.

Each batch row owns a row of the cache and a length. A step writes its tokens' keys and values
at positions length..length+n of that row and attends, under a causal mask over positions, to
everything before them; rejecting drafts only moves the length back, so whatever was written past
it is never seen again and is overwritten by the next step (gpt-fast's design). Nothing is
gathered, cropped or compacted, and the step's shapes depend only on (rows, tokens per row, cache
length), which is what lets `torch.compile` specialise it.

Rows are left-aligned: row i's n_i new tokens fill slots 0..n_i-1 and its pad slots continue the
row's positions past its end (harmless writes past the length, invisible to every real query).
Rows of very different widths (a request joining running rows with its whole prompt) run as
separate forwards, each padded only to its own widest row (`width_groups`).
"""

from __future__ import annotations

import logging
import time
import weakref

import torch
import torch.nn.functional as F

from specpair.kv import buckets, fixed_step, warmup
from specpair.kv.compiling import resolve_compile
from specpair.kv.graphs import (CapturedGraph, CapturedStep, capture_graph, cuda_graphs_wanted,
                               to_device)
from specpair.kv.layouts import TreeLayout, chain_parented
from specpair.kv.protocol import KVCache
from specpair.kv.runner import StaticLlama
from specpair.kv.shelf import CacheLease


log = logging.getLogger(__name__)


class StaticKVModel(KVCache):
    """A causal LM plus its preallocated per-row cache (the cache protocol, protocol.KVCache).

    Capacity (rows, positions) doubles when exceeded (one copy, amortised) and shrinks back once
    live rows need a quarter of it (SHRINK_BELOW), so memory follows the longest live row rather
    than the model's whole context or the longest row ever seen.

    `fixed` (default: fixed_step_applies) runs the fixed-shape step (fixed_step.py) at
    `token_bucket` tokens per row (bucketed); capacity is then bucketed too, and the step runs
    over all of it.
    """

    def __init__(self, model, vocab_size: int | None = None, compile: str | None = None,
                 token_bucket: int | None = None, fixed: bool | None = None):
        self.model = model
        self.runner = StaticLlama.of(model)
        self.device = self.runner.device
        self.vocab_size = vocab_size
        self.compiled = resolve_compile(compile, self.device) == "on"
        self.fixed = (fixed_step.fixed_step_applies(self.device, self.runner.dtype) if fixed is None
                      else fixed)
        self.token_bucket = buckets.bucket(token_bucket or 1)
        self.prefill_step_tokens = buckets.PREFILL_STEP_TOKENS
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.lengths: list[int] = []
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.table: torch.Tensor | None = None      # block tables, where paged (paged_fixed.py)
        # CUDA graphs of the fixed step over the current cache, by input shape (CapturedStep),
        # and the steps other code records over it (a drafting head's, drafters.EagleDraftStep),
        # by their own keys; why capture failed, if it did (the step then runs uncaptured).
        self.graphs: dict[tuple, object] = {}
        self.recorded = {"graphs": 0, "seconds": 0.0}
        self._lease = CacheLease(self.runner.shelf)
        weakref.finalize(self, self._lease.release)
        self.capture_error: str | None = None
        self.captures_graphs = (self.fixed and self.compiled and self.device.type == "cuda"
                                and cuda_graphs_wanted())
        self._allocate(rows=1, positions=self._position_floor)

    @property
    def _position_floor(self) -> int:
        # The fixed step's capacity is a bucket; otherwise a short context needs no more.
        floor = buckets.INITIAL_POSITIONS
        return floor if self.fixed else min(floor, self.max_positions)

    @property
    def cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        return max(self.lengths, default=0)

    @property
    def capacity(self) -> tuple[int, int]:
        kc = self.caches[0][0]
        return int(kc.shape[0]), int(kc.shape[2])

    def _zero_caches(self, shape: tuple) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A key and a value tensor of `shape` per layer, zeroed."""
        r = self.runner
        return [(torch.zeros(shape, dtype=r.dtype, device=self.device),
                 torch.zeros(shape, dtype=r.dtype, device=self.device))
                for _ in range(r.layer_count)]

    def _allocate(self, rows: int, positions: int) -> None:
        r = self.runner
        shape = (rows, r.kv_heads, positions, r.head_dim)
        # The old cache goes first where it need not be copied: peak memory stays one cache.
        if not self.caches or not self.lengths:
            self.caches = []
            self._lease.release()
        kept = r.shelf.take(shape)
        if kept is not None:         # a released cache of this shape, with its graphs
            new, graphs = kept
        else:
            new, graphs = self._zero_caches(shape), {}
        if self.caches:
            old_rows, old_pos = self.capacity
            keep_rows, keep_pos = min(old_rows, rows), min(old_pos, positions)
            for (nk, nv), (ok, ov) in zip(new, self.caches):
                nk[:keep_rows, :, :keep_pos] = ok[:keep_rows, :, :keep_pos]
                nv[:keep_rows, :, :keep_pos] = ov[:keep_rows, :, :keep_pos]
            self._lease.release()
        self.caches, self.graphs = new, graphs
        self._lease.shape, self._lease.caches, self._lease.graphs = shape, new, graphs

    def _reserve(self, rows: int, positions: int) -> None:
        have_rows, have_pos = self.capacity
        if rows <= have_rows and positions <= have_pos:
            return
        if self.fixed:
            self._allocate(max(have_rows, buckets.bucket(rows)),
                           max(have_pos, buckets.bucket(positions, self._position_floor)))
            return
        if positions > have_pos:
            need = max(positions, have_pos * 2)
            # Pad slots may run past the context; the cache may too (they are never attended).
            have_pos = need
        while have_rows < rows:
            have_rows *= 2
        self._allocate(have_rows, have_pos)

    def _shrink(self) -> None:
        """Give memory back once live rows need a quarter of the capacity (SHRINK_BELOW): down
        to twice the bucket they need, so a row joining and leaving does not reallocate again."""
        have_rows, have_pos = self.capacity
        live_rows = max(1, self.batch_size)
        # The fixed step writes a token bucket past each row's length.
        live_pos = max(self.lengths, default=0) + (self.token_bucket if self.fixed else 0)
        rows, positions = have_rows, have_pos
        if live_rows * buckets.SHRINK_BELOW <= have_rows:
            rows = 2 * buckets.bucket(live_rows)
        if live_pos * buckets.SHRINK_BELOW <= have_pos:
            positions = max(self._position_floor, 2 * buckets.bucket(live_pos))
        if (rows, positions) != (have_rows, have_pos):
            self._allocate(min(rows, have_rows), min(positions, have_pos))

    def _advance(self, counts: list[int]) -> tuple[torch.Tensor, int]:
        """Positions [B, W] for rows feeding `counts` new tokens (pads continue each row's
        positions), the rows' lengths moved on, and the cache grown to hold them."""
        B = len(counts)
        assert B == self.batch_size, (B, self.batch_size)
        width = max(counts, default=0)
        if width == 0:
            raise ValueError("extend() called with no tokens")
        start = torch.tensor(self.lengths, dtype=torch.long).view(B, 1)
        positions = start + torch.arange(width, dtype=torch.long).view(1, width)
        for i, n in enumerate(counts):
            self.lengths[i] += n
        attend = int(positions.max()) + 1
        self._reserve(B, attend)
        return positions.to(self.device), attend

    @torch.no_grad()
    def extend(self, rows: list[list[int]], last: int | list[int] = 1, hidden: bool = False,
               parents: list[list[int]] | None = None):
        """Feed each row its new tokens; return the logits of each row's last `last` tokens,
        [B, L, V] right-aligned (as BatchedKVModel.extend). With `hidden`, also the normed last
        hidden state of every fed token, [B, W, D] left-aligned (row i's first len(rows[i])).
        `parents` makes the tokens a tree (TreeLayout): per row, each token's parent index among
        the row's fed tokens, or -1; after verification `move` puts the kept branch in place."""
        if self.fixed and (parents is None or (chain_parented(parents) and
                                               max(map(len, rows)) <= self.token_bucket)):
            return self._extend_fixed(rows, last, hidden, parents)
        # Any other tree: the general step below (exact to rounding, not bitwise).
        B = len(rows)
        width = max((len(r) for r in rows), default=0)
        n_last = max(last) if isinstance(last, list) else last
        ids = torch.zeros(B, width, dtype=torch.long)
        gather = torch.zeros(B, n_last, dtype=torch.long)
        for i, toks in enumerate(rows):
            n = len(toks)
            if n:
                ids[i, :n] = torch.tensor(toks, dtype=torch.long)
            gather[i] = (torch.arange(n_last) + (n - n_last)).clamp(min=0)
        counts = [len(r) for r in rows]
        positions, attend = self._advance(counts)
        tree = TreeLayout(positions, parents) if parents is not None else None
        ids, gather = ids.to(self.device), gather.to(self.device)
        groups = (buckets.width_groups(counts) if tree is None and not self.compiled
                  else [list(range(B))])
        if len(groups) == 1:
            out = self.runner.forward(ids, positions, gather, self.caches, attend, self.compiled,
                                      hidden=hidden, tree=tree)
            logits, states = out if hidden else (out, None)
        else:
            logits, states = self._extend_apart(groups, counts, ids, positions, gather, hidden)
        if self.vocab_size is not None and logits.shape[-1] > self.vocab_size:
            logits = logits[..., : self.vocab_size]   # padded embedding rows are never real tokens
        return (logits, states) if hidden else logits

    def _extend_fixed(self, rows, last, hidden: bool, parents=None, vectors: bool = False):
        """extend() (or, with `vectors`, extend_vectors()) through fixed-shape steps: rows
        feeding more than the token bucket (a prompt) first run apart at their own bucket (a
        fixed step of only those rows, `_prefill_step`; eagerly when long, or for vectors); then
        one step of every cache row at the token bucket feeds the rest, padding
        slots continuing each row's positions past its length (written, never attended)."""
        B, W = len(rows), self.token_bucket
        counts = [int(r.shape[0]) if vectors else len(r) for r in rows]
        if max(counts, default=0) == 0:
            raise ValueError("extend() called with no tokens")
        assert B == self.batch_size, (B, self.batch_size)
        starts = list(self.lengths)
        wide = [i for i in range(B) if counts[i] > W]
        wide_width = buckets.bucket(max((counts[i] for i in wide), default=1))
        for i, n in enumerate(counts):
            self.lengths[i] += n
        self._reserve(B, max([max(self.lengths) + W] + [starts[i] + wide_width for i in wide]))
        r, dim = self.runner, self.model.config.hidden_size
        n_last = max(last) if isinstance(last, list) else last
        width = max(counts)
        out = states = None
        if wide and not vectors and len(wide) * wide_width <= self.prefill_step_tokens:
            h = self._prefill_step(rows, wide, starts, counts, wide_width)
            out, states = self._place(out, states, h, wide, list(range(len(wide))), counts,
                                      n_last, width, vectors, hidden)
        elif wide:    # long prompts (compute-bound) or vectors, at their own width
            starts_wide = torch.tensor([starts[i] for i in wide], dtype=torch.long).view(-1, 1)
            pos = starts_wide + torch.arange(wide_width).view(1, -1)
            if vectors:
                h = torch.zeros(len(wide), wide_width, dim, dtype=r.dtype, device=self.device)
                for n, i in enumerate(wide):
                    h[n, :counts[i]] = rows[i]
            else:
                ids = torch.zeros(len(wide), wide_width, dtype=torch.long)
                for n, i in enumerate(wide):
                    ids[n, :counts[i]] = torch.tensor(rows[i], dtype=torch.long)
                h = self.model.model.embed_tokens(ids.to(self.device))
            # A head's vectors, compiled: as a prompt's step runs (`_step_uncaptured`: its planes,
            # the rows' whole capacity), so they take the graphs `_warm_prefill` compiled. Else
            # eagerly, attending only the slots reached.
            compiled = self.compiled and vectors
            kv_rows = torch.tensor(wide, dtype=torch.long).view(-1, 1).expand(len(wide), wide_width)
            planes = to_device(torch.stack((pos, pos, pos, kv_rows)), self.device)
            reach = None if compiled else int(pos.max()) + 1
            features = None if vectors else r.feature_layers
            h = r.fixed_layers(h, planes[1], planes[2], self.caches, kv_rows=planes[3, :, 0],
                               reach=reach, compiled=compiled, table=self.table,
                               features=features)
            if features:      # as the fixed step hands them: (logits, normed, the layers')
                h = (None, self.model.model.norm(h[0]), h[1])
            out, states = self._place(out, states, h, wide, list(range(len(wide))), counts,
                                      n_last, width, vectors, hidden)
        narrow = [i for i in range(B) if 0 < counts[i] <= W]
        if narrow:
            R = self.capacity[0]
            fed = [0 if i in wide else counts[i] for i in range(B)]
            start = torch.zeros(R, 1, dtype=torch.long)
            start[:B, 0] = torch.tensor([self.lengths[i] - fed[i] for i in range(B)])
            slots = start + torch.arange(W).view(1, W)
            positions = slots.clone()
            for i, row in enumerate(parents or []):
                for w, parent in enumerate(row):
                    if parent >= 0:
                        positions[i, w] = slots[i, parent] + 1
            if vectors:
                slots, positions = slots.to(self.device), positions.to(self.device)
                h = torch.zeros(R, W, dim, dtype=r.dtype, device=self.device)
                for i in narrow:
                    h[i, :counts[i]] = rows[i]
                h = r.fixed_layers(h, positions, slots, self.caches, compiled=self.compiled,
                                   table=self.table)
            else:
                # ids, positions and slots go over in one copy: from pageable memory each copy
                # waits for the stream, and the GPU step is short enough that three such waits
                # were a visible share of it (docs/gpu.md).
                pad = [0] * W
                ids = torch.tensor([list(rows[i]) + pad[counts[i]:] if fed[i] else pad
                                    for i in range(B)] + [pad] * (R - B), dtype=torch.long)
                host = torch.stack((ids, positions, slots))
                if self.captures_graphs and self.capture_error is None:
                    h = self._replay(host)
                else:
                    h = self._step_uncaptured(host, self.caches, table=self.table)
            out, states = self._place(out, states, h, narrow, narrow, counts, n_last, width,
                                      vectors, hidden)
        if vectors:
            return out
        if self.vocab_size is not None and out.shape[-1] > self.vocab_size:
            out = out[..., : self.vocab_size]   # padded embedding rows are never real tokens
        return (out, states) if hidden else out

    def _prefill_step(self, rows, wide, starts, counts, width: int):
        """The prompts of rows `wide` as one fixed step of those rows at their bucket `width`
        (no LM head: _place applies it to the slots asked for): on CUDA one replay of a recorded
        graph, where the same layers run eagerly cost ~34 ms a SmolLM2 prompt in kernel launches
        (docs/gpu.md). The step writes only these rows, reads their whole capacity (the
        graph's shape cannot follow the prompt's reach) and its pad slots continue each row's
        positions past its new length, never attended. Rows are not bucketed: a padded row
        would have to write somewhere, and a full cache has no row to spare."""
        ids = torch.zeros(len(wide), width, dtype=torch.long)
        for n, i in enumerate(wide):
            ids[n, :counts[i]] = torch.tensor(rows[i], dtype=torch.long)
        slots = (torch.tensor([starts[i] for i in wide], dtype=torch.long).view(-1, 1)
                 + torch.arange(width).view(1, width))
        kv_rows = torch.tensor(wide, dtype=torch.long).view(-1, 1).expand(len(wide), width)
        host = torch.stack((ids, slots, slots, kv_rows))
        if self.captures_graphs and self.capture_error is None:
            return self._replay(host, head=False)
        return self._step_uncaptured(host, self.caches, head=False, table=self.table)

    def _replay(self, host: torch.Tensor, head: bool = True):
        """The fixed step through this cache's CUDA graph for the inputs' shape, recorded on first
        use. A graph that cannot be recorded is reported once and the step runs uncaptured."""
        key = (tuple(host.shape), head)
        graph = self.graphs.get(key)
        if graph is None:
            started = time.perf_counter()
            try:
                graph = CapturedStep(self.runner, host.to(self.device), self.caches, self.compiled,
                                     head=head, table=self.table)
            except Exception as exc:     # noqa: BLE001 - any capture failure: run uncaptured
                self.capture_error = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, the fixed step runs uncaptured: %s",
                            self.capture_error)
                return self._step_uncaptured(host, self.caches, head, table=self.table)
            self.graphs[key] = graph
            self.recorded["graphs"] += 1
            self.recorded["seconds"] += time.perf_counter() - started
        return graph(host)      # recording computes nothing: even a new graph replays now

    def capture(self, step, state=()) -> CapturedGraph | None:
        """`step`, a function of device buffers over this cache, recorded (`capture_graph`)."""
        return capture_graph(self, step, state)

    def make_room(self, slots: int) -> None:
        """Capacity for every row to write `slots` slots past its length (a fixed step writes
        every row; what a row writes past its length is never attended)."""
        self._reserve(self.batch_size, max(self.lengths, default=0) + slots)

    def buckets(self, max_rows: int, max_positions: int, rows_from: int = 1
                ) -> list[tuple[int, int]]:
        """Every (rows, capacity) bucket this cache's fixed step can run at (warmup.buckets)."""
        return warmup.buckets(self, max_rows, max_positions, rows_from)

    @torch.no_grad()
    def warm_up(self, max_rows: int, max_positions: int, rows_from: int = 1) -> dict:
        """Compile (and on CUDA record) the fixed step at every bucket ahead of the first
        request (warmup.warm_up); -> its report."""
        return warmup.warm_up(self, max_rows, max_positions, rows_from)

    def _step_uncaptured(self, host: torch.Tensor, caches, head: bool = True, table=None):
        """The fixed step on host planes (ids, positions, slots, and for a prompt's step the
        cache row of each row) without a CUDA graph: compiled or eager. `table`: where `caches`
        are a paged cache's pools, its block tables."""
        planes = to_device(host, self.device)
        return self.runner.fixed_step(*planes[:3], caches, compiled=self.compiled, head=head,
                                      kv_rows=planes[3, :, 0] if len(planes) == 4 else None,
                                      table=table)

    def _scratch(self, shape: tuple):
        """Caches of `shape` (rows, kv heads, capacity, head dim) for warming a bucket up, and
        their block tables (None: this cache is not paged)."""
        return self._zero_caches(shape), None

    def _place(self, out, states, h, which: list[int], at: list[int], counts, n_last: int,
               width: int, vectors: bool, hidden: bool):
        """Put one forward's results for the batch rows `which` (found at rows `at` of h) where
        extend() returns them. h: a fixed step's (logits, normed states) over every cache row,
        or the layers' output (vectors: returned as is; tokens: normed, then the LM head over
        only the slots asked for: a prompt's every slot would be its length times the vocabulary)."""
        B = len(counts)
        if isinstance(h, tuple):
            # A third: what `hidden` hands over instead of the normed states (the layers an
            # EAGLE-3 head reads: StaticLlama.feature_layers).
            logits, normed = h[0], h[1]
            handed = h[2] if len(h) > 2 else normed
        else:
            logits, normed = None, h if vectors else self.model.model.norm(h)
            handed = normed
        if vectors:
            if out is None:
                out = normed.new_zeros(B, max(width, 1), normed.shape[-1])
            for i, a in zip(which, at):
                out[i, :counts[i]] = normed[a, :counts[i]]
            return out, None
        first = counts[which[0]] - n_last
        if logits is not None and at == list(range(len(at))) and first >= 0 and all(
                counts[i] - n_last == first for i in which):
            # Rows 0..n-1 each feeding as many tokens (every decode step without per-row k): a
            # slice, copied out of the step's output (a CUDA graph's buffers are overwritten by
            # its next replay), with no index tensors to build and send.
            part = logits[:len(at), first:first + n_last].clone()
        else:
            index = torch.tensor(at, dtype=torch.long, device=self.device).view(-1, 1)
            gather = torch.tensor([[max(0, counts[i] - n_last + t) for t in range(n_last)]
                                   for i in which], dtype=torch.long, device=self.device)
            part = (logits[index, gather] if logits is not None
                    else F.linear(normed[index, gather], self.model.lm_head.weight))
        if out is None and len(which) == B:      # every row from this forward, in order
            out = part
        else:
            if out is None:
                out = part.new_zeros(B, n_last, part.shape[-1])
            out[torch.tensor(which, device=self.device)] = part
        if hidden:
            if states is None:
                states = handed.new_zeros(B, width, handed.shape[-1])
            for i, a in zip(which, at):
                states[i, :counts[i]] = handed[a, :counts[i]]
        return out, states

    def _extend_apart(self, groups, counts, ids, positions, gather, hidden):
        """One forward per group of rows, each padded only to its own widest row; the results
        land where one padded forward would have put them."""
        logits = states = None
        for group in groups:
            index = torch.tensor(group, dtype=torch.long, device=self.device)
            w = max(1, max(counts[i] for i in group))
            pos = positions[index, :w]
            kv_rows = None if group == list(range(len(group))) else index
            out = self.runner.forward(ids[index, :w], pos, gather[index], self.caches,
                                      int(pos.max()) + 1, self.compiled, hidden=hidden,
                                      rows=kv_rows)
            part, part_states = out if hidden else (out, None)
            if logits is None:
                logits = part.new_empty((len(counts),) + tuple(part.shape[1:]))
            logits[index] = part
            if hidden:
                if states is None:
                    states = part_states.new_zeros(len(counts), ids.shape[1], part_states.shape[-1])
                states[index, :w] = part_states
        return logits, states

    @torch.no_grad()
    def extend_vectors(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Feed each row new input vectors [n_i, D] instead of token ids (a drafting head's
        inputs); -> the last layer's output for every slot, [B, W, D] left-aligned."""
        if self.fixed:
            return self._extend_fixed(rows, 1, False, vectors=True)
        B = len(rows)
        width = max((int(r.shape[0]) for r in rows), default=0)
        r = self.runner
        dim = self.model.config.hidden_size
        h = torch.zeros(B, max(width, 1), dim, dtype=r.dtype, device=self.device)
        for i, vectors in enumerate(rows):
            if vectors.shape[0]:
                h[i, :vectors.shape[0]] = vectors
        positions, attend = self._advance([int(v.shape[0]) for v in rows])
        return r.run_layers(h, positions, self.caches, attend, self.compiled)

    def move(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy keys and values (row, from slot, to slot) in every layer: a tree's kept branch
        goes where a chain would have written it, so later steps see plain positions."""
        if not moves:
            return
        rows, src, dst = (torch.tensor(c, dtype=torch.long, device=self.device) for c in zip(*moves))
        for kc, vc in self.caches:
            kc[rows, :, dst] = kc[rows, :, src]
            vc[rows, :, dst] = vc[rows, :, src]

    def rollback(self, row: int, keep: int) -> None:
        """Forget row's tokens beyond its first `keep`: the length moves back, nothing else."""
        if keep < self.lengths[row]:
            self.lengths[row] = keep

    def trim(self) -> None:
        """Nothing to crop (positions past a row's length are simply overwritten later); memory
        no live row needs goes back (_shrink)."""
        self._shrink()

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, moved to the front of the cache (rows leave at step boundaries)."""
        used = max((self.lengths[i] for i in rows), default=0)
        if used and rows != list(range(len(rows))):
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            for kc, vc in self.caches:
                kc[:len(rows), :, :used] = kc[index, :, :used]
                vc[:len(rows), :, :used] = vc[index, :, :used]
        self.lengths = [self.lengths[i] for i in rows]
        self._shrink()

    def add_rows(self, count: int) -> None:
        if count <= 0:
            return
        self.lengths += [0] * count
        self._reserve(len(self.lengths), self.capacity[1])

    # -- prefix reuse (prefix_cache.py) ---------------------------------------------------------

    reuses_prefixes = True

    def read_blocks(self, row: int, starts: list[int], width: int) -> list[torch.Tensor]:
        """Copies of `row`'s keys and values at slots start..start+width-1, for each start: one
        tensor [layers, 2, kv heads, width, head dim] a block (what the prefix store keeps)."""
        if not starts:
            return []
        lo, hi = min(starts), max(starts) + width
        if hi > self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions, not {hi}")
        span = torch.stack([torch.stack((k[row, :, lo:hi], v[row, :, lo:hi]))
                            for k, v in self.caches])
        return [span[:, :, :, s - lo:s - lo + width].clone() for s in starts]

    def load_blocks(self, row: int, blocks: list[torch.Tensor]) -> int:
        """Write consecutive blocks (read_blocks' tensors) at an empty row's first slots; the row
        then holds them as if its prompt's first tokens had been fed. -> positions now held."""
        if self.lengths[row]:
            raise ValueError(f"row {row} already holds {self.lengths[row]} positions")
        if not blocks:
            return 0
        span = torch.cat(blocks, dim=3).to(self.device)
        n = int(span.shape[3])
        self._reserve(self.batch_size, n + (self.token_bucket if self.fixed else 0))
        for layer, (kc, vc) in enumerate(self.caches):
            kc[row, :, :n] = span[layer, 0]
            vc[row, :, :n] = span[layer, 1]
        self.lengths[row] = n
        return n
