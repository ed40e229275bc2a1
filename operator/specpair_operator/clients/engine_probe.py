"""How the operator asks engine pods who they are and how well they speculate.

The production probe speaks the engine's gRPC API (specpair.engine.v1.Engine: GetModelInfo,
GetStats, SetSpeculation). Its generated stubs live in the `specpair` package; they are
imported lazily and are torch-free. The operator only needs the plain-dict shapes below, so
tests can stand an engine in with any object that has these three coroutines.

    model_info(address) -> {"pair": str, "releaseVersion": str, "contentHash": str (optional),
                            "tokenizer": {"target": fp, "draft": fp | None}, "speculationEnabled": bool}
    stats(address)      -> {"categories": {category: RequestMoments.as_stats() (specpair.stats)},
                            "serving": {category: {"ttft": histogram, "tpot": histogram,
                                                   "requests": {status: int}}},
                            "uptimeSeconds": float | None}  (cumulative since the engine process started)
                           histogram: {"upperBounds": [s], "counts": [int, cumulative], "count": int, "sum": s};
                           "serving" is absent for an engine that does not report it
                           (specpair_operator.policy.serving_health reads it); "shadow" is there
                           while the pod scores a candidate drafter (shadow_stats;
                           specpair_operator.policy.shadow_run reads it)
    set_speculation(address, enabled: bool) -> None
    swap_draft(address, release_json) -> {"swapped", "draftVersion", "draftContentHash", ...}
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from specpair.stats import RequestMoments


class EngineProbe(Protocol):
    # server_name: the name the engine's certificate must carry (the operator dials pod IPs).
    async def model_info(self, address: str, server_name: str = "") -> dict[str, Any]: ...
    async def stats(self, address: str, server_name: str = "") -> dict[str, Any]: ...
    async def set_speculation(self, address: str, enabled: bool, reason: str = "", server_name: str = "") -> None: ...
    async def swap_draft(self, address: str, release_json: str, reason: str = "",
                         server_name: str = "") -> dict[str, Any]: ...


@dataclass
class ClientTLS:
    """The operator's side of the control listener's mutual TLS (PEM bytes)."""
    ca: bytes
    cert: bytes
    key: bytes


class EngineUnreachable(Exception):
    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code          # the gRPC status code's name, where the engine answered one


# SwapDraft loads and warms a draft beside the serving one before it answers.
SWAP_TIMEOUT_S = 180.0
# Answers to SwapDraft that mean the engine cannot take this draft in place (a roll can): it
# refused it by name, does not know the call (older than SwapDraft), could not read the
# release, or could not load its draft (the serving draft is unchanged then).
SWAP_REFUSED_CODES = ("FAILED_PRECONDITION", "UNIMPLEMENTED", "INVALID_ARGUMENT", "INTERNAL")


@dataclass
class _Kept:
    channel: Any
    loop: Any
    tls: ClientTLS | None
    used: float
    stub: Any = None          # the channel's EngineStub, made once (a stub per call cost ~14 attributes a call)


class GrpcEngineProbe:
    """gRPC client for engine pods. Needs specpair._proto (generated from protos/engine.proto).

    With `tls` set (the operator sets it once it holds its CA), every call is mutual TLS to the
    engine's control listener, checked against `server_name`; without, plaintext (tests that
    call an engine's serving port directly)."""

    # A channel is kept per (address, server name) while it answers, for the event loop and the
    # TLS identity it was made with: dialling anew for every call cost a TCP and mutual-TLS
    # handshake on both sides on every pass (per ready pod, every 10 s in a cluster, every second
    # in the tests). A call that fails drops its channel, so the next one dials afresh rather
    # than waiting out gRPC's reconnect backoff (a pod restarted at the same address); channels
    # idle this long are closed (pods that went away).
    IDLE_S = 60.0

    def __init__(self, timeout_s: float = 5.0, tls: ClientTLS | None = None):
        self.timeout_s = timeout_s
        self.tls = tls
        self._channels: dict[tuple[str, str], _Kept] = {}
        # When idle channels were last looked for: every IDLE_S / 4 at most, not on every call (with
        # a channel per pod, a look on every call is one pass over a thousand channels 33 times
        # a second at 1,000 pairs).
        self._swept_at = float("-inf")

    def _stubs(self) -> tuple[Any, Any]:
        try:
            from specpair._proto import engine_pb2, engine_pb2_grpc  # torch-free generated code
        except ImportError as exc:  # pragma: no cover - depends on the engine package build
            raise EngineUnreachable(f"engine gRPC stubs not available: {exc}") from exc
        return engine_pb2, engine_pb2_grpc

    def _channel(self, address: str, server_name: str) -> Any:
        import grpc

        tls = self.tls
        if tls is None:
            return grpc.aio.insecure_channel(address)
        creds = grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        return grpc.aio.secure_channel(address, creds, options=options)

    async def _call(self, address: str, method: str, request_name: str, server_name: str = "",
                    timeout_s: float | None = None, **fields: Any) -> Any:
        import grpc

        pb2, pb2_grpc = self._stubs()
        loop, now, key = asyncio.get_running_loop(), time.monotonic(), (address, server_name)
        if now - self._swept_at >= self.IDLE_S / 4:
            self._swept_at = now
            await self._close(lambda kept: now - kept.used > self.IDLE_S)
        kept = self._channels.get(key)
        if kept is not None and (kept.loop is not loop or kept.tls is not self.tls):
            await self._close(lambda k: k is kept)
            kept = None
        if kept is None:
            kept = self._channels[key] = _Kept(self._channel(address, server_name), loop, self.tls, now)
        kept.used = now
        try:
            if kept.stub is None:
                kept.stub = pb2_grpc.EngineStub(kept.channel)
            return await getattr(kept.stub, method)(getattr(pb2, request_name)(**fields),
                                               timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            await self._close(lambda k: k is kept)
            raise EngineUnreachable(f"{method} on {address}: {exc.code().name} {exc.details()}",
                                    code=exc.code().name) from exc

    async def _close(self, which: Any) -> None:
        loop = asyncio.get_running_loop()
        for key, kept in list(self._channels.items()):
            if which(kept):
                del self._channels[key]
                if kept.loop is loop:      # a channel of an ended loop cannot be closed from this one
                    await kept.channel.close()

    async def close(self) -> None:
        """Close the kept channels (the operator's cleanup)."""
        await self._close(lambda kept: True)

    async def model_info(self, address: str, server_name: str = "") -> dict[str, Any]:
        from google.protobuf.json_format import MessageToDict

        info = MessageToDict(await self._call(address, "GetModelInfo", "GetModelInfoRequest", server_name))
        tok = info.get("tokenizer") or {}
        return {"pair": info.get("pair", ""), "releaseVersion": info.get("version", ""),
                "tokenizer": {"target": tok.get("targetFingerprint") or None, "draft": tok.get("draftFingerprint") or None},
                "speculationEnabled": bool((info.get("speculation") or {}).get("enabled", False)),
                "contentHash": info.get("contentHash", ""),
                # The release whose draft serves (a SwapDraft changes it); absent: an engine
                # that cannot swap.
                "draftVersion": info.get("draftVersion", ""), "draftContentHash": info.get("draftContentHash", "")}

    async def stats(self, address: str, server_name: str = "") -> dict[str, Any]:
        stats = await self._call(address, "GetStats", "GetStatsRequest", server_name)
        cats = {}
        for name, cat in stats.categories.items():
            if cat.HasField("finished"):
                # Per-request sums over finished requests that drafted (docs/drift.md). Tokens then
                # count once their request finishes, so the ratio and its variance rest on the
                # same requests.
                moments = RequestMoments.from_message(cat.finished)
            else:
                # An engine without them: its token counters, and no request count where it has 0
                # (proto3 cannot tell 0 from "not counted").
                moments = RequestMoments(cat.cumulative.num_draft_tokens, cat.cumulative.num_accepted_tokens,
                                         cat.requests or None)
            cats[name] = moments.as_stats()
        out = {"categories": cats, "speculating": stats.speculating, "uptimeSeconds": stats.uptime_seconds or None}
        serving = {name: serving_stats(cat.serving) for name, cat in stats.categories.items() if cat.HasField("serving")}
        if serving:
            out["serving"] = serving
        if stats.HasField("shadow"):
            out["shadow"] = shadow_stats(stats.shadow)
        # spec.learning's capture: records per category in the capture folder's complete shards,
        # as this pod lists them (a training waits for enough, plan/learning.py); {} when it does
        # not capture.
        out["captured"] = {name: int(n) for name, n in stats.captured.items()}
        return out

    async def set_speculation(self, address: str, enabled: bool, reason: str = "", server_name: str = "") -> None:
        await self._call(address, "SetSpeculation", "SetSpeculationRequest", server_name,
                         enabled=enabled, reason=reason)


    async def swap_draft(self, address: str, release_json: str, reason: str = "", server_name: str = "") -> dict[str, Any]:
        """SwapDraft: the pod loads the release's draft and swaps it in between two steps. Returns
        {"swapped", "draftVersion", "draftContentHash", "loadSeconds", "installSeconds"};
        EngineUnreachable with `code` in SWAP_REFUSED_CODES when the engine cannot take it."""
        reply = await self._call(address, "SwapDraft", "SwapDraftRequest", server_name, timeout_s=SWAP_TIMEOUT_S,
                                 release_json=release_json, reason=reason)
        return {"swapped": bool(reply.swapped), "draftVersion": reply.draft_version,
                "draftContentHash": reply.draft_content_hash, "loadSeconds": float(reply.load_seconds),
                "installSeconds": float(reply.install_seconds)}


def serving_stats(msg: Any) -> dict[str, Any]:
    """A category's ServingStats message -> the probe's plain dict (see the module docstring)."""
    def histogram(h: Any) -> dict[str, Any]:
        return {"upperBounds": list(h.upper_bounds), "counts": [int(c) for c in h.counts], "count": int(h.count),
                "sum": float(h.sum)}
    return {"ttft": histogram(msg.time_to_first_token), "tpot": histogram(msg.time_per_output_token),
            "requests": {status: int(n) for status, n in msg.requests.items()}}


def shadow_stats(msg: Any) -> dict[str, Any]:
    """A ShadowStats message -> the probe's plain dict (specpair_operator.policy.shadow_run reads it):
    the candidate's version and content hash, and per category both sides' first-position alpha
    sums over the same shadowed requests, their cross sums, and the candidate's drafting cost."""
    def alpha(a: Any) -> dict[str, Any]:
        return {"requests": int(a.requests), "positions": int(a.positions), "alpha": float(a.alpha),
                "positionsSq": float(a.positions_sq), "alphaSq": float(a.alpha_sq),
                "positionsAlpha": float(a.positions_alpha)}

    def cross(p: Any) -> dict[str, Any]:
        return {"requests": int(p.requests), "acceptedBoth": float(p.accepted_both),
                "acceptedDrafted": float(p.accepted_drafted), "draftedAccepted": float(p.drafted_accepted),
                "draftedBoth": float(p.drafted_both)}
    categories = {}
    for name, cat in msg.categories.items():
        categories[name] = {"requests": int(cat.requests), "candidateAlpha": alpha(cat.candidate_alpha),
                            "championAlpha": alpha(cat.champion_alpha),
                            "alphaPaired": cross(cat.alpha_paired) if cat.HasField("alpha_paired") else None,
                            "draftSeconds": float(cat.draft_seconds), "committedTokens": int(cat.committed_tokens)}
    return {"candidateVersion": msg.candidate_version, "candidateHash": msg.candidate_content_hash,
            "share": float(msg.share), "skippedSteps": int(msg.skipped_steps), "categories": categories}


class VllmProbe(GrpcEngineProbe):
    """Reads vLLM engine pods through their companion (specpair.vllm_companion): the same
    GetModelInfo and GetStats on the same mutual-TLS control port as our engine's, counted per
    category from vLLM's own per-request acceptance and timings, so drift and serving health
    judge both engines alike. Identity is what vLLM itself serves (its first served name, which
    the companion reads). vLLM has no runtime switch, so set_speculation refuses
    (NoRuntimeSwitch); the plan rolls the Deployment instead."""

    async def set_speculation(self, address: str, enabled: bool, reason: str = "", server_name: str = "") -> None:
        # Never planned for vLLM pods (serving_plan._switch rolls the Deployment instead): a call
        # here is a plan that lost that, and must not pass for a switch that happened.
        raise NoRuntimeSwitch(f"{address}: vLLM cannot switch speculation {'on' if enabled else 'off'} at run time; "
                              "a vLLM pair's speculation changes by a rollout of its Deployment")


class NoRuntimeSwitch(Exception):
    """Asked to switch speculation on an engine that has no runtime switch (vLLM)."""
