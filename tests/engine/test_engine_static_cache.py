"""The static KV cache and its step: the same logits as Hugging Face's forward over the dynamic
cache through every cache operation, the CPU kernel against torch's linear, and greedy identity of
whole generations (eager and compiled)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specpair import cpu_kernels
from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.drafters import NgramDrafter
from specpair.errors import SpecpairError
from specpair.kv import buckets, compiling, families, runner
from specpair.kv.choice import kv_model
from specpair.kv.dynamic import BatchedKVModel
from specpair.kv.static import StaticKVModel


# -- the CPU kernel ---------------------------------------------------------------------------

@pytest.mark.parametrize("in_features", [576, 37, 8, 1536])
def test_small_linear_matches_torch_for_every_row_count(in_features):
    assert cpu_kernels.available(), cpu_kernels.status()
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(203, in_features, generator=gen)
    for rows in range(1, cpu_kernels.MAX_TOKENS + 1):
        x = torch.randn(rows, in_features, generator=gen)
        ours = cpu_kernels.linear(x, weight)
        assert cpu_kernels.layer_applies(rows, torch.float32, torch.device("cpu"), head_dim=64)
        torch.testing.assert_close(ours, F.linear(x, weight), rtol=1e-4, atol=1e-4)
    # The limits are the library's own (cpu_kernels.c), and beyond them torch takes the step.
    assert cpu_kernels.MAX_TOKENS == 128 and cpu_kernels.MAX_HEAD_DIM == 256
    cpu = torch.device("cpu")
    assert not cpu_kernels.layer_applies(cpu_kernels.MAX_TOKENS + 1, torch.float32, cpu, 64)
    assert not cpu_kernels.layer_applies(4, torch.float32, cpu, head_dim=36)    # not 8-wide
    assert not cpu_kernels.layer_applies(4, torch.float32, cpu, head_dim=512)


def test_a_rows_output_does_not_depend_on_how_many_rows_came_with_it():
    """Bitwise: a token's logits in a 1-token step equal its logits inside a 5-token verification,
    so rounding cannot make speculative greedy output differ from target-only output."""
    cpu_kernels.available()
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(300, 576, generator=gen), torch.randn(13, 576, generator=gen)
    together = cpu_kernels.linear(x, weight)          # 13 rows: two passes of 7 and 6
    for i in range(13):
        assert torch.equal(cpu_kernels.linear(x[i:i + 1], weight)[0], together[i])


@pytest.mark.parametrize("in_features", [576, 37, 1536])
def test_a_rows_output_is_the_same_in_every_tiling_of_the_rows(in_features):
    """Bitwise, for every row count the kernel takes: rows go in tiles (cpu_kernels.c
    TILE_KERNEL: 4 x 2 at four rows, 4 x 4 and then 1 x 8, 2 x 4 or 3 x 4 at five to eight,
    their lane sums transposed) where they fill and through the one-output kernels elsewhere
    (a block's last outputs, 1-3 rows); each output must be the very float a 1-row product
    gives. 203 outputs leave a block of 11; 37 inputs leave a tail past the eight-float steps."""
    cpu_kernels.available()
    gen = torch.Generator().manual_seed(in_features + 1)
    weight = torch.randn(203, in_features, generator=gen)
    x = torch.randn(cpu_kernels.MAX_TOKENS, in_features, generator=gen)
    alone = torch.cat([cpu_kernels.linear(x[i:i + 1], weight) for i in range(len(x))])
    for rows in range(2, cpu_kernels.MAX_TOKENS + 1):
        assert torch.equal(cpu_kernels.linear(x[:rows], weight), alone[:rows]), rows


def _products_over_nan(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """cpu_kernels._small_linear's call, into outputs filled with NaN: an output the kernel never
    writes stays NaN."""
    import ctypes
    M, I = x.shape
    outs = [torch.full((M, w.shape[0]), float("nan")) for w in weights]
    n = len(weights)
    rc = cpu_kernels._LIB.specpair_small_linear(
        x.data_ptr(), (ctypes.c_void_p * n)(*[w.data_ptr() for w in weights]),
        (ctypes.c_void_p * n)(*[y.data_ptr() for y in outs]),
        (ctypes.c_long * n)(*[w.shape[0] for w in weights]), n, M, I, torch.get_num_threads())
    assert rc == 0
    return outs


@pytest.mark.parametrize("threads", [1, 2])
def test_every_piece_of_a_block_is_the_one_row_product_in_passes_of_eight(threads):
    """Bitwise, in full passes of eight rows (the 32-row decode step's, a prompt's 128-token
    calls): a task's block of outputs goes in 4 x 6 tiles, then 4 x 4, then the one-output
    kernel (cpu_kernels.c rows_block, on AVX-512 machines). Output counts from 1 to 53 leave each
    of those pieces, alone and together, at a block's end; weights of several widths in one
    call put blocks of different matrices side by side in the threads' split; 37 inputs leave a
    tail past the eight-float steps. A piece that skipped an output leaves it NaN; one that
    repeated or misplaced an output leaves it unlike its 1-row product."""
    assert cpu_kernels.available(), cpu_kernels.status()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        for in_features in (576, 37):
            weights = [torch.randn(o, in_features, generator=gen) for o in
                       (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 16, 23, 24, 25, 29, 30, 53)]
            x = torch.randn(cpu_kernels.MAX_TOKENS, in_features, generator=gen)
            for j in range(0, len(weights), 8):          # at most 8 weights a call
                group = weights[j:j + 8]
                alone = [torch.cat(col) for col in
                         zip(*[cpu_kernels.linears(x[i:i + 1], *group) for i in range(len(x))])]
                for rows in (8, 16, 32, 64, 128):
                    together = _products_over_nan(x[:rows].contiguous(), group)
                    for w, y, ref in zip(group, together, alone):
                        assert torch.equal(y, ref[:rows]), (in_features, w.shape[0], rows)
                        torch.testing.assert_close(y, F.linear(x[:rows], w), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_linear_falls_back_to_torch_where_the_kernel_does_not_apply():
    cpu_kernels.available()
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 32, generator=gen)
    for x in (torch.randn(cpu_kernels.MAX_TOKENS + 1, 32, generator=gen),  # more rows than the kernel
              torch.randn(2, 32, generator=gen).to(torch.float64)):    # not float32
        w = weight.to(x.dtype)
        assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
    # A transposed (non-contiguous) weight is legal input and still correct.
    wt = torch.randn(64, 16, generator=gen).t()        # [16, 64], columns contiguous
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(cpu_kernels.linear(x, wt), F.linear(x, wt))


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPECPAIR_CPU_KERNELS", "0")
    cpu_kernels.library.cache_clear()
    try:
        assert not cpu_kernels.available()
        assert "SPECPAIR_CPU_KERNELS=0" in cpu_kernels.status()
        x, w = torch.randn(2, 16), torch.randn(8, 16)
        assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
    finally:
        monkeypatch.delenv("SPECPAIR_CPU_KERNELS")
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.available()


def test_available_leaves_the_kernel_in_use_as_it_is():
    """A bench's A/B puts another build in place of the default one (cpu_kernels._LIB, as
    bench/layer_kernel_ab.py does, or use_library); the caches then ask available() before each
    step: asking must not put the default build back (it did, and a bench ran it twice)."""
    assert cpu_kernels.available()
    built = cpu_kernels._LIB
    other, error = cpu_kernels.build_library(cpu_kernels.SOURCE)   # the same build, another handle
    assert other is not None and other is not built, error
    try:
        cpu_kernels._LIB = other
        assert cpu_kernels.available() and cpu_kernels._LIB is other
        cpu_kernels.use_library(None)           # torch in its place: available() says so
        assert not cpu_kernels.available() and cpu_kernels._LIB is None
    finally:
        cpu_kernels.use_library(built)
    assert cpu_kernels.available() and cpu_kernels._LIB is built


# -- the cache --------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[4, 2], ids=["mha", "gqa"])
def model(request, tiny_tokenizer):
    from tiny_models import make_model
    loaded = make_model(tiny_tokenizer, seed=3, hidden=64, heads=4)
    if request.param != 4:      # grouped-query attention: fewer key/value heads than query heads
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(**{**loaded.model.config.to_dict(), "num_key_value_heads": request.param})
        torch.manual_seed(3)
        return LlamaForCausalLM(cfg).eval()
    return loaded.model.eval()


def test_static_cache_matches_the_dynamic_cache_through_every_operation(model, monkeypatch):
    # A tiny first allocation so rows and positions both have to grow on the way.
    monkeypatch.setattr(buckets, "INITIAL_POSITIONS", 8)
    ref, ours = BatchedKVModel(model), StaticKVModel(model)
    assert ours.capacity == (1, 8)

    def both(rows, last):
        expected, got = ref.extend(rows, last), ours.extend(rows, last)
        assert got.shape == expected.shape
        for i, r in enumerate(rows):
            n = min(len(r), last)
            if n:
                torch.testing.assert_close(got[i, -n:], expected[i, -n:], rtol=1e-4, atol=1e-4)
        assert ours.lengths == ref.lengths

    def each(op, *args):
        getattr(ref, op)(*args)
        getattr(ours, op)(*args)
        ref.trim()
        ours.trim()

    each("add_rows", 2)
    both([[5, 6, 7, 8, 9], [3, 4]], 5)                   # prefills of different lengths
    both([[1, 2, 3], [4]], 3)                            # a verification next to a decode step
    each("rollback", 0, 6)                               # row 0 rejects two drafts
    both([[9, 9], [7, 7, 7, 7]], 4)
    each("add_rows", 1)                                  # a request joins mid-flight
    both([[1], [2], list(range(10, 40))], 1)
    assert ours.capacity[0] >= 3 and ours.capacity[1] >= 33
    each("select", [2, 0])                               # row 1 finished; rows reorder
    both([[3, 4], [5]], 2)
    each("rollback", 1, 3)
    both([[3], [5, 6, 7]], 3)
    both([[], [8, 8]], 2)                                # a row with nothing to add this step
    each("select", [])
    each("add_rows", 1)
    both([[11, 12, 13]], 1)
    assert ours.capacity == (2, 8)                       # given back once the rows left


def test_rows_of_very_different_widths_run_apart():
    """A prompt joining running rows is not padded into them: the cut is where the padding saved
    pays for another forward, and rows of similar widths stay together."""
    from specpair.kv.buckets import GROUP_CALL_TOKENS, width_groups

    assert width_groups([1, 1, 300, 1]) == [[2], [0, 1, 3]]
    assert width_groups([5, 5, 5, 5]) == [[0, 1, 2, 3]]
    assert width_groups([3, 2, 5]) == [[0, 1, 2]]              # 6 tokens of padding: not worth it
    assert width_groups([200, 1, 190, 2, 1]) == [[0, 2], [1, 3, 4]]
    assert width_groups([200, 1, 180, 2, 1]) == [[0], [2], [1, 3, 4]]   # 20 padded > 16
    assert width_groups([0, 0, 40]) == [[2], [0, 1]]
    assert width_groups([]) == []
    # Exactly at the price of a call: stay together.
    assert width_groups([1 + GROUP_CALL_TOKENS, 1]) == [[0, 1]]
    assert width_groups([2 + GROUP_CALL_TOKENS, 1]) == [[0], [1]]


def test_a_step_run_apart_gives_what_one_padded_step_gives(tiny_target, monkeypatch):
    """Logits and features of a step whose rows run apart (a prefill beside decode and verify
    rows, in a batch whose rows were reordered) equal those of the same step padded into one
    forward; the cache afterwards serves the next step the same way."""
    def run(apart: bool):
        monkeypatch.setattr(buckets, "GROUP_CALL_TOKENS", 16 if apart else 10**9)
        kv = StaticKVModel(tiny_target.model)
        kv.add_rows(3)
        kv.extend([[5, 6, 7], [8, 9], [10]])
        kv.select([2, 0, 1])
        kv.add_rows(1)
        seen = [kv.extend([[1], [2, 3, 4], list(range(20, 60)), [11]], last=3, hidden=True)]
        seen.append(kv.extend([[12], [13], [14], [15]], last=1, hidden=True))
        return seen

    calls = []
    original = runner.StaticLlama.forward

    def counted(self, ids, *args, **kwargs):
        calls.append(tuple(ids.shape))
        return original(self, ids, *args, **kwargs)

    monkeypatch.setattr(runner.StaticLlama, "forward", counted)
    padded = run(apart=False)
    assert calls == [(3, 3), (4, 40), (4, 1)]
    calls.clear()
    apart = run(apart=True)
    assert calls == [(3, 3), (1, 40), (3, 3), (4, 1)]
    counts = [1, 3, 40, 1]
    # Within rounding: the short rows now take the C layer, which padded to 40 they could not.
    for (pl, ps), (al, as_) in zip(padded, apart):
        torch.testing.assert_close(al, pl, rtol=1e-4, atol=1e-4)
        for i, n in enumerate(counts if pl.shape[1] == 3 else [1] * 4):
            torch.testing.assert_close(as_[i, :n], ps[i, :n], rtol=1e-4, atol=1e-4)


def test_rejection_costs_nothing_and_keeps_the_survivors(tiny_target):
    kv = StaticKVModel(tiny_target.model)
    kv.add_rows(1)
    kv.extend([[1, 2, 3, 4]])
    before = [k.clone() for k, _ in kv.caches]
    kv.rollback(0, 2)
    assert kv.lengths == [2]
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, kv.caches))   # nothing moved
    fresh = StaticKVModel(tiny_target.model)
    fresh.add_rows(1)
    fresh.extend([[1, 2]])
    torch.testing.assert_close(kv.extend([[7]]), fresh.extend([[7]]), rtol=1e-5, atol=1e-5)


def test_unsupported_models_get_the_dynamic_cache_and_bad_kinds_are_refused(tiny_target, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in families.supports(gpt2)
    assert isinstance(kv_model(gpt2), BatchedKVModel)
    assert isinstance(kv_model(tiny_target.model), StaticKVModel)
    assert isinstance(kv_model(tiny_target.model, kind="dynamic"), BatchedKVModel)
    monkeypatch.setenv("SPECPAIR_KV", "dynamic")
    assert isinstance(kv_model(tiny_target.model), BatchedKVModel)
    monkeypatch.setenv("SPECPAIR_KV", "holes")
    with pytest.raises(SpecpairError, match="static, dynamic"):
        kv_model(tiny_target.model)
    with pytest.raises(SpecpairError, match="off, on"):
        compiling.resolve_compile("max")


def test_compiling_is_on_by_default_on_cuda_only(monkeypatch):
    """CUDA graphs are what make the GPU step fast (docs/gpu.md); the CPU's eager step is faster
    there. Asking, or SPECPAIR_COMPILE, wins either way."""
    monkeypatch.delenv("SPECPAIR_COMPILE", raising=False)
    assert compiling.resolve_compile(None, torch.device("cuda")) == "on"
    assert compiling.resolve_compile(None, torch.device("cpu")) == "off"
    assert compiling.resolve_compile(None) == "off"
    assert compiling.resolve_compile("off", torch.device("cuda")) == "off"
    monkeypatch.setenv("SPECPAIR_COMPILE", "off")
    assert compiling.resolve_compile(None, "cuda") == "off"


def test_compiled_kernels_are_kept_in_the_model_cache_when_it_is_writable(monkeypatch, tmp_path):
    # setenv first, so the variable's state before the test is what monkeypatch restores.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("SPECPAIR_CACHE", str(tmp_path / "cache"))
    compiling.use_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert (tmp_path / "cache" / "inductor").is_dir()
    # Set by the operator of the machine: kept.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compiling.use_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    # A cache that cannot be created (a file in the way): inductor keeps its own default.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (tmp_path / "blocked").write_text("")
    monkeypatch.setenv("SPECPAIR_CACHE", str(tmp_path / "blocked"))
    compiling.use_compile_cache()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


# -- whole generations ------------------------------------------------------------------------

PROMPTS = ["def foo(x):\n    return", "Hello world, hello world, hello", "import os\nimport sys\n"]
PARAMS = GenerationParams(max_new_tokens=24)


@pytest.fixture(scope="module")
def dynamic_reference(tiny_target):
    engine = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False), kv="dynamic")
    return [engine.generate([p], PARAMS)[0].token_ids for p in PROMPTS]


def test_static_engine_equals_the_dynamic_engine(tiny_target, tiny_draft, dynamic_reference):
    target_only = SpeculativeEngine(tiny_target, speculation=SpeculationConfig(enabled=False))
    assert target_only.describe_step()["kv_cache"] == "static"
    assert [r.token_ids for r in target_only.generate(PROMPTS, PARAMS)] == dynamic_reference
    for drafter, draft in ((None, tiny_draft), (NgramDrafter(), None)):
        engine = SpeculativeEngine(tiny_target, drafter=drafter, draft=draft,
                                   speculation=SpeculationConfig(k=4, fallback_threshold=0))
        results = engine.generate(PROMPTS, PARAMS)
        assert [r.token_ids for r in results] == dynamic_reference
        assert sum(r.stats.num_draft_tokens - r.stats.num_accepted_tokens for r in results) > 0


# The one test that compiles the step with inductor (the others use aot_eager: the same graphs and
# guards) and a draft model's step at all: 8 graphs (5 in warm-up, 3 in generate: the prompts'
# shapes), ~20 CPU-s of dynamo tracing alone, and on a cold inductor cache (a fresh CI machine)
# 29 + 24.5 CPU-s in the process and 35 in the compiler's children: 475 s at load 12-16, 503 s at
# load 45-65, against the suite's 600 s. Its work is what it proves (an n-gram drafter would leave
# out the draft model's compiled step and save one graph of 8), so it gets a deadline in minutes.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compiled_step_is_warmed_and_exact(tiny_target, tiny_draft, dynamic_reference):
    engine = SpeculativeEngine(tiny_target, draft=tiny_draft, compile="on",
                               speculation=SpeculationConfig(k=3, fallback_threshold=0))
    assert engine.describe_step() == {"kv_cache": "static", "compiled": True,
                                      "cpu_kernels": cpu_kernels.status()}
    results = engine.generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in results] == dynamic_reference


def test_a_verified_tokens_logits_are_bitwise_its_decode_step_logits(tiny_target):
    """Through the C layer (CPU, float32, <= 16 tokens) a token's arithmetic does not depend on the
    tokens verified with it: decoding five tokens one by one and verifying them at once give
    identical logits, so speculation cannot flip a greedy choice by rounding."""
    assert cpu_kernels.layer_applies(5, torch.float32, torch.device("cpu"), head_dim=16)
    prompt, tokens = list(range(5, 25)), [31, 7, 99, 4, 250]
    one_by_one, at_once = StaticKVModel(tiny_target.model), StaticKVModel(tiny_target.model)
    for kv in (one_by_one, at_once):
        kv.add_rows(1)
        kv.extend([prompt])
    singles = torch.cat([one_by_one.extend([[t]]) for t in tokens], dim=1)
    verified = at_once.extend([tokens], last=len(tokens))
    assert torch.equal(singles, verified)
    # And both agree with Hugging Face's forward to float32 rounding.
    ref = tiny_target.model(torch.tensor([prompt + tokens])).logits[:, -len(tokens):]
    torch.testing.assert_close(verified, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [32, 64])
def test_a_large_batchs_decode_step_is_bitwise_each_row_alone(tiny_target, rows, monkeypatch):
    """At 32 and 64 rows a decode step still runs the C layer (before, past 16 tokens it went to
    torch's step, 4x the time of 16 rows on the 2-core machine), so each row's logits are the
    very ones it gets decoding alone (over the same keys and values: its cache copied, as the
    prefix store copies one)."""
    assert cpu_kernels.available(), cpu_kernels.status()
    assert cpu_kernels.layer_applies(rows, torch.float32, torch.device("cpu"), head_dim=16)
    gen = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(3, 300, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 40, (rows,), generator=gen)]
    nexts = torch.randint(3, 300, (rows,), generator=gen).tolist()
    together = StaticKVModel(tiny_target.model)
    together.add_rows(rows)
    together.extend(prompts)
    calls = []
    layers = cpu_kernels.llama_layers
    monkeypatch.setattr(cpu_kernels, "llama_layers", lambda h, *a, **k: calls.append(h.shape[0])
                        or layers(h, *a, **k))
    stepped = together.extend([[t] for t in nexts])
    assert calls == [rows]          # the C layers, every layer in one call (kv.runner.run_layers)
    for i in range(rows):
        alone = StaticKVModel(tiny_target.model)
        alone.add_rows(1)
        alone.load_blocks(0, together.read_blocks(i, [0], len(prompts[i])))
        assert torch.equal(alone.extend([[nexts[i]]])[0], stepped[i]), i


def test_an_unwritable_cache_or_a_broken_compiler_falls_back_and_says_why(tmp_path, monkeypatch):
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    monkeypatch.setenv("SPECPAIR_CACHE", str(readonly / "cache"))
    cpu_kernels.library.cache_clear()
    try:
        if os.geteuid() != 0:     # root writes anywhere: the next case holds for root too
            assert not cpu_kernels.available()
            assert "PermissionError" in cpu_kernels.status()
        # A cache no one can create, root included (as CI runs): its parent is a file.
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        monkeypatch.setenv("SPECPAIR_CACHE", str(blocker / "cache"))
        cpu_kernels.library.cache_clear()
        assert not cpu_kernels.available()
        assert "NotADirectoryError" in cpu_kernels.status()
        monkeypatch.setenv("SPECPAIR_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("CC", "false")          # a compiler that fails
        cpu_kernels.library.cache_clear()
        assert not cpu_kernels.available()
        assert "false failed" in cpu_kernels.status()
        x, w = torch.randn(2, 16), torch.randn(8, 16)
        assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.available()


def test_a_model_with_a_strided_weight_takes_the_torch_step(tiny_tokenizer):
    """The C layer reads raw pointers; a transposed-in-place weight must not reach it."""
    from tiny_models import make_model
    model = make_model(tiny_tokenizer, seed=9, hidden=64, heads=4).model.eval()
    proj = model.model.layers[0].self_attn.o_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().t().contiguous().t())   # same values, strided
    assert not proj.weight.is_contiguous()
    runner.StaticLlama._by_model.pop(model, None)
    ours, ref = StaticKVModel(model), BatchedKVModel(model)
    assert not ours.runner.dense
    for kv in (ours, ref):
        kv.add_rows(1)
    torch.testing.assert_close(ours.extend([[5, 6, 7]], 3), ref.extend([[5, 6, 7]], 3), rtol=1e-4, atol=1e-4)


def test_the_join_step_script_times_both_ways(tiny_pair_dirs, capsys):
    """bench/join_step.py: one figure per prompt length and way (timings are benchmark
    figures, printed, never asserted), and bad sizes are refused."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from join_step import main

    assert main(["--target", str(tiny_pair_dirs["target"]), "--rows", "3", "--context", "5",
                 "--prompt-tokens", "4", "30", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["prompts"]) == {"4", "30"}
    assert all(set(v) == {"padded_ms", "apart_ms", "prefill_alone_ms"} and min(v.values()) > 0
               for v in out["prompts"].values())
    assert buckets.GROUP_CALL_TOKENS == 16          # put back after the padded runs
    with pytest.raises(SystemExit):
        main(["--target", str(tiny_pair_dirs["target"]), "--rows", "0"])
