"""The gRPC adapter: specpair.engine.v1.Engine on grpc.aio, in front of an EngineWorker.

Every RPC is registered with raw bytes in (no request deserializer) so that a request protobuf
refuses to parse, such as one with malformed UTF-8 in a string field, still gets INVALID_ARGUMENT
naming the field instead of gRPC's generic UNKNOWN/INTERNAL "exception deserializing request".
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf.message import DecodeError

from specpair import __version__
from specpair._proto import engine_pb2 as pb
from specpair.contract import DEFAULT_CATEGORY
from specpair.errors import SpecpairError
from specpair.server.admission import Admission
from specpair.server.auth import bearer_token_matches
from specpair.server.draft_swap import SwapRefused
from specpair.server.requests import (MAX_SPECULATION_K, InvalidField, Limits, check_size, find_invalid_utf8,
                                      generate_fields)
from specpair.server.worker import Failed, Finished, NotAccepting, QueueFull, Tokens
from specpair.stats import AcceptanceStats

log = logging.getLogger("specpair.server")

SERVICE_NAME = "specpair.engine.v1.Engine"
PROTOCOL = "grpc"
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
FAILURE_CODES = {"unavailable": grpc.StatusCode.UNAVAILABLE, "internal": grpc.StatusCode.INTERNAL,
                 "invalid": grpc.StatusCode.INVALID_ARGUMENT}
# A client's deadline passes on the client first: it cancels the call, and the server sees a
# cancellation a transit time before its own copy of the deadline. A cancellation this close to
# the deadline is counted as the deadline.
DEADLINE_SLACK_SECONDS = 0.25


def gone_status(context) -> str:
    """Why a call ended before its reply: "deadline" or "cancelled" (the metric's status)."""
    remaining = context.time_remaining()
    return "deadline" if remaining is not None and remaining <= DEADLINE_SLACK_SECONDS else "cancelled"


def stats_message(stats: AcceptanceStats) -> pb.AcceptanceStats:
    return pb.AcceptanceStats(
        num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        num_accepted_tokens_per_pos=stats.num_accepted_tokens_per_pos,
        num_draft_tokens_per_pos=stats.num_draft_tokens_per_pos,
        acceptance_rate=stats.acceptance_rate, mean_acceptance_length=stats.mean_acceptance_length,
        acceptance_per_position=stats.acceptance_per_position, fallback_events=stats.fallback_events,
        num_emitted_tokens=stats.num_emitted_tokens, num_target_steps=stats.num_target_steps)


def speculation_message(engine, max_batch_size: int) -> pb.SpeculationSettings:
    config, controller = engine.config, engine.controller
    msg = pb.SpeculationSettings(
        enabled=bool(controller.enabled and engine.drafter is not None), k=config.k,
        dynamic_k=config.dynamic_k, k_min=config.k_min, k_max=config.k_max,
        fallback_threshold=config.fallback_threshold, fallback_window=config.fallback_window,
        batch_size_threshold=config.batch_size_threshold, max_batch_size=max_batch_size)
    if controller.k_override is not None:
        msg.k_override = controller.k_override
    return msg


def model_identity(engine, which: str) -> pb.ModelIdentity:
    if which == "target":
        return pb.ModelIdentity(kind="model", **engine.target.identity())
    if engine.draft is not None:
        return pb.ModelIdentity(kind="model", **engine.draft.identity())
    if engine.drafter is not None:
        return pb.ModelIdentity(kind=engine.drafter.name, source=engine.drafter.name)
    return pb.ModelIdentity(kind="none")


def model_info_message(engine, *, pair: str, version: str, limits: Limits, max_batch_size: int,
                       max_queue: int, content_hash: str = "") -> pb.ModelInfo:
    check = engine.tokenizer_check
    tokenizer = pb.TokenizerInfo(
        target_fingerprint=engine.target_fingerprint["sha256"],
        draft_fingerprint=(engine.draft_fingerprint or {}).get("sha256", ""),
        # A model-free drafter proposes target tokens: compatible by construction.
        compatible=check.compatible if check is not None else engine.drafter is not None,
        differences=check.differences if check is not None else [],
        notes=check.notes if check is not None else [])
    return pb.ModelInfo(
        pair=pair, version=version, target=model_identity(engine, "target"),
        draft=model_identity(engine, "draft"), tokenizer=tokenizer,
        speculation=speculation_message(engine, max_batch_size),
        context_length=engine.target.context_length, max_new_tokens_limit=limits.max_new_tokens,
        max_queue=max_queue, engine_version=__version__, warnings=list(engine.warnings),
        content_hash=content_hash)


def category_message(snapshot: dict) -> pb.CategoryStats:
    msg = pb.CategoryStats(window_draft_tokens=snapshot["window_draft_tokens"],
                           cumulative=stats_message(snapshot["cumulative"]), requests=snapshot["requests"])
    msg.finished.CopyFrom(snapshot["finished"].to_message())
    if snapshot["window_rate"] is not None:
        msg.window_acceptance_rate = snapshot["window_rate"]
    return msg


def serving_message(counts: dict) -> pb.ServingStats:
    """One category's latency histograms and requests by status (EngineMetrics.serving_counts)."""
    return pb.ServingStats(time_to_first_token=pb.Histogram(**counts["ttft"]),
                           time_per_output_token=pb.Histogram(**counts["tpot"]), requests=counts["requests"])


def add_serving(msg: pb.Stats, serving: dict[str, dict]) -> None:
    """Per category and overall (their sums) into a Stats message."""
    overall = None
    for name, counts in serving.items():
        part = serving_message(counts)
        msg.categories[name].serving.CopyFrom(part)
        if overall is None:
            overall = part
            continue
        overall = pb.ServingStats(
            time_to_first_token=_sum_histograms(overall.time_to_first_token, part.time_to_first_token),
            time_per_output_token=_sum_histograms(overall.time_per_output_token, part.time_per_output_token),
            requests={s: overall.requests.get(s, 0) + part.requests.get(s, 0)
                      for s in {*overall.requests, *part.requests}})
    if overall is not None:
        msg.overall.serving.CopyFrom(overall)


def _sum_histograms(a: pb.Histogram, b: pb.Histogram) -> pb.Histogram:
    return pb.Histogram(upper_bounds=a.upper_bounds, counts=[x + y for x, y in zip(a.counts, b.counts)],
                        count=a.count + b.count, sum=a.sum + b.sum)


def alpha_sums_message(m) -> pb.AlphaSums:
    """A RequestMoments of first positions (drafted) and Σ alpha (accepted) on the wire."""
    return pb.AlphaSums(requests=m.requests, positions=m.drafted, alpha=m.accepted, positions_sq=m.drafted_sq,
                        alpha_sq=m.accepted_sq, positions_alpha=m.drafted_accepted)


def shadow_message(scorer) -> pb.ShadowStats:
    """What the shadow scorer (specpair/shadow.py) has counted, for GetStats."""
    msg = pb.ShadowStats(candidate_version=scorer.candidate.version,
                         candidate_content_hash=scorer.candidate.content_hash, share=scorer.share,
                         skipped_steps=scorer.skipped_steps)
    for name, c in scorer.snapshot().items():
        msg.categories[name].CopyFrom(pb.ShadowCategoryStats(
            requests=c.requests, candidate_alpha=alpha_sums_message(c.candidate_alpha),
            champion_alpha=alpha_sums_message(c.champion_alpha),
            candidate_chain=c.candidate_chain.to_message(), champion_chain=c.champion_chain.to_message(),
            alpha_paired=c.alpha_paired.to_message(), chain_paired=c.chain_paired.to_message(),
            draft_seconds=c.draft_seconds, committed_tokens=c.committed_tokens))
    return msg


class EngineService:
    """Handlers for one server. `state` is the owning EngineServer (engine, worker, limits, ...)."""

    def __init__(self, state):
        self.state = state
        self.admission = Admission(state)     # shared with the HTTP front

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=None,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.get_model_info, request_deserializer=None,
                response_serializer=pb.ModelInfo.SerializeToString),
            "GetStats": grpc.unary_unary_rpc_method_handler(
                self.get_stats, request_deserializer=None,
                response_serializer=pb.Stats.SerializeToString),
            "SetSpeculation": grpc.unary_unary_rpc_method_handler(
                self.set_speculation, request_deserializer=None,
                response_serializer=pb.SpeculationSettings.SerializeToString),
            "SwapDraft": grpc.unary_unary_rpc_method_handler(
                self.swap_draft, request_deserializer=None,
                response_serializer=pb.SwapDraftReply.SerializeToString),
        })

    def close(self) -> None:
        self.admission.close()

    async def _authorize(self, context) -> None:
        """With a token configured (--auth-token-file): "authorization: Bearer <token>" metadata, or
        a client certificate allowed to control the server (the operator on the control port)."""
        token = self.state.options.auth_token
        if token is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if bearer_token_matches(given, token) or self.state.control_client_allowed(context):
            return
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong bearer token (metadata authorization: Bearer <token>)")

    async def _require_ready(self, context) -> None:
        if self.state.phase != "serving":
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.state.unavailable_reason())

    async def _invalid(self, context, field: str, reason: str, category: str = DEFAULT_CATEGORY, count: bool = True):
        if count:    # specpair_requests_total counts Generate requests only
            self.state.count_rejected(category, "invalid")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {reason}",
                            trailing_metadata=(("specpair-invalid-field", field),))

    async def _parse(self, raw: bytes, message_type, context, count: bool = True):
        """Request bytes -> message, or INVALID_ARGUMENT naming the malformed field."""
        try:
            return message_type.FromString(raw)
        except DecodeError:
            field = find_invalid_utf8(raw, message_type.DESCRIPTOR)
            if field:
                await self._invalid(context, field, "malformed UTF-8 in a string field", count=count)
            await self._invalid(context, "request", f"not a valid {message_type.DESCRIPTOR.name} protobuf",
                                count=count)

    # -- Generate ------------------------------------------------------------------------------

    async def generate(self, raw: bytes, context):
        arrived = time.perf_counter()
        await self._authorize(context)
        await self._require_ready(context)
        state = self.state
        try:
            check_size(len(raw), state.limits)
        except InvalidField as exc:
            await self._invalid(context, exc.field, exc.reason)
        request = await self._parse(raw, pb.GenerateRequest, context)
        try:
            fields = generate_fields(request)
        except InvalidField as exc:
            await self._invalid(context, exc.field, exc.reason)
        try:
            admitted = await self.admission.admit(fields, protocol=PROTOCOL, arrived=arrived,
                                                  client_id=request.request_id, gone=lambda: gone_status(context))
        except InvalidField as exc:      # counted by admit
            await self._invalid(context, exc.field, exc.reason, count=False)
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except NotAccepting as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        job, events = admitted.job, admitted.events
        request_id = request.request_id or job.request_id
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, Tokens):
                    yield pb.GenerateResponse(request_id=request_id, text=event.text, token_ids=event.token_ids)
                elif isinstance(event, Finished):
                    finished = True
                    yield pb.GenerateResponse(
                        request_id=request_id, text=event.text, token_ids=event.token_ids,
                        finish_reason=FINISH_REASONS.get(event.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                        usage=pb.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                                       cached_tokens=event.cached_tokens),
                        timings=pb.Timings(queue_seconds=event.queue_seconds,
                                           time_to_first_token_seconds=event.time_to_first_token,
                                           total_seconds=event.total_seconds),
                        stats=stats_message(event.stats))
                    return
                elif isinstance(event, Failed):
                    finished = True
                    await context.abort(FAILURE_CODES.get(event.kind, grpc.StatusCode.INTERNAL), event.message)
        finally:
            if not finished:
                # Client cancelled, deadline passed, or the stream broke: free the batch slot.
                state.worker.cancel(job, gone_status(context))
            admitted.replied()

    # -- unary ----------------------------------------------------------------------------------

    async def get_model_info(self, raw: bytes, context):
        await self._authorize(context)
        await self._require_ready(context)
        await self._parse(raw, pb.GetModelInfoRequest, context, count=False)
        return self.state.model_info()

    async def get_stats(self, raw: bytes, context):
        await self._authorize(context)
        await self._require_ready(context)
        await self._parse(raw, pb.GetStatsRequest, context, count=False)
        msg = self.state.stats()
        add_serving(msg, self.state.metrics.serving_counts())
        shadow = getattr(self.state.engine, "shadow", None)
        if shadow is not None:
            msg.shadow.CopyFrom(shadow_message(shadow))
        return msg

    async def _require_control(self, context, rpc: str) -> None:
        """The gate of every control RPC, in this order: first, a caller without the operator's
        certificate learns nothing and changes nothing; then the engine must be ready."""
        await self._authorize(context)
        refusal = self.state.control_refusal(context, rpc)
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        await self._require_ready(context)

    async def set_speculation(self, raw: bytes, context):
        await self._require_control(context, "SetSpeculation")
        request = await self._parse(raw, pb.SetSpeculationRequest, context, count=False)
        if request.HasField("k") and request.k > MAX_SPECULATION_K:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"k: must be <= {MAX_SPECULATION_K} (0 clears), got {request.k}")
        if request.HasField("enabled") and request.enabled and self.state.engine.drafter is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "enabled: this server has no draft (or its tokenizer differs from the "
                                "target's); speculation cannot be turned on")
        loop = asyncio.get_running_loop()
        enabled = request.enabled if request.HasField("enabled") else None
        k = request.k if request.HasField("k") else None
        return await loop.run_in_executor(None, self.state.set_speculation, enabled, k, request.reason)

    async def swap_draft(self, raw: bytes, context):
        await self._require_control(context, "SwapDraft")
        request = await self._parse(raw, pb.SwapDraftRequest, context, count=False)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, self.state.swap_draft, request.release_json, request.reason)
        except SwapRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except SpecpairError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"release_json: {exc}"
                                if not str(exc).startswith("release_json") else str(exc))
        except Exception as exc:    # a draft that would not load: the serving drafter is unchanged
            log.exception("SwapDraft failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"the release's draft could not be swapped in "
                                f"(the serving draft is unchanged): {type(exc).__name__}: {exc}")
