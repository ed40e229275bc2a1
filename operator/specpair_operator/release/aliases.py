"""Which registry aliases move, and in which order, for a promotion or a rollback.

Order matters for crash safety: `previous` is written before `champion`, so an operator killed
between the two writes finds champion unchanged and simply redoes both (each write idempotent).
The durable mark of a rollback is a tag on the rolled-back version, written before any alias
moves, so a restarted operator neither re-promotes it nor forgets to finish the rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

CANDIDATE = "candidate"
CHAMPION = "champion"
PREVIOUS = "previous"


@dataclass(frozen=True)
class AliasMove:
    alias: str
    version: str


def plan_promotion(aliases: dict[str, str], new_version: str) -> list[AliasMove]:
    """Moves that make `new_version` champion and the old champion previous (none if done)."""
    champion = aliases.get(CHAMPION)
    if champion == new_version:
        return []
    moves = []
    if champion is not None and aliases.get(PREVIOUS) != champion:
        moves.append(AliasMove(PREVIOUS, champion))
    moves.append(AliasMove(CHAMPION, new_version))
    return moves


def rollback_target(aliases: dict[str, str]) -> str | None:
    """The version a rollback would serve, or None when there is nothing to go back to."""
    champion, previous = aliases.get(CHAMPION), aliases.get(PREVIOUS)
    if previous is None or previous == champion:
        return None
    return previous


def plan_rollback(aliases: dict[str, str]) -> list[AliasMove]:
    target = rollback_target(aliases)
    return [] if target is None else [AliasMove(CHAMPION, target)]
