"""What the devcluster's vLLM tests share (test_operator_vllm.py, and the run script of
docs/measurements/2026-12-07f-vllm-deepseek-mtp-tp2):
the vLLM engine image on the nodes, a vLLM pair's spec, and readings of its status and pods. A
module, not conftest: a test file imports the fixture it uses (pytest finds it there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_test_env import VLLM_TEST_ENV

VLLM_IMAGE = "specpair/engine-vllm:test"
PROMPTS = [{"prompt": "one two three one two three one two", "category": "extraction"},
           {"prompt": "abc abc abc abc abc", "category": "extraction"},
           {"prompt": "Hello there", "category": "chat"}]
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def vllm_image(devcluster) -> None:
    """The vLLM engine image on the nodes: our package (python -m specpair.vllm_serve, the gate
    runner and `specpair gate`) beside vLLM (its own virtualenv here; one environment in the
    real image)."""
    from specpair.vllm_peer import default_python
    from specpair_devcluster.node_agent import LocalImage, project_programs

    devcluster.images.images["specpair/engine-vllm"] = LocalImage(
        ["python"], programs=project_programs(sys.executable),
        env={"SPECPAIR_VLLM_PYTHON": str(default_python()),
             "SPECPAIR_GATE_COMMAND": f"{sys.executable} -m specpair gate", **VLLM_TEST_ENV})


def vllm_pair(name: str, target: str, draft: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": name},
            "spec": {"engine": "vllm", "vllm": {"dtype": "float32"}, "target": {"source": target}, "draft": draft,
                     "speculation": {"k": 3},
                     "gating": {"prompts": PROMPTS, "maxNewTokens": MAX_NEW_TOKENS,
                                "thresholds": {"minAcceptance": 0.0, "minSpeedup": 0.0}},
                     "rollout": {"image": VLLM_IMAGE, "httpPort": 8000, "progressDeadlineSeconds": 900},
                     "drift": {"intervalSeconds": 1, "windowSeconds": 10, "minRequests": 2, "minDraftedTokens": 5,
                               "probeAfterWindows": 1000, "ladder": ["SpeculationOff"]}}}


def cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def start_seconds(pod: dict[str, Any]) -> float:
    """From the pod's start to its Ready condition: a vLLM start (CI's budget), as the node saw it."""
    from datetime import datetime
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    at = lambda text: datetime.fromisoformat(text.replace("Z", "+00:00"))  # noqa: E731
    return round((at(ready["lastTransitionTime"]) - at(pod["status"]["startTime"])).total_seconds(), 1)


def gate_record_of_vllm_v1(mlflow_url: str, model: str, workdir: Path) -> tuple[Any, str, dict, list[dict]]:
    """The gate's record of a vLLM pair's v1 as MLflow holds it (the client, the gate run's id, its
    verdict and golden outputs), with what every vLLM gate must show: vLLM judged it with a
    compatible tokenizer, every golden prompt (PROMPTS, in order) came out exactly as target-only
    did (fp32 greedy), and vLLM's own counters saw drafts."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_url)
    run_id = client.get_model_version(model, "1").tags["specpair.gate.run_id"]
    gate = Path(client.download_artifacts(run_id, "gate", str(workdir)))
    verdict = json.loads((gate / "verdict.json").read_text())
    golden = json.loads((gate / "golden_outputs.json").read_text())
    assert verdict["engine"] == "vllm" and verdict["tokenizer"]["compatible"] is True, verdict["tokenizer"]
    assert verdict["greedyIdentity"] == 1.0 and all(g["identical"] for g in golden), golden
    assert [g["prompt"] for g in golden] == [p["prompt"] for p in PROMPTS], golden
    assert sum(g["draft_tokens"] for g in golden) > 0, golden
    return client, run_id, verdict, golden
