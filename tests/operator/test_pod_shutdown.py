"""How an engine pod stops without failing a request (desired/pod_shutdown.py, rollout.shutdown):
the engine's stop delay and drain flags and the pod's grace period covering them, for both
engines, the CRD's defaults and bounds. Pure. The engine's side is tests/server/test_server_stop_delay.py;
through a real gateway, tests/operator/test_gateway_canary.py (no failed request across a promotion
and an abort)."""

from __future__ import annotations

import pytest

from specpair_operator.crd.validation import validate_spec
from specpair_operator.desired import engine_objects
from specpair_operator.desired.pod_shutdown import EXIT_MARGIN_SECONDS, Shutdown, shutdown_defaults, shutdown_of

RELEASE = {"target": {"source": "default"}, "draft": {"drafter": "ngram"}, "speculation": {"k": 3},
           "gating": {}, "pair": "p", "version": "4"}
VLLM = {**RELEASE, "engine": {"kind": "vllm"}, "draft": {"source": "tiny-draft"}}


def deployment(release: dict, rollout: dict) -> dict:
    return engine_objects.engine_deployment("p", "ns", release, "d" * 64, "4", rollout, "http://mlflow")


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_defaults_are_the_crds():
    assert shutdown_defaults() == {"stopDelaySeconds": 5, "drainSeconds": 30}
    assert shutdown_of({}) == Shutdown(stop_delay=5, drain=30)
    assert shutdown_of({"shutdown": {"drainSeconds": 120}}) == Shutdown(stop_delay=5, drain=120)


@pytest.mark.parametrize("rollout, delay, drain", [({}, 5, 30),
                                                    ({"shutdown": {"stopDelaySeconds": 0, "drainSeconds": 600}}, 0, 600),
                                                    ({"shutdown": {"stopDelaySeconds": 20}}, 20, 30)])
def test_our_engine_serves_through_the_stop_delay_and_the_pod_waits_for_the_drain(rollout, delay, drain):
    dep = deployment(RELEASE, {"replicas": 2, **rollout})
    pod = dep["spec"]["template"]["spec"]
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    assert (flag(engine["command"], "--stop-delay"), flag(engine["command"], "--drain-timeout")) == (str(delay), str(drain))
    # The kubelet's SIGKILL comes only after the delay, the drain and the process's exit.
    assert pod["terminationGracePeriodSeconds"] == delay + drain + EXIT_MARGIN_SECONDS


def test_a_vllm_pod_gets_the_same_grace_period():
    pod = deployment(VLLM, {"shutdown": {"stopDelaySeconds": 8, "drainSeconds": 60}})["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 8 + 60 + EXIT_MARGIN_SECONDS


@pytest.mark.parametrize("shutdown, field", [({"stopDelaySeconds": -1}, "stopDelaySeconds"),
                                             ({"stopDelaySeconds": 301}, "stopDelaySeconds"),
                                             ({"drainSeconds": 0}, "drainSeconds"),
                                             ({"drainSeconds": "30"}, "drainSeconds")])
def test_the_crd_bounds_the_settings(shutdown, field):
    errors = validate_spec({"target": {"source": "default"}, "draft": {"drafter": "ngram"},
                            "rollout": {"shutdown": shutdown}})
    assert any(field in e for e in errors), errors
    assert validate_spec({"target": {"source": "default"}, "draft": {"drafter": "ngram"},
                          "rollout": {"shutdown": {"stopDelaySeconds": 0, "drainSeconds": 1}}}) == []
