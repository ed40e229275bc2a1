"""The operator's side of a vLLM release's k by load, and of its pods' metrics port, without a
cluster: the gate's schedule is checked with its verdict, recorded in MLflow beside the speedups it
rests on, and served in the release file of the engine pods; a vLLM pod's companion serves /metrics
on the container port `metrics` the Service's `metrics` port targets, as on our engine's pods.
Through real vLLM servers and pods: tests/operator/test_operator_vllm.py."""

from __future__ import annotations

from specpair.vllm_peer import speculative_config
from specpair_operator.desired import engine_objects, manifests
from specpair_operator.gate.verdict import verdict_problems
from specpair_operator.release import content as release
from specpair_operator.release.registry_contract import gate_metrics, gate_params

PROMPTS = [{"prompt": "def fib(n):", "category": "code"}]
SCHEDULE = [[1, 15, 3], [16, 64, 0]]


def vllm_release() -> dict:
    spec = {"engine": "vllm", "target": {"source": "t"}, "draft": {"drafter": "ngram"}, "speculation": {"k": 3}}
    return release.build_release("chat", "team", spec, PROMPTS)


def verdict(best: dict | None) -> dict:
    return {"passed": True, "reasons": [], "engine": "vllm", "greedyIdentity": 1.0, "acceptanceRate": 0.5,
            "meanAcceptanceLength": 2.0, "speedup": 1.4, "categories": {}, "acceptancePerPosition": [],
            "kSweep": [], "batchSweep": [{"batchSize": 1, "speedup": 1.4}, {"batchSize": 16, "speedup": 0.9},
                                         {"batchSize": 64, "speedup": 0.7}],
            "bestSpeculation": best, "tokenizer": None, "mlflowRunId": None, "device": "vllm (float32)"}


def test_a_verdicts_schedule_is_checked_by_vllms_rules():
    assert verdict_problems(verdict({"kByBatchSize": SCHEDULE})) == []
    for bad in ([[2, 15, 3]], [[1, 15, 3], [10, 20, 0]], "1-15:3", [[1, 15, 99]]):
        problems = verdict_problems(verdict({"kByBatchSize": bad}))
        assert problems and all("bestSpeculation.kByBatchSize" in p for p in problems), (bad, problems)


def test_the_gate_run_records_the_schedule_beside_the_speedups_it_rests_on():
    v = verdict({"kByBatchSize": SCHEDULE})
    metrics = gate_metrics(v)
    assert {step: value for (name, step), value in metrics.items() if name == "speedup_by_batch_size"} == \
        {1: 1.4, 16: 0.9, 64: 0.7}
    assert gate_params(vllm_release(), v)["tuned.kByBatchSize"] == str(SCHEDULE)


def test_the_served_release_carries_the_schedule_unless_gate_tuning_is_off():
    from specpair_operator.plan.serving_steps import gate_tuned

    served = gate_tuned(vllm_release(), verdict({"kByBatchSize": SCHEDULE}), {})
    assert served["speculation"]["kByBatchSize"] == SCHEDULE
    # What the pod's vLLM is started with (specpair.vllm_serve reads this release file).
    assert speculative_config(served)["num_speculative_tokens_per_batch_size"] == SCHEDULE
    untuned = gate_tuned(vllm_release(), verdict({"kByBatchSize": SCHEDULE}), {"applyGateTuning": False})
    assert "kByBatchSize" not in untuned["speculation"]
    assert "kByBatchSize" not in gate_tuned(vllm_release(), verdict(None), {})["speculation"]


def test_a_vllm_pods_metrics_port_is_the_one_its_service_and_monitor_name():
    rel = vllm_release()
    dep = engine_objects.engine_deployment("chat", "team", rel, "d" * 64, "1", {}, "http://mlflow")
    _, companion = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in companion["ports"]}
    assert ports["metrics"] == manifests.METRICS_PORT
    command = companion["command"]
    assert command[command.index("--metrics-port") + 1] == str(manifests.METRICS_PORT)
    service = engine_objects.engine_service("chat", "team", {}, kind="vllm")
    (metrics,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
    assert metrics["targetPort"] == "metrics"
    # The same port name on our engine's pods: the chart's one ServiceMonitor scrapes both.
    ours = engine_objects.engine_service("chat", "team", {}, kind="specpair")
    assert [p["targetPort"] for p in ours["spec"]["ports"] if p["name"] == "metrics"] == ["metrics"]
