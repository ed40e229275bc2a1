"""The one-command demo end to end, on tiny models: a real control plane (devcluster), real
MLflow, the operator as the helm chart's Deployment pod, gate Jobs and engine Deployments run by
the devcluster node from what the operator wrote.

The tiny target is built so a model draft pays on CPU whatever the machine's timing noise: its
first layer does the work and seven more (wide) layers cost time but add nothing (their output
projections are zero), and the draft is that first layer alone (so it agrees with the target). So the
gate finds speculation worth it, the engine speculates, and a draft overwritten with noise
(the demo's bad-draft chapter) shows up as an acceptance collapse the operator acts on, while
traffic in a category the gate never measured is reported as a traffic shift and left alone.
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


# Six tokens a golden prompt: each gate's k and batch sweeps decode a few hundred times, and
# nothing here asks how much speculation pays (the demo's pairs name a speedup floor of 0, so
# speculation stays on whatever a busy machine's timing says: releases.THRESHOLDS). One breaching
# window per drift ladder step (the demo's two are for watching it): the same ladder, two windows
# sooner.
@pytest.mark.timeout(900)
def test_demo_gates_serves_shifts_drifts_and_rolls_back_on_tiny_models(cheap_draft_pair, tmp_path):
    target, draft = cheap_draft_pair
    out = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo.run_demo", "--target", target, "--draft", draft, "--out", str(out),
         "--max-new-tokens", "16", "--gate-tokens", "6", "--answers", "1", "--timeout", "720",
         "--step-timeout", "300", "--drift-breaches", "1", "--no-shadow"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=750)
    except subprocess.TimeoutExpired:
        proc.terminate()   # SIGTERM: the demo stops its cluster, MLflow and pods before exiting
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout[-4000:] + stderr[-3000:]
    run = next(out.iterdir())
    summary = json.loads((run / "summary.json").read_text())
    history = summary["status"]["history"]
    actions = [h["action"] for h in history]
    # v1 promoted, v2 promoted, then the drift ladder on v2: speculation off, roll back to v1.
    assert actions.count("Promoted") == 2, actions
    assert actions.index("SpeculationOff") < actions.index("RolledBack"), actions
    assert summary["status"]["servingVersion"] == "1"
    assert summary["verdicts"]["2"]["passed"] and summary["verdicts"]["2"]["acceptanceRate"] > 0.5
    # The traffic shift: counted, not judged, no action.
    shift = summary["driftChapter"]["trafficShift"]
    assert shift["category"] not in summary["verdicts"]["2"]["categories"], shift
    assert shift["trafficShift"].get(shift["category"], 0) > 0, shift
    assert shift["actions"] == [] and shift["speculationEnabled"] is True, shift
    # ... while the gated categories beside it were judged: a window with live acceptance for one
    # (the chapter may also end on its time limit, which would leave "not judged" unproven).
    assert set(shift["liveAcceptance"] or {}) & set(summary["verdicts"]["2"]["categories"]), shift
    # The bad draft: rolled back on evidence, citing the previous release's gated numbers.
    drift = summary["drift"]
    assert drift["drafted"] > 0 and drift["acceptance"] < summary["verdicts"]["2"]["acceptanceRate"] - 0.15, drift
    rollback = next(h for h in history if h["action"] == "RolledBack")
    assert "the previous release does better" in rollback["reason"], rollback
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "RolledBack" in page and "SpeculationOff" in page and "Traffic shift" in page
    # Every pod process is gone: nothing listens on any engine pod's address any more.
    import socket
    assert summary["engineAddresses"]
    for address in summary["engineAddresses"]:
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((host, int(port))) != 0, address
