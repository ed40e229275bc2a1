"""Acceptance statistics, named as vLLM names them so dashboards need no glossary. Torch-free."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass
class AcceptanceStats:
    """Counts for one request, one category or the whole engine."""

    num_drafts: int = 0                 # verification rounds that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    # Of those, the rounds that copied (lookup first, then a head): they cost a lookup and a
    # chain where the others cost head steps and a tree, and the bench prices them so.
    num_copied_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0
    num_target_steps: int = 0           # target forward passes (verification or plain decode)
    fallback_events: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    # One request's: it drafted every round it could, whatever its acceptance (no per-row
    # back-off; costs.RequestAudit), so live acceptance may read it. Not summed by merge.
    audited: bool = True

    def drift_sample(self) -> tuple[int, int]:
        """One finished request's (drafted, accepted) as live acceptance counts it (drift's
        per-request sums): an unaudited request's rounds are the back-off's choice, so none."""
        return (self.num_draft_tokens, self.num_accepted_tokens) if self.audited else (0, 0)

    def record_round(self, drafted: int, accepted: int, copied: bool = False) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for series, upto in ((self.num_draft_tokens_per_pos, drafted),
                             (self.num_accepted_tokens_per_pos, accepted),
                             (self.num_copied_draft_tokens_per_pos, drafted if copied else 0)):
            if len(series) < drafted:
                series.extend([0] * (drafted - len(series)))
            for j in range(upto):
                series[j] += 1

    def merge(self, other: "AcceptanceStats") -> None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
                     "num_target_steps", "fallback_events", "draft_seconds", "target_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos",
                     "num_copied_draft_tokens_per_pos"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for j, v in enumerate(theirs):
                mine[j] += v

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification round: 1 (the target's own) + accepted drafts per round."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in
                zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": round(self.acceptance_rate, 6),
            "mean_acceptance_length": round(self.mean_acceptance_length, 6),
            "acceptance_per_position": [round(a, 6) for a in self.acceptance_per_position],
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_target_steps": self.num_target_steps,
            "fallback_events": self.fallback_events,
            "draft_seconds": round(self.draft_seconds, 6),
            "target_seconds": round(self.target_seconds, 6),
        }


class AcceptanceWindow:
    """Acceptance over the last `size` draft tokens (what fallback and drift decisions read)."""

    def __init__(self, size: int = 200):
        self.size = size
        self._rounds: deque[tuple[int, int]] = deque()
        self.drafted = 0
        self.accepted = 0

    def add(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self._rounds.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        while self._rounds and self.drafted - self._rounds[0][0] >= self.size:
            d, a = self._rounds.popleft()
            self.drafted -= d
            self.accepted -= a

    @property
    def full(self) -> bool:
        return self.drafted >= self.size

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def clear(self) -> None:
        self._rounds.clear()
        self.drafted = self.accepted = 0


def _sum(a: float | None, b: float | None, sign: int = 1) -> float | None:
    return None if a is None or b is None else a + sign * b


@dataclass(frozen=True)
class RequestMoments:
    """Sums over the requests of one category, with the request as the sampled unit: drift's
    ratio estimator needs them so that one long request does not weigh as hundreds of
    independent tokens (docs/drift.md). d_i and a_i are request i's drafted and accepted draft
    tokens.

    The engine sums its finished requests that drafted (d_i > 0) and fills every field. A source
    with token counters only (vLLM, an engine that predates these sums) leaves the second
    moments None, the request count too where it has none, and its drafted / accepted then count
    every draft token. Sums and differences of two moments keep a field only where both have it.
    """
    drafted: int = 0                         # Σ d_i, tokens
    accepted: int = 0                        # Σ a_i, tokens
    requests: int | None = None              # n, requests
    drafted_sq: float | None = None          # Σ d_i², tokens²
    accepted_sq: float | None = None         # Σ a_i², tokens²
    drafted_accepted: float | None = None    # Σ d_i·a_i, tokens²

    @classmethod
    def zero(cls) -> "RequestMoments":
        """No request yet, every sum kept."""
        return cls(0, 0, 0, 0.0, 0.0, 0.0)

    @classmethod
    def of_request(cls, drafted: int, accepted: int) -> "RequestMoments":
        """One finished request's terms; one that drafted nothing is no unit of acceptance."""
        if drafted <= 0:
            return cls.zero()
        return cls(drafted, accepted, 1, float(drafted) ** 2, float(accepted) ** 2, float(drafted) * accepted)

    def _combine(self, o: "RequestMoments", sign: int) -> "RequestMoments":
        return RequestMoments(self.drafted + sign * o.drafted, self.accepted + sign * o.accepted,
                              _sum(self.requests, o.requests, sign), _sum(self.drafted_sq, o.drafted_sq, sign),
                              _sum(self.accepted_sq, o.accepted_sq, sign),
                              _sum(self.drafted_accepted, o.drafted_accepted, sign))

    def __add__(self, o: "RequestMoments") -> "RequestMoments":
        return self._combine(o, 1)

    def __sub__(self, o: "RequestMoments") -> "RequestMoments":
        return self._combine(o, -1)

    def below(self, o: "RequestMoments") -> bool:
        """Some count is lower than in `o`: the process behind these cumulative sums started again."""
        pairs = [(self.drafted, o.drafted), (self.accepted, o.accepted), (self.requests, o.requests)]
        return any(a is not None and b is not None and a < b for a, b in pairs)

    @property
    def has_moments(self) -> bool:
        """Every sum the ratio estimator's variance needs is here."""
        return None not in (self.requests, self.drafted_sq, self.accepted_sq, self.drafted_accepted)

    # -- on the wire (specpair.engine.v1.FinishedRequestSums) and in the operator's probe reports

    def to_message(self) -> Any:
        from specpair._proto import engine_pb2  # torch-free generated code, loaded only by who sends

        if not self.has_moments:
            # The message has no "unknown": a missing sum would arrive as a measured zero.
            raise ValueError(f"only complete sums go on the wire: {self}")
        return engine_pb2.FinishedRequestSums(
            requests=self.requests, draft_tokens=self.drafted, accepted_tokens=self.accepted,
            draft_tokens_sq=self.drafted_sq, accepted_tokens_sq=self.accepted_sq,
            draft_accepted_tokens=self.drafted_accepted)

    @classmethod
    def from_message(cls, msg: Any) -> "RequestMoments":
        return cls(int(msg.draft_tokens), int(msg.accepted_tokens), int(msg.requests), float(msg.draft_tokens_sq),
                   float(msg.accepted_tokens_sq), float(msg.draft_accepted_tokens))

    def as_stats(self) -> dict[str, Any]:
        """The probe's plain-dict form (specpair_operator.clients.engine_probe): the sums only where known."""
        out: dict[str, Any] = {"drafted": self.drafted, "accepted": self.accepted, "requests": self.requests}
        for key, v in (("draftedSq", self.drafted_sq), ("acceptedSq", self.accepted_sq),
                       ("draftedAccepted", self.drafted_accepted)):
            if v is not None:
                out[key] = v
        return out

    @classmethod
    def from_stats(cls, d: Mapping[str, Any]) -> "RequestMoments":
        def opt(key: str, kind: type) -> Any:
            return kind(d[key]) if d.get(key) is not None else None
        return cls(int(d.get("drafted", 0)), int(d.get("accepted", 0)), opt("requests", int),
                   opt("draftedSq", float), opt("acceptedSq", float), opt("draftedAccepted", float))


@dataclass(frozen=True)
class PairedSums:
    """Cross sums over the same requests of two drafters measured side by side (shadow drafting:
    a candidate's (d_i, a_i) and the champion's (e_i, b_i)). With each side's RequestMoments they
    give the standard error of the difference of the two ratios with the request as the unit:
    what makes one request easy or hard moves both, and cancels in the difference.
    `requests` counts every request summed, also one where a side drafted nothing."""
    requests: int = 0
    accepted_both: float = 0.0         # Σ a_i·b_i
    accepted_drafted: float = 0.0      # Σ a_i·e_i
    drafted_accepted: float = 0.0      # Σ d_i·b_i
    drafted_both: float = 0.0          # Σ d_i·e_i

    @classmethod
    def of_request(cls, first: tuple[float, float], second: tuple[float, float]) -> "PairedSums":
        """One request's terms from (drafted, accepted) of the first and of the second drafter."""
        (d, a), (e, b) = first, second
        return cls(1, float(a) * b, float(a) * e, float(d) * b, float(d) * e)

    def __add__(self, o: "PairedSums") -> "PairedSums":
        return PairedSums(self.requests + o.requests, self.accepted_both + o.accepted_both,
                          self.accepted_drafted + o.accepted_drafted, self.drafted_accepted + o.drafted_accepted,
                          self.drafted_both + o.drafted_both)

    def to_message(self) -> Any:
        from specpair._proto import engine_pb2

        return engine_pb2.PairedSums(requests=self.requests, accepted_both=self.accepted_both,
                                     accepted_drafted=self.accepted_drafted,
                                     drafted_accepted=self.drafted_accepted, drafted_both=self.drafted_both)

    @classmethod
    def from_message(cls, msg: Any) -> "PairedSums":
        return cls(int(msg.requests), float(msg.accepted_both), float(msg.accepted_drafted),
                   float(msg.drafted_accepted), float(msg.drafted_both))
