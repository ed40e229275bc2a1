"""The operator's own check of a pair's spec against the CRD's schema, with the API server's
wording: the CRD can be bypassed (an old CRD still installed, a spec written before a rule
existed), and a spec the operator would choke on must become a Stalled condition a person can
act on, not a crash loop.

It reads the schema from the CRD the package ships (one home for the rules) and checks what
the CRD declares: required fields, types, minimum/maximum, minLength/maxLength, minItems/maxItems,
enum, pattern, and the CEL rules it knows an equivalent for.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from typing import Any, Callable

from specpair.model_fetch import (DOT_SEGMENT, LOCAL_MLFLOW_URI, REMOTE_MLFLOW_URI, mlflow_uri_is_local,
                                  mlflow_uri_leaves_its_folder)

from specpair_operator.crd import names
from specpair_operator.crd.names import METRICS_PORT
# The schema and its defaults have their home in schema.py; callers read them here too.
from specpair_operator.crd.schema import (autoscaling_with_defaults, canary_default_steps,  # noqa: F401
                                          canary_step_defaults, latency_defaults, shadow_defaults, spec_schema)

# The draft methods the specpair engine serves (n-gram lookup, a draft model, its drafting heads);
# eagle3 and mtp are vLLM's alone. The CRD's rule names the same list (a test holds them together).
SPECPAIR_METHODS = ("draft-model", "ngram", "eagle", "medusa")
# Methods vLLM has that the CRD names only to refuse them with the reason (its own rule's message):
# suffix decoding needs Arctic Inference, which the engine's vLLM environment does not build.
UNSERVED_METHODS = ("suffix",)

# CEL rules of the CRD, as Python (a rule missing here is left to the API server).
CEL_EQUIVALENTS: dict[str, Callable[[Any], bool]] = {
    "has(self.source) != has(self.drafter)": lambda o: ("source" in o) != ("drafter" in o),
    "!has(self.engine) || self.engine != 'vllm' || !has(self.speculation) || "
    "!has(self.speculation.treeWidth) || self.speculation.treeWidth == 1":
        lambda o: o.get("engine") != "vllm" or (o.get("speculation") or {}).get("treeWidth", 1) == 1,
    "!has(self.engine) || self.engine != 'vllm' || !has(self.speculation) || "
    "!has(self.speculation.lookupMinMatch) || self.speculation.lookupMinMatch == 0":
        lambda o: o.get("engine") != "vllm" or (o.get("speculation") or {}).get("lookupMinMatch", 0) == 0,
    "!has(self.engine) || self.engine != 'vllm' || !has(self.rollout) || "
    "!has(self.rollout.strategy) || !has(self.rollout.strategy.type) || "
    "self.rollout.strategy.type != 'Shadow'":
        lambda o: o.get("engine") != "vllm" or _obj(_obj(o, "rollout"), "strategy").get("type") != "Shadow",
    "(has(self.engine) && self.engine == 'vllm') || !has(self.parallelism) || "
    "((!has(self.parallelism.tensor) || self.parallelism.tensor == 1) && "
    "(!has(self.parallelism.pipeline) || self.parallelism.pipeline == 1))":
        lambda o: o.get("engine") == "vllm" or all(_obj(o, "parallelism").get(k, 1) == 1
                                                   for k in ("tensor", "pipeline")),
    "(has(self.engine) && self.engine == 'vllm') || !has(self.draft.method) || "
    "self.draft.method in ['draft-model', 'ngram', 'eagle', 'medusa']":
        lambda o: o.get("engine") == "vllm" or _obj(o, "draft").get("method", SPECPAIR_METHODS[0]) in SPECPAIR_METHODS,
    "!has(self.draft.draftTensorParallel) || self.draft.draftTensorParallel == 1 || "
    "(has(self.parallelism) && has(self.parallelism.tensor) && "
    "self.draft.draftTensorParallel == self.parallelism.tensor)":
        lambda o: _obj(o, "draft").get("draftTensorParallel", 1) in (1, _obj(o, "parallelism").get("tensor")),
    # draft: a method agrees with the drafter or the source it drafts with
    "!has(self.method) || (self.method == 'ngram') == has(self.drafter)":
        lambda o: "method" not in o or (o["method"] == "ngram") == ("drafter" in o),
    "!has(self.draftTensorParallel) || has(self.source)": lambda o: "draftTensorParallel" not in o or "source" in o,
    "!has(self.method) || self.method != 'suffix'": lambda o: o.get("method") != "suffix",
    # vllm
    "!has(self.gpuMemoryUtilization) || self.gpuMemoryUtilization > 0.0":
        lambda o: not _number(o.get("gpuMemoryUtilization")) or o["gpuMemoryUtilization"] > 0,
    # rollout.autoscaling (minReplicas as the API server sees it: its default applied first)
    "self.maxReplicas >= self.minReplicas":
        lambda o: not _number(o.get("maxReplicas")) or not _number(autoscaling_with_defaults(o)["minReplicas"])
        or o["maxReplicas"] >= autoscaling_with_defaults(o)["minReplicas"],
    "self.target > 0.0": lambda o: not _number(o.get("target")) or o["target"] > 0,
    # drift.latency: bounds of the serving-health thresholds
    "!has(self.ttftP95Ratio) || (self.ttftP95Ratio > 1.0 && self.ttftP95Ratio <= 100.0)":
        lambda o: not _number(o.get("ttftP95Ratio")) or 1.0 < o["ttftP95Ratio"] <= 100.0,
    "!has(self.tpotP95Ratio) || (self.tpotP95Ratio > 1.0 && self.tpotP95Ratio <= 100.0)":
        lambda o: not _number(o.get("tpotP95Ratio")) or 1.0 < o["tpotP95Ratio"] <= 100.0,
    "!has(self.maxErrorRate) || (self.maxErrorRate >= 0.0 && self.maxErrorRate < 1.0)":
        lambda o: not _number(o.get("maxErrorRate")) or 0.0 <= o["maxErrorRate"] < 1.0,
    "!has(self.minRequests) || (self.minRequests >= 10 && self.minRequests <= 100000)":
        lambda o: not _number(o.get("minRequests")) or 10 <= o["minRequests"] <= 100000,
    # learning: capture needs the volume it writes to, and a rate it can draw
    "!has(self.enabled) || !self.enabled || has(self.persistentVolumeClaim)":
        lambda o: o.get("enabled") is not True or "persistentVolumeClaim" in o,
    "!has(self.sampleRate) || (self.sampleRate > 0.0 && self.sampleRate <= 1.0)":
        lambda o: not _number(o.get("sampleRate")) or 0.0 < o["sampleRate"] <= 1.0,
    # learning.schedule: trains on the captured traffic, so only where there is some
    "!has(self.schedule) || (has(self.enabled) && self.enabled)":
        lambda o: "schedule" not in o or o.get("enabled") is True,
    # rollout.shadow
    "!has(self.share) || (self.share > 0.0 && self.share <= 1.0)":
        lambda o: not _number(o.get("share")) or 0.0 < o["share"] <= 1.0,
    # rollout.strategy: a canary has steps; a canary step (its share: the rule above, worded for it)
    "!has(self.type) || self.type != 'Canary' || (has(self.steps) && size(self.steps) > 0)":
        lambda o: o.get("type") != "Canary" or bool(o.get("steps")),
    "[has(self.replicas), has(self.share), has(self.weight)].filter(x, x).size() == 1":
        lambda o: sum(k in o for k in ("replicas", "share", "weight")) == 1,
    # rollout: no two of the serving, control and metrics ports are one port
    "!has(self.controlPort) || ((!has(self.port) || self.controlPort != self.port) && "
    "(!has(self.httpPort) || self.controlPort != self.httpPort) && self.controlPort != 9400)":
        lambda o: _ports(o)["controlPort"] not in (_ports(o)["port"], _ports(o)["httpPort"], METRICS_PORT),
    "!has(self.port) || ((!has(self.httpPort) || self.port != self.httpPort) && self.port != 9400)":
        lambda o: _ports(o)["port"] not in (_ports(o)["httpPort"], METRICS_PORT),
    "!has(self.httpPort) || self.httpPort != 9400": lambda o: _ports(o)["httpPort"] != METRICS_PORT,
    "!has(self.tls) || !has(self.tls.enabled) || !self.tls.enabled || "
    "!has(self.httpPort) || self.httpPort != 0":
        lambda o: not _tls_enabled(o) or _ports(o)["httpPort"] != 0,
    # target.source, draft.source: what the model-cache fill Job may download (its own rules)
    "!self.startsWith('mlflow:') || "
    f"(self.matches('{REMOTE_MLFLOW_URI}') && !self.matches('{LOCAL_MLFLOW_URI}'))":
        lambda s: not mlflow_uri_is_local(s),
    "!(self.startsWith('mlflow:') || self.startsWith('models:/') || self.startsWith('runs:/')) || "
    f"!self.matches('{DOT_SEGMENT}')":
        lambda s: not mlflow_uri_leaves_its_folder(s),
    # rollout.auth.tokenSecretRef: in the pair's namespace, and none of the Secrets the operator issues
    "!has(self.__namespace__)": lambda o: "namespace" not in o,
    " && ".join([f"!self.name.endsWith('{suffix}')" for suffix in names.OWNED_SECRET_SUFFIXES]
                + [f"self.name != '{name}'" for name in names.OWNED_SECRETS]):
        lambda o: not isinstance(o.get("name"), str) or not names.operator_owned_secret(o["name"]),
    "!has(self.key) || !(self.key in [" + ", ".join(f"'{k}'" for k in names.CERTIFICATE_KEYS) + "])":
        lambda o: o.get("key") not in names.CERTIFICATE_KEYS,
}


def _obj(o: dict[str, Any], key: str) -> dict[str, Any]:
    """o[key] where it is an object, else {} (a wrong type is reported by the type check)."""
    value = o.get(key)
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tls_enabled(rollout: dict[str, Any]) -> bool:
    return (rollout.get("tls") or {}).get("enabled") is True


def _ports(rollout: dict[str, Any]) -> dict[str, Any]:
    """The rollout's ports as the API server's CEL rules see them: defaults applied first."""
    props = spec_schema()["properties"]["rollout"]["properties"]
    return {k: rollout.get(k, props[k]["default"]) for k in ("port", "httpPort", "controlPort")}


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def _type_ok(kind: str | None, value: Any) -> bool:
    return {
        None: True, "object": isinstance(value, dict), "array": isinstance(value, list),
        "string": isinstance(value, str), "boolean": isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
    }.get(kind, True)


# The most a pair's spec may weigh, serialized as JSON. An object's annotations may hold 256 KiB
# in all (Kubernetes' limit), and the spec, golden prompts and all, lands in them more than once:
# kubectl apply's last-applied-configuration on the pair, the release (prompts included) on each
# gate and engine pod template, twice while a candidate is scored in shadow. A spec above this
# would be refused (422) on one of those writes, again at every pass; so it is refused up front.
# The CRD bounds the prompts one by one (gating.prompts: maxItems, each prompt's maxLength).
MAX_SPEC_BYTES = 96 * 1024


def _engine_limit_rules() -> dict[str, Callable[[Any], bool]]:
    """rollout.kvBudget (the specpair engine's --kv-budget, engine_objects.engine_limit_flags): its
    CEL rule, as Python (its bounds and pattern are the schema's, checked by _check).
    rollout.maxBatchSize is both engines' (vLLM's --max-num-seqs, engine_objects.vllm_command)."""
    return {
        "!has(self.engine) || self.engine != 'vllm' || !has(self.rollout) || "
        "!has(self.rollout.kvBudget)":
            lambda o: o.get("engine") != "vllm" or "kvBudget" not in _obj(o, "rollout"),
    }


CEL_EQUIVALENTS.update(_engine_limit_rules())


def spec_size_refusals(spec: Any) -> list[str]:
    """The spec's size as a violation (empty: it fits MAX_SPEC_BYTES)."""
    size = len(json.dumps(spec, separators=(",", ":"), ensure_ascii=False).encode())
    if size <= MAX_SPEC_BYTES:
        return []
    prompts = _obj(spec, "gating").get("prompts") if isinstance(spec, dict) else None
    inline = len(json.dumps(prompts, separators=(",", ":"), ensure_ascii=False).encode()) \
        if isinstance(prompts, list) else 0
    return [f"spec: Too long: the spec is {size} bytes serialized ({inline} of them inline golden prompts), "
            f"at most {MAX_SPEC_BYTES}: it is carried in annotations (kubectl's last-applied-configuration, "
            f"the release on gate and engine pods), which Kubernetes caps at 256 KiB per object; "
            f"gate on fewer or shorter golden prompts"]


# Every pass checks its pair's spec (act/reconciler), a settled pair's at each 30 s drift window:
# ~42 us of CPU on a small spec, 8-10% of a settled pass's samples at 546 pairs (2026-12-07e).
# The verdict depends on the spec's content alone (the schema and rules are the package's), so
# it is kept by a digest of that content (its pickle: equal bytes are equal JSON values, types
# included) and the spec is checked again only when its content changes. At most VERDICTS_KEPT
# verdicts are kept (a pair's spec each, and its edits), the oldest dropped first.
VERDICTS_KEPT = 4096
_verdicts: dict[bytes, tuple[str, ...]] = {}


def validate_spec(spec: Any) -> list[str]:
    """Every violation, each as the API server words it (empty: valid); a new list each call."""
    try:
        key = hashlib.blake2b(pickle.dumps(spec, pickle.HIGHEST_PROTOCOL), digest_size=16).digest()
    except Exception:  # noqa: BLE001  (a value pickle refuses cannot come from JSON: checked, not kept)
        return checked_spec(spec)
    verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _verdicts[key] = tuple(checked_spec(spec))
        while len(_verdicts) > VERDICTS_KEPT:
            del _verdicts[next(iter(_verdicts))]
    return list(verdict)


def checked_spec(spec: Any) -> list[str]:
    """validate_spec's verdict, checked afresh."""
    errors: list[str] = []
    _check(spec, spec_schema(), "spec", errors)
    errors += spec_size_refusals(spec) if not errors else []   # the operator's own bound, past the CRD's
    from specpair_operator.crd.engine_limits import (
                                                     refusals)  # it reads this module's CRD defaults: imported at the call
    errors += refusals(spec) if not errors else []  # what the pair's engine cannot do (engine_limits.py)
    return errors


def _check(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    kind = schema.get("type")
    if not _type_ok(kind, value):
        got = "object" if isinstance(value, dict) else "array" if isinstance(value, list) else \
            "boolean" if isinstance(value, bool) else "string" if isinstance(value, str) else \
            "integer" if isinstance(value, int) else "number" if isinstance(value, float) else "null"
        errors.append(f'{path}: Invalid value: "{got}": {path} in body must be of type {kind}: "{got}"')
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: Unsupported value: {_show(value)}: supported values: "
                      + ", ".join(_show(v) for v in schema["enum"]))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: Invalid value: {_show(value)}: {path} in body should be greater than or equal to "
                          f"{schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: Invalid value: {_show(value)}: {path} in body should be less than or equal to "
                          f"{schema['maximum']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: Invalid value: {_show(value)}: {path} in body should be at least "
                          f"{schema['minLength']} chars long")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: Too long: may not be more than {schema['maxLength']} bytes")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: Invalid value: {_show(value)}: {path} in body should match '{schema['pattern']}'")
    if isinstance(value, dict):
        for name in schema.get("required") or []:
            if name not in value:
                errors.append(f"{path}.{name}: Required value")
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                _check(value[name], sub, f"{path}.{name}", errors)
    # Rules on objects and on strings (a model source's own) alike; the API server shows a
    # string's value, not an object's.
    for rule in schema.get("x-kubernetes-validations") or []:
        check = CEL_EQUIVALENTS.get(rule["rule"])
        if check is not None and not check(value):
            shown = f"{_show(value)}: " if isinstance(value, str) else ""
            errors.append(f'{path}: Invalid value: {shown}{rule.get("message") or rule["rule"]}')
    if isinstance(value, list) and "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
    if isinstance(value, list) and "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{path}: Invalid value: {len(value)}: {path} in body should have at least "
                      f"{schema['minItems']} items")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", errors)
