"""A release: the immutable content of one SpecModelPair spec, and its content hash.

The release is what the gate Job is handed (as JSON; docs/operator.md, "Gating") and what the MLflow
registry stores as one model version. Only fields that change what is served or how it is judged
go into the hash: the models (and how the draft drafts), speculation, gating, the engine image (a
new image is new code: it is gated again) and its settings, and how the target is split over GPUs
(parallelism). Replicas, placement and drift policy do not, so scaling a pair never creates a new
release. Settings a pair leaves out are left out of the release too, unless every release carries
them, so releases made before a setting existed keep their content hashes.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from specpair.config import release_speculation_defaults
from specpair.contract import (DEFAULT_CATEGORY, DEFAULT_MIN_SPEEDUP, GOLDEN_STRUCTURE_KEYS,
                               MLFLOW_SOURCE_PREFIXES, content_hash, parallelism, tuning_given)
from specpair.vllm_peer import VLLM_FLAGS

__all__ = ["build_release", "content_hash", "effective_model_name", "with_mlflow", "parse_prompt_lines",
           "builtin_prompts", "describe_release", "release_tags"]

HASH_PREFIX_LEN = 12

SPECULATION_DEFAULTS = release_speculation_defaults()
THRESHOLD_DEFAULTS = {
    "requireGreedyIdentity": True,
    "minAcceptance": 0.0,
    "minCategoryAcceptance": {},
    # No minSpeedup: absent, the gate holds a release to contract.DEFAULT_MIN_SPEEDUP within the
    # noise it measured, and ships it with speculation off where it falls short.
}
DEFAULT_MAX_NEW_TOKENS = 32
# The engine image when a pair names none and the installation names none either. The CRD has
# no default (a persisted default would pin every pair to one registry): the operator resolves
# an absent spec.rollout.image here, into the release and so into its content hash.
ENGINE_IMAGE = "ghcr.io/specpair/engine:0.1.0"
_default_image = ENGINE_IMAGE


def set_default_engine_image(image: str | None) -> None:
    """The installation's engine image (the chart's engine.image, SPECPAIR_ENGINE_IMAGE), set once
    at operator startup. Changing it is a new release for every pair that names no image."""
    global _default_image
    _default_image = (image or "").strip() or ENGINE_IMAGE


def default_engine_image() -> str:
    return _default_image


def effective_model_name(name: str, namespace: str, spec: dict[str, Any]) -> str:
    """The registered model name: spec.mlflow.modelName, or NAMESPACE.NAME. A namespace has no
    dots, so the first dot splits it off and two pairs never share a default name (with a dash,
    `a-b/c` and `a/b-c` would both be `a-b-c`)."""
    given = ((spec.get("mlflow") or {}).get("modelName") or "").strip()
    return given or f"{namespace}.{name}"


def _model_ref(ref: dict[str, Any] | None) -> dict[str, Any]:
    ref = dict(ref or {})
    if ref.get("drafter"):
        # A drafter names its method (the CRD allows no other): a method that repeats it is dropped.
        return {"drafter": ref["drafter"]}
    out = {"source": ref.get("source"), "revision": ref.get("revision")}
    out.update({key: ref[key] for key in ("method", "draftTensorParallel") if ref.get(key) is not None})
    return out


def _parallelism(spec: dict[str, Any]) -> dict[str, Any]:
    """{"parallelism": {tensor, pipeline}} when the target is split over devices, else nothing:
    a release on one device carries no block (and keeps the hash it had before the field existed)."""
    split = parallelism(spec)
    return {"parallelism": split} if any(n != 1 for n in split.values()) else {}


def build_release(
    name: str,
    namespace: str,
    spec: dict[str, Any],
    prompts: list[dict[str, Any]],
    default_image: str | None = None,
) -> dict[str, Any]:
    """The release JSON for a spec, with defaults filled the same way the CRD fills them.

    `prompts` are the golden prompts already resolved (inline, from the ConfigMap, or the
    engine's built-in set), so the hash changes when the prompts do. The image is the spec's,
    else `default_image`, else the installation's (default_engine_image()).
    """
    gating = spec.get("gating") or {}
    thresholds = {**THRESHOLD_DEFAULTS, **(gating.get("thresholds") or {})}
    thresholds["minCategoryAcceptance"] = dict(sorted((thresholds.get("minCategoryAcceptance") or {}).items()))
    return {
        "pair": name,
        "namespace": namespace,
        "target": _model_ref(spec.get("target")),
        "draft": _model_ref(spec.get("draft")),
        "speculation": {**SPECULATION_DEFAULTS, **(spec.get("speculation") or {})},
        "engine": _engine(spec, default_image),
        **_parallelism(spec),
        "gating": {
            "prompts": [
                golden_prompt(p) for p in prompts
            ],
            "maxNewTokens": int(gating.get("maxNewTokens") or DEFAULT_MAX_NEW_TOKENS),
            "thresholds": thresholds,
            **_tuning(gating),
        },
    }


def _tuning(gating: dict[str, Any]) -> dict[str, Any]:
    """The gate's sweeps where the spec names them (contract.TUNING_DEFAULTS otherwise, filled in
    by the gate): none of the block where it names neither, so older releases keep their hashes."""
    tuning = tuning_given(gating)
    return {"tuning": tuning} if tuning else {}


def _engine(spec: dict[str, Any], default_image: str | None) -> dict[str, Any]:
    """The engine block: image, and for vLLM its kind, dtype and the spec.vllm settings the pair
    sets (vllm_peer.serving_flags turns each into vLLM's flag). A specpair release carries no
    kind, so releases made before vLLM existed keep their content hash (and are not re-gated)."""
    engine: dict[str, Any] = {"image": str((spec.get("rollout") or {}).get("image") or default_image or _default_image)}
    if spec.get("engine", "specpair") == "vllm":
        settings = spec.get("vllm") or {}
        engine.update({key: settings[key] for key in VLLM_FLAGS if settings.get(key) is not None})
        engine.update(kind="vllm", dtype=str(settings.get("dtype") or "auto"))
    return engine


def engine_kind(release: dict[str, Any]) -> str:
    return str((release.get("engine") or {}).get("kind") or "specpair")


def reads_from_mlflow(release: dict[str, Any]) -> bool:
    """Whether serving the release downloads a model from MLflow (and so needs its credentials)."""
    sources = [str((release.get(side) or {}).get("source") or "") for side in ("target", "draft")]
    return any(s.startswith(MLFLOW_SOURCE_PREFIXES) for s in sources)


def with_mlflow(release: dict[str, Any], tracking_uri: str, model_name: str, version: str) -> dict[str, Any]:
    """The release as handed to the gate: plus where to log and which version it is."""
    out = copy.deepcopy(release)
    out["mlflow"] = {"trackingUri": tracking_uri, "modelName": model_name, "version": str(version)}
    return out


def golden_prompt(item: dict[str, Any]) -> dict[str, Any]:
    """One golden prompt as the release carries it: its text and category, and the structure it
    asks for (response_format, tools, ...) only where it asks, so plain prompts hash as before."""
    return {"prompt": item["prompt"], "category": item.get("category") or DEFAULT_CATEGORY,
            **{key: item[key] for key in GOLDEN_STRUCTURE_KEYS if item.get(key) is not None}}


def parse_prompt_lines(text: str) -> list[dict[str, Any]]:
    """Golden prompts from a ConfigMap value: JSON lines, or one JSON array."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        items = json.loads(text)
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    prompts = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f"golden prompt #{i} has no 'prompt' string")
        prompts.append(golden_prompt(item))
    return prompts


def builtin_prompts() -> list[dict[str, Any]]:
    """The engine's default golden prompts (package data of `specpair`; reading them imports
    only `specpair/__init__`, which is torch-free). Used when a pair names no prompts."""
    from importlib import resources

    text = (resources.files("specpair") / "prompts" / "default.jsonl").read_text(encoding="utf-8")
    return parse_prompt_lines(text)


def describe_release(release: dict[str, Any], digest: str) -> str:
    """A model-version description a person can read in the MLflow UI (markdown)."""
    def ref(r: dict[str, Any]) -> str:
        if r.get("drafter"):
            return f"model-free drafter `{r['drafter']}`"
        rev = f" @ `{r['revision']}`" if r.get("revision") else ""
        method = f" ({r['method']})" if r.get("method") else ""
        return f"`{r.get('source')}`{rev}{method}"

    spec = release["speculation"]
    gating = release["gating"]
    th = gating["thresholds"]
    cats = ", ".join(f"{c} >= {v}" for c, v in th["minCategoryAcceptance"].items()) or "none"
    prompts = f"{len(gating['prompts'])} inline" if gating["prompts"] else "built-in set"
    return "\n".join(
        [
            f"Speculative-decoding release of pair `{release['namespace']}/{release['pair']}`.",
            "",
            f"- target: {ref(release['target'])}",
            f"- draft: {ref(release['draft'])}",
            f"- speculation: k={spec['k']}, dynamic k={spec['dynamicK']}, "
            f"fallback below {spec['fallbackThreshold']}, off at batch >= {spec['batchSizeThreshold']}"
            + (f", token tree of {spec['treeWidth']} candidates a position" if spec.get("treeWidth", 1) > 1 else "")
            + (f", prompt lookup first where the last {spec['lookupMinMatch']}+ tokens repeat"
               if spec.get("lookupMinMatch", 0) > 0 else ""),
            *([f"- parallelism: tensor {release['parallelism']['tensor']} x pipeline "
               f"{release['parallelism']['pipeline']}"] if release.get("parallelism") else []),
            f"- golden prompts: {prompts}, {gating['maxNewTokens']} new tokens each",
            f"- thresholds: greedy identity {'required' if th['requireGreedyIdentity'] else 'not required'}, "
            f"acceptance >= {th['minAcceptance']}, per category: {cats}, speedup >= "
            + (f"{th['minSpeedup']}" if th.get("minSpeedup") is not None else
               f"{DEFAULT_MIN_SPEEDUP} within the gate's measured noise (else speculation off)"),
            f"- content hash: `{digest}`",
        ]
    )


def release_tags(release: dict[str, Any], digest: str) -> dict[str, str]:
    """Model-version tags (strings only, as MLflow stores them)."""
    tags = {
        "specpair.content_hash": digest,
        "specpair.pair": f"{release['namespace']}/{release['pair']}",
        "specpair.target.source": str(release["target"].get("source")),
        "specpair.target.revision": str(release["target"].get("revision") or ""),
        "specpair.speculation": json.dumps(release["speculation"], sort_keys=True),
        "specpair.gate.status": "pending",
    }
    if release["draft"].get("drafter"):
        tags["specpair.draft.drafter"] = release["draft"]["drafter"]
    else:
        tags["specpair.draft.source"] = str(release["draft"].get("source"))
        tags["specpair.draft.revision"] = str(release["draft"].get("revision") or "")
    return tags
