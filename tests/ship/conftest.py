"""Fixtures for the ship tests: the real helm, kubectl, checkov and Lua from .tools/bin, and
`helm template` renders parsed into manifests (helpers live in ship_helpers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from ship_helpers import (CHART_DIR, KUBERNETES_VERSION, RELEASE_NAMESPACE, load_manifests, render_args,
                          require_tool, run)


@pytest.fixture(scope="session")
def helm() -> Path:
    return require_tool("helm")


@pytest.fixture(scope="session")
def kubectl() -> Path:
    return require_tool("kubectl")


@pytest.fixture(scope="session")
def checkov() -> Path:
    return require_tool("checkov")


@pytest.fixture(scope="session")
def lua() -> Path:
    return require_tool("lua")


@pytest.fixture(scope="session")
def render(helm: Path) -> Callable[..., list[dict[str, Any]]]:
    """Render the chart with the given values and return the manifests (cached per values)."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def _render(values: dict[str, Any] | None = None, *, include_crds: bool = False) -> list[dict[str, Any]]:
        key = json.dumps([values, include_crds], sort_keys=True)
        if key not in cache:
            argv = [helm, "template", "ship", CHART_DIR, "--namespace", RELEASE_NAMESPACE,
                    "--kube-version", KUBERNETES_VERSION]
            if include_crds:
                argv.append("--include-crds")
            argv += render_args(values)
            result = run(argv, input=json.dumps(values) if values else None)
            cache[key] = load_manifests(result.stdout)
        return cache[key]

    return _render
