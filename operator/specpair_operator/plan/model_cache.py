"""Where a release's models stand in the pair's model cache, as steps: start the fetch Job, wait
for it, record what it fetched, or stall on its failure. Shared by the gate (release_gate.py) and
the engine's rollout (serving_rollout.py); the Job itself is desired/model_fetch.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from specpair_operator.desired import model_fetch
from specpair_operator.observe.serving_world import Installation
from specpair_operator.plan.release_steps import (PostEvent, Record, ReleaseSteps, Report, ServeChampion, SetStatus,
                                                  versions_status)
from specpair_operator.plan.serving_steps import EnsureOwned
from specpair_operator.release import aliases as aliases_mod
from specpair_operator.release import content as release_mod

if TYPE_CHECKING:
    from specpair_operator.plan.steps import Step   # the union of every plan's steps

FETCHED_KEPT = 5   # status.modelCache.fetched: the models digests of the last few fetches


def fetch_job(pair: str, namespace: str, release: Mapping[str, Any], rollout: Mapping[str, Any],
              installation: Installation) -> dict[str, Any]:
    """The fetch Job of a release (`release` as its pods get it, with where MLflow is), rendered
    with the installation's settings: the one place the plans build it (desired/model_fetch.py
    says what it is), so the gate's and a rollout's fetch of the same models are the same Job."""
    return model_fetch.desired_fetch_job(pair, namespace, dict(release), dict(rollout), installation.tracking_uri,
                                         installation.credentials, installation.pods)


def fetch_steps(state: Any, version: str, models: str, fetched: tuple[str, ...], was_failed: bool,
                serving: str | None, phase: str, job: Callable[[], dict[str, Any]]) -> tuple[bool, list[Step]]:
    """Where the release's models stand in the model cache (model_fetch.fetch_state, or None
    when it needs no fetch): whether its pods may start (the models are there), and the steps
    that say so: `job()` (fetch_job) created when there is none. Shared by the gate
    (release_gate.py) and the engine's rollout (serving_rollout.py)."""
    if state is None:
        return True, []
    keeps = f"; v{serving} keeps serving" if serving else ""
    if state.phase == model_fetch.DONE:
        return True, fetched_record(state, version, models, fetched)
    if state.phase == model_fetch.FAILED:
        steps: list[Step] = [Report("stalled", "Failed", model_fetch.MODEL_FETCH_FAILED, state.message,
                                    ready_message=f"the models of v{version} could not be fetched{keeps}")]
        if not was_failed:
            steps.insert(0, Record(model_fetch.MODEL_FETCH_FAILED, f"v{version}: {state.message}", None, version,
                                   warning=True, key=models))
        return False, steps
    steps = []
    if state.phase == model_fetch.ABSENT:
        steps = [EnsureOwned(job(), None, mutable=False),
                 PostEvent("Normal", "ModelFetchStarted", f"fetching the models of v{version} into the model cache")]
        message = f"fetching the models of v{version} into the model cache"
    else:
        message = state.message
    return False, steps + [Report("reconciling", phase, model_fetch.MODELS_FETCHING, message,
                                  ready_message=f"fetching the models of v{version}{keeps}", provisional=True)]


def fetched_record(state: Any, version: str, models: str, fetched: tuple[str, ...]) -> list[Step]:
    """A completed fetch into status.modelCache.fetched (the last few), with its Event: later
    passes need no Job for these models, so its TTL may delete it."""
    kept = [d for d in fetched if d != models][-(FETCHED_KEPT - 1):] + [models]
    return [SetStatus({"modelCache": {"fetched": kept}}),
            PostEvent("Normal", "ModelsFetched", f"v{version}: {state.message}")]


def models_ready(out: ReleaseSteps) -> bool:
    """The release's models are in the model cache (or it has none): else the fetch's steps,
    the champion watched meanwhile."""
    w = out.world
    inst = w.installation or Installation()
    ready, steps = fetch_steps(w.model_fetch, w.version, w.models, w.fetched,
                               out.was(model_fetch.MODEL_FETCH_FAILED, w.models, w.version),
                               w.aliases.get(aliases_mod.CHAMPION), "Gating",
                               lambda: fetch_job(w.pair, w.namespace,
                                                 release_mod.with_mlflow(dict(w.release or {}), inst.tracking_uri,
                                                                         w.model, w.version), w.rollout, inst))
    out.add(*steps)
    if not ready:
        out.add(versions_status(w.aliases))
        if w.model_fetch.phase != model_fetch.FAILED:
            # A stalled report is final for the pass; as after a gate given up, the champion's
            # Deployment stays as it is.
            out.add(ServeChampion(w.aliases, None, while_gating=True))
    return ready

