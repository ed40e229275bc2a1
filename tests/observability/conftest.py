"""Fixtures of the observability tests (helpers: obs_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def prometheus_bin() -> Path:
    from specpair_devcluster.prometheus import prometheus_binaries
    return prometheus_binaries()
