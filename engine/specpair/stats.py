"""Acceptance statistics, named as vLLM names them so dashboards need no glossary. Torch-free."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


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
