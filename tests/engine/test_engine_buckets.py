"""The fixed-shape step (specpair.kv): on the torch path, with every step of a batch padded to
one token bucket, a verification's logits equal one-token steps' bitwise (chains and trees, bf16
and fp32, batch 1 and 8), so greedy speculation equals target-only bitwise in bf16; compiled with
fullgraph=True it does not recompile over a generation; the cache gives memory back."""

from __future__ import annotations

import random

import pytest
import torch

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter
from specpair.kv import buckets, fixed_step, runner, shelf
from specpair.kv.buckets import bucket
from specpair.kv.static import StaticKVModel

W = 8     # the token bucket of k = 4 (5 tokens a verification) and of a 7-token tree


@pytest.fixture(scope="module", params=[(torch.float32, 4), (torch.bfloat16, 4), (torch.bfloat16, 2)],
                ids=["fp32", "bf16", "bf16-gqa"])
def model(request, tiny_tokenizer):
    """Tiny Llamas; bf16-gqa has 2 key/value heads for 4 query heads (as SmolLM2's 3 for 9)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny_models import make_model
    dtype, kv_heads = request.param
    model = make_model(tiny_tokenizer, seed=4, dtype=dtype).model.eval()
    if kv_heads != model.config.num_attention_heads:
        config = LlamaConfig(**{**model.config.to_dict(), "num_key_value_heads": kv_heads})
        torch.manual_seed(4)
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model


def test_buckets_are_powers_of_two_from_a_floor():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert bucket(3, floor=256) == 256 and bucket(300, floor=256) == 512


def _prefilled(model, prompts):
    """A fixed-step cache holding these prompts (fed in one extend, as a batch's first step)."""
    kv = StaticKVModel(model, token_bucket=W, fixed=True)
    kv.add_rows(len(prompts))
    kv.extend(prompts)
    return kv


def _one_by_one(model, prompts, paths):
    """Each row's path fed a token a step (rows whose path ended feed nothing); -> per row the
    logits of every token of its path, [len(path), V]."""
    kv = _prefilled(model, prompts)
    got = [[] for _ in paths]
    for j in range(max(len(p) for p in paths)):
        feed = [[p[j]] if j < len(p) else [] for p in paths]
        logits = kv.extend(feed)
        for i, p in enumerate(paths):
            if j < len(p):
                got[i].append(logits[i, -1])
    return [torch.stack(g) for g in got]


@pytest.mark.parametrize("prompts_as", ["step", "apart"])
@pytest.mark.parametrize("rows", [1, 8])
def test_a_verification_equals_one_token_steps_bitwise(model, rows, prompts_as, monkeypatch):
    """Chains: each row verifies its own number of tokens (a bonus token and 0-4 drafts); every
    position's logits equal those of feeding the same tokens one step at a time, bitwise. The
    prompts, some longer than the bucket, run first and write the same keys both ways: as one
    fixed step of their rows at their bucket, or (past PREFILL_STEP_TOKENS) eagerly."""
    if prompts_as == "apart":
        monkeypatch.setattr(buckets, "PREFILL_STEP_TOKENS", 0)
    rng = random.Random(rows)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 20))] for _ in range(rows)]
    chains = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 6))] for _ in range(rows)]
    kv = _prefilled(model, prompts)
    verified = kv.extend(chains, last=max(len(c) for c in chains))
    singles = _one_by_one(model, prompts, chains)
    for i, chain in enumerate(chains):
        assert torch.equal(verified[i, verified.shape[1] - len(chain):], singles[i]), i
    # And the step computes the model: Hugging Face's forward agrees to the dtype's rounding.
    ref = model(torch.tensor([prompts[0] + chains[0]])).logits[0, -len(chains[0]):]
    tol = 1e-4 if model.dtype == torch.float32 else 0.3
    torch.testing.assert_close(singles[0].float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("rows", [1, 8])
def test_a_tree_verification_equals_one_token_steps_bitwise(model, rows):
    """Trees as decoding feeds them: a bonus token, a chain of 3 drafts, 1 sibling per depth
    (parent: the chain token before it). A sibling is written past the chain, away from its
    position, and still gives bitwise the logits of the one-token steps down its own path."""
    rng = random.Random(10 + rows)
    depth = 3
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 20))] for _ in range(rows)]
    chains = [[rng.randrange(3, 300) for _ in range(1 + depth)] for _ in range(rows)]
    siblings = [[rng.randrange(3, 300) for _ in range(depth)] for _ in range(rows)]
    feed = [c + s for c, s in zip(chains, siblings)]
    parents = [[-1] * (1 + depth) + list(range(depth)) for _ in range(rows)]
    kv = _prefilled(model, prompts)
    verified = kv.extend(feed, last=len(feed[0]), parents=parents)       # [rows, 7, V]
    singles = _one_by_one(model, prompts, chains)
    for i in range(rows):
        assert torch.equal(verified[i, :1 + depth], singles[i]), i
    for j in range(depth):         # the path to sibling j: the chain up to its parent, then it
        paths = [c[:j + 1] + [s[j]] for c, s in zip(chains, siblings)]
        ends = _one_by_one(model, prompts, paths)
        for i in range(rows):
            assert torch.equal(verified[i, 1 + depth + j], ends[i][-1]), (i, j)


PROMPTS = ["def foo(x):\n    return", "Hello world, hello world, hello", "import os\nimport sys\n"]


@pytest.mark.parametrize("prompts_as", ["step", "apart"])
def test_greedy_speculation_equals_target_only_bitwise_in_bf16(tiny_tokenizer, prompts_as,
                                                               monkeypatch):
    """bf16 on the CPU takes the fixed step: speculative greedy output equals the same engine's
    target-only output token for token, with drafts rejected on the way. The model's logits are
    close enough (init 0.05) for rounding to matter: over the dynamic cache (Hugging Face's
    forward, a verification's shape unlike a decode step's) one of these prompts diverges.
    Prompts run as a fixed step or eagerly (PREFILL_STEP_TOKENS), equal both ways."""
    if prompts_as == "apart":
        monkeypatch.setattr(buckets, "PREFILL_STEP_TOKENS", 0)
    from tiny_models import make_model, perturbed_copy
    target = make_model(tiny_tokenizer, seed=1, dtype=torch.bfloat16, init_std=0.05)
    draft = perturbed_copy(target, seed=5, noise=0.03)
    params = GenerationParams(max_new_tokens=32)
    for drafter, drafted in ((NgramDrafter(), None), (None, draft)):
        engine = SpeculativeEngine(target, drafter=drafter, draft=drafted,
                                   speculation=SpeculationConfig(k=4, k_max=4, fallback_threshold=0))
        assert engine.token_bucket == W
        step = engine.describe_step()
        assert step["fixed_step"] and step["token_bucket"] == W and "masked math" in step["attention"]
        plain = engine.generate(PROMPTS, params, speculate=False)
        spec = engine.generate(PROMPTS, params)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert sum(r.stats.num_draft_tokens - r.stats.num_accepted_tokens for r in spec) > 0
        assert sum(r.stats.num_accepted_tokens for r in spec) > 0


def test_the_cache_gives_memory_back_when_a_long_row_leaves(tiny_target):
    """A long prompt beside short ones grows the cache; once it leaves, the cache returns to the
    short rows' size (both kinds of step), and a row joining and leaving at the edge of a bucket
    does not reallocate every time (hysteresis)."""
    for fixed in (False, True):
        kv = StaticKVModel(tiny_target.model, token_bucket=W if fixed else None, fixed=fixed)
        kv.add_rows(3)
        kv.extend([[5] * 10, [6] * 12, [7] * 9])
        short = kv.cache_bytes
        kv.add_rows(1)
        kv.extend([[1], [2], [3], [8] * 400])
        assert kv.cache_bytes >= 2 * short
        kv.select([0, 1, 2])
        kv.extend([[1], [2], [3]])
        assert kv.cache_bytes == short, fixed
        # The short rows carry on exactly where they were.
        assert kv.lengths == [12, 14, 11]
        caches = kv.caches
        for _ in range(3):           # a fourth row in and out: rows stay at 4, nothing moves
            kv.add_rows(1)
            kv.extend([[1], [2], [3], [4]])
            kv.select([0, 1, 2])
            kv.trim()
        assert kv.caches is caches


def test_a_shrunk_cache_computes_what_a_fresh_one_does(tiny_target):
    kv = StaticKVModel(tiny_target.model, token_bucket=W, fixed=True)
    kv.add_rows(2)
    kv.extend([[5, 6, 7], [9] * 300])
    kv.select([0])
    assert kv.capacity == (2, buckets.INITIAL_POSITIONS)     # 1 row of 2: kept
    fresh = _prefilled(tiny_target.model, [[5, 6, 7]])
    assert torch.equal(kv.extend([[4, 3]], last=2), fresh.extend([[4, 3]], last=2))


# Slow: dynamo traces the step's layer (13-20 s here); the fast lane keeps the
# exactness tests, the full suite this one.
@pytest.mark.slow
def test_the_compiled_step_does_not_recompile_over_a_generation(tiny_tokenizer, monkeypatch):
    """fullgraph=True over every layer, two graphs for six buckets; after warming them, a run where
    rows join (a prompt run apart beside decoding rows) and leave, drafts are rejected, lengths
    move within a bucket and a row crosses into the next capacity bucket compiles nothing new
    (dynamo's error_on_recompile), and gives the eager step's logits."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tiny_models import make_model

    monkeypatch.setenv("SPECPAIR_COMPILE_BACKEND", "aot_eager")   # inductor: minutes on 2 cores
    model = make_model(tiny_tokenizer, seed=6, layers=2, dtype=torch.bfloat16).model.eval()
    torch._dynamo.reset()
    compiled = StaticKVModel(model, compile="on", token_bucket=W)
    eager = StaticKVModel(model, token_bucket=W)
    assert compiled.fixed and compiled.compiled
    before = counters["stats"]["unique_graphs"]
    report = compiled.warm_up(max_rows=4, max_positions=buckets.INITIAL_POSITIONS)
    assert report["buckets"] == [(r, c) for r in (1, 2, 4) for c in (256, 512)]
    graphs = counters["stats"]["unique_graphs"]
    # Capacity and rows (past one) are symbolic: one graph for a row, one for several; and a
    # prompt's step (its rows by index, the token count symbolic) for one row in a cache of one,
    # one row in a cache of several, and several rows (_warm_prefill).
    assert graphs - before == 5
    rng = random.Random(0)

    def both(op, *args, **kwargs):
        out = [getattr(kv, op)(*args, **kwargs) for kv in (compiled, eager)]
        if op == "extend":
            assert torch.equal(out[0], out[1])

    with torch._dynamo.config.patch(error_on_recompile=True):
        both("add_rows", 1)
        both("extend", [[rng.randrange(3, 300) for _ in range(30)]])
        for step in range(40):
            if step == 5:                                   # a request joins with its prompt
                both("add_rows", 1)
                both("extend", [[7], [rng.randrange(3, 300) for _ in range(20)]])
            if step == 20:                                  # the first row leaves
                both("select", [1])
            if step == 25:                                  # another joins
                both("add_rows", 1)
                both("extend", [[7], [rng.randrange(3, 300) for _ in range(3)]])
            k = rng.randrange(0, 5)
            feed = [[rng.randrange(3, 300) for _ in range(1 + k)] for _ in compiled.lengths]
            both("extend", feed, last=1 + k)
            keep = [n - rng.randrange(0, len(f)) for n, f in zip(compiled.lengths, feed)]
            for i, n in enumerate(keep):                    # rejected drafts: lengths move back
                both("rollback", i, n)
            if step == 30:                                  # a long answer crosses into 512 positions
                both("extend", [[5] * 8 for _ in compiled.lengths])
                both("extend", [[5] * 200 if i == 0 else [5] for i in range(len(compiled.lengths))])
    assert compiled.capacity[1] == 512
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_gpu_step_bench_runs_on_the_cpu(tmp_path):
    """bench/gpu_step_bench.py, for a machine with a GPU: proven here on the tiny shape (its
    figures are benchmark output, never asserted)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_step_bench import main

    out = tmp_path / "step.json"
    assert main(["--device", "cpu", "--shape", "tiny", "--repeats", "1", "--k-max", "2",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] == torch.__version__
    tiny = report["shapes"]["tiny"]
    assert set(tiny["specpair"]["step_ms"]) == {"1", "2", "4"}      # k+1 for k <= 2, bucketed
    assert set(tiny["specpair"]["verify_over_step"]) == {"0", "1", "2"}
    assert min(n["count"] for n in tiny["specpair"]["launches"].values()) > 0
    assert tiny["hf_static"]["step_ms"] > 0
    # Its bitwise check: W tokens verified at once against the same tokens one step at a time.
    assert set(tiny["exactness"]) == {"2", "4"}
    assert all(e["tokens_bitwise_equal"] == e["tokens"] and e["max_abs_diff"] == 0
               for e in tiny["exactness"].values())
    assert all(tiny["specpair"]["host_ms"][w] <= tiny["specpair"]["step_ms"][w] for w in ("1", "2"))
    assert tiny["bandwidth_limit_ms"] > 0
    # Where the host's time goes at one token and at the widest bucket, by Python function.
    assert set(tiny["specpair"]["host_profile"]) == {"1", "4"}
    assert all(ms >= 0 for rows in tiny["specpair"]["host_profile"].values() for _, ms in rows)
    # Beside it, an EAGLE head's drafting step and a round of k-max drafts (random weights).
    head = tiny["eagle_head"]
    assert head["draft_step_ms"] > 0 and head["launches"]["count"] > 0
    assert head["round_drafts"] == 2 and head["round_launches"]["count"] > head["launches"]["count"]
    # And a round of Medusa heads (every head in one step).
    medusa = tiny["medusa_heads"]
    assert medusa["heads"] == 4 and medusa["round_ms"] > 0 and medusa["launches"]["count"] > 0


def test_the_no_spec_beside_spec_comparison_runs_on_the_cpu(tmp_path):
    """bench/no_spec_beside_spec.py, for a machine with a GPU: a speculating engine's k=0
    request (at the engine's token bucket) against a target-only engine (one token), proven
    here on the tiny shape in bf16 (the fixed step on the CPU); its figures are never asserted."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from no_spec_beside_spec import main

    out = tmp_path / "ab.json"
    assert main(["--device", "cpu", "--shape", "tiny", "--turns", "1", "--max-new-tokens", "6",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    speculating, target_only = report["engines"].values()
    assert speculating["describe_step"]["token_bucket"] == 16
    assert target_only["describe_step"]["token_bucket"] == 1
    assert all(e["ms_per_token"] > 0 and e["python_calls_per_step"] > 0
               for e in (speculating, target_only))
    assert report["ratio"] > 0


@pytest.mark.parametrize("layer", ["cat"])
def test_the_step_bench_candidate_layers_compute_the_engine_layer_bitwise(layer, monkeypatch):
    """The other layers the step bench measures against the engine's (--layer) are the same
    arithmetic: equal outputs and cache writes, bitwise, at one token and several."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import gpu_step_bench as bench

    torch.manual_seed(0)
    B, H, KV, D, HID, INTER, C = 2, 4, 2, 16, 64, 128, 32
    dt = torch.bfloat16
    engine_layer = fixed_step.fixed_layer
    for W in (1, 4):
        positions = torch.tensor([[5 + w for w in range(W)], [9 + w for w in range(W)]])
        cos, sin = torch.randn(2, B, 1, W, D, dtype=dt)
        weights = [torch.randn(n, m, dtype=dt) * 0.1 for n, m in
                   [((H + 2 * KV) * D, HID), (HID, H * D), (2 * INTER, HID), (HID, INTER)]]
        weights += [torch.rand(HID, dtype=dt) + 0.5, torch.rand(HID, dtype=dt) + 0.5]
        h = torch.randn(B, W, HID, dtype=dt)
        rows = torch.arange(B).view(B, 1).expand(B, W)
        caches = torch.randn(2, B, KV, C, D, dtype=dt)
        kw = dict(eps=1e-5, heads=H, kv_heads=KV, head_dim=D)
        kc, vc = caches.clone()
        want = engine_layer(h, cos, sin, rows, positions, positions, kc, vc, *weights, **kw)
        kc2, vc2 = caches.clone()
        with monkeypatch.context() as patched:     # use_layer swaps module globals: put back
            patched.setattr(fixed_step, "fixed_layer", engine_layer)
            patched.setattr(fixed_step, "_rotate_half", fixed_step._rotate_half)
            bench.use_layer(layer)
            got = fixed_step.fixed_layer(h, cos, sin, rows, positions, positions, kc2, vc2,
                                            *weights, **kw)
        assert fixed_step.fixed_layer is engine_layer
        assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_a_tree_whose_branch_branches_takes_the_general_step(tiny_target):
    """A branch off a branch has an ancestor away from its position: the fixed step's attention
    does not take it, the general step does, to rounding."""
    prompt, feed = [5, 6, 7, 8], [11, 12, 13, 14, 15]
    parents = [[-1, -1, -1, 1, 3]]          # 14 branches off 12; 15 off 14
    kv = _prefilled(tiny_target.model, [prompt])
    logits = kv.extend([feed], last=5, parents=parents)
    ref = tiny_target.model(torch.tensor([prompt + [11, 12, 14, 15]])).logits[0, -1]
    torch.testing.assert_close(logits[0, -1], ref, rtol=1e-4, atol=1e-4)


# Slow: dynamo traces the step's layer (13-20 s here); the fast lane keeps the
# exactness tests, the full suite this one.
@pytest.mark.slow
def test_a_compiled_engine_warms_every_bucket_and_then_compiles_nothing(tiny_tokenizer, monkeypatch):
    """SpeculativeEngine(compile="on") on the fixed step warms each (rows, capacity) bucket up to
    the speculation threshold and the context at start-up (the report says which), and a
    speculative generation afterwards compiles nothing and equals the eager engine's."""
    import torch._dynamo

    from tiny_models import make_model

    monkeypatch.setenv("SPECPAIR_COMPILE_BACKEND", "aot_eager")
    target = make_model(tiny_tokenizer, seed=1, dtype=torch.bfloat16, init_std=0.05)
    config = SpeculationConfig(k=3, k_max=3, fallback_threshold=0, batch_size_threshold=2)
    torch._dynamo.reset()
    compiled = SpeculativeEngine(target, drafter=NgramDrafter(), speculation=config, compile="on")
    report = compiled.captures["target"]
    assert report["token_bucket"] == 4 and report["seconds"] > 0
    assert report["buckets"] == [(r, c) for r in (1, 2) for c in (256, 512, 1024)]
    # Each bucket's own seconds and the prompt's step's, within the whole (each rounded to a
    # millisecond, so their sum may pass the rounded whole by half a millisecond each).
    parts = report["bucket_seconds"] + [report["prefill_seconds"]]
    assert len(parts) == len(report["buckets"]) + 1 and min(parts) >= 0
    assert 0 < sum(parts) <= report["seconds"] + 0.0005 * (len(parts) + 1)
    assert compiled.describe_step()["compile"] == {"backend": "aot_eager"}
    # Past the threshold the target steps at one token (SpeculativeEngine.step_bucket): warmed too.
    past = compiled.captures["target_past_speculation"]
    assert past["token_bucket"] == 1 and past["buckets"] == [(4, c) for c in (256, 512, 1024)]
    eager = SpeculativeEngine(target, drafter=NgramDrafter(), speculation=config)
    params = GenerationParams(max_new_tokens=20)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = compiled.generate(PROMPTS[:2], params)
        crowded = compiled.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in eager.generate(PROMPTS[:2], params)]
    assert sum(r.stats.num_draft_tokens for r in got) > 0
    assert [r.token_ids for r in crowded] == [r.token_ids for r in eager.generate(PROMPTS, params)]


def test_a_heads_vector_steps_through_the_fixed_step_match_the_general_step(tiny_target):
    """extend_vectors (a drafting head's inputs) on the fixed step: prompts run apart, one-vector
    steps at the bucket, rows feeding nothing; the same outputs as the C layer's, to rounding."""
    gen = torch.Generator().manual_seed(2)
    dim = tiny_target.model.config.hidden_size
    fixed = StaticKVModel(tiny_target.model, fixed=True)
    general = StaticKVModel(tiny_target.model, fixed=False)
    for kv in (fixed, general):
        kv.add_rows(2)
    for counts in ([5, 0], [1, 1], [3, 1], [0, 2]):
        rows = [torch.randn(n, dim, generator=gen) for n in counts]
        a, b = fixed.extend_vectors(rows), general.extend_vectors(rows)
        assert a.shape == b.shape == (2, max(counts), dim)
        for i, n in enumerate(counts):
            torch.testing.assert_close(a[i, :n], b[i, :n], rtol=1e-4, atol=1e-4)
        assert fixed.lengths == general.lengths


def test_the_cost_model_times_the_step_a_batch_runs(tiny_tokenizer):
    """On the fixed step every target pass of a batch is padded to the engine's token bucket: the
    cost model (dynamic k's prices) must time that cache, or it prices a one-token step no batch
    runs (and a verification as a prompt, apart)."""
    from tiny_models import make_model

    from specpair.costs import measure_step_costs
    target = make_model(tiny_tokenizer, seed=1, dtype=torch.bfloat16)
    engine = SpeculativeEngine(target, drafter=NgramDrafter(),
                               speculation=SpeculationConfig(k=4, k_max=4, fallback_threshold=0))
    made = []
    build = engine.kv_model

    def recording(model, token_bucket=None):
        kv = build(model, token_bucket)
        made.append((model is target.model, kv.token_bucket, kv.fixed))
        return kv
    engine.kv_model = recording
    measure_step_costs(engine, engine.encode("def foo(x):\n    return"), [1, 2, 4], repeats=1)
    assert made and all(entry == (True, W, True) for entry in made), made


def test_a_released_small_cache_is_taken_by_the_next_batch_and_gives_the_same_logits(tiny_tokenizer):
    """One-request batches (generate(), the bench, the gate) reuse their model's last small cache
    and the CUDA graphs recorded over it (shelf.CacheShelf); its stale keys are never
    attended, so a reused cache's logits equal a fresh one's bitwise; a large cache is not kept."""
    import gc

    from tiny_models import make_model

    model = make_model(tiny_tokenizer, seed=8, dtype=torch.bfloat16).model.eval()
    runner.StaticLlama._by_model.pop(model, None)
    first = StaticKVModel(model, token_bucket=W, fixed=True)
    first.add_rows(1)
    first.extend([[9, 8, 7, 6, 5, 4]])
    first.extend([[3, 2]], last=2)
    kept = [t.data_ptr() for t in first.caches[0]]
    del first
    gc.collect()
    second = StaticKVModel(model, token_bucket=W, fixed=True)
    assert [t.data_ptr() for t in second.caches[0]] == kept       # taken from the shelf
    fresh = StaticKVModel(model, token_bucket=W, fixed=True)
    assert [t.data_ptr() for t in fresh.caches[0]] != kept       # the one kept is in use
    for kv in (second, fresh):
        kv.add_rows(1)
    assert torch.equal(second.extend([[5, 6, 7]], last=3), fresh.extend([[5, 6, 7]], last=3))
    assert torch.equal(second.extend([[11, 12]], last=2), fresh.extend([[11, 12]], last=2))
    big = StaticKVModel(model, token_bucket=W, fixed=True)
    big.add_rows(1)
    big.extend([[5] * 600])                                     # 1,024 positions: not kept
    assert big.capacity[1] > shelf.CacheShelf.KEEP_POSITIONS
    del big
    gc.collect()
    # Kept: big's first cache, released when it grew; its 1,024-position one was refused.
    assert _shelved_shape(model)[2] == buckets.INITIAL_POSITIONS


def _shelved_shape(model):
    kept = runner.StaticLlama.of(model).shelf._kept
    return None if kept is None else kept[0]


def test_a_prompt_joining_running_rows_leaves_their_keys_alone(tiny_target):
    """A prompt run as a fixed step of its own rows (`_prefill_step`) beside running rows writes
    only its rows: their next logits are those of the same rows without the newcomer (to float32
    rounding: the batch's products have other shapes). Writes into a running row's cached keys
    would move them by far more."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (30, 5)]
    fed = [[rng.randrange(3, 300) for _ in range(3)] for _ in range(4)]
    joined = _prefilled(tiny_target.model, prompts)
    alone = _prefilled(tiny_target.model, prompts)
    for tokens in fed:
        joined.extend([[t] for t in tokens[:2]])
        alone.extend([[t] for t in tokens[:2]])
    newcomer = [rng.randrange(3, 300) for _ in range(40)]
    joined.add_rows(1)
    assert bucket(len(newcomer)) <= buckets.PREFILL_STEP_TOKENS
    joined.extend([[7], [8], newcomer])
    alone.extend([[7], [8]])
    got = joined.extend([[9], [10], [11]])[:2]
    expected = alone.extend([[9], [10]])
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-4, atol=1e-4)


def test_past_the_speculation_batch_size_the_target_steps_at_one_token(tiny_tokenizer):
    """A batch larger than batch_size_threshold does not speculate (Batch._ks) and its target
    steps at one token a row, as a target-only engine's does (SpeculativeEngine.step_bucket): while the
    batch stays that large its output equals a target-only engine's bitwise; once it is small
    again it steps at the speculation bucket."""
    from tiny_models import make_model
    target = make_model(tiny_tokenizer, seed=1, dtype=torch.bfloat16, init_std=0.05)
    config = SpeculationConfig(k=4, k_max=4, fallback_threshold=0, batch_size_threshold=2)
    engine = SpeculativeEngine(target, drafter=NgramDrafter(), speculation=config)
    plain = SpeculativeEngine(target, speculation=config)
    assert (engine.token_bucket, plain.token_bucket) == (W, 1)
    engine.eos_ids = plain.eos_ids = set()        # every row lives every step
    params = GenerationParams(max_new_tokens=24)
    spec = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain.generate(PROMPTS, params)]
    assert sum(r.stats.num_draft_tokens for r in spec) == 0

    batch = engine.new_batch()
    rows = [batch.add(engine.target.tokenizer(p)["input_ids"], params) for p in PROMPTS]
    batch.step()
    assert batch.target.token_bucket == 1
    for seq in rows[1:]:
        batch.cancel(seq.request_id)
    batch.step()
    assert batch.target.token_bucket == W


@pytest.mark.parametrize("width", [1, 2])
def test_an_eagle_head_on_the_fixed_step_equals_target_only_bitwise(tiny_tokenizer, width):
    """An EAGLE head drafting on a bf16 (fixed-step) target: its prompt's features come out of
    the prompt's own step (`_prefill_step` with the hidden states), its drafting steps through
    `extend_vectors`; chains and trees, greedy output equal to the same engine's target-only
    output token for token, with kept and rejected drafts."""
    from head_builders import mirror_head
    from tiny_models import make_model
    target = make_model(tiny_tokenizer, seed=11, layers=1, dtype=torch.bfloat16)
    head = mirror_head(target, vocab_every=2)
    head.model.to(torch.bfloat16)
    engine = SpeculativeEngine(target, draft=head, speculation=SpeculationConfig(
        k=3, k_max=3, dynamic_k=False, fallback_threshold=0, tree_width=width))
    assert engine.describe_step()["fixed_step"]
    prompts = PROMPTS + ["class A:\n  pass\n" * 3]
    params = GenerationParams(max_new_tokens=24)
    spec = engine.generate(prompts, params)
    assert [r.token_ids for r in spec] == [r.token_ids
                                           for r in engine.generate(prompts, params, speculate=False)]
    drafted = sum(r.stats.num_draft_tokens for r in spec)
    assert 0 < sum(r.stats.num_accepted_tokens for r in spec) < drafted


def test_a_prompts_step_hands_back_its_logits_and_hidden_states(tiny_target):
    """A drafting head reads the prompt's normed hidden states (`extend(..., hidden=True)`): the
    prompt's fixed step returns those of every fed token and the last token's logits, as the
    general step computes them (float32 rounding)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (30, 12)]
    fixed = StaticKVModel(tiny_target.model, token_bucket=W, fixed=True)
    general = StaticKVModel(tiny_target.model, fixed=False)
    got, expected = [], []
    for kv, into in ((fixed, got), (general, expected)):
        kv.add_rows(len(prompts))
        into.extend(kv.extend(prompts, hidden=True))
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-4)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got[1][i, :len(p)], expected[1][i, :len(p)], rtol=1e-4, atol=1e-4)


# Slow: dynamo traces the step's layer (13-20 s here); the fast lane keeps the
# exactness tests, the full suite this one.
@pytest.mark.slow
def test_a_pair_that_never_speculates_warms_and_steps_at_one_token(tiny_tokenizer, monkeypatch):
    """batch_size_threshold 0 (speculation never runs): warm-up compiles the one-token step,
    and a generation afterwards compiles nothing and drafts nothing."""
    import torch._dynamo

    from tiny_models import make_model

    monkeypatch.setenv("SPECPAIR_COMPILE_BACKEND", "aot_eager")
    target = make_model(tiny_tokenizer, seed=1, dtype=torch.bfloat16, init_std=0.05)
    config = SpeculationConfig(k=3, k_max=3, fallback_threshold=0, batch_size_threshold=0)
    torch._dynamo.reset()
    engine = SpeculativeEngine(target, drafter=NgramDrafter(), speculation=config, compile="on")
    assert engine.captures["target"]["token_bucket"] == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = engine.generate(PROMPTS[:2], GenerationParams(max_new_tokens=12))
    assert sum(r.stats.num_draft_tokens for r in got) == 0
