"""Skips that depend on the machine: a missing tool or a kernel feature the test needs. Locally
such a test is skipped, saying why; under CI (SPECPAIR_CI, set by scripts/test.sh, which installs
and builds everything the suite needs) it fails instead, so a check cannot switch itself off
where it is meant to run. The vLLM tests follow the same rule through SPECPAIR_REQUIRE_VLLM
(conftest.py)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def skip_unless_ci(why: str) -> NoReturn:
    """Skip the test with `why`; under CI, fail it with `why`."""
    if os.environ.get("SPECPAIR_CI"):
        pytest.fail(why + "; SPECPAIR_CI is set (scripts/test.sh), so this is a failure, not a skip",
                    pytrace=False)
    pytest.skip(why)
