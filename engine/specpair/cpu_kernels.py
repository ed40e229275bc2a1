"""The CPU's decode kernels (cpu_kernels.c): built on first use, loaded with ctypes, with a fallback.

The C source is compiled here, for this CPU (-march=native), into the model cache the first time
an engine needs it (about a second), keyed by the source's hash, the compiler flags and the CPU's
features (a cache volume shared by different nodes never hands one a library for another);
`python -m specpair.cpu_kernels` builds it ahead and says whether it could. The small-batch
linear is also a torch custom op, so `torch.compile` keeps it as one opaque call in a compiled step.

Where it does not apply (CUDA, a dtype other than float32, more than MAX_TOKENS = 128 rows:
a many-row LM head, where BLAS is good; a prompt goes to the C layer in calls of MAX_TOKENS) or
cannot be built (no C compiler, SPECPAIR_CPU_KERNELS=0), linear() is torch's own.
`status()` says which, for the bench and the server's start-up log.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# The headers cpu_kernels.c #includes from its folder: part of the build's cache key.
HEADERS = (SOURCE.with_name("prompt_scores.h"),)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-ffp-contract=off"]
# The library's limits, read from it when it loads (cpu_kernels.c is their one home): token rows
# per call and the largest head dimension of the layer kernel. 0 while nothing is loaded.
MAX_TOKENS = 0
MAX_HEAD_DIM = 0
_build_error: str | None = None


def _enabled() -> bool:
    return os.environ.get("SPECPAIR_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _cpu_signature() -> bytes:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    features = next((ln for ln in lines if ln.split(":")[0].strip() in ("flags", "Features")), "")
    return (os.uname().machine + features).encode()


def build_library(source: Path, *included: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library built from `source`, None) or (None, why not): compiled for this CPU into
    the model cache once, keyed by its text and that of the files it #includes (`included`, from
    its folder), the flags and the CPU's features. Also head_kernels.c's build."""
    if not _enabled():
        return None, "disabled by SPECPAIR_CPU_KERNELS=0"
    from specpair.models import cache_root

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler (cc/gcc) on PATH"
    try:
        text = b"".join(path.read_bytes() for path in (source, *included))
        # -march=native: a library built on one CPU may not run on another sharing a cache volume.
        key = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu_signature()).hexdigest()[:16]
        out = cache_root() / "kernels" / f"{source.stem}-{key}.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            # (and SOURCE's folder: a copy built elsewhere, e.g. a bench's older revision, finds
            # the headers the served source includes)
            proc = subprocess.run([compiler, *FLAGS, f"-I{source.parent}", f"-I{SOURCE.parent}",
                                   str(source), "-o", str(tmp)], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                tmp.unlink(missing_ok=True)
                return None, f"{compiler} failed: {proc.stderr.strip()[-500:]}"
            os.replace(tmp, out)      # atomic: concurrent first uses never load half a file
        return ctypes.CDLL(str(out)), None
    except (OSError, subprocess.SubprocessError) as exc:
        # A read-only cache, a compiler that hangs, a library that will not load: serve anyway.
        return None, f"{type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built kernel library, or None (disabled or no compiler: the reason is in status()).
    Built once (library.cache_clear() builds again): the build is the kernel every caller gets,
    until use_library puts another in its place."""
    global _build_error
    lib, _build_error = build_library(SOURCE, *HEADERS)
    if lib is None:
        use_library(None)
        return None
    lib.specpair_small_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_long,
                                                                  ctypes.c_long, ctypes.c_int]
    lib.specpair_small_linear.restype = ctypes.c_int
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.specpair_llama_layer.argtypes = ([p, p, p, p, p, ctypes.c_long, ctypes.c_long, i, i, i,
                                          ctypes.c_long, f, p, p, p, p, ctypes.c_long, p,
                                          ctypes.c_long, ctypes.c_long] + [p] * 9
                                         + [p] * 5 + [ctypes.c_long, p, i])
    lib.specpair_llama_layer.restype = ctypes.c_int
    _type_layers(lib)
    lib.specpair_max_tokens.restype = ctypes.c_int
    lib.specpair_max_head_dim.restype = ctypes.c_int
    use_library(lib)
    return lib


def _type_layers(lib: ctypes.CDLL) -> None:
    """Type specpair_llama_layers where the build has it (a bench's build of an older revision
    may not: llama_layers is then refused, and its caller runs llama_layer a layer at a time)."""
    if not hasattr(lib, "specpair_llama_layers"):
        return
    p, i, f, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.specpair_llama_layers.argtypes = ([p] * 5 + [n, n, i, i, i, n, f, p, p, p, p, n, p, n, n,
                                           i, p, p, p, p, p, i])
    lib.specpair_llama_layers.restype = ctypes.c_int


def status() -> str:
    lib = library()
    return "built" if lib is not None else f"fallback to torch ({_build_error})"


def _small_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    x = x.contiguous()
    n, (M, I) = len(weights), x.shape
    outs = [x.new_empty(M, w.shape[0]) for w in weights]
    rc = _LIB.specpair_small_linear(
        x.data_ptr(), (ctypes.c_void_p * n)(*[w.data_ptr() for w in weights]),
        (ctypes.c_void_p * n)(*[y.data_ptr() for y in outs]),
        (ctypes.c_long * n)(*[w.shape[0] for w in weights]), n, M, I, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"specpair_small_linear refused {tuple(x.shape)} x {len(weights)} weights")
    return outs


@torch.library.custom_op("specpair::small_linear", mutates_args=())
def small_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[x [M, I] @ w.T for w in weights] (each w [O, I]) for 1 <= M <= MAX_TOKENS, float32 on CPU."""
    return _small_linear(x, weights)


@small_linear.register_fake
def _(x, weights):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]


_LIB = None      # the kernel in use (use_library); read on every call, so kept out of the lru_cache


def use_library(lib: ctypes.CDLL | None) -> None:
    """Make `lib` (typed as library() types its build; None: torch) the kernel every caller gets:
    library()'s build does, and a bench's A/B puts another build in its place."""
    global _LIB, MAX_TOKENS, MAX_HEAD_DIM
    _LIB = lib
    if lib is not None:
        _type_layers(lib)
        MAX_TOKENS, MAX_HEAD_DIM = lib.specpair_max_tokens(), lib.specpair_max_head_dim()


def available() -> bool:
    """Whether the kernel can be used (the first call builds it). Call before stepping or
    compiling. A query: it leaves the kernel in use as it is (it reset a bench's A/B build to the
    default one before, and the bench ran that twice)."""
    library()
    return _LIB is not None


def linears(x: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
    """[F.linear(x, w) for w in weights] (no bias); one small-batch kernel call where it applies
    (see available()).

    Eager calls go straight to the kernel: the custom-op dispatcher costs ~20 us a call, as much
    as a small layer's work. Under torch.compile the op is what keeps the call in the graph."""
    rows = x.numel() // x.shape[-1]
    if (_LIB is None or rows > MAX_TOKENS or len(weights) > 8 or x.dtype != torch.float32
            or x.device.type != "cpu"
            or any(w.dtype != torch.float32 or not w.is_contiguous() for w in weights)):
        return [F.linear(x, w) for w in weights]
    x2 = x.reshape(rows, x.shape[-1])
    ys = small_linear(x2, list(weights)) if torch.compiler.is_compiling() else _small_linear(x2, weights)
    return [y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, weights)]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linears(x, weight)[0]


def layer_applies(tokens: int, dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether llama_layer can run a step of this many tokens (eager, CPU, float32, a head
    dimension the kernel's vectors divide)."""
    return (_LIB is not None and tokens <= MAX_TOKENS and dtype == torch.float32
            and device.type == "cpu" and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM)


def layer_scratch(tokens: int, dim: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                  attend: int) -> torch.Tensor:
    """Working memory for llama_layer: one allocation a step serves every layer of it."""
    return torch.empty(tokens * (2 * dim + 2 * heads * head_dim + 2 * kv_heads * head_dim + 2 * ffn)
                       + tokens * heads * attend + ffn, dtype=torch.float32)


LAYER_OPTIONS = ("bq", "bk", "bv", "qn", "kn")   # llama_layer's per-family tensors, in C's order


def _attend_and_scratch(entry: str, h: torch.Tensor, positions: torch.Tensor, ffn: int, heads: int,
                        kv_heads: int, head_dim: int, attend: int | None,
                        scratch: torch.Tensor | None, table: torch.Tensor | None):
    """What llama_layer and llama_layers both derive before their C call: the positions attended
    (the furthest + 1 unless given), the scratch (made for them unless given), and a block table
    the kernel can read (contiguous int64, refused by name otherwise). -> (attend, scratch)."""
    if attend is None:
        attend = int(positions.max()) + 1
    if scratch is None:
        T, D = h.shape
        scratch = layer_scratch(T, D, heads, kv_heads, head_dim, ffn, attend)
    if table is not None and (table.dtype != torch.long or not table.is_contiguous()):
        raise ValueError(f"{entry}'s block table must be contiguous int64, not {table.dtype}")
    return attend, scratch


def llama_layer(h: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, weights, eps: float,
                heads: int, kv_heads: int, head_dim: int, attend: int | None = None,
                scratch: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                parents: torch.Tensor | None = None, options: dict | None = None,
                window: int | None = None, table: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer through cpu_kernels.c (see specpair_llama_layer there); h [T, D] is
    updated in place and returned. Tensors: contiguous; rows/positions int64 [T]; cos/sin [T, hd].
    A token tree: `slots` (where each token's key/value is written; default its position) and
    `parents` (int64 [T], the parent's index in this call or -1). `options`: the tensors of
    LAYER_OPTIONS a family has (q/k/v biases: Qwen2; q/k head norms: Qwen3), contiguous float32;
    `window`: a sliding window in positions (Mistral), None for none. A paged cache (`table`,
    int64 [rows, blocks a row], each row's blocks in position order): kc/vc are a pool
    [blocks, kv heads, block, head dim] (block a power of 2, at least 4), read and written through the
    table, bitwise as the contiguous cache."""
    wq, wk, wv, wo, wg, wu, wd, n1, n2 = weights
    options = options or {}
    unknown = set(options) - set(LAYER_OPTIONS)
    if unknown:
        raise ValueError(f"llama_layer options {sorted(unknown)}: known {LAYER_OPTIONS}")
    T, D = h.shape
    F_ = wg.shape[0]
    attend, scratch = _attend_and_scratch("llama_layer", h, positions, F_, heads, kv_heads,
                                          head_dim, attend, scratch, table)
    ptr = lambda t: t.data_ptr()   # noqa: E731
    rc = _LIB.specpair_llama_layer(
        ptr(h), ptr(rows), ptr(positions), None if slots is None else ptr(slots),
        None if parents is None else ptr(parents), T, D, heads, kv_heads, head_dim, F_, eps, ptr(cos),
        ptr(sin), ptr(kc), ptr(vc), kc.shape[0] if table is not None else kc.shape[2],
        None if table is None else ptr(table), 0 if table is None else table.shape[1],
        kc.shape[2] if table is not None else 0, ptr(wq), ptr(wk), ptr(wv), ptr(wo), ptr(wg),
        ptr(wu), ptr(wd), ptr(n1), ptr(n2),
        *[ptr(options[name]) if options.get(name) is not None else None for name in LAYER_OPTIONS],
        window or 0, ptr(scratch), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"specpair_llama_layer refused a step of {T} tokens (code {rc})")
    return h


# A layer's tensors as specpair_llama_layers reads them: StaticLlama.layer_weights' nine, then
# the LAYER_OPTIONS (None where the family lacks one).
LAYER_TENSORS = 9 + len(LAYER_OPTIONS)


class LayerStack:
    """A model's decoder layers as one specpair_llama_layers call reads them: every layer's
    tensors, cache and window in arrays of pointers built once (not per step: 30 calls' argument
    conversion was the engine thread's alone), and the tensors themselves, so that a step can
    ask whether any of them moved since (`current`: a weight's storage replaced, as the fixed
    step's joined q|k|v does) and build the stack again."""

    def __init__(self, weights, options, windows, caches):
        """weights: per layer its nine tensors (StaticLlama.layer_weights); options: per layer
        its LAYER_OPTIONS dict; windows: per layer a sliding window or None; caches: per layer
        (keys, values), all of one shape."""
        self.count = len(caches)
        if not (len(weights) == len(options) == len(windows) == self.count >= 1):
            raise ValueError(f"a layer stack of {len(weights)} weights, {len(options)} options, "
                             f"{len(windows)} windows and {len(caches)} caches")
        self.tensors = [t for w, o in zip(weights, options)
                        for t in (*w, *(o.get(name) for name in LAYER_OPTIONS))]
        self.caches = list(caches)
        self._held = [t for t in self.tensors if t is not None] + [t for kv in self.caches for t in kv]
        ptrs = lambda ts: [None if t is None else t.data_ptr() for t in ts]   # noqa: E731
        self.weights = (ctypes.c_void_p * len(self.tensors))(*ptrs(self.tensors))
        self.keys = (ctypes.c_void_p * self.count)(*ptrs(k for k, _ in self.caches))
        self.values = (ctypes.c_void_p * self.count)(*ptrs(v for _, v in self.caches))
        self.windows = (ctypes.c_long * self.count)(*[w or 0 for w in windows])
        self.shape = self.caches[0][0].shape
        self._pointers = self._now()
        self._captures: dict[tuple[int, ...], ctypes.Array] = {}

    def _now(self) -> list[int]:
        return [t.data_ptr() for t in self._held]

    def current(self) -> bool:
        """Whether every tensor is where the arrays point (~30 us for a 30-layer model)."""
        return self._now() == self._pointers

    def capture_at(self, layers: tuple[int, ...]) -> ctypes.Array:
        """[count] where each layer's input goes among the captured ones (-1: nowhere), for
        the layers numbered in `layers` (a number past the last layer is not one: its output)."""
        at = self._captures.get(layers)
        if at is None:
            taken = sorted(n for n in set(layers) if 0 <= n < self.count)
            index = {n: j for j, n in enumerate(taken)}
            at = self._captures[layers] = (ctypes.c_long * self.count)(
                *[index.get(n, -1) for n in range(self.count)])
        return at


def layers_apply() -> bool:
    """Whether the kernel in use runs several layers in one call (llama_layers)."""
    return _LIB is not None and hasattr(_LIB, "specpair_llama_layers")


def llama_layers(h: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, stack: LayerStack, eps: float, heads: int, kv_heads: int,
                 head_dim: int, attend: int | None = None, scratch: torch.Tensor | None = None,
                 slots: torch.Tensor | None = None, parents: torch.Tensor | None = None,
                 table: torch.Tensor | None = None,
                 capture: tuple[int, ...] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every layer of `stack` over h [T, D] in one call (specpair_llama_layers), each as
    llama_layer computes it (bitwise: the same output and cache writes as the calls a layer at
    a time), h updated in place. Arguments as llama_layer's, the weights, options, windows and
    caches the stack's. `capture`: layer numbers whose inputs to hand back, taken on the way
    (StaticLlama.feature_layers; the layer count, the last output, is h itself). -> (h, the
    captured inputs [T, D] each, in increasing layer order)."""
    if not layers_apply():
        raise RuntimeError("the kernel in use has no specpair_llama_layers")
    T, D = h.shape
    F_ = stack.tensors[4].shape[0]
    attend, scratch = _attend_and_scratch("llama_layers", h, positions, F_,
                                          heads, kv_heads, head_dim, attend, scratch, table)
    at = stack.capture_at(tuple(capture)) if capture else None
    taken = sum(1 for n in set(capture or ()) if 0 <= n < stack.count)
    captured = h.new_empty(taken, T, D) if taken else None
    S = stack.shape[0] if table is not None else stack.shape[2]
    ptr = lambda t: None if t is None else t.data_ptr()   # noqa: E731
    rc = _LIB.specpair_llama_layers(
        ptr(h), ptr(rows), ptr(positions), ptr(slots), ptr(parents), T, D, heads, kv_heads,
        head_dim, F_, eps, ptr(cos), ptr(sin), stack.keys, stack.values, S, ptr(table),
        0 if table is None else table.shape[1], stack.shape[2] if table is not None else 0,
        stack.count, stack.weights, stack.windows, at, ptr(captured), ptr(scratch),
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"specpair_llama_layers refused a step of {T} tokens (code {rc})")
    return h, list(captured) if captured is not None else []


if __name__ == "__main__":     # warm the build (e.g. in an image) and say what happened
    print(f"cpu kernels: {status()}")
    sys.exit(0 if library() is not None else 1)
