"""`specpair gate` on a release vLLM serves (release.engine.kind: vllm), up to the point where
it would start vLLM: a mismatched draft fails from the tokenizer files alone, the target must be a
model directory, and both gate servers get the release's serving flags. The gate run through real
vLLM servers end to end, its verdict and golden outputs checked against our engine's, is
tests/operator/test_operator_vllm.py (the gate Job of a vLLM release on the real control plane).
"""

from __future__ import annotations

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
