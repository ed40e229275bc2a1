"""Why a set of pods cannot start, from the status the cluster reports of them: the fetch Job's,
the gate Job's and the engine's pods are judged alike (desired/model_fetch.fetch_state, observe's
gate world, the serving plan's rollout)."""

from __future__ import annotations

from typing import Any


# Container states that wait on a person (a Secret, a key, an image), not on time.
STUCK_CONTAINER_REASONS = ("CreateContainerConfigError", "ErrImagePull", "ImagePullBackOff", "InvalidImageName")


def pods_waiting(pods: list[dict[str, Any]]) -> str:
    """Why these pods cannot start ('' when nothing stops them): the scheduler's reason, or the
    kubelet's for a container it cannot create (a missing credentials Secret or key, an image it
    cannot pull)."""
    for pod in pods:
        st = pod.get("status") or {}
        for cd in st.get("conditions") or []:
            if cd.get("type") == "PodScheduled" and cd.get("status") == "False":
                return f"pod {pod['metadata']['name']} is Pending: {cd.get('reason')}: {cd.get('message', '')}"
        for cs in st.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_CONTAINER_REASONS:
                return f"pod {pod['metadata']['name']} cannot start: {waiting['reason']}: {waiting.get('message', '')}"
    return ""
