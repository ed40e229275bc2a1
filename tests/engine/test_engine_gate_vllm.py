"""`specpair gate` on a release vLLM serves (release.engine.kind: vllm): real vLLM servers from
their own virtualenv (scripts/setup-vllm.sh), the same verdict contract as our engine's gate,
judged by the operator's own verdict check.

Marked `vllm` (conftest: skipped where the vLLM virtualenv is absent unless SPECPAIR_REQUIRE_VLLM
is set, as in CI).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from specpair.errors import SpecpairError

PROMPTS = [{"prompt": "one two three one two three one two", "category": "extraction"},
           {"prompt": "abc abc abc abc", "category": "extraction"},
           {"prompt": "Hello there", "category": "chat"}]


def vllm_release(target: str, draft: dict, **gating) -> dict:
    return {"pair": "tiny", "namespace": "t", "target": {"source": target}, "draft": draft,
            "speculation": {"k": 3}, "engine": {"image": "x", "kind": "vllm", "dtype": "float32"},
            "gating": {"prompts": PROMPTS, "maxNewTokens": 12,
                       "thresholds": {"requireGreedyIdentity": True, "minAcceptance": 0.0,
                                      "minCategoryAcceptance": {}, "minSpeedup": 0.0}, **gating}}


@pytest.fixture(scope="module")
def vllm_tiny_target(tmp_path_factory) -> str:
    """A tiny random Llama vLLM's CPU attention runs: head_dim 64 (it refuses 16)."""
    from tiny_models import make_model, make_tokenizer, save_tiny
    return save_tiny(make_model(make_tokenizer(), seed=1, hidden=128, heads=2),
                     tmp_path_factory.mktemp("vllm-tiny") / "target")


@pytest.mark.vllm
def test_vllm_gate_runs_the_golden_prompts_through_real_vllm_and_writes_our_verdict(vllm_tiny_target, tmp_path):
    from specpair.decoding import SpeculativeEngine
    from specpair.config import GenerationParams
    from specpair.models import load_model
    from specpair_operator.gate_verdict import evaluate_verdict

    release = vllm_release(vllm_tiny_target, {"drafter": "ngram"})
    path, out = tmp_path / "release.json", tmp_path / "verdict.json"
    path.write_text(json.dumps(release))
    # The CLI the gate Job runs (through the operator's gate runner).
    done = subprocess.run([sys.executable, "-m", "specpair", "gate", "--release", str(path), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = json.loads(out.read_text())
    golden = json.loads((tmp_path / "golden_outputs.json").read_text())
    assert verdict["engine"] == "vllm" and verdict["tokenizer"]["compatible"] is True
    # fp32 greedy: vLLM with n-gram speculation emits exactly what vLLM target-only does ...
    assert verdict["greedyIdentity"] == 1.0 and all(g["identical"] for g in golden)
    assert set(verdict["categories"]) == {"extraction", "chat"}
    # ... and vLLM's own counters saw drafts on the repetitive prompts.
    assert verdict["meanAcceptanceLength"] >= 1.0 and 0.0 <= verdict["acceptanceRate"] <= 1.0
    assert sum(g["draft_tokens"] for g in golden) > 0
    assert verdict["speedup"] > 0 and verdict["passed"] is True
    # What vLLM generated is what our engine generates for the same prompt ids (target-only).
    target = load_model(vllm_tiny_target, device="cpu")
    ours = SpeculativeEngine(target)
    for g in golden:
        res = ours.generate([g["prompt"]], GenerationParams(max_new_tokens=12), chat=True, speculate=False)[0]
        assert res.token_ids == g["token_ids"], g["prompt"]
    # The operator judges it as any verdict.
    assert evaluate_verdict(verdict, release["gating"]["thresholds"]).passed


def test_vllm_gate_fails_a_mismatched_draft_before_starting_vllm(tiny_pair_dirs, tmp_path, monkeypatch):
    """No vLLM needed: the tokenizers are compared from their files first, so a draft with
    another tokenizer fails without a server ever starting (a missing vLLM would raise)."""
    from tiny_models import make_model, make_tokenizer, save_tiny
    from specpair.gate import run_gate

    other = save_tiny(make_model(make_tokenizer(vocab_size=300), seed=3), tmp_path / "other")
    monkeypatch.setenv("SPECPAIR_VLLM_PYTHON", "/nonexistent/python")
    started = time.monotonic()
    verdict, golden = run_gate(vllm_release(tiny_pair_dirs["target"], {"source": other}), progress=lambda *_: None)
    assert verdict["passed"] is False and verdict["tokenizer"]["compatible"] is False
    assert verdict["reasons"][0].startswith("tokenizer mismatch") and golden == []
    assert time.monotonic() - started < 60


def test_vllm_gate_needs_the_target_as_a_model_directory(tmp_path, monkeypatch):
    from specpair.gate.vllm import run_gate_vllm

    monkeypatch.setattr("specpair.gate.vllm.tokenizer_check", lambda release, progress: {"compatible": True})
    with pytest.raises(SpecpairError, match="local model directory"):
        run_gate_vllm(vllm_release("some-org/some-model", {"drafter": "ngram"}), progress=lambda *_: None)


def test_both_gate_servers_run_the_target_as_the_release_serves_it(tiny_pair_dirs, monkeypatch):
    """Target-only and speculative servers alike get the release's parallel sizes and serving
    settings (the same flags its engine pods get), and its context length where it names one."""
    import specpair.vllm_peer as peer
    from specpair.gate.vllm import run_gate_vllm

    started: list[list[str]] = []

    class Stop(Exception):
        pass

    class Recording(peer.VllmServer):
        def start(self):
            started.append(self.command())
            raise Stop

    monkeypatch.setattr(peer, "VllmServer", Recording)
    monkeypatch.setattr("specpair.gate.vllm.tokenizer_check", lambda release, progress: {"compatible": True})
    rel = vllm_release(tiny_pair_dirs["target"], {"drafter": "ngram"})
    rel["parallelism"] = {"tensor": 2, "pipeline": 1}
    rel["engine"].update(gpuMemoryUtilization=0.8, maxModelLen=1024, kvCacheDtype="fp8")
    with pytest.raises(Stop):
        run_gate_vllm(rel, progress=lambda *_: None, python="/py")
    (cmd,) = started
    flags = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
    assert (flags["--tensor-parallel-size"], flags["--pipeline-parallel-size"], flags["--gpu-memory-utilization"],
            flags["--kv-cache-dtype"], flags["--dtype"]) == ("2", "1", "0.8", "fp8", "float32")
    assert cmd.count("--max-model-len") == 1 and flags["--max-model-len"] == "1024"
