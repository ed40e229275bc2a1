"""The EAGLE head's steps: one drafting step (EagleDraftStep, captured in a CUDA graph where it can
be) and the catch-up over the features a round committed (EagleCatchUp)."""

from __future__ import annotations

import torch

from specpair.drafters.head import draft_vocab_logits
from specpair.kv.graphs import to_device


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
        runner, caches, compiled, table = kv.runner, kv.caches, kv.compiled, kv.table
        at = self.slots.view(rows, 1, 1).expand(rows, 1, width)

        def step():
            x = head.inputs(embed(self.ids).to(dtype), self.features)             # [R, 1, D]
            h = runner.fixed_layers(x, self.positions, self.slots, caches, compiled=compiled,
                                    table=table)
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


def catch_up_planes(shape, width: int, lengths: list[int], tokens: list[list[int]],
                    features: list, into: torch.Tensor) -> torch.Tensor:
    """A catch-up step's host planes [4, R, width] (ids, positions, slots, each row's last pair
    at [3, :, 0]) for rows 0..B-1 feeding `tokens[i]` from `lengths[i]`, which move on by n_i;
    each row's features [n_i, F] copied into `into[i, :n_i]` (the step's device buffer). Pad
    pairs continue a row's slots past its new length. EAGLE's and EAGLE-3's catch-ups alike."""
    host = torch.zeros(shape, dtype=torch.long)
    starts = torch.zeros(shape[1], 1, dtype=torch.long)
    for i, (toks, feats) in enumerate(zip(tokens, features)):
        n = len(toks)
        starts[i, 0] = lengths[i]
        if n:
            host[0, i, :n] = torch.tensor(toks, dtype=torch.long)
            host[3, i, 0] = n - 1
            into[i, :n] = feats
        lengths[i] += n
    host[1] = host[2] = starts + torch.arange(width).view(1, -1)
    return host


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
        runner, caches, compiled, table = kv.runner, kv.caches, kv.compiled, kv.table
        ids, positions, slots, last = self.planes[0], self.planes[1], self.planes[2], self.planes[3]
        every = torch.arange(rows, device=device)

        def step():
            x = head.inputs(embed(ids).to(dtype), self.features)                 # [R, W, D]
            h = runner.fixed_layers(x, positions, slots, caches, compiled=compiled,
                                    table=table)
            return head.model.norm(h[every, last[:, 0]])                         # [R, D]

        self.step = step

    def __call__(self, kv, tokens: list[list[int]], features: list[torch.Tensor]) -> torch.Tensor:
        """Rows 0..B-1 feed `tokens[i]` with `features[i]` [n_i, D] from their lengths, which
        move on by n_i; -> [R, D] (rows' outputs at their last pair; a row feeding none: unused)."""
        host = catch_up_planes(self.planes.shape, self.width, kv.lengths, tokens, features,
                               self.features)
        self.planes.copy_(to_device(host, self.planes.device))
        if self.graph is None:
            self.graph = kv.capture(self.step)
        return self.graph.replay() if self.graph is not None else self.step()
