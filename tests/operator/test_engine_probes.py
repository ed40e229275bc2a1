"""The engine pods' probes let a busy engine answer late: on a loaded CPU node a serving engine's
health answer can take more than the kubelet's default second, and a liveness probe that counts
that as a failure restarts a working engine (its requests in flight fail, and so do those sent to
it while its pod is still listed Ready). Pure: the Deployments as the operator renders them."""

from __future__ import annotations

import pytest

from specpair_operator.desired import engine_objects
from specpair_operator.release import content as release

SPEC = {"target": {"source": "HuggingFaceTB/SmolLM2-135M", "revision": "abc123"}, "draft": {"drafter": "ngram"}}
PROMPTS = [{"prompt": "def f(x):", "category": "code"}]
KUBELET_DEFAULT_TIMEOUT_S = 1     # what a probe without timeoutSeconds waits


def _containers(engine: str, rollout: dict) -> list[dict]:
    spec = {**SPEC, "engine": engine} if engine == "specpair" else {**SPEC, "engine": "vllm", "vllm": {}}
    rel = release.build_release("p", "ns", spec, PROMPTS)
    dep = engine_objects.engine_deployment("p", "ns", rel, release.content_hash(rel), "1", rollout, "http://m")
    return dep["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("engine, rollout", [("specpair", {}),
                                             ("specpair", {"httpPort": 8000, "tls": {"enabled": True}}),
                                             ("vllm", {"httpPort": 8000})])
def test_a_late_health_answer_neither_restarts_an_engine_nor_unlists_it(engine, rollout):
    probed = 0
    for container in _containers(engine, rollout):
        liveness, readiness = container.get("livenessProbe"), container.get("readinessProbe")
        if liveness:
            probed += 1
            timeout = liveness.get("timeoutSeconds", KUBELET_DEFAULT_TIMEOUT_S)
            # A restart needs the process silent for most of a minute, not three late seconds.
            assert timeout >= 5 * KUBELET_DEFAULT_TIMEOUT_S, (container["name"], liveness)
            assert liveness["failureThreshold"] * liveness["periodSeconds"] >= 60, (container["name"], liveness)
            assert timeout < liveness["periodSeconds"], liveness      # one probe at a time
        if readiness:
            timeout = readiness.get("timeoutSeconds", KUBELET_DEFAULT_TIMEOUT_S)
            assert KUBELET_DEFAULT_TIMEOUT_S < timeout <= readiness["periodSeconds"], (container["name"], readiness)
            if liveness:
                assert timeout <= liveness.get("timeoutSeconds", KUBELET_DEFAULT_TIMEOUT_S), container["name"]
    assert probed >= 1
