"""The measuring scripts of the heads' work: teacher-forced agreement (scripts/head_agreement.py)
tells a head that predicts the target from one that does not; the drafters' table
(scripts/bench_drafters.py) reads bench reports as `specpair bench` writes them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_engine_eagle import _head, _mirror_head, one_layer_target  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_drafters import main as bench_drafters_main, table  # noqa: E402
from head_agreement import agreement  # noqa: E402


def test_agreement_tells_a_predicting_head_from_a_random_one(one_layer_target):
    torch.manual_seed(0)
    conversations = [(torch.randint(3, 300, (40,)).tolist(), 10) for _ in range(4)]
    mirror = agreement(one_layer_target, _mirror_head(one_layer_target).model, conversations)
    noise = agreement(one_layer_target, _head(one_layer_target, seed=3).model, conversations)
    assert mirror["tokens"] == noise["tokens"] == 4 * 30     # reply tokens only
    assert mirror["rate"] > 0.5 > noise["rate"]


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
