"""An EAGLE-3 head's round of drafts as fixed-shape steps over device buffers: what a CUDA graph
records (kv.graphs.capture_graph), as EAGLE heads' rounds are (drafters.EagleCatchUp,
EagleDraftStep).

The head's one layer (eagle3.Eagle3Layer: attention over [normed embedding, normed hidden], the
residual on the hidden alone) is not a target layer, so it has a step of its own here
(`eagle3_layer`), over a key/value cache of its own for every row of the batch at a bucketed
capacity (`Eagle3Cache`): keys written at slots, attention by the fixed step's `attend` (the
slots before each query's position and its own key), no host reads. A round is

- the catch-up (`Eagle3CatchUp`): every row's pairs observed since its last round (the token
  after each observed position and the target's auxiliary states there, through the head's fc)
  at a bucketed width, pad pairs past each row's new length (written, never attended);
- the drafting steps (`Eagle3DraftStep`): every row feeds its drafted token and the head's own
  pre-norm output at the next position, its top token and output become the next step's
  inputs, and the top tokens land in `drafted`, read back once a round (greedy). Drafted pairs
  are written past the rows' lengths: the next catch-up writes the real pairs over them.

The arithmetic is Eagle3Layer's, step for step, with the attention as the fixed step computes
it (float32 scores and softmax): on the CPU in float32 the drafts equal the per-row path's
(drafters.eagle3.Eagle3Drafter, tests/engine/test_engine_eagle3.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specpair.drafters.eagle_steps import catch_up_planes
from specpair.kv.buckets import bucket
from specpair.kv.fixed_step import _rotate_half, attend
from specpair.kv.graphs import capture_graph, cuda_graphs_wanted, to_device
from specpair.kv.ops import rms_norm


def eagle3_layer(layer, embeds, hidden, cos, sin, rows, positions, slots, kc, vc):
    """Eagle3Layer.forward for embeds/hidden [R, W, D] at `positions` [R, W], keys and values
    written at `slots` [R, W] of the cache rows `rows` [R, W] (kc/vc [R, KV, C, hd]), attention
    over the slots before each position and the pair's own key (fixed_step.attend); cos/sin
    [R, 1, W, hd]. -> the pre-norm output [R, W, D]."""
    a = layer.self_attn
    R, W, _ = embeds.shape
    eps = layer.input_layernorm.variance_epsilon
    normed_hidden = rms_norm(hidden, layer.hidden_norm.weight, eps)
    residual = normed_hidden if layer.norm_before_residual else hidden
    x = torch.cat([rms_norm(embeds, layer.input_layernorm.weight, eps), normed_hidden], dim=-1)
    hd = layer.head_dim
    q = a.q_proj(x).view(R, W, layer.heads, hd).transpose(1, 2)
    k = a.k_proj(x).view(R, W, layer.kv_heads, hd).transpose(1, 2)
    v = a.v_proj(x).view(R, W, layer.kv_heads, hd).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    kc[rows, :, slots] = k.transpose(1, 2)
    vc[rows, :, slots] = v.transpose(1, 2)
    out = attend(q, k, v, kc, vc, positions)
    r = residual + a.o_proj(out.transpose(1, 2).reshape(R, W, -1))
    x = rms_norm(r, layer.post_attention_layernorm.weight, eps)
    m = layer.mlp
    return r + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


class Eagle3Cache:
    """The head's keys and values for every row of a batch, [R, KV, C, hd] with R and C
    bucketed (kv.buckets.bucket), and each row's length (real pairs) on the host. Growing or
    shrinking makes new tensors, and the steps recorded over the old ones go with them
    (`steps`). Records CUDA graphs where the fixed step does (CUDA, SPECPAIR_CUDA_GRAPHS)."""

    def __init__(self, head, device: torch.device, dtype: torch.dtype):
        self.head, self.device, self.dtype = head, device, dtype
        layer = head.layer
        self.kv_heads, self.head_dim = layer.kv_heads, layer.head_dim
        self.lengths: list[int] = []
        self.kc = self.vc = None
        self.steps: dict = {}
        self.captures_graphs = device.type == "cuda" and cuda_graphs_wanted()
        self.capture_error: str | None = None
        self.recorded = {"graphs": 0, "seconds": 0.0}

    @property
    def capacity(self) -> tuple[int, int]:
        return (0, 0) if self.kc is None else (self.kc.shape[0], self.kc.shape[2])

    def _allocate(self, rows: int, positions: int) -> None:
        shape = (bucket(rows), self.kv_heads, bucket(positions), self.head_dim)
        kc = torch.zeros(shape, dtype=self.dtype, device=self.device)
        vc = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.kc is not None:
            n, c = min(shape[0], self.kc.shape[0]), min(shape[2], self.kc.shape[2])
            kc[:n, :, :c] = self.kc[:n, :, :c]
            vc[:n, :, :c] = self.vc[:n, :, :c]
        self.kc, self.vc, self.steps = kc, vc, {}

    def reserve(self, positions: int) -> None:
        """Room for every row to write up to `positions` slots."""
        rows, capacity = self.capacity
        if len(self.lengths) > rows or positions > capacity:
            self._allocate(max(len(self.lengths), 1), max(positions, capacity))

    def add_rows(self, count: int) -> None:
        self.lengths += [0] * count

    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order (their keys and values move to rows 0..n-1)."""
        self.lengths = [self.lengths[i] for i in rows]
        if self.kc is not None and rows:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            self.kc[:len(rows)] = self.kc[index]
            self.vc[:len(rows)] = self.vc[index]

    def capture(self, step, state=()):
        return capture_graph(self, step, state)


class _Recorded:
    """A step kept with its CUDA graph (recorded on first call where the cache records)."""

    graph = None

    def run(self, cache: Eagle3Cache):
        if self.graph is None:
            self.graph = cache.capture(self.step, getattr(self, "state", ()))
        return self.graph.replay() if self.graph is not None else self.step()


class Eagle3CatchUp(_Recorded):
    """Every row's pending pairs at `width` a row, one step (module docstring): ids, positions
    and slots in `planes[0..2]` [R, W], each row's last pair in `planes[3, :, 0]`, the target's
    auxiliary states `aux` [R, W, A*T]. -> the head's pre-norm output at each row's last pair,
    [R, D]."""

    def __init__(self, head, embed, cache: Eagle3Cache, width: int):
        rows, _ = cache.capacity
        self.width = width
        self.planes = torch.zeros(4, rows, width, dtype=torch.long, device=cache.device)
        self.aux = torch.zeros(rows, width, head.fc.in_features, dtype=cache.dtype,
                               device=cache.device)
        kc, vc = cache.kc, cache.vc
        ids, positions, slots, last = self.planes
        every = torch.arange(rows, device=cache.device)
        at = every.view(rows, 1).expand(rows, width)

        def step():
            embeds = embed(ids).to(cache.dtype)
            cos, sin = head.rotary(embeds, positions)
            h = eagle3_layer(head.layer, embeds, head.fc(self.aux), cos.unsqueeze(1),
                             sin.unsqueeze(1), at, positions, slots, kc, vc)
            return h[every, last[:, 0]]

        self.step = step

    def __call__(self, cache: Eagle3Cache, tokens: list[list[int]], aux: list) -> torch.Tensor:
        """Rows 0..B-1 feed `tokens[i]` with `aux[i]` [n_i, A*T] from their lengths, which move
        on by n_i; -> [R, D] (a row feeding none: unused)."""
        host = catch_up_planes(self.planes.shape, self.width, cache.lengths, tokens, aux,
                               self.aux)
        self.planes.copy_(to_device(host, self.planes.device))
        return self.run(cache)


class Eagle3DraftStep(_Recorded):
    """One drafting step over every row of the cache (module docstring): from `ids` [R, 1] and
    the head's pre-norm output `hidden` [R, 1, D] at `positions`/`slots` [R, 1], the layer, the
    norm, the draft vocabulary's logits and their top `width` as target ids, written to
    `drafted` [R, C, width] at the row's slot; the top token and the output move on to the next
    step's inputs. -> the draft-vocabulary logits [R, Vd] (a sampled row chooses from them and
    overwrites its `ids`)."""

    def __init__(self, head, embed, draft_ids: torch.Tensor, cache: Eagle3Cache, width: int):
        from specpair.drafters.head import draft_vocab_logits

        rows, capacity = cache.capacity
        device, dtype = cache.device, cache.dtype
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.hidden = torch.zeros(rows, 1, head.config.hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.drafted = torch.zeros(rows, capacity, width, dtype=torch.long, device=device)
        self.state = (self.ids, self.hidden, self.positions, self.slots)
        kc, vc = cache.kc, cache.vc
        every = torch.arange(rows, device=device).view(rows, 1)
        at = self.slots.view(rows, 1, 1).expand(rows, 1, width)

        def step():
            embeds = embed(self.ids).to(dtype)
            cos, sin = head.rotary(embeds, self.positions)
            h = eagle3_layer(head.layer, embeds, self.hidden, cos.unsqueeze(1), sin.unsqueeze(1),
                             every, self.positions, self.slots, kc, vc)
            logits = draft_vocab_logits(head, head.norm(h[:, 0]))               # [R, Vd]
            # a chain's draft: the argmax (ties to the lowest index, as the CPU's rounds)
            top = draft_ids[logits.argmax(-1, keepdim=True) if width == 1
                            else logits.topk(width, dim=-1).indices]           # [R, width]
            self.drafted.scatter_(1, at, top.unsqueeze(1))
            self.ids.copy_(top[:, :1])
            self.hidden.copy_(h)
            self.positions.add_(1)
            self.slots.add_(1)
            return logits

        self.step = step

    def start(self, ids: torch.Tensor, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """A round's first inputs: rows 0..B-1 feed ids [B] with the head's outputs [B, D] at
        their lengths; the cache's other rows at slot 0. -> the lengths on the device [B, 1]."""
        B = len(lengths)
        start = torch.zeros(self.positions.shape, dtype=torch.long)
        start[:B, 0] = torch.tensor(lengths, dtype=torch.long)
        start = to_device(start, self.positions.device)
        self.positions.copy_(start)
        self.slots.copy_(start)
        self.ids[:B, 0] = ids
        self.hidden[:B, 0] = hidden
        return start[:B]

    def __call__(self, cache: Eagle3Cache):
        return self.run(cache)

    def tokens(self, start: torch.Tensor, steps: int) -> torch.Tensor:
        """What rows 0..B-1 drafted in `steps` steps from `start` [B, 1]: [B, steps, width]."""
        B = start.shape[0]
        index = start + torch.arange(steps, device=start.device).view(1, steps)
        return self.drafted[torch.arange(B, device=start.device).view(B, 1), index]
