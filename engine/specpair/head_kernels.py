"""An EAGLE-3 head's layer on the CPU in one C call a step (head_kernels.c), loaded with ctypes.

Built as the target's kernels are (cpu_kernels.build_library: for this CPU, into the model
cache, on first use), from head_kernels.c, which includes cpu_kernels.c for its parts. Where it
does not apply (no compiler or SPECPAIR_CPU_KERNELS=0, CUDA, a dtype other than float32, a head
dimension the kernel's vectors do not divide) `applies` says so and the drafter runs the head's
round row by row in PyTorch (drafters.eagle3.Eagle3Drafter).
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
    lib, _ = cpu_kernels.build_library(SOURCE, cpu_kernels.SOURCE)
    if lib is None:
        return None
    p, i, f, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.specpair_eagle3_layer.argtypes = ([p] * 6 + [n, n, i, i, i, n, f, p, p, p, p, n]
                                          + [p] * 14 + [i, p, i])
    lib.specpair_eagle3_layer.restype = ctypes.c_int
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
        rc = self.lib.specpair_eagle3_layer(
            embeds.data_ptr(), hidden.data_ptr(), out.data_ptr(), normed.data_ptr(),
            rows.data_ptr(), positions.data_ptr(), T, D, H, KV, hd, F, self.eps, cos.data_ptr(),
            sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[2], *self.pointers, self.nbr,
            self.scratch.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"specpair_eagle3_layer refused a step of {T} tokens (code {rc})")
        return out, normed
