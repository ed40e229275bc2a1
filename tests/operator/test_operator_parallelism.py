"""Targets over several GPUs: spec.parallelism, spec.vllm's serving settings and the draft's
method, from the CRD through the release (and its content hash) to the pods' GPU requests; and
the specpair engine's refusal of what it cannot serve, by the API server and by the operator's
own check in the same words.

Decisions are tables (no server); the refusals are proven on the real API server with the CRD
the chart ships. That vLLM accepts the flags a release renders is proven against vLLM's own
parser in tests/engine/test_engine_vllm_serve.py.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from typing import Any

import pytest
import yaml

from cluster_env import REPO, kubectl, wait_until
from specpair.contract import PARALLELISM_KEYS
from specpair.vllm_peer import PARALLELISM_FLAGS, VLLM_FLAGS, VLLM_METHODS
from specpair_devcluster.client import ApiError
from specpair_operator.desired import engine_objects, gate_objects, manifests
from specpair_operator.release import content as release
from specpair_operator.crd.validation import (CEL_EQUIVALENTS, SPECPAIR_METHODS, UNSERVED_METHODS, spec_schema,
                                               validate_spec)

PROMPTS = [{"prompt": "def fib(n):", "category": "code"}]
SPEC = {"target": {"source": "meta-llama/Llama-3.1-70B-Instruct"},
        "draft": {"source": "meta-llama/Llama-3.1-8B-Instruct"}}
VLLM_SPEC = {**SPEC, "engine": "vllm"}
NGRAM_SPEC = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}}


def _with(spec: dict[str, Any], **change: Any) -> dict[str, Any]:
    """spec with each top-level key of `change` merged into its block (a dict) or set."""
    out = copy.deepcopy(spec)
    for key, value in change.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# The CRD's messages, read from the CRD (the one home of their words).
def _message(starts: str) -> str:
    found = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(r["message"] for r in node.get("x-kubernetes-validations") or []
                         if r["message"].startswith(starts))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)
    visit(spec_schema())
    (message,) = found
    return message


PARALLEL_NEEDS_VLLM = "parallelism.tensor and parallelism.pipeline above 1 need engine vllm"
METHOD_NEEDS_VLLM = "draft.method eagle3 and mtp need engine vllm"
DRAFT_TP = "draft.draftTensorParallel must be 1 or parallelism.tensor"
NGRAM_METHOD = "draft.method ngram goes with draft.drafter ngram"
DRAFT_TP_NEEDS_MODEL = "draft.draftTensorParallel needs a draft model"
GPU_SHARE = "vllm.gpuMemoryUtilization must be above 0"
SUFFIX_UNSERVED = ("draft.method suffix (vLLM's suffix decoding) is not served: vLLM 0.32 runs it through Arctic "
                   "Inference (the arctic-inference package), which PyPI has as source only")

# (name, spec, the CRD message that refuses it, or None: accepted)
CASES = [
    ("specpair, one device", _with(SPEC, parallelism={"tensor": 1, "pipeline": 1}), None),
    ("specpair, tensor 2", _with(SPEC, parallelism={"tensor": 2}), PARALLEL_NEEDS_VLLM),
    ("specpair, pipeline 2", _with(SPEC, parallelism={"pipeline": 2}), PARALLEL_NEEDS_VLLM),
    ("specpair named, tensor 4", _with(SPEC, engine="specpair", parallelism={"tensor": 4}), PARALLEL_NEEDS_VLLM),
    ("vllm, tensor 4 x pipeline 2", _with(VLLM_SPEC, parallelism={"tensor": 4, "pipeline": 2}), None),
    ("specpair, eagle", _with(SPEC, draft={"method": "eagle"}), None),
    ("specpair, medusa", _with(SPEC, draft={"method": "medusa"}), None),
    ("specpair, draft-model", _with(SPEC, draft={"method": "draft-model"}), None),
    ("specpair, ngram", _with(NGRAM_SPEC, draft={"method": "ngram"}), None),
    ("specpair, eagle3", _with(SPEC, draft={"method": "eagle3"}), METHOD_NEEDS_VLLM),
    ("specpair, mtp", _with(SPEC, draft={"method": "mtp"}), METHOD_NEEDS_VLLM),
    ("vllm, eagle3", _with(VLLM_SPEC, draft={"method": "eagle3"}), None),
    ("vllm, mtp on the target's checkpoint", _with(VLLM_SPEC, draft={"source": SPEC["target"]["source"],
                                                                      "method": "mtp"}), None),
    ("ngram method with a model", _with(VLLM_SPEC, draft={"method": "ngram"}), NGRAM_METHOD),
    ("eagle method with the ngram drafter", _with(NGRAM_SPEC, draft={"method": "eagle"}), NGRAM_METHOD),
    ("vllm, draft TP 1 under tensor 4", _with(VLLM_SPEC, parallelism={"tensor": 4},
                                             draft={"draftTensorParallel": 1}), None),
    ("vllm, draft TP = tensor", _with(VLLM_SPEC, parallelism={"tensor": 4}, draft={"draftTensorParallel": 4}), None),
    ("vllm, draft TP 2 under tensor 4", _with(VLLM_SPEC, parallelism={"tensor": 4},
                                             draft={"draftTensorParallel": 2}), DRAFT_TP),
    ("vllm, draft TP 2 with no tensor", _with(VLLM_SPEC, draft={"draftTensorParallel": 2}), DRAFT_TP),
    ("draft TP of an ngram drafter", _with(NGRAM_SPEC, engine="vllm", draft={"draftTensorParallel": 1}),
     DRAFT_TP_NEEDS_MODEL),
    ("vllm settings", _with(VLLM_SPEC, vllm={"gpuMemoryUtilization": 0.9, "maxModelLen": 8192,
                                             "quantization": "fp8", "kvCacheDtype": "fp8_e4m3"}), None),
    ("all of a GPU's memory", _with(VLLM_SPEC, vllm={"gpuMemoryUtilization": 1}), None),
    ("none of a GPU's memory", _with(VLLM_SPEC, vllm={"gpuMemoryUtilization": 0}), GPU_SHARE),
    ("vllm, suffix", _with(VLLM_SPEC, draft={"method": "suffix"}), SUFFIX_UNSERVED),
]


@pytest.mark.parametrize("spec, refusal", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_operators_check_refuses_what_the_crd_refuses(spec, refusal):
    errors = validate_spec(spec)
    if refusal is None:
        assert errors == []
    else:
        assert errors and all(_message(refusal) in e for e in errors), errors


@pytest.mark.parametrize("spec, path", [
    (_with(VLLM_SPEC, parallelism={"tensor": 0}), "spec.parallelism.tensor"),
    (_with(VLLM_SPEC, parallelism={"pipeline": "two"}), "spec.parallelism.pipeline"),
    (_with(VLLM_SPEC, vllm={"gpuMemoryUtilization": 1.5}), "spec.vllm.gpuMemoryUtilization"),
    (_with(VLLM_SPEC, vllm={"maxModelLen": 0}), "spec.vllm.maxModelLen"),
    (_with(VLLM_SPEC, vllm={"quantization": "fp8 --trust-remote-code"}), "spec.vllm.quantization"),
    (_with(VLLM_SPEC, vllm={"kvCacheDtype": ""}), "spec.vllm.kvCacheDtype"),
    (_with(VLLM_SPEC, draft={"method": "lookahead"}), "spec.draft.method"),
    (_with(VLLM_SPEC, draft={"draftTensorParallel": 0}), "spec.draft.draftTensorParallel"),
])
def test_out_of_range_settings_are_refused_by_the_schema(spec, path):
    errors = validate_spec(spec)
    assert any(e.startswith(path + ": ") for e in errors), errors


def test_the_lists_the_crd_names_are_the_ones_the_code_maps():
    props = spec_schema()["properties"]
    # Every method the CRD offers has vLLM's name, and the specpair rule names our engine's own.
    # suffix: named only to be refused with its reason (UNSERVED_METHODS).
    assert props["draft"]["properties"]["method"]["enum"] == list(VLLM_METHODS) + list(UNSERVED_METHODS)
    (rule,) = [r for r in CEL_EQUIVALENTS if "self.draft.method in" in r]
    assert re.findall(r"'([-a-z0-9]+)'", rule.split(" in ")[1]) == list(SPECPAIR_METHODS)
    assert set(SPECPAIR_METHODS) < set(VLLM_METHODS)
    # Every vLLM setting reaches a flag (dtype is passed on its own), and so does every split.
    assert set(props["vllm"]["properties"]) == {"dtype", *VLLM_FLAGS}
    assert tuple(props["parallelism"]["properties"]) == PARALLELISM_KEYS == tuple(PARALLELISM_FLAGS)


# -- the release ---------------------------------------------------------------------------------

def _hash(spec: dict[str, Any]) -> str:
    return release.content_hash(release.build_release("p", "ns", spec, PROMPTS))


@pytest.mark.parametrize("spec", [SPEC, VLLM_SPEC, NGRAM_SPEC], ids=["specpair", "vllm", "ngram"])
def test_a_pair_without_the_new_fields_keeps_its_releases_shape_and_hash(spec):
    """What a pair leaves out is left out of the release: a release made before these fields
    existed has the same content, so the same hash (and is not gated again)."""
    rel = release.build_release("p", "ns", spec, PROMPTS)
    assert set(rel) == {"pair", "namespace", "target", "draft", "speculation", "engine", "gating"}
    assert set(rel["engine"]) == ({"image", "kind", "dtype"} if spec.get("engine") == "vllm" else {"image"})
    assert set(rel["draft"]) in ({"source", "revision"}, {"drafter"})
    # Saying the defaults out loud is the same release.
    said = _with(spec, parallelism={"tensor": 1, "pipeline": 1})
    if "drafter" in spec["draft"]:
        said["draft"]["method"] = "ngram"
    assert _hash(said) == _hash(spec)


@pytest.mark.parametrize("change", [
    {"parallelism": {"tensor": 4}},
    {"parallelism": {"pipeline": 2}},
    {"draft": {"method": "eagle3"}},
    {"draft": {"method": "draft-model"}},
    {"draft": {"draftTensorParallel": 1}},
    {"vllm": {"gpuMemoryUtilization": 0.85}},
    {"vllm": {"maxModelLen": 8192}},
    {"vllm": {"quantization": "fp8"}},
    {"vllm": {"kvCacheDtype": "fp8"}},
], ids=json.dumps)
def test_each_setting_is_part_of_the_release_and_its_hash(change):
    """A changed split or serving setting is a new release: gated again before it serves."""
    base = _hash(VLLM_SPEC)
    changed = _with(VLLM_SPEC, **change)
    assert _hash(changed) != base
    rel = release.build_release("p", "ns", changed, PROMPTS)
    (key, value), = change.items()
    block = {"parallelism": rel.get("parallelism"), "draft": rel["draft"], "vllm": rel["engine"]}[key]
    assert all(block[k] == v for k, v in value.items())


def test_a_split_is_written_whole_and_only_where_it_splits():
    rel = release.build_release("p", "ns", _with(VLLM_SPEC, parallelism={"pipeline": 2}), PROMPTS)
    assert rel["parallelism"] == {"tensor": 1, "pipeline": 2}
    assert _hash(_with(VLLM_SPEC, parallelism={"pipeline": 2})) == \
        _hash(_with(VLLM_SPEC, parallelism={"tensor": 1, "pipeline": 2}))
    assert "parallelism" not in release.build_release("p", "ns", _with(VLLM_SPEC, parallelism={}), PROMPTS)


def test_vllm_settings_of_a_specpair_pair_are_not_part_of_its_release():
    """spec.vllm configures vLLM only: changing it must not re-gate a pair our engine serves."""
    assert _hash(_with(SPEC, vllm={"maxModelLen": 4096, "dtype": "float16"})) == _hash(SPEC)


# -- the pods ------------------------------------------------------------------------------------

def _rendered(spec: dict[str, Any], resources: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    rollout = {"image": "img:1", **({"resources": resources} if resources is not None else {})}
    rel = release.build_release("p", "ns", {**spec, "rollout": rollout}, PROMPTS)
    digest = release.content_hash(rel)
    dep = engine_objects.engine_deployment("p", "ns", rel, digest, "1", rollout, "http://m")
    job = gate_objects.gate_job("p", "ns", rel, digest, "1", rollout, "http://m")
    return dep["spec"]["template"]["spec"], job["spec"]["template"]["spec"]


@pytest.mark.parametrize("tensor, pipeline", [(2, 1), (4, 1), (2, 2), (1, 3)])
def test_a_split_target_asks_for_tensor_times_pipeline_gpus_in_engine_and_gate_pods(tensor, pipeline):
    spec = _with(VLLM_SPEC, parallelism={"tensor": tensor, "pipeline": pipeline})
    resources = {"requests": {"cpu": "8", "nvidia.com/gpu": 1}, "limits": {"memory": "200Gi", "nvidia.com/gpu": 1}}
    for pod in _rendered(spec, resources):
        container, *companion = pod["containers"]      # an engine pod's companion holds no GPU
        assert [c["resources"] for c in companion] in ([], [{"requests": manifests.COMPANION_REQUESTS}])
        assert container["resources"]["limits"] == {"memory": "200Gi", "nvidia.com/gpu": tensor * pipeline}
        assert container["resources"]["requests"] == {"cpu": "8", "nvidia.com/gpu": tensor * pipeline}
        # The workers' shared memory: a memory-backed /dev/shm, not the runtime's 64 MiB.
        shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shm) == 1 and shm[0]["emptyDir"]["sizeLimit"] == manifests.SHM_SIZE_LIMIT
        assert {"name": shm[0]["name"], "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert resources["limits"]["nvidia.com/gpu"] == 1   # the pair's own spec is not changed


def test_one_device_or_no_gpu_keeps_the_pairs_resources_as_they_are():
    for spec, resources in ((VLLM_SPEC, {"limits": {"nvidia.com/gpu": 2}}),
                            (SPEC, {"limits": {"nvidia.com/gpu": 1}}),
                            (_with(VLLM_SPEC, parallelism={"tensor": 2}), {"limits": {"cpu": "16"}})):
        for pod in _rendered(spec, resources):
            container = pod["containers"][0]
            assert container["resources"] == resources
            assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"]) is \
                bool(spec.get("parallelism"))
    for pod in _rendered(_with(VLLM_SPEC, parallelism={"tensor": 2}), None):
        assert "resources" not in pod["containers"][0]


# -- on the real API server ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def crd(devcluster):
    """The CRD the chart ships, applied as a platform engineer would (kubectl apply)."""
    done = kubectl(devcluster, "apply", "-f", str(REPO / "crds" / "specmodelpair.yaml"))
    assert done.returncode == 0, done.stderr

    def served() -> bool:
        try:
            devcluster.kube.list("specpair.io/v1alpha1", "SpecModelPair", "default")
            return True
        except ApiError:
            return False
    wait_until("the SpecModelPair CRD to be served", served, timeout=60)


def _pair(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "specpair.io/v1alpha1", "kind": "SpecModelPair", "metadata": {"name": name},
            "spec": copy.deepcopy(spec)}


@pytest.mark.parametrize("spec, refusal", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_api_server_refuses_what_the_operator_refuses_in_the_same_words(crd, ns, spec, refusal):
    name = f"p-{uuid.uuid4().hex[:6]}"
    if refusal is None:
        stored = ns.create(_pair(name, spec))["spec"]
        # Nothing the pair says is pruned on the way in (a field missing from the schema would be).
        for key in ("parallelism", "vllm"):
            assert all(stored[key][k] == v for k, v in spec.get(key, {}).items())
        assert all(stored["draft"][k] == v for k, v in spec["draft"].items())
        return
    with pytest.raises(ApiError) as err:
        ns.create(_pair(name, spec))
    assert err.value.status == 422 and _message(refusal) in err.value.message, err.value.message
    ours = validate_spec(spec)
    assert ours, f"the operator's check let through what the API server refused: {err.value.message}"
    for message in ours:
        assert message.split(": Invalid value: ", 1)[1] in err.value.message, (message, err.value.message)
    assert ns.pair(name) == {}


@pytest.mark.parametrize("change, refusal", [
    ({"parallelism": {"tensor": 2}}, PARALLEL_NEEDS_VLLM),
    ({"draft": {"method": "mtp"}}, METHOD_NEEDS_VLLM),
], ids=["tensor 2", "mtp"])
def test_kubectl_apply_of_what_our_engine_cannot_serve_is_refused_with_the_reason(crd, ns, devcluster, change, refusal):
    name = f"big-{uuid.uuid4().hex[:6]}"
    bad = _pair(name, _with(SPEC, **change))
    bad["metadata"]["namespace"] = ns.name
    done = kubectl(devcluster, "apply", "-f", "-", input=yaml.safe_dump(bad))
    assert done.returncode != 0
    assert _message(refusal) in " ".join(done.stderr.split()), done.stderr
    assert ns.pair(name) == {}
    # The same pair on vLLM is taken.
    good = copy.deepcopy(bad)
    good["spec"]["engine"] = "vllm"
    done = kubectl(devcluster, "apply", "-f", "-", input=yaml.safe_dump(good))
    assert done.returncode == 0, done.stderr
    assert ns.pair(name)["spec"]["engine"] == "vllm"


def test_the_api_server_takes_the_engine_and_gate_pods_of_a_split_target(ns, devcluster):
    """The rendered Deployment and gate Job (4 GPUs, the memory-backed /dev/shm), as the API
    server validates them (a server-side dry run: nothing is scheduled)."""
    rollout = {"image": "img:1", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    rel = release.build_release("p", ns.name, _with(VLLM_SPEC, parallelism={"tensor": 2, "pipeline": 2},
                                                    rollout=rollout), PROMPTS)
    digest = release.content_hash(rel)
    for obj in (engine_objects.engine_deployment("p", ns.name, rel, digest, "1", rollout, "http://m"),
                gate_objects.gate_job("p", ns.name, rel, digest, "1", rollout, "http://m")):
        done = kubectl(devcluster, "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(obj))
        assert done.returncode == 0, done.stderr
        container = json.loads(done.stdout)["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
