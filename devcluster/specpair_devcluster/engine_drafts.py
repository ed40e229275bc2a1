"""Which draft the engine pods of a pair serve, asked of each ready pod over its gRPC port
(GetModelInfo.draft_version). A pair's status (servingVersion) follows its MLflow aliases, which
move before the operator swaps the new draft into the running pods; what the pods answer is what
serves.

Used by the learning loop's e2e test and the demo's domain shift chapter: both wait until every
ready pod reports the learned release's draft before they measure it."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

ENGINE_PORT = 50051          # the engine's gRPC port as the chart's pods serve it


def pod_ready(pod: Mapping[str, Any]) -> bool:
    st = pod.get("status") or {}
    return bool(st.get("podIP")) and not (pod.get("metadata") or {}).get("deletionTimestamp") \
        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def drafts_served(pods: Iterable[Mapping[str, Any]], port: int = ENGINE_PORT, timeout_s: float = 30.0) -> set[str]:
    """The release versions whose draft the ready pods among `pods` report; empty while a pod does
    not answer (one going or coming: the caller looks again), or when none is ready."""
    import grpc     # imported here: the devcluster itself runs without the engine's packages
    from specpair._proto import engine_pb2, engine_pb2_grpc

    out: set[str] = set()
    for pod in pods:
        if not pod_ready(pod):
            continue
        try:
            with grpc.insecure_channel(f"{pod['status']['podIP']}:{port}") as channel:
                info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(),
                                                                        timeout=timeout_s)
        except grpc.RpcError:
            return set()
        out.add(info.draft_version)
    return out
