"""How the operator asks engine pods who they are and how well they speculate.

The production probe speaks the engine's gRPC API (specpair.engine.v1.Engine: GetModelInfo,
GetStats, SetSpeculation). Its generated stubs live in the `specpair` package; they are
imported lazily and are torch-free. The operator only needs the plain-dict shapes below, so
tests can stand an engine in with any object that has these three coroutines.

    model_info(address) -> {"pair": str, "releaseVersion": str, "contentHash": str (optional),
                            "tokenizer": {"target": fp, "draft": fp | None}, "speculationEnabled": bool}
    stats(address)      -> {"categories": {category: {"drafted": int, "accepted": int, "requests": int | None,
                                                     "draftedSq", "acceptedSq", "draftedAccepted": float (optional)}},
                            "uptimeSeconds": float | None}  (cumulative since the engine process started)
    set_speculation(address, enabled: bool) -> None
"""

from __future__ import annotations

from typing import Any, Protocol


class EngineProbe(Protocol):
    async def model_info(self, address: str) -> dict[str, Any]: ...
    async def stats(self, address: str) -> dict[str, Any]: ...
    async def set_speculation(self, address: str, enabled: bool, reason: str = "") -> None: ...


class EngineUnreachable(Exception):
    pass


class GrpcEngineProbe:
    """gRPC client for engine pods. Needs specpair._proto (generated from protos/engine.proto)."""

    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s

    def _stubs(self) -> tuple[Any, Any]:
        try:
            from specpair._proto import engine_pb2, engine_pb2_grpc  # torch-free generated code
        except ImportError as exc:  # pragma: no cover - depends on the engine package build
            raise EngineUnreachable(f"engine gRPC stubs not available: {exc}") from exc
        return engine_pb2, engine_pb2_grpc

    async def _call(self, address: str, method: str, request_name: str, **fields: Any) -> dict[str, Any]:
        import grpc
        from google.protobuf.json_format import MessageToDict

        pb2, pb2_grpc = self._stubs()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pb2_grpc.EngineStub(channel)
                reply = await getattr(stub, method)(getattr(pb2, request_name)(**fields), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise EngineUnreachable(f"{method} on {address}: {exc.code().name} {exc.details()}") from exc
        return MessageToDict(reply, preserving_proto_field_name=False)

    async def model_info(self, address: str) -> dict[str, Any]:
        info = await self._call(address, "GetModelInfo", "GetModelInfoRequest")
        tok = info.get("tokenizer") or {}
        return {"pair": info.get("pair", ""), "releaseVersion": info.get("version", ""),
                "tokenizer": {"target": tok.get("targetFingerprint") or None, "draft": tok.get("draftFingerprint") or None},
                "speculationEnabled": bool((info.get("speculation") or {}).get("enabled", False)),
                "contentHash": info.get("contentHash", "")}

    async def stats(self, address: str) -> dict[str, Any]:
        stats = await self._call(address, "GetStats", "GetStatsRequest")
        cats = {}
        for name, cat in (stats.get("categories") or {}).items():
            cum = cat.get("cumulative") or {}
            # uint64 fields arrive as strings from MessageToDict; fields at their default are left out
            cats[name] = {"drafted": int(cum.get("numDraftTokens", 0)), "accepted": int(cum.get("numAcceptedTokens", 0)),
                          "requests": int(cat["requests"]) if "requests" in cat else None}
            # Per-request sums over finished requests that drafted (docs/drift.md), when the engine
            # has them. Tokens then count once their request finishes, so the ratio and its
            # variance rest on the same requests.
            fin = cat.get("finished")
            if fin is not None:
                cats[name].update(drafted=int(fin.get("draftTokens", 0)), accepted=int(fin.get("acceptedTokens", 0)),
                                  requests=int(fin.get("requests", 0)), draftedSq=float(fin.get("draftTokensSq", 0.0)),
                                  acceptedSq=float(fin.get("acceptedTokensSq", 0.0)),
                                  draftedAccepted=float(fin.get("draftAcceptedTokens", 0.0)))
        return {"categories": cats, "speculating": bool(stats.get("speculating", False)),
                "uptimeSeconds": float(stats["uptimeSeconds"]) if "uptimeSeconds" in stats else None}

    async def set_speculation(self, address: str, enabled: bool, reason: str = "") -> None:
        await self._call(address, "SetSpeculation", "SetSpeculationRequest", enabled=enabled, reason=reason)
