"""A small blocking client for the engine API (the CLI, the load benchmark and tests use it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from specpair._proto import engine_pb2 as pb
from specpair._proto import engine_pb2_grpc as pb_grpc


def channel(address: str, *, ca: str | None = None, cert: str | None = None, key: str | None = None,
            server_name: str | None = None, insecure: bool = False) -> grpc.Channel:
    """A channel to host:port: TLS unless `insecure` (ca: the server's CA; cert/key: mutual TLS)."""
    if insecure:
        return grpc.insecure_channel(address)

    def read(path):
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()
    credentials = grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                               certificate_chain=read(cert))
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def request(prompt: str | list[dict], *, max_new_tokens: int | None = None, temperature: float | None = None,
            top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
            stop: list[str] | None = None, speculation_k: int | None = None, category: str = "",
            request_id: str = "") -> pb.GenerateRequest:
    """Build a GenerateRequest; prompt is text or a list of {"role", "content"} messages.

    speculation_k: None = the server's settings, 0 = off for this request, k = that many drafts.
    """
    msg = pb.GenerateRequest(request_id=request_id, category=category, stop=stop or [])
    if isinstance(prompt, list):
        msg.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        msg.prompt = prompt
    for name, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature), ("top_k", top_k),
                        ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(msg, name, value)
    if speculation_k is not None:
        msg.speculation.CopyFrom(pb.SpeculationOverride(off=speculation_k == 0, k=max(speculation_k, 0)))
    return msg


@dataclass
class Reply:
    """A whole streamed reply, put back together."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    messages: int = 0
    last: pb.GenerateResponse | None = None

    @property
    def finish_reason(self) -> str:
        return pb.FinishReason.Name(self.last.finish_reason) if self.last else ""


def collect(stream) -> Reply:
    reply = Reply()
    for msg in stream:
        reply.text += msg.text
        reply.token_ids.extend(msg.token_ids)
        reply.messages += 1
        reply.last = msg
    return reply


class EngineClient:
    def __init__(self, address: str, token: str | None = None, **channel_options):
        """token: sent as "authorization: Bearer <token>" (servers started with --auth-token-file)."""
        self.channel = channel(address, **channel_options)
        self.stub = pb_grpc.EngineStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    def stream(self, req: pb.GenerateRequest, timeout: float | None = None):
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def generate(self, prompt, timeout: float | None = None, **options) -> Reply:
        return collect(self.stream(request(prompt, **options), timeout=timeout))

    def model_info(self, timeout: float = 10.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def stats(self, timeout: float = 10.0) -> pb.Stats:
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=timeout, metadata=self.metadata)

    def set_speculation(self, enabled: bool | None = None, k: int | None = None, reason: str = "",
                        timeout: float = 10.0) -> pb.SpeculationSettings:
        req = pb.SetSpeculationRequest(reason=reason)
        if enabled is not None:
            req.enabled = enabled
        if k is not None:
            req.k = k
        return self.stub.SetSpeculation(req, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
