"""checkov on the objects the operator creates for a pair (not in the chart: rendered by
operator/specpair_operator/desired/manifests.py): the engine Deployment, Service and NetworkPolicy, the
gate Job and its NetworkPolicy, the engine's TLS Secret."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ship_helpers import run

# Every skip, with its reason. Nothing else may fail.
SKIPS = {
    # The engine image is what the user names (the pair's spec.rollout.image or the chart's
    # engine.image): a digest when they pin one. The operator never picks an image itself.
    "CKV_K8S_43": "image digest: the image is the user's spec.rollout.image / engine.image",
    # Engine images are gigabytes and releases name immutable images: IfNotPresent by default,
    # spec.rollout.imagePullPolicy: Always where a cluster wants the pull-time credential check.
    "CKV_K8S_15": "IfNotPresent is the default on purpose; spec.rollout.imagePullPolicy sets Always",
}


def _tls_secret() -> dict[str, Any]:
    from specpair_operator.desired import engine_objects, gate_objects, manifests, tls
    ca = tls.new_ca()
    leaf = tls.issue(ca, "chat-engine", tls.engine_dns_names("chat-engine", "team"), server=True, days=1)
    return manifests.engine_tls_secret("chat", "team", leaf.cert_pem, leaf.key_pem, ca.cert_pem)


def _objects(with_policies: bool = True) -> dict[str, dict[str, Any]]:
    """A pair as docs/operator.md writes one: models, and resources for its GPU pool. (A pair with
    no spec.rollout.resources also fails CKV_K8S_10..13: the operator cannot size models it has
    not loaded, so it invents no requests.)"""
    from specpair_operator.desired import engine_objects, gate_objects, manifests
    from specpair_operator.release import content as release

    spec = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc123"}, "draft": {"drafter": "ngram"}}
    rollout = {"resources": {"requests": {"cpu": "4", "memory": "16Gi"},
                             "limits": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 1}}}
    rel = release.build_release("chat", "team", spec, [{"prompt": "def f():", "category": "code"}])
    digest = release.content_hash(rel)
    defaults = manifests.PodDefaults(image_pull_secrets=("regcred",))
    objects = {
        "engine-deployment": engine_objects.engine_deployment("chat", "team", rel, digest, "1", rollout, "http://m",
                                                         defaults=defaults),
        "engine-service": engine_objects.engine_service("chat", "team", rollout),
        "gate-job": gate_objects.gate_job("chat", "team", rel, digest, "1", rollout, "http://m", defaults=defaults),
        # The engine's control-listener certificate Secret, with a real certificate and key.
        "engine-tls-secret": _tls_secret(),
    }
    if with_policies:
        objects["engine-networkpolicy"] = engine_objects.engine_network_policy("chat", "team", defaults)
        objects["gate-networkpolicy"] = gate_objects.gate_network_policy("chat", "team")
    return objects


def _checkov(checkov: Path, objects: dict[str, dict[str, Any]], where: Path) -> dict[str, Any]:
    where.mkdir()
    for name, obj in objects.items():
        (where / f"{name}.yaml").write_text(yaml.safe_dump(obj))
    result = run([checkov, "-d", where, "--framework", "kubernetes", "--compact", "--quiet", "--output", "json",
                  "--skip-check", ",".join(SKIPS)], check=False, timeout=300)
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    return {"failed": [(c["check_id"], c["resource"]) for r in reports
                       for c in r.get("results", {}).get("failed_checks", [])],
            "passed": sum(r.get("summary", {}).get("passed", 0) for r in reports),
            "parsing_errors": sum(r.get("summary", {}).get("parsing_errors", 0) for r in reports),
            "returncode": result.returncode}


def test_checkov_finds_nothing_in_the_objects_the_operator_creates(checkov, tmp_path):
    report = _checkov(checkov, _objects(), tmp_path / "pair")
    assert report["parsing_errors"] == 0 and report["passed"] > 100, report
    assert report["failed"] == [] and report["returncode"] == 0, report
    # The same pods without their NetworkPolicies fail CKV2_K8S_6: the scan sees the policies.
    bare = _checkov(checkov, _objects(with_policies=False), tmp_path / "bare")
    assert {check for check, _ in bare["failed"]} == {"CKV2_K8S_6"} and len(bare["failed"]) == 2, bare
