"""The CLI: JSON output contract and clear errors (exit 2, one line, no traceback) for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specpair.prefix_cache import BLOCK_TOKENS


def specpair(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "specpair", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_generate_json_contract(tiny_pair_dirs):
    proc = specpair("generate", "--target", tiny_pair_dirs["target"], "--draft", tiny_pair_dirs["draft"],
                    "--prompt", "def foo(x):", "--max-new-tokens", "12", "--k", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("text", "token_ids", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                "acceptance_per_position", "mean_acceptance_length", "fallback_events",
                "draft_seconds", "target_seconds"):
        assert key in out, key
    assert len(out["token_ids"]) == 12
    base = json.loads(specpair("generate", "--target", tiny_pair_dirs["target"], "--no-spec", "--prompt",
                               "def foo(x):", "--max-new-tokens", "12", "--json").stdout)
    assert base["token_ids"] == out["token_ids"] and base["num_drafts"] == 0


@pytest.mark.parametrize("args, message", [
    (["--target", "/nonexistent/model"], "model path not found: /nonexistent/model"),
    (["--target", "{broken}"], "cannot read GGUF file"),
    (["--k", "0"], "--k must be >= 1"),
    (["--max-new-tokens", "100000"], "exceeds the model's context of 512"),
    (["--prompt", "   "], "empty prompt"),
    (["--draft", "{other}"], "draft and target tokenizers differ: vocabulary sizes differ"),
    (["--temperature", "-1"], "temperature must be >= 0"),
])
def test_bad_input_is_a_clear_error(tmp_path, tiny_pair_dirs, args, message, monkeypatch, capsys):
    """The command's main in this process (an exception other than the clear error would escape
    it and fail the test); the entry point's own exit is the next test's."""
    from specpair.cli import main

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    args = [a.replace("{broken}", str(broken)) for a in args]
    if "{other}" in args:
        from tiny_models import make_model, make_tokenizer, save_tiny
        args[args.index("{other}")] = save_tiny(make_model(make_tokenizer(vocab_size=350), seed=4),
                                               tmp_path / "other")
    base = {"--target": tiny_pair_dirs["target"], "--prompt": "hello", "--max-new-tokens": "4"}
    for flag in list(base):
        if flag in args:
            base.pop(flag)
    argv = ["generate", *[x for kv in base.items() for x in kv], *args]
    monkeypatch.setenv("SPECPAIR_CACHE", str(tmp_path / "cache"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err[-2000:]
    assert "Traceback" not in err


def test_the_entry_point_exits_2_with_one_line_and_no_traceback(tiny_pair_dirs):
    proc = specpair("generate", "--target", tiny_pair_dirs["target"], "--prompt", "hello", "--k", "0")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("specpair: error: --k must be >= 1"), proc.stderr[-2000:]


def test_on_mismatch_target_only_serves_and_says_so(tmp_path, tiny_pair_dirs, capsys):
    from specpair.cli import main
    from tiny_models import make_model, make_tokenizer, save_tiny
    other = save_tiny(make_model(make_tokenizer(vocab_size=350), seed=4), tmp_path / "other")
    code = main(["generate", "--target", tiny_pair_dirs["target"], "--draft", other, "--on-mismatch",
                 "target-only", "--prompt", "hello", "--max-new-tokens", "4", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "serving target-only" in out.err
    assert json.loads(out.out)["num_drafts"] == 0


@pytest.mark.slow
def test_bench_json_on_tiny_pair(tmp_path, tiny_pair_dirs):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def foo(x):", "category": "code"}\n'
                       '{"prompt": "The quick brown fox", "category": "qa"}\n')
    proc = specpair("bench", "--target", tiny_pair_dirs["target"], "--draft", tiny_pair_dirs["draft"],
                    "--prompts", str(prompts), "--raw", "--runs", "1", "--max-new-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert set(report["categories"]) == {"code", "qa"}
    for row in [*report["categories"].values(), report["overall"]]:
        for key in ("speedup", "acceptance_rate", "mean_acceptance_length", "cost_ratio", "bound",
                    "efficiency", "greedy_identity", "hf_assisted_speedup", "prompts_above_bound"):
            assert key in row, key
        assert row["greedy_identity"] == 1.0
        assert row["bound"] > 0 and row["cost_ratio"] > 0
        # Peers side by side in tokens/s, and ours over theirs.
        assert row["hf_target_tokens_per_s"] > 0 and row["hf_assisted_tokens_per_s"] > 0
        assert row["spec_vs_hf"] == pytest.approx(
            row["spec_tokens_per_s"] / row["hf_assisted_tokens_per_s"], rel=1e-2)
    # The step against this machine's memory bandwidth, measured in the same run.
    # A draft-model pair runs the paged cache (e2563ae): its pool is named beside the step.
    step = dict(report["step"])
    paged = step.pop("paged")
    assert step == {"kv_cache": "static", "compiled": False, "cpu_kernels": "built"}
    assert paged["block_positions"] == BLOCK_TOKENS and paged["blocks"] > 0
    bw = report["bandwidth"]
    assert bw["memory_gb_s"] == max(bw["read_gb_s"], bw["copy_gb_s"]) > 0
    for name in ("target", "draft"):
        f = bw[name]
        # The report rounds GB/s to 3 decimals: a tiny model's ~0.01 GB/s needs an absolute allowance.
        assert f["gb_s"] == pytest.approx(f["bytes"] / (f["step_ms"] / 1e3) / 1e9, rel=1e-2, abs=1e-3)
        assert f["fraction_of_bandwidth"] == pytest.approx(f["gb_s"] / bw["memory_gb_s"], rel=1e-2, abs=1e-3)
    assert set(report["verify_ratio"]) == set(report["costs_seconds"]["verify"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    proc = specpair("bench", "--target", tiny_pair_dirs["target"], "--drafter", "ngram", "--prompts", str(bad))
    assert proc.returncode == 2 and "line 1: not JSON" in proc.stderr
