"""Shared fixtures: tiny seeded models (fast) for the engine, server and gate tests."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Tests use 2 CPU threads like CI; more threads on a 2-core box only adds contention.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tiny_models import make_tokenizer
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tiny_tokenizer):
    from tiny_models import make_model
    return make_model(tiny_tokenizer, seed=1)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target):
    """Partially accepting draft: the target plus noise, one layer fewer."""
    from tiny_models import perturbed_copy
    return perturbed_copy(tiny_target, seed=5, noise=0.03)


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory, tiny_target, tiny_draft):
    """The tiny pair saved as model directories, for CLI / gate / server subprocess tests."""
    from tiny_models import save_tiny
    root = tmp_path_factory.mktemp("tiny-pair")
    return {"target": save_tiny(tiny_target, root / "target"),
            "draft": save_tiny(tiny_draft, root / "draft")}
