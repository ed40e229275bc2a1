"""An EAGLE-3 head's layer on the CPU in one C call a step (head_kernels.c), loaded with ctypes.

Built as the target's kernels are (cpu_kernels.build_library: for this CPU, into the model
cache, on first use), from head_kernels.c, which includes cpu_kernels.c for its parts. Where it
does not apply (no compiler or SPECPAIR_CPU_KERNELS=0, CUDA, a dtype other than float32, a head
dimension the kernel's vectors do not divide) `applies` says so and the drafter runs the head's
round row by row in PyTorch (drafters.eagle3.Eagle3Drafter).

Greedy drafting reads only each row's argmax over the head's draft vocabulary: the layer's call
takes the LM head too and returns the argmax (`Eagle3Kernel.with_top1`; `top1` alone for what
does not fit one call), the vocabulary scored in blocks reduced as they are produced, no logits
row written (head_kernels.c, specpair_top1_linear). Ties go as torch.argmax's (lowest index).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specpair import cpu_kernels

SOURCE = Path(__file__).with_name("head_kernels.c")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built library, or None (the target's kernels cannot be built either, or this failed)."""
    if not cpu_kernels.available():
        return None
    lib, _ = cpu_kernels.build_library(SOURCE, cpu_kernels.SOURCE, *cpu_kernels.HEADERS)
    if lib is None:
        return None
    p, i, f, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.specpair_eagle3_layer.argtypes = ([p] * 6 + [n, n, i, i, i, n, f, p, p, p, p, n]
                                          + [p] * 14 + [i, p, i] + [p, n, p, n, p])
    lib.specpair_eagle3_layer.restype = ctypes.c_int
    lib.specpair_top1_linear.argtypes = [p, p, p, n, n, n, i]
    lib.specpair_top1_linear.restype = ctypes.c_int
    lib.specpair_eagle3_scratch.argtypes = [n, n, i, i, i, n, n]
    lib.specpair_eagle3_scratch.restype = n
    return lib


def applies(head) -> bool:
    """Whether the head's layer can run here: float32 weights on the CPU, dense, a head
    dimension of the kernel's, and the library built."""
    layer = head.layer
    weights = [w for w in _weights(head) if w is not None]
    return (library() is not None and all(w.device.type == "cpu" and w.dtype == torch.float32
                                          and w.is_contiguous() for w in weights)
            and layer.head_dim % 8 == 0 and layer.head_dim <= cpu_kernels.MAX_HEAD_DIM)


def _weights(head) -> tuple:
    layer = head.layer
    a, m = layer.self_attn, layer.mlp
    return (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight,
            m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, a.q_proj.bias,
            a.k_proj.bias, a.v_proj.bias, layer.input_layernorm.weight, layer.hidden_norm.weight,
            layer.post_attention_layernorm.weight, head.norm.weight)


class Eagle3Kernel:
    """A head's layer through the C kernel, prepared once: its weights' addresses (the head's
    weights stay where they are while it drafts), its rotary embedding as a table of positions
    (the values head.rotary computes, element by element) and working memory, grown as needed:
    per step only the pairs' own tensors cross into C."""

    def __init__(self, head):
        self.head, self.lib = head, library()
        layer = head.layer
        self.dims = (layer.heads, layer.kv_heads, layer.head_dim,
                     layer.mlp.gate_proj.weight.shape[0])
        self.eps = layer.input_layernorm.variance_epsilon
        self.nbr = int(layer.norm_before_residual)
        self.weights = _weights(head)          # kept: the addresses below are theirs
        self.pointers = [None if w is None else w.data_ptr() for w in self.weights]
        self.cos = self.sin = None
        self.scratch = torch.empty(0, dtype=torch.float32)

    def top1_applies(self) -> bool:
        """Whether with_top1 can read the head's LM head (float32, on the CPU, contiguous)."""
        lm = self.head.lm_head.weight
        return lm.device.type == "cpu" and lm.dtype == torch.float32 and lm.is_contiguous()

    def _rotary(self, positions: int) -> None:
        size = 256
        while size < positions:
            size *= 2
        at = torch.arange(size).view(1, size)
        cos, sin = self.head.rotary(torch.zeros(1, size, 1), at)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor, attend: int, kc: torch.Tensor, vc: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's layer for T <= cpu_kernels.MAX_TOKENS pairs (embeds/hidden [T, D]
        float32), token t of cache row rows[t] at positions[t] (int64 [T]; a row's tokens
        consecutive, in position order; `attend`: the largest position + 1), its key and value
        written there in kc/vc [R, KV, C, hd]. -> (the pre-norm output [T, D], it through the
        head's final norm [T, D])."""
        out, normed, _ = self._run(embeds, hidden, rows, positions, attend, kc, vc, None, False)
        return out, normed

    def with_top1(self, embeds: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor,
                  positions: torch.Tensor, attend: int, kc: torch.Tensor, vc: torch.Tensor,
                  pick: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As __call__, and in the same call the argmax of the head's logits over its draft
        vocabulary (lm_head of the normed output) of the tokens `pick` (int64 [P] indices into
        the T tokens, 1 <= P <= MAX_TOKENS; None: every token): -> (out, normed, top [P], draft
        vocabulary indices, the lowest of equal maxima as torch.argmax)."""
        return self._run(embeds, hidden, rows, positions, attend, kc, vc, pick, True)

    def _run(self, embeds, hidden, rows, positions, attend, kc, vc, pick, want_top):
        T, D = embeds.shape
        H, KV, hd, F = self.dims
        if self.cos is None or self.cos.shape[0] < attend:
            self._rotary(attend)
        cos, sin = self.cos[positions], self.sin[positions]
        need = self.lib.specpair_eagle3_scratch(T, D, H, KV, hd, F, attend)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(2 * need, dtype=torch.float32)
        embeds, hidden = embeds.contiguous(), hidden.contiguous()
        rows, positions = rows.contiguous(), positions.contiguous()
        out, normed = torch.empty_like(embeds), torch.empty_like(embeds)
        top = lm = None
        P = 0
        if want_top:
            lm = self.head.lm_head.weight
            if pick is not None:
                pick = pick.to(dtype=torch.long).contiguous()
            P = T if pick is None else pick.shape[0]
            top = torch.empty(P, dtype=torch.long)
        rc = self.lib.specpair_eagle3_layer(
            embeds.data_ptr(), hidden.data_ptr(), out.data_ptr(), normed.data_ptr(),
            rows.data_ptr(), positions.data_ptr(), T, D, H, KV, hd, F, self.eps, cos.data_ptr(),
            sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[2], *self.pointers, self.nbr,
            self.scratch.data_ptr(), torch.get_num_threads(),
            None if lm is None else lm.data_ptr(), 0 if lm is None else lm.shape[0],
            None if pick is None else pick.data_ptr(), P,
            None if top is None else top.data_ptr())
        if rc != 0:
            raise RuntimeError(f"specpair_eagle3_layer refused a step of {T} tokens"
                               + (f" and {P} top-1 rows" if want_top else "") + f" (code {rc})")
        return out, normed, top


def top1(x: torch.Tensor, weight: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """The argmax of x @ weight.T a row (x [M, I], weight [V, I], float32 CPU, contiguous
    weight), computed in blocks without the logits (specpair_top1_linear), MAX_TOKENS rows a
    call: -> int64 [M], each the lowest index of equal maxima (torch.argmax's rule) of the
    logits cpu_kernels.linear writes for <= MAX_TOKENS rows. threads: default torch's."""
    lib = library()
    threads = threads or torch.get_num_threads()
    x = x.contiguous()
    M, I = x.shape
    top = torch.empty(M, dtype=torch.long)
    step = cpu_kernels.MAX_TOKENS
    for a in range(0, M, step):
        P = min(step, M - a)
        rc = lib.specpair_top1_linear(x[a].data_ptr(), weight.data_ptr(), top[a].data_ptr(), P,
                                      I, weight.shape[0], threads)
        if rc != 0:
            raise RuntimeError(f"specpair_top1_linear refused {P} rows of {I} (code {rc})")
    return top
