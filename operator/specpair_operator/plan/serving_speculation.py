"""The serving plan's speculation: each engine pod's speculation reconciled with the desired switch."""

from __future__ import annotations

from specpair_operator.crd.schema import has_gpu
from specpair_operator.desired import engine_objects
from specpair_operator.policy import rollout_strategy
from specpair_operator.observe.serving_world import EnginePod
from specpair_operator.plan.serving_steps import (address, kind_of, ReconcilePodSpeculation, RollSpeculation, _Steps,
                                                  SwitchSpeculation)


def _speculation(out: _Steps, champion: str, pods: list[EnginePod]) -> list[str]:
    """Every pod speculates exactly when the operator wants it to (level-triggered: a pod that
    restarted after SpeculationOff speculates again until told otherwise). Returns the pods known
    now to stay off-target (vLLM cannot switch at run time); act adds those that do not follow."""
    w = out.world
    desired = out.speculation(champion)
    stuck = []
    for pod in pods:
        if bool((pod.info or {}).get("speculationEnabled", True)) == desired:
            continue
        if kind_of(w) == "vllm":
            # No runtime switch: the Deployment is rendered with the desired state and rolls.
            stuck.append(f"pod {pod.name} is replaced by one {'with' if desired else 'without'} speculation "
                         "(vLLM cannot switch it at run time)")
            continue
        out.add(ReconcilePodSpeculation(pod.name, address(w, pod), desired, champion))
    return stuck


def _switch(out: _Steps, champion: str, addresses: tuple[str, ...], enabled: bool, reason: str) -> None:
    """The drift ladder's switch: on the specpair engine each pod's SetSpeculation. vLLM has no
    runtime switch (its probe's set_speculation refuses), so no such step is planned for its
    pods: the Deployment, rendered from the speculationEnabled this pass sets, rolls, and the
    plan says how (RollSpeculation)."""
    w = out.world
    if kind_of(w) != "vllm":
        out.add(SwitchSpeculation(addresses, enabled, reason[:500]))
        return
    roll = rollout_strategy.speculation_roll(engine_objects.rollout_strategy(dict(w.rollout), "vllm"),
                                             int(w.rollout.get("replicas", 1)), has_gpu(dict(w.rollout)))
    out.add(RollSpeculation("Warning" if roll.unserved else "Normal", "SpeculationRollout",
                            f"{roll.describe(champion, enabled)}; because: {reason}"[:1000], enabled, roll))
