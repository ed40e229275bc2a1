"""The operator converges from every crash point and every lost reply (issue: states that never
converge), on the real control plane with a real MLflow server and real Kopf.

The operator runs as a child process with failpoints on its writes (failpoints.py). In the
crash test every life of the process makes one write and is killed right after it, then
started again; each write of the reconcile from "pair applied" to "v1 serving" and on to "v2
serving" is thus followed by a kill once. In the lost-reply test the first call of every write
method is committed and then answered with a connection error. Either way the end state must
be the one an undisturbed operator reaches: one model version per release, aliases in place,
each GateStarted / Promoted / RolloutStarted recorded exactly once, one gate Job per release.
(The serving marks, a rollback's tag before its alias move and SpeculationOff's before the pods,
are replayed killed after each write in test_operator_serving_plan.py.)
"""

from __future__ import annotations

import time
import uuid

from mlflow import MlflowClient

from cluster_env import REPLACE, engine_pods, model_name, pair, serving, set_spec
from failing_operator import FailingOperator, history
from specpair_operator.desired import manifests


def test_killed_after_every_write_the_operator_still_promotes_once(env, mlflow_server, tmp_path):
    ns = env
    name = f"crash-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    operator = FailingOperator(tmp_path / "writes.jsonl")
    # Replace: v2 changes only the draft, which the operator would otherwise score in shadow.
    ns.create(pair(name, "good-draft", rollout=REPLACE))
    kills = operator.crash_until(lambda: serving(ns, name, "1"))
    obj = ns.pair(name)
    crashed = {w["write"] for w in operator.writes() if w["failed"] == "crash"}
    # Every kind of write was followed by a kill at least once on the way to v1.
    for write in ("mlflow.create_registered_model", "mlflow.create_model_version", "mlflow.set_registered_model_alias candidate",
                  "mlflow.set_model_version_tag specpair.promoted_at", "mlflow.set_registered_model_alias champion",
                  "kube.create Job", "kube.create Deployment", "kube.create Service"):
        assert write in crashed, (write, sorted(crashed))
    assert kills >= 10
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 1
    assert mlflow.get_registered_model(model).aliases == {"candidate": "1", "champion": "1"}
    counts = history(obj)
    assert counts[("GateStarted", "1")] == 1 and counts[("Promoted", "1")] == 1, counts
    assert counts[("RolloutStarted", "1")] == 1, counts
    assert [e for e in ns.events("Promoted")], "the promotion's Event is posted even when its pass was killed"
    assert len(ns.list("batch/v1", "Job")) == 1

    # A new release, killed after every write again: v2 promoted once, v1 is previous.
    set_spec(ns, name, {"draft": {"source": "faster-draft"}})
    operator.crash_until(lambda: serving(ns, name, "2"))
    obj = ns.pair(name)
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 2
    assert mlflow.get_registered_model(model).aliases == {"candidate": "2", "champion": "2", "previous": "1"}
    counts = history(obj)
    assert counts[("Promoted", "2")] == 1 and counts[("GateStarted", "2")] == 1, counts
    assert obj["status"]["previousVersion"] == "1"
    assert len(ns.list("batch/v1", "Job")) == 2
    ns.wait_for("only v2's pods", lambda: [p["metadata"]["labels"]["specpair.io/release-version"]
                                           for p in engine_pods(ns)] == ["2"])


def test_lost_replies_make_no_duplicate_versions_and_no_stuck_gate(env, mlflow_server, tmp_path):
    """MLflow commits the version but the reply is lost: the retry finds that version instead
    of creating a second one with the same hash (whose verdict the operator would never see)."""
    ns = env
    name = f"lost-{uuid.uuid4().hex[:5]}"
    model = model_name(ns, name)
    mlflow = MlflowClient(mlflow_server.url)
    operator = FailingOperator(tmp_path / "writes.jsonl")
    ns.create(pair(name, "good-draft"))
    proc = operator.start("lose-first-reply")
    try:
        ns.wait_for("v1 serving despite lost replies", lambda: serving(ns, name, "1"), timeout=150)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lost = {w["write"].split(" ")[0] for w in operator.writes() if w["failed"] == "reply lost"}
    for write in ("mlflow.create_model_version", "mlflow.set_registered_model_alias", "mlflow.create_run",
                  "kube.create"):
        assert write in lost, (write, sorted(lost))
    assert len(mlflow.search_model_versions(f"name='{model}'")) == 1
    counts = history(ns.pair(name))
    assert counts[("GateStarted", "1")] == 1 and counts[("Promoted", "1")] == 1, counts
    assert len(ns.list("batch/v1", "Job")) == 1


def test_a_certificate_replaced_by_a_pass_killed_after_its_json_patch_is_kept(env, mlflow_server, tmp_path):
    """The engine's TLS Secret is written blind (the operator may not read Secrets): created, or
    replaced by a JSON patch that tests the owner. Killed right after creating it, the next
    operator finds it by its mark and keeps it; a Secret whose mark names another CA is replaced,
    and an operator killed right after that patch leaves one the next keeps: no certificate is
    issued in a loop, and the pair is served."""
    ns = env
    name = f"tls-{uuid.uuid4().hex[:5]}"
    secret = manifests.engine_tls_secret_name(name)
    operator = FailingOperator(tmp_path / "writes.jsonl")
    ns.create(pair(name, "good-draft"))

    def killed(mode: str) -> None:
        assert operator.life(mode, lambda: False, time.monotonic() + 240) == 137, f"{mode}: no crash"
    killed(f"crash-after:kube.create Secret {secret}")
    # The Secret as a certificate from another CA left it.
    ns.patch("v1", "Secret", secret, {"metadata": {"annotations": {"specpair.io/issued-for": "another-ca/x"}}})
    killed(f"crash-after:kube.json_patch secrets {secret}")
    assert not (ns.pair(name).get("status") or {}).get("engineTLS"), "the killed pass wrote its status"
    operator.life("log", lambda: serving(ns, name, "1"), time.monotonic() + 150)
    assert serving(ns, name, "1"), ns.pair(name).get("status")
    secret_writes = [w["write"] for w in operator.writes() if w["write"].endswith(f" {secret}")]
    assert secret_writes == [f"kube.create Secret {secret}", f"kube.json_patch secrets {secret}"], secret_writes
    mark = ns.get("v1", "Secret", secret)["metadata"]["annotations"]["specpair.io/issued-for"]
    assert mark.startswith(ns.pair(name)["status"]["engineTLS"]["caFingerprint"] + "/")


def test_an_autoscaler_switch_killed_between_its_delete_and_its_create_is_finished(env, mlflow_server, tmp_path,
                                                                                    monkeypatch):
    """KEDA installed under an autoscaled pair: the pass deletes the pair's HPA, then writes its
    ScaledObject. Killed right after the delete, the next operator writes the ScaledObject, and
    deletes nothing more."""
    from autoscaler_scenario import HPA, PROMETHEUS, SO, get_autoscaler, install_keda_crd, remove_keda_crd
    from specpair_operator.desired import autoscaling

    ns = env
    name = f"scaled-{uuid.uuid4().hex[:5]}"
    child = manifests.engine_name(name)
    operator = FailingOperator(tmp_path / "writes.jsonl")
    monkeypatch.delenv(autoscaling.PROMETHEUS_ENV, raising=False)
    remove_keda_crd(ns.kube)
    ns.create(pair(name, "good-draft", rollout={"autoscaling": {"maxReplicas": 2, "target": 4}}))
    operator.life("log", lambda: serving(ns, name, "1") and get_autoscaler(ns, HPA, child), time.monotonic() + 150)
    assert get_autoscaler(ns, HPA, child), ns.pair(name).get("status")
    install_keda_crd(ns.kube)
    monkeypatch.setenv(autoscaling.PROMETHEUS_ENV, PROMETHEUS)  # the child operators' environment
    try:
        assert operator.life("crash-after:kube.delete horizontalpodautoscalers", lambda: False,
                             time.monotonic() + 120) == 137, "no crash"
        assert get_autoscaler(ns, HPA, child) is None and get_autoscaler(ns, SO, child) is None
        operator.life("log", lambda: get_autoscaler(ns, SO, child), time.monotonic() + 120)
        assert get_autoscaler(ns, SO, child) and get_autoscaler(ns, HPA, child) is None
        assert [w["write"] for w in operator.writes() if w["write"].startswith("kube.delete")] == \
            ["kube.delete horizontalpodautoscalers"]
    finally:
        remove_keda_crd(ns.kube)
