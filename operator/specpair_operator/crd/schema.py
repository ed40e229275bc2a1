"""The CRD's schema of a pair's spec as the package ships it (specmodelpair.crd.yaml, the one
home of the rules and defaults), the defaults read from it, and the plain reads of a spec that
several stages share. A leaf of crd/: the spec's check (validation.py) and the limits of each
engine (engine_limits.py, autoscaling_signals.py) read it, and it reads none of them."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any

import yaml


@lru_cache(maxsize=1)
def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((resources.files("specpair_operator.crd") / "specmodelpair.crd.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def autoscaling_with_defaults(autoscaling: dict[str, Any]) -> dict[str, Any]:
    """rollout.autoscaling with the CRD's defaults applied (their one home), as the API server
    sees it once it has defaulted the object."""
    props = spec_schema()["properties"]["rollout"]["properties"]["autoscaling"]["properties"]
    return {**{k: sub["default"] for k, sub in props.items() if "default" in sub}, **autoscaling}


def shadow_defaults() -> dict[str, Any]:
    """spec.rollout.shadow's defaults as the CRD declares them (their one home)."""
    props = spec_schema()["properties"]["rollout"]["properties"]["shadow"]["properties"]
    return {k: sub["default"] for k, sub in props.items() if "default" in sub}


def latency_defaults() -> dict[str, Any]:
    """spec.drift.latency's defaults as the CRD declares them (their one home)."""
    props = spec_schema()["properties"]["drift"]["properties"]["latency"]["properties"]
    return {k: sub["default"] for k, sub in props.items() if "default" in sub}


def canary_default_steps() -> list[dict[str, Any]]:
    """The rollout.strategy.steps a Canary runs when the spec gives none (the CRD's default)."""
    return list(spec_schema()["properties"]["rollout"]["properties"]["strategy"]["properties"]["steps"]["default"])


def canary_step_defaults() -> dict[str, Any]:
    """A rollout.strategy.steps item's defaults as the CRD declares them (their one home)."""
    props = spec_schema()["properties"]["rollout"]["properties"]["strategy"]["properties"]["steps"]["items"]["properties"]
    return {k: sub["default"] for k, sub in props.items() if "default" in sub}



def has_gpu(rollout: dict[str, Any]) -> bool:
    """Whether the rollout's resources ask for a GPU (any `*/gpu` request or limit above 0)."""
    limits = {**((rollout.get("resources") or {}).get("requests") or {}),
              **((rollout.get("resources") or {}).get("limits") or {})}
    return any(name.endswith("/gpu") and str(v) not in ("0", "") for name, v in limits.items())
