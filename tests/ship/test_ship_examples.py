"""examples/ are valid against the CRD's own openAPIV3Schema (and its CEL rules), the Kubernetes
schemas for built-in kinds, and each other (a pair's ConfigMap exists and holds good prompts)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from ship_helpers import KUBERNETES_VERSION, REPO_ROOT
from specpair_operator.crd.validation import CEL_EQUIVALENTS

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))
CRD = yaml.safe_load((REPO_ROOT / "crds" / "specmodelpair.yaml").read_text())


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in EXAMPLES for doc in yaml.safe_load_all(path.read_text()) if doc]


def _pairs() -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name, doc in _documents() if doc["kind"] == "SpecModelPair"]


def _served_schema() -> dict[str, Any]:
    (version,) = [v for v in CRD["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]


def _cel_violations(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    problems = []
    # The CEL rules (x-kubernetes-validations) the API server would run, as the Python predicates
    # the operator checks specs with (their one home). A rule without one fails the test, so a
    # new rule in the CRD cannot slip past the examples unchecked.
    for rule in schema.get("x-kubernetes-validations", []):
        check = CEL_EQUIVALENTS.get(rule["rule"])
        if check is None:
            problems.append(f"{path or '/'}: no Python twin for CEL rule {rule['rule']!r}; add it to "
                            "CEL_EQUIVALENTS (operator/specpair_operator/crd/validation.py)")
        elif not check(value):
            problems.append(f"{path or '/'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                problems += _cel_violations(sub, value[key], f"{path}/{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += _cel_violations(schema["items"], item, f"{path}/{i}")
    return problems


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The API server prunes unknown fields of a structural schema; reject them instead, so a
    typo in an example fails here rather than being silently dropped on apply."""
    schema = copy.deepcopy(schema)

    def visit(node: dict[str, Any]) -> None:
        if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        for sub in node.get("properties", {}).values():
            visit(sub)
        if isinstance(node.get("items"), dict):
            visit(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            visit(node["additionalProperties"])
    visit(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def validate_pair(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(_strict(_served_schema()))
    errors = [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    return errors + _cel_violations(_served_schema(), doc)


def test_every_kind_of_example_is_there():
    pairs = dict((doc["metadata"]["name"], doc) for _, doc in _pairs())
    assert pairs["default"]["spec"] == {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}
    assert any(p["spec"]["draft"].get("drafter") == "ngram" and p["spec"].get("gating", {}).get("configMapRef")
               for p in pairs.values())
    assert any("source" in p["spec"]["draft"] for p in pairs.values()), "no model-draft (tokenizer mismatch) pair"
    assert any(p["spec"].get("rollout", {}).get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
               for p in pairs.values()), "no example shows GPU requests"


@pytest.mark.parametrize("name,doc", _pairs(), ids=[f"{n}:{d['metadata']['name']}" for n, d in _pairs()])
def test_pair_matches_the_crd_schema(name, doc):
    assert doc["apiVersion"] == f"{CRD['spec']['group']}/{_served_version()}"
    assert validate_pair(doc) == []


def _served_version() -> str:
    return next(v["name"] for v in CRD["spec"]["versions"] if v.get("storage"))


BROKEN = [
    ("both draft source and drafter", lambda s: s["draft"].update(source="x"), "set exactly one of draft.source and draft.drafter"),
    ("neither draft source nor drafter", lambda s: s.update(draft={}), "set exactly one"),
    ("unknown drafter", lambda s: s["draft"].update(drafter="eagle"), "'eagle' is not one of ['ngram']"),
    ("k out of range", lambda s: s.update(speculation={"k": 0}), "/spec/speculation/k"),
    ("typo in a field", lambda s: s.update(speculaton={"k": 4}), "speculaton"),
    ("acceptance above 1", lambda s: s.update(gating={"thresholds": {"minCategoryAcceptance": {"code": 1.5}}}),
     "/spec/gating/thresholds/minCategoryAcceptance/code"),
    ("no target", lambda s: s.pop("target"), "'target' is a required property"),
    ("token tree on vLLM", lambda s: s.update(engine="vllm", speculation={"treeWidth": 2}),
     "speculation.treeWidth above 1 needs engine specpair"),
    ("lookup first on vLLM", lambda s: s.update(engine="vllm", speculation={"lookupMinMatch": 2}),
     "speculation.lookupMinMatch needs engine specpair"),
]


@pytest.mark.parametrize("mutate,expected", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_schema_check_rejects_broken_pairs(mutate, expected):
    doc = copy.deepcopy(dict(_pairs())["default-pair.yaml"])
    mutate(doc["spec"])
    errors = validate_pair(doc)
    assert any(expected in e for e in errors), errors


def test_builtin_kinds_are_valid_kubernetes():
    builtins = [(n, d) for n, d in _documents() if d["kind"] != "SpecModelPair"]
    assert builtins, "expected the golden-prompts ConfigMap"
    for name, doc in builtins:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_configmap_references_resolve_to_good_prompts():
    configmaps = {d["metadata"]["name"]: d for _, d in _documents() if d["kind"] == "ConfigMap"}
    referenced = [p["spec"]["gating"]["configMapRef"] for _, p in _pairs() if "configMapRef" in p["spec"].get("gating", {})]
    assert referenced, "no pair references a golden-prompts ConfigMap"
    key_default = _served_schema()["properties"]["spec"]["properties"]["gating"]["properties"]["configMapRef"]["properties"]["key"]["default"]
    for ref in referenced:
        assert ref["name"] in configmaps, f"ConfigMap {ref['name']} is not in examples/"
        text = configmaps[ref["name"]]["data"][ref.get("key", key_default)]
        prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
        assert len(prompts) >= 5
        for prompt in prompts:
            assert set(prompt) == {"prompt", "category"} and prompt["prompt"].strip() and prompt["category"]
        categories = {p["category"] for p in prompts}
        pair = next(p for _, p in _pairs() if p["spec"].get("gating", {}).get("configMapRef") == ref)
        thresholds = pair["spec"]["gating"].get("thresholds", {}).get("minCategoryAcceptance", {})
        assert set(thresholds) <= categories, f"thresholds for categories without prompts: {set(thresholds) - categories}"

