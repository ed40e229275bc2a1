"""The one-command demo end to end, on tiny models: real MLflow, the API emulator, the real
operator process, the real gate and engine processes run by the demo's local runtime.

The tiny target is built so a model draft pays on CPU whatever the machine's timing noise: its
first layer does the work and seven more (wide) layers cost time but add nothing (their output
projections are zero), and the draft is that first layer alone (so it agrees with the target). So the
gate finds speculation worth it, the engine speculates, and a draft overwritten with noise
(the demo's degraded-draft drift) shows up as an acceptance collapse the operator acts on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cheap_draft_pair(tmp_path_factory):
    import torch

    from tiny_models import make_model, make_tokenizer, perturbed_copy, save_tiny

    root = tmp_path_factory.mktemp("demo-models")
    target = make_model(make_tokenizer(), seed=3, layers=8, hidden=512)
    with torch.no_grad():
        for layer in target.model.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft = perturbed_copy(target, seed=7, noise=0.0, layers=1)
    return save_tiny(target, root / "target"), save_tiny(draft, root / "draft")


@pytest.mark.timeout(480)
def test_demo_gates_serves_drifts_and_rolls_back_on_tiny_models(cheap_draft_pair, tmp_path):
    target, draft = cheap_draft_pair
    out = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "-m", "demo.run_demo", "--target", target, "--draft", draft, "--out", str(out),
         "--max-new-tokens", "16", "--gate-tokens", "12", "--answers", "1", "--timeout", "420",
         "--step-timeout", "240"],
        cwd=REPO, capture_output=True, text=True, timeout=450,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    run = next(out.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    actions = [h["action"] for h in summary["status"]["history"]]
    # v1 promoted, v2 promoted, then the drift ladder on v2: speculation off, roll back to v1.
    assert actions.count("Promoted") == 2, actions
    assert actions.index("SpeculationOff") < actions.index("RolledBack"), actions
    assert summary["status"]["servingVersion"] == "1"
    assert summary["verdicts"]["2"]["passed"] and summary["verdicts"]["2"]["acceptanceRate"] > 0.5
    drift = summary["drift"]
    assert drift["drafted"] > 0 and drift["acceptance"] < summary["verdicts"]["2"]["acceptanceRate"] - 0.15, drift
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "RolledBack" in page and "SpeculationOff" in page
    # Every child process is gone: nothing listens on the engine port any more.
    import socket
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", summary["enginePort"])) != 0
