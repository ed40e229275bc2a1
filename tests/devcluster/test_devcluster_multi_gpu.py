"""A target split over several GPUs, placed by the real scheduler on nodes with several GPUs.

The operator renders a tensor-parallel vLLM pair's engine pods asking for tensor x pipeline GPUs
each (tests/operator/test_operator_parallelism.py proves the arithmetic and the argv against
vLLM's own parser). Here the real kube-scheduler places them on a devcluster whose GPU node has
four: two pods of two GPUs fill it, the third waits with the scheduler's reason, and the CPU-only
node never takes one. No vLLM starts (the engine image is not on this machine, so each placed pod
waits in ErrImagePull): placement is what this proves, not serving.
"""

from __future__ import annotations

import pytest

from specpair_devcluster import DevCluster, NodeSpec
from specpair_operator.desired import engine_objects, manifests
from specpair_operator.release import content as release
from waiting import wait_until

pytestmark = pytest.mark.slow

GPU = "nvidia.com/gpu"
SPEC = {"engine": "vllm", "target": {"source": "meta-llama/Llama-3.1-70B-Instruct"},
        "draft": {"source": "meta-llama/Llama-3.1-8B-Instruct"}, "parallelism": {"tensor": 2}}
PROMPTS = [{"prompt": "def fib(n):", "category": "code"}]


@pytest.fixture(scope="module")
def four_gpu_cluster(tmp_path_factory):
    nodes = [NodeSpec(name="cpu-1", cpu="4"), NodeSpec(name="gpu4-1", cpu="8", gpus=4)]
    with DevCluster(tmp_path_factory.mktemp("multi-gpu"), nodes=nodes) as cluster:
        yield cluster


def _scheduled(pod: dict) -> dict | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"), None)


def test_a_tensor_parallel_2_vllm_pair_gets_two_gpus_a_pod_and_the_scheduler_fills_a_four_gpu_node(four_gpu_cluster):
    kube = four_gpu_cluster.kube
    ns = "tp2"
    kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    # The pair asks for one GPU per device, as users write it; the split multiplies it.
    rollout = {"image": "registry.example.com/vllm-openai:tp", "replicas": 3,
               "resources": {"limits": {GPU: 1}}}
    rel = release.build_release("big", ns, SPEC, PROMPTS)
    dep = engine_objects.engine_deployment("big", ns, rel, release.content_hash(rel), "1", rollout, "http://mlflow:5000")
    # vLLM holds the GPUs; its companion (the pair's API port and control port) asks for none.
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"engine", "companion"}
    assert containers["engine"]["resources"]["limits"][GPU] == 2       # tensor 2 x pipeline 1
    assert GPU not in (containers["companion"]["resources"].get("limits") or {})
    kube.create(dep)
    selector = ",".join(f"{k}={v}" for k, v in manifests.engine_selector("big").items())

    def placed() -> tuple[list[dict], list[dict]] | None:
        pods = kube.list("v1", "Pod", ns, labels=selector)
        bound = [p for p in pods if p["spec"].get("nodeName")]
        waiting = [p for p in pods if (c := _scheduled(p)) and c["status"] == "False" and c.get("reason") == "Unschedulable"]
        return (bound, waiting) if len(pods) == 3 and len(bound) == 2 and len(waiting) == 1 else None

    bound, waiting = wait_until("two pods bound and one unschedulable", placed, timeout=60)
    assert {p["spec"]["nodeName"] for p in bound} == {"gpu4-1"}
    assert sum(int(c["resources"].get("limits", {}).get(GPU, 0))
               for p in bound for c in p["spec"]["containers"]) == 4
    assert f"Insufficient {GPU}" in _scheduled(waiting[0])["message"]
    # Scaling to two frees nothing bound and leaves nothing waiting: both fit the one node.
    kube.patch("apps/v1", "Deployment", ns, dep["metadata"]["name"], {"spec": {"replicas": 2}})
    wait_until("two pods, both bound", lambda: (pods := kube.list("v1", "Pod", ns, labels=selector))
               and len(pods) == 2 and all(p["spec"].get("nodeName") == "gpu4-1" for p in pods), timeout=60)
