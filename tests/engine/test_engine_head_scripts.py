"""The measuring scripts of the drafters' work: teacher-forced agreement (bench/head_agreement.py)
tells a head that predicts the target from one that does not; the drafters' table
(bench/bench_drafters.py) reads bench reports as `specpair bench` writes them; the n-gram
replay (bench/ngram_ceiling.py) counts greedy rounds as the engine runs them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from head_builders import eagle_head, mirror_head

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_drafters import main as bench_drafters_main, table  # noqa: E402
from head_agreement import agreement, main as head_agreement_main  # noqa: E402
from head_probe import FeatureReader, columns, fused_head, parse_variant  # noqa: E402
from ngram_ceiling import main as ngram_ceiling_main, replay  # noqa: E402


def test_agreement_tells_a_predicting_head_from_a_random_one(one_layer_target):
    torch.manual_seed(0)
    conversations = [(torch.randint(3, 300, (40,)).tolist(), 10) for _ in range(4)]
    mirror = agreement(one_layer_target, mirror_head(one_layer_target).model, conversations)
    noise = agreement(one_layer_target, eagle_head(one_layer_target, seed=3).model, conversations)
    assert mirror["tokens"] == noise["tokens"] == 4 * 30     # reply tokens only
    assert mirror["rate"] > 0.5 > noise["rate"]


def test_chain_agreement_counts_runs_of_right_drafts(one_layer_target):
    """--depth: step d counts chains right at every step up to d; tokens per pass is one plus
    the mean run. A head that nearly is the target keeps long runs; a random one does not."""
    torch.manual_seed(0)
    conversations = [(torch.randint(3, 300, (40,)).tolist(), 10) for _ in range(4)]
    mirror = mirror_head(one_layer_target).model
    one = agreement(one_layer_target, mirror, conversations)
    chain = agreement(one_layer_target, mirror, conversations, depth=3)
    assert chain["rate_per_step"][0] == one["rate"] and chain["tokens"] == one["tokens"]
    rates = chain["rate_per_step"]
    # every chain that starts in a reply has a first draft; each later step loses the last chain
    # of every conversation (its token is past the text). The mean run is the right drafts of
    # all steps over the chains started.
    reached = [chain["tokens"] - d * len(conversations) for d in range(3)]
    runs = sum(r * n for r, n in zip(rates, reached))
    assert len(rates) == 3 and chain["tokens_per_pass"] == pytest.approx(1 + runs / reached[0], abs=1e-3)
    noise = agreement(one_layer_target, eagle_head(one_layer_target, seed=3).model, conversations, depth=3)
    assert chain["tokens_per_pass"] > 1.5 > noise["tokens_per_pass"] >= 1.0


def test_the_probe_reads_the_last_feature_as_head_agreement_does(one_layer_target):
    """The probe's reader (it reads fused layers too) gives agreement the same first columns and
    the same count as the target's own last feature: the probe's figures mean the same thing."""
    torch.manual_seed(0)
    conversations = [(torch.randint(3, 300, (40,)).tolist(), 10) for _ in range(4)]
    mirror = mirror_head(one_layer_target).model
    reader = FeatureReader(one_layer_target, [0])
    D = one_layer_target.model.config.hidden_size
    try:
        assert reader(conversations[0][0]).shape == (40, 2 * D)     # the last feature, then layer 0's
        cols = columns(reader, [], D)
        probe = agreement(one_layer_target, mirror, conversations,
                          read=lambda ids: reader(ids)[None, :, cols])
        reference = agreement(one_layer_target, mirror, conversations)
        # a fused head at its start reads layer 0's columns too, and drafts as the plain one
        fused = agreement(one_layer_target, fused_head(mirror, 1), conversations,
                          read=lambda ids: reader(ids)[None])
    finally:
        reader.close()
    assert probe == fused == reference


def test_a_fused_head_starts_as_the_plain_head(one_layer_target):
    """fc is zero on the other layers' columns: whatever those features hold, step 0 of a fused
    probe is the plain head, so a difference after training is the fusion's."""
    head = mirror_head(one_layer_target).model
    torch.manual_seed(1)
    embeds, features = torch.randn(2, 9, head.config.hidden_size), torch.randn(2, 9, head.config.hidden_size)
    plain = head(embeds, features)
    fused = fused_head(head, 2)
    other = torch.randn(2, 9, 2 * head.config.hidden_size) * 50
    assert torch.allclose(fused(embeds, torch.cat([features, other], dim=-1)), plain, atol=1e-5)


def test_probe_variants_are_parsed_and_unknown_settings_refused():
    name, settings = parse_variant("fused:aux=2+15,noise=0.3")
    assert name == "fused" and settings["aux"] == [2, 15] and settings["noise"] == 0.3
    assert parse_variant("base")[1] == {"aux": [], "noise": None, "wd": 0.01, "freeze": "",
                                           "steps": None}
    with pytest.raises(ValueError, match="unknown setting"):
        parse_variant("x:dropout=0.1")


def _report(speedup: float) -> dict:
    row = {"speedup": speedup, "mean_acceptance_length": 1.5, "acceptance_per_position": [0.4, 0.2],
           "cost_ratio": 0.08, "greedy_identity": 1.0, "prompts": 2}
    return {"categories": {"code": row}, "overall": row}


def test_the_table_has_a_row_per_drafter_and_a_column_per_category():
    lines = table({"chain": _report(1.1), "tree of 2": _report(1.25)}).splitlines()
    assert lines[0].startswith("| drafter | code | overall |")
    assert lines[3] == ("| tree of 2 | 1.25x (len 1.50) | 1.25x (len 1.50) | 0.40 0.20 | 0.080 "
                        "| 2/2 |")


def test_a_config_without_a_name_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench_drafters_main(["--out", str(tmp_path), "--config=--drafter ngram"])


def test_replayed_rounds_follow_the_engine_and_the_ceiling_takes_the_best_match():
    from specpair.drafters import NgramDrafter

    # prompt 7 1 2 8 1 3 | reply 1 2 8 5. Round 1: "3" never occurred: no match, one token.
    # Round 2 (context ends "1"): the latest "1" is followed by 3 (wrong, 1 token kept by the
    # engine's lookup); the earlier one by 2 8 (right: 2 kept + 1). Round 3 ("1 2"): one match.
    ids, start = [7, 1, 2, 8, 1, 3, 1, 2, 8, 5], 6
    rounds = replay(NgramDrafter(), ids, start, k=4)
    assert rounds == {"rounds": 3, "no_match": 1, "lookup": 4, "ceiling": 6}
    assert rounds["lookup"] == len(ids) - start        # the engine's rounds write the reply once


def test_a_real_greedy_run_accepts_what_the_replay_says(tiny_target):
    """The replay's acceptance equals the engine's own count on the same reply (greedy)."""
    from specpair.config import GenerationParams, SpeculationConfig
    from specpair.decoding import SpeculativeEngine
    from specpair.drafters import NgramDrafter

    engine = SpeculativeEngine(tiny_target, drafter=NgramDrafter(),
                               speculation=SpeculationConfig(k=3, dynamic_k=False, fallback_threshold=0))
    prompt = engine.encode("the cat sat on the mat and the cat sat on the hat", chat=False)
    batch = engine.new_batch()
    seq = batch.add(prompt, GenerationParams(max_new_tokens=40))
    while batch.active:
        batch.step()
    assert seq.stats.num_accepted_tokens > 0           # drafts were kept: rounds differ from steps
    rounds = replay(NgramDrafter(), prompt + seq.generated, len(prompt), k=3)
    assert rounds["lookup"] == len(seq.generated)
    assert rounds["rounds"] == seq.stats.num_target_steps


def test_the_ceiling_script_reads_distills_replies(tmp_path, tiny_pair_dirs, tiny_target, capsys):
    import json

    from specpair.decoding import encode_prompt

    prompt = "repeat after me: red green blue red green blue"
    ids = encode_prompt(tiny_target.tokenizer, prompt, chat=True)
    reply = ids[-6:] * 2                      # a reply that copies from its prompt
    path = tmp_path / "replies.jsonl"
    path.write_text(json.dumps({"kind": "extraction", "prompt": prompt, "ids": ids + reply}) + "\n")
    assert ngram_ceiling_main(["--target", str(tiny_pair_dirs["target"]), "--replies", str(path),
                               "--k", "2", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["kinds"]["extraction"]
    assert out["replies"] == 1 and set(row) == {"k=2", "k=4"}
    assert row["k=4"]["lookup_length"] > 1 and row["k=4"]["ceiling_length"] >= row["k=4"]["lookup_length"]
    with pytest.raises(SystemExit):
        ngram_ceiling_main(["--target", str(tiny_pair_dirs["target"]), "--replies", str(path),
                            "--kinds", "code"])


def test_the_agreement_script_spreads_over_distills_replies(tmp_path, tiny_pair_dirs, tiny_target,
                                                            capsys):
    """--stride takes every Nth conversation of a replies file (they are ordered by prompt
    length), --limit the first N of those; agreement counts their reply tokens only."""
    import json

    from specpair.decoding import encode_prompt
    from specpair.heads import save_head

    head_dir = tmp_path / "head"
    save_head(eagle_head(tiny_target, seed=1).model, head_dir, tiny_target.tokenizer, {"target": "tiny"})
    rows = []
    for i in range(6):
        prompt = f"question number {i}: " + "why " * i
        ids = encode_prompt(tiny_target.tokenizer, prompt, chat=True)
        rows.append({"kind": "qa", "prompt": prompt, "ids": ids + list(range(10, 13 + i))})
    path = tmp_path / "replies.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--target", str(tiny_pair_dirs["target"]), "--head", str(head_dir),
            "--replies", str(path)]
    assert head_agreement_main(args + ["--stride", "2", "--limit", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 3 + 5    # conversations 0 and 2
    with pytest.raises(SystemExit):
        head_agreement_main(args + ["--stride", "0"])
